# Graph capture: turn a job's model into the planner's `plan.graph.Graph` (plain numbers per layer).
# This module holds the public `capture_graph` and the order of ways it tries; finding the units and
# recording their inputs is worker/graph_units.py's, measuring them worker/graph_measure.py's.
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
# copied when recorded and again for its replay (worker/graph_units.py), so a replay starts from
# what the unit saw in the forward and changes nothing another replay reads.
#
# Every worker of a job must reach the same units (FSDP2 wraps each unit as one all-gather, and the
# coordinator plans from the first worker's upload). Steps 1-3 are a pure function of the job's code
# and the installed libraries (the same on every worker), so every worker reaches the same graph.
# The one machine-dependent failure, running out of memory in step 2, is never turned into a coarse
# graph: it raises, and that worker leaves with the error rather than wrap the model differently.
#
# Each unit is measured alone on the input it received in one forward of the whole model; the root
# unit is the whole model minus its units. Every parameter is recorded with its fully qualified name,
# shape, dtype and unit (`Graph.tensors`).

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from plan.graph import ROOT_UNIT, Graph, Layer
from worker.graph_measure import (estimate_whole, measure_block, optimizer_state, root_remainder, tensor_bytes,
                                  tensor_infos)
from worker.graph_units import find_units, unit_inputs
from worker import sequence
from worker.job import Job, JobError
from worker.tp_plan import tp_dims, tp_styles

__all__ = ["capture_graph", "find_units"]

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
    calls = unit_inputs(model, units, x)
    layers: list[Layer] = []
    for index, name in enumerate(sorted(units, key=lambda u: calls[u][0] if u in calls else len(calls))):
        module = units[name]
        if name in calls:
            _, args, kwargs = calls[name]
            layers.append(measure_block(name, module, args, kwargs, n, grad_input=index > 0))
        else:  # never called in a forward: it costs memory only
            layers.append(Layer(name=name, kind=type(module).__name__, forward_flops=0.0, backward_flops=0.0,
                                param_bytes=sum(tensor_bytes(q) for q in module.parameters())))
    if len(units) > 1 or next(iter(units.values())) is not model:
        whole = measure_block(ROOT_UNIT, model, (x,) if not isinstance(x, tuple) else x, {}, n, grad_input=False)
        root = root_remainder(whole, layers, type(model).__name__)
        if root is not None:
            layers.insert(0, root)
    state_bytes, state = optimizer_state(job, model)
    return Graph(tuple(layers), optimizer_state_bytes=state_bytes,
                 tensors=tensor_infos(model, units, state, tp_dims(model, tp_styles(job, model))),
                 sequential=_is_sequence(model, layers))


def _is_sequence(model: nn.Module, layers: list[Layer]) -> bool:
    """Whether the units are the model itself, in order (`Graph.sequential`): an nn.Sequential calls
    its children one after the other on one tensor, so a pipeline may cut between any two. (Units
    found by a heuristic, or a root unit beside them, may hide a residual or a second input.)"""
    return isinstance(model, nn.Sequential) and [name for name, _ in model.named_children()] == [
        layer.name for layer in layers]


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
            layer = measure_block(type(model).__name__, model, x if isinstance(x, tuple) else (x,), {}, n,
                                  grad_input=False)
            costs = f"costs measured on a whole forward on {device.type}"
            break
        except Exception as e:  # noqa: BLE001 (estimated below)
            if _out_of_memory(e):
                raise
    else:
        assert model is not None
        layer = estimate_whole(job, model)
        costs = "FLOPs estimated as 2 per parameter per input position, activations unknown"
    name = type(model).__name__
    state_bytes, state = optimizer_state(job, model)
    return Graph((layer,), optimizer_state_bytes=state_bytes,
                 tensors=tensor_infos(model, {name: model}, state, tp_dims(model, tp_styles(job, model)))), costs


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


def _build_model(job: Job, device: torch.device) -> nn.Module:
    """A throwaway instance of the job's model on `device`, seeded as the job seeds it (the global RNG
    untouched), with its key/value cache off where it has one (see the file comment)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        with device:
            model = sequence.build(job)
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
