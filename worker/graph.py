# Graph capture: turn a job's model into the planner's `plan.graph.Graph` (plain numbers per layer).
#
# Why the meta device first: the model is built under `torch.device("meta")` and every block runs on
# meta tensors, which carry shapes and dtypes but no storage and do no arithmetic. Capture is
# therefore fast (~0.1 s for a 10M-parameter GPT) and allocates nothing, whatever the model's
# size, and it never touches the job's real parameters or the global RNG. (The first meta build
# in a process also pays ~1 s once: meta `normal_` imports torch._dynamo.)
#
# A capture never depends on the model tolerating meta tensors or replays, because models users
# bring often do not (Hugging Face's mask code reads tensor values; a block fed its recorded
# key/value cache appends to it). So, in order:
# 1. on meta, as above;
# 2. if the model cannot be built or run on meta (a forward that reads a value: `.item()`, `if
#    mask.all()`): on CPU with real tensors, seeded as the job seeds it, on at most 2 samples;
# 3. if that fails too (a block that cannot be run alone again): a COARSE graph, the whole model as
#    one unit, its parameters listed from `named_parameters` (no forward needed), its costs measured
#    on one whole forward where that works, else estimated (2 FLOPs per parameter per input
#    position); the caller logs the one line `warn` receives. Sharded layouts then gather the model
#    whole and no pipeline cuts it: slower and bigger, but exact, and it never stops training.
# Replays are made safe up front: the throwaway capture model runs with `config.use_cache = False`
# where it has such a config (a Hugging Face model), and each unit's recorded keyword arguments are
# copied when recorded and again for its replay (non-tensor objects such as a cache deep-copied), so
# a replay starts from what the unit saw in the forward and changes nothing another replay reads.
#
# Every worker of a job must reach the same units (FSDP2 wraps each unit as one all-gather, and the
# coordinator plans from the first worker's upload). Steps 1-3 are a pure function of the job's code
# and the installed libraries (the same on every worker), so every worker reaches the same graph.
# The one machine-dependent failure, running out of memory in step 2, is never turned into a coarse
# graph: it raises, and that worker leaves with the error rather than wrap the model differently.

# What is counted, per unit run alone (DESIGN.md, "Graph capture"):
# - FLOPs with `torch.utils.flop_counter.FlopCounterMode`: one counter around the forward, a second
#   around the backward (gradient of the output's sum w.r.t. the block's parameters and, for every
#   block after the first, its input — what a pipeline stage really computes).
# - Activation bytes with `saved_tensors_hooks`: every tensor autograd saves for backward, counted
#   once per storage (views share one), parameters excluded (they are `param_bytes`).
# - Boundary bytes: the block's output, what a pipeline cut after this block sends.
# All but `param_bytes` are per sample: measured on `sample_batch` samples, then divided.
# - Optimizer state bytes: the job's optimizer takes one step (zero gradients) on the throwaway
#   model and its state tensors are counted, so the planner knows what a replica holds and moves.
#
# Attention: on CPU (and on meta, whose kernels mirror CPU's), `F.scaled_dot_product_attention`
# dispatches to `_scaled_dot_product_flash_attention_for_cpu`, which FlopCounterMode has no formula
# for in torch 2.13; the counters here get torch's own SDPA formulas for it and its backward, so the
# SDPA that Hugging Face models call is counted (as torch counts it: the full square, causal or not).
# The examples write attention by hand (q @ k^T, mask, softmax, @ v), counted as matmuls.
# Elementwise work (softmax, norms, GELU) is never counted; the cost model calibrates per block kind.
#
# Units (the layers of the graph): what FSDP2 shards and gathers as one, and where a pipeline may cut.
# Found in this order:
# 1. the job's own declaration (`Job.blocks`: module paths or class names; naming nothing is the
#    user's mistake, a `JobError`, never a coarse graph);
# 2. an nn.Sequential model: its children (a chain by construction);
# 3. repeated blocks at any depth: in every nn.ModuleList / nn.Sequential, each run of two or more
#    children of one class that hold parameters (the transformer layers of Hugging Face and
#    torchvision models, however deep they sit), outermost first; everything else is the root unit;
# 4. a model whose direct children, called in order, reproduce its output shapes (checked on meta;
#    a heuristic: it cannot see e.g. a residual around the children): its children;
# 5. else the whole model is one unit (named after its class, as the coarse graph's).
# Each unit is measured alone on the input it received in one forward of the whole model (forward
# pre-hooks capture it); the root unit is the whole model minus its units. Every parameter is
# recorded with its fully qualified name, shape, dtype and unit (`Graph.tensors`).

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from plan.graph import ROOT_UNIT, Graph, Layer, TensorInfo
from worker.job import Job, JobError

