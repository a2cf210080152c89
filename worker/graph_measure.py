# Graph capture's measurements: the costs of one unit run alone, the coarse estimate when nothing can
# run, and the tensors (parameters and optimizer state) the graph records. DESIGN.md, "Graph capture".
#
# What is counted, per unit run alone:
# - FLOPs with `torch.utils.flop_counter.FlopCounterMode`: one counter around the forward, a second
#   around the backward (gradient of the output's sum w.r.t. the block's parameters and, for every
#   block after the first, its input — what a pipeline stage really computes).
# - Activation bytes with `saved_tensors_hooks`: every tensor autograd saves for backward, counted
#   once per storage (views share one), parameters excluded (they are `param_bytes`).
# - Boundary bytes: the block's output, what a pipeline cut after this block sends.
# All but `param_bytes` are per sample: measured on `n` samples, then divided.
# - Optimizer state bytes: the job's optimizer takes one step (zero gradients) on the throwaway
#   model and its state tensors are counted, so the planner knows what a replica holds and moves.
# The root unit is the whole model's costs minus its units' (`root_remainder`).
#
# Attention: on CPU (and on meta, whose kernels mirror CPU's), `F.scaled_dot_product_attention`
# dispatches to `_scaled_dot_product_flash_attention_for_cpu`, which FlopCounterMode has no formula
# for in torch 2.13; the counters here get torch's own SDPA formulas for it and its backward, so the
# SDPA that Hugging Face models call is counted (as torch counts it: the full square, causal or not).
# The examples write attention by hand (q @ k^T, mask, softmax, @ v), counted as matmuls.
# Elementwise work (softmax, norms, GELU) is never counted; the cost model calibrates per block kind.
#
# A block is measured on a snapshot of its recorded arguments (worker/graph_units.py), so measuring
# it leaves what it was given, and what another block's replay reads, untouched.

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from plan.graph import ROOT_UNIT, Layer, TensorInfo
from worker.graph_units import snapshot
from worker.job import Job

__all__ = ["estimate_whole", "measure_block", "optimizer_state", "root_remainder", "tensor_bytes", "tensor_infos"]

# per parameter (by id): its optimizer state shaped like it, as (key, dtype) in the optimizer's order
OptimizerState = dict[int, tuple[tuple[str, str], ...]]


def measure_block(
    name: str, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, *, grad_input: bool
) -> Layer:
    """`block` run alone on `args`/`kwargs` (`n` samples): its per-sample costs as the layer `name`."""
    def prepare(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if grad_input and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    args, kwargs = tree_map(prepare, snapshot(args)), tree_map(prepare, snapshot(kwargs))
    params = [p for p in block.parameters() if p.requires_grad]
    param_bytes = sum(tensor_bytes(p) for p in block.parameters())
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
    boundary = sum(tensor_bytes(t) for t in leaves)
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


def root_remainder(whole: Layer, layers: list[Layer], kind: str) -> Layer | None:
    """The root unit: the whole model's costs minus its units' (None when nothing is left)."""
    def rest(field: str) -> float:
        return max(0.0, float(getattr(whole, field)) - sum(float(getattr(layer, field)) for layer in layers))

    params = int(rest("param_bytes"))
    forward, backward = rest("forward_flops"), rest("backward_flops")
    if params == 0 and forward == 0:
        return None
    return Layer(name=ROOT_UNIT, kind=kind, forward_flops=forward, backward_flops=backward, param_bytes=params,
                 activation_bytes=int(rest("activation_bytes")), boundary_bytes=whole.boundary_bytes)


def estimate_whole(job: Job, model: nn.Module) -> Layer:
    """The whole model as one layer with no forward run: a dense model does ~2 FLOPs per parameter per
    input position (a token id of an integer input; one position for any other sample)."""
    sample = job.dataset[torch.arange(1)]
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    positions = max((t.numel() for t in leaves if not (t.is_floating_point() or t.is_complex())), default=1)
    params = sum(q.numel() for q in model.parameters())
    return Layer(name=type(model).__name__, kind=type(model).__name__, forward_flops=2.0 * params * positions,
                 backward_flops=4.0 * params * positions,
                 param_bytes=sum(tensor_bytes(q) for q in model.parameters()))


def tensor_infos(model: nn.Module, units: dict[str, nn.Module], state: OptimizerState | None,
                 tp_dims: Mapping[str, int | None] | None = None) -> tuple[TensorInfo, ...]:
    """Every parameter of `model`: its fully qualified name, shape, dtype, unit, optimizer state and
    the dim the job's tensor-parallel plan splits (`tp_dims`, by name)."""
    owner = {id(q): name for name, m in units.items() for q in m.parameters()}
    whole = len(units) == 1 and next(iter(units.values())) is model
    return tuple(TensorInfo(fqn=fqn, shape=tuple(q.shape), dtype=_dtype_name(q.dtype),
                            unit=owner.get(id(q), ROOT_UNIT) if not whole else next(iter(units)),
                            state=state.get(id(q), ()) if state is not None else None,
                            tp_dim=(tp_dims or {}).get(fqn))
                 for fqn, q in model.named_parameters())


def optimizer_state(job: Job, model: nn.Module) -> tuple[int | None, OptimizerState | None]:
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
        nbytes = sum(tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor))
        shaped = {id(p): tuple((str(k), _dtype_name(v.dtype)) for k, v in s.items()
                               if isinstance(v, torch.Tensor) and v.shape == p.shape)
                  for p, s in optimizer.state.items()}
        return nbytes, shaped
    except Exception:  # noqa: BLE001 (the planner then assumes Adam)
        return None, None


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
