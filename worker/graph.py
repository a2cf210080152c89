# Graph capture: turn a job's model into the planner's `plan.graph.Graph` (plain numbers per layer).
#
# Why the meta device: the model is built under `torch.device("meta")` and every block runs on
# meta tensors, which carry shapes and dtypes but no storage and do no arithmetic. Capture is
# therefore fast (~0.1 s for a 10M-parameter GPT) and allocates nothing, whatever the model's
# size, and it never touches the job's real parameters or the global RNG. (The first meta build
# in a process also pays ~1 s once: meta `normal_` imports torch._dynamo.) If the model cannot be
# built on meta (some custom initialisation), we fall back to CPU and run on real data: correct,
# only slower.
#
# What is counted, per top-level block run alone (DESIGN.md, "Graph capture"):
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
# Caveat: on CPU, `F.scaled_dot_product_attention` and `nn.MultiheadAttention` dispatch to a kernel
# FlopCounterMode has no formula for in torch 2.13, so attention FLOPs silently vanish. The examples
# write attention by hand (q @ k^T, mask, softmax, @ v) so that it is counted. Elementwise work
# (softmax, norms, GELU) is never counted; the cost model calibrates per block kind for that.
#
# Blocks: an nn.Sequential gives its children. Any other model gives its direct children if
# calling them in order reproduces the model's output shapes (checked on meta; a heuristic, it
# cannot see e.g. a residual around the children), else the whole model is one layer.

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from plan.graph import Graph, Layer
from worker.job import Job, JobError

__all__ = ["capture_graph"]


def capture_graph(job: Job, *, sample_batch: int = 2) -> Graph:
    """Capture `job`'s model as a chain of layers with per-sample costs (see the file comment)."""
    if sample_batch < 1:
        raise ValueError(f"sample_batch must be >= 1, got {sample_batch}")
    n = min(sample_batch, len(job.dataset))
    if n < 1:
        raise JobError("job.dataset is empty; graph capture needs at least one sample")
    model, device = _build_model(job)
    model.train()
    sample = job.dataset[torch.arange(n)]
    inputs = sample[0] if isinstance(sample, (tuple, list)) else sample
    x = _to_device(inputs, device)

    blocks = _top_level_blocks(model, x)
    layers: list[Layer] = []
    for index, (name, block) in enumerate(blocks):
        layer, x = _measure_block(name, block, x, n, grad_input=index > 0)
        layers.append(layer)
    return Graph(tuple(layers), optimizer_state_bytes=_optimizer_state_bytes(job, model))


def _optimizer_state_bytes(job: Job, model: nn.Module) -> int | None:
    """The bytes of state the job's optimizer keeps after one step (Adam: two moments per
    parameter), on the capture's throwaway model; None if the optimizer cannot step there."""
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = job.optimizer(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))
    except Exception:  # noqa: BLE001 (the planner then assumes Adam)
        return None


def _build_model(job: Job) -> tuple[nn.Module, torch.device]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        try:
            with torch.device("meta"):
                return job.model(), torch.device("meta")
        except Exception:
            pass
        return job.model(), torch.device("cpu")


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


def _top_level_blocks(model: nn.Module, x: Any) -> list[tuple[str, nn.Module]]:
    children = list(model.named_children())
    if isinstance(model, nn.Sequential) and children:
        return children
    whole = [(type(model).__name__, model)]
    if not children:
        return whole
    try:
        with torch.no_grad():
            expected = _signature(_call(model, x))
            y = x
            for _, child in children:
                y = _call(child, y)
            if _signature(y) == expected:
                return children
    except Exception:
        pass
    return whole


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure_block(
    name: str, block: nn.Module, x: Any, n: int, *, grad_input: bool
) -> tuple[Layer, Any]:
    def prepare(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        if grad_input and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    x = tree_map(prepare, x)
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

    forward = FlopCounterMode(display=False)
    with forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call(block, x)

    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    boundary = sum(_tensor_bytes(t) for t in leaves)
    differentiable = [t for t in leaves if t.requires_grad]
    wrt = params + [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    backward = FlopCounterMode(display=False)
    if differentiable and wrt:
        loss = torch.stack([t.sum() for t in differentiable]).sum()
        with backward:
            torch.autograd.grad(loss, wrt, allow_unused=True)

    layer = Layer(
        name=name,
        kind=type(block).__name__,
        forward_flops=forward.get_total_flops() / n,
        backward_flops=backward.get_total_flops() / n,
        param_bytes=param_bytes,
        activation_bytes=round(sum(saved.values()) / n),
        boundary_bytes=round(boundary / n),
    )
    next_x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return layer, next_x