__all__ = ["capture_graph"]


def capture_graph(job: Job, *, sample_batch: int = 2, warn: Callable[[str], None] | None = None) -> Graph:
    """Capture `job`'s model as units with per-sample costs and its parameters (see the file comment):
    on meta, else on CPU, else the coarse one-unit graph, whose one-line reason goes to `warn`.
    Raises only for the user's mistakes (`JobError`) and for running out of memory."""
    if sample_batch < 1:
        raise ValueError(f"sample_batch must be >= 1, got {sample_batch}")
    n = min(sample_batch, len(job.dataset))
    if n < 1:
        raise JobError("job.dataset is empty; graph capture needs at least one sample")
    failures: list[str] = []
    for device in (META, CPU):
        batch = n if device.type == "meta" else min(n, CPU_SAMPLES)
        try:
            return _capture(job, _build_model(job, device), device, batch)
        except JobError:
            raise
        except Exception as e:  # noqa: BLE001 (the next way is tried; the last one never fails)
            if _out_of_memory(e):
                raise
            failures.append(f"{device.type}: {_describe(e)}")
    graph, costs = _coarse(job, min(n, CPU_SAMPLES))
    reason = "; ".join(failures)
    line = (f"graph capture failed ({reason}): the model is planned as one unit ({costs}); sharded layouts "
            f"gather it whole and no pipeline can cut it")
    if warn is not None:
        warn(line)
    return graph


META, CPU = torch.device("meta"), torch.device("cpu")
CPU_SAMPLES = 2  # a CPU capture runs on real tensors: a tiny batch keeps its memory and time small


def _capture(job: Job, model: nn.Module, device: torch.device, n: int) -> Graph:
    """The graph per unit, measured on `model` (built on `device`) with `n` samples."""
    model.train()
    x = _sample(job, n, device)
    units = find_units(model, x, job.blocks)
    calls = _unit_inputs(model, units, x)
    layers: list[Layer] = []
    for index, name in enumerate(sorted(units, key=lambda u: calls[u][0] if u in calls else len(calls))):
        module = units[name]
        if name in calls:
            _, args, kwargs = calls[name]
            layers.append(_measure_block(name, module, args, kwargs, n, grad_input=index > 0))
        else:  # never called in a forward: it costs memory only
            layers.append(Layer(name=name, kind=type(module).__name__, forward_flops=0.0, backward_flops=0.0,
                                param_bytes=sum(_tensor_bytes(q) for q in module.parameters())))
    if len(units) > 1 or next(iter(units.values())) is not model:
        whole = _measure_block(ROOT_UNIT, model, (x,) if not isinstance(x, tuple) else x, {}, n, grad_input=False)
        root = _remainder(whole, layers, type(model).__name__)
        if root is not None:
            layers.insert(0, root)
    state_bytes, state = _optimizer_state(job, model)
    return Graph(tuple(layers), optimizer_state_bytes=state_bytes, tensors=_tensors(model, units, state))


def _coarse(job: Job, n: int) -> tuple[Graph, str]:
    """The whole model as one unit, and how its costs were found: measured on one whole forward (meta,
    then CPU) where that works, else estimated from the parameter count."""
    model: nn.Module | None = None
    for device in (META, CPU):
        try:
            model = _build_model(job, device)
        except Exception as e:  # noqa: BLE001 (no way to build the model: the job cannot train; say why)
            if device == CPU:
                raise JobError(f"the job's model cannot be built: {_describe(e)}") from e
            continue
        try:
            model.train()
            x = _sample(job, n, device)
            layer = _measure_block(type(model).__name__, model, x if isinstance(x, tuple) else (x,), {}, n,
                                   grad_input=False)
            costs = f"costs measured on a whole forward on {device.type}"
            break
        except Exception as e:  # noqa: BLE001 (estimated below)
            if _out_of_memory(e):
                raise
    else:
        assert model is not None
        layer = _estimate(job, model)
        costs = "FLOPs estimated as 2 per parameter per input position, activations unknown"
    name = type(model).__name__
    state_bytes, state = _optimizer_state(job, model)
    return Graph((layer,), optimizer_state_bytes=state_bytes, tensors=_tensors(model, {name: model}, state)), costs


def _estimate(job: Job, model: nn.Module) -> Layer:
    """The whole model as one layer with no forward run: a dense model does ~2 FLOPs per parameter per
    input position (a token id of an integer input; one position for any other sample)."""
    sample = job.dataset[torch.arange(1)]
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    positions = max((t.numel() for t in leaves if not (t.is_floating_point() or t.is_complex())), default=1)
    params = sum(q.numel() for q in model.parameters())
    return Layer(name=type(model).__name__, kind=type(model).__name__, forward_flops=2.0 * params * positions,
                 backward_flops=4.0 * params * positions,
                 param_bytes=sum(_tensor_bytes(q) for q in model.parameters()))


def _sample(job: Job, n: int, device: torch.device) -> Any:
    sample = job.dataset[torch.arange(n)]
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    return _to_device(inputs, device)


def _out_of_memory(e: BaseException) -> bool:
    """A failure of this machine, not of the model: another worker might not fail (see the file comment)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _describe(e: BaseException) -> str:
    """An exception as one short line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}" if text else type(e).__name__


def find_units(model: nn.Module, x: Any, declared: tuple[str, ...] | None = None) -> dict[str, nn.Module]:
    """The model's units by module path, in module order (see the file comment)."""
    if declared:
        found = _outermost([(n, m) for n, m in model.named_modules() if n and (n in declared or type(m).__name__ in declared)])
        if not found:
            raise JobError(f"Job.blocks names {list(declared)}, but no module of the model has that path or class "
                           f"(its children: {', '.join(n for n, _ in model.named_children())})")
        return dict(found)
    children = list(model.named_children())
    if isinstance(model, nn.Sequential) and children:
        return dict(children)
    repeated = _repeated_blocks(model)
    if repeated:
        return dict(repeated)
    if children and _is_chain(model, children, x):
        return dict(children)
    return {type(model).__name__: model}


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        run: list[tuple[str, nn.Module]] = []
        for name, child in [*children, ("", None)]:
            if run and (child is None or type(child) is not type(run[0][1])):
                if len(run) >= 2 and all(any(True for _ in c.parameters()) for _, c in run):
                    found += [(f"{path}.{n}" if path else n, c) for n, c in run]
                run = []
            if child is not None:
                run.append((name, child))
    return _outermost(found)


def _outermost(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop every module that sits inside another one of the list."""
    paths = [p for p, _ in modules]
    return [(p, m) for p, m in modules if not any(p.startswith(q + ".") for q in paths if q != p)]


def _is_chain(model: nn.Module, children: list[tuple[str, nn.Module]], x: Any) -> bool:
    try:
        with torch.no_grad():
            expected = _signature(_call(model, x))
            y = x
            for _, child in children:
                y = _call(child, y)
            return _signature(y) == expected
    except Exception:
        return False


def _unit_inputs(model: nn.Module, units: dict[str, nn.Module], x: Any) -> dict[str, tuple[int, tuple[Any, ...], dict[str, Any]]]:
    """name -> (call order, args, kwargs) of each unit's first call in one forward of the model."""
    calls: dict[str, tuple[int, tuple[Any, ...], dict[str, Any]]] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in calls:  # (copied now: the unit and those after it may change a cache object)
                calls[name] = (len(calls), _snapshot(args), _snapshot(kwargs))
        return record

    if len(units) == 1 and next(iter(units.values())) is model:
        return {next(iter(units)): (0, x if isinstance(x, tuple) else (x,), {})}
    handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in units.items()]
    try:
        with torch.no_grad():
            _call(model, x)
    finally:
        for h in handles:
            h.remove()
    return calls


def _remainder(whole: Layer, layers: list[Layer], kind: str) -> Layer | None:
    """The root unit: the whole model's costs minus its units' (None when nothing is left)."""
    def rest(field: str) -> float:
        return max(0.0, float(getattr(whole, field)) - sum(float(getattr(layer, field)) for layer in layers))

    params = int(rest("param_bytes"))
    forward, backward = rest("forward_flops"), rest("backward_flops")
    if params == 0 and forward == 0:
        return None
    return Layer(name=ROOT_UNIT, kind=kind, forward_flops=forward, backward_flops=backward, param_bytes=params,
                 activation_bytes=int(rest("activation_bytes")), boundary_bytes=whole.boundary_bytes)


def _tensors(model: nn.Module, units: dict[str, nn.Module],
             state: dict[int, tuple[tuple[str, str], ...]] | None) -> tuple[TensorInfo, ...]:
    owner = {id(q): name for name, m in units.items() for q in m.parameters()}
    whole = len(units) == 1 and next(iter(units.values())) is model
    return tuple(TensorInfo(fqn=fqn, shape=tuple(q.shape), dtype=_dtype_name(q.dtype),
                            unit=owner.get(id(q), ROOT_UNIT) if not whole else next(iter(units)),
                            state=state.get(id(q), ()) if state is not None else None)
                 for fqn, q in model.named_parameters())


def _optimizer_state(job: Job, model: nn.Module) -> tuple[int | None, dict[int, tuple[tuple[str, str], ...]] | None]:
    """The bytes of state the job's optimizer keeps after one step (Adam: two moments per
    parameter), on the capture's throwaway model, and per parameter (by id) its state shaped like
    it, as (key, dtype) in the optimizer's order (what `worker.parallel.slices.from_module` calls its
    companions); (None, None) if the optimizer cannot step there."""
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = job.optimizer(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        nbytes = sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor))
        shaped = {id(p): tuple((str(k), _dtype_name(v.dtype)) for k, v in s.items()
                               if isinstance(v, torch.Tensor) and v.shape == p.shape)
                  for p, s in optimizer.state.items()}
        return nbytes, shaped
    except Exception:  # noqa: BLE001 (the planner then assumes Adam)
        return None, None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _build_model(job: Job, device: torch.device) -> nn.Module:
    """A throwaway instance of the job's model on `device`, seeded as the job seeds it (the global RNG
    untouched), with its key/value cache off where it has one (see the file comment)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        with device:
            model = job.model()
    _no_cache(model)
    return model


def _no_cache(model: nn.Module) -> None:
    """`use_cache = False` on every config the modules of `model` hold (a Hugging Face model's), as a
    copy: a config the job's code shares between builds keeps its own value."""
    copies: dict[int, Any] = {}
    for module in model.modules():
        config = module.__dict__.get("config")
        if getattr(config, "use_cache", None) is not True:
            continue
        if id(config) not in copies:
            try:
                copies[id(config)] = copy.copy(config)
                copies[id(config)].use_cache = False
            except Exception:  # noqa: BLE001 (the copied keyword arguments still keep replays apart)
                copies[id(config)] = config
        module.config = copies[id(config)]


def _to_device(value: Any, device: torch.device) -> Any:
    if device.type != "meta":
        return value
    return tree_map(
        lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, value
    )


def _call(module: nn.Module, x: Any) -> Any:
    return module(*x) if isinstance(x, tuple) else module(x)


def _signature(value: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    leaves, _ = tree_flatten(value)
    return [(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]


def _cpu_sdpa(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]


def _cpu_sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                       **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))  # type: ignore[no-untyped-call]


def _flop_counter() -> FlopCounterMode:
    """A FLOP counter that also counts CPU's SDPA kernel (see the file comment)."""
    aten = torch.ops.aten
    extra = {getattr(aten, op): formula for op, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward)) if hasattr(aten, op)}
    return FlopCounterMode(display=False, custom_mapping=extra)


def _snapshot(value: Any) -> Any:
    """`value` with its tensors detached (shared, not copied) and every other object deep-copied (a
    key/value cache a unit appends to), so a replay sees what the unit saw and changes nothing that
    another replay reads; an object that cannot be copied is shared."""
    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach()
        if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
            return v
        try:
            return copy.deepcopy(v)
        except Exception:  # noqa: BLE001 (shared, as before: a replay may then fail, and capture falls back)
            return v
    return tree_map(leaf, value)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure_block(
    name: str, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, *, grad_input: bool
) -> Layer:
    def prepare(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if grad_input and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    args, kwargs = tree_map(prepare, _snapshot(args)), tree_map(prepare, _snapshot(kwargs))
    params = [p for p in block.parameters() if p.requires_grad]
    param_bytes = sum(_tensor_bytes(p) for p in block.parameters())
    param_storages = {p.untyped_storage()._cdata for p in block.parameters()}

    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keeps storages alive, so no storage key is reused meanwhile

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in param_storages and key not in saved:
            saved[key] = storage.nbytes()
            keep.append(t)
        return t

    forward = _flop_counter()
    with forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(*args, **kwargs)

    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    boundary = sum(_tensor_bytes(t) for t in leaves)
    differentiable = [t for t in leaves if t.requires_grad]
    wrt = params + [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    backward = _flop_counter()
    if differentiable and wrt:
        loss = torch.stack([t.sum() for t in differentiable]).sum()
        with backward:
            torch.autograd.grad(loss, wrt, allow_unused=True)

    return Layer(
        name=name,
        kind=type(block).__name__,
        forward_flops=forward.get_total_flops() / n,
        backward_flops=backward.get_total_flops() / n,
        param_bytes=param_bytes,
        activation_bytes=round(sum(saved.values()) / n),
        boundary_bytes=round(boundary / n),
    )
