# Graph capture's units (the layers of the graph): what FSDP2 shards and gathers as one, and where a
# pipeline may cut; and the input each unit received in one forward, kept for its replay.
#
# Units are found in this order:
# 1. the job's own declaration (`Job.blocks`: module paths or class names; naming nothing is the
#    user's mistake, a `JobError`, never a coarse graph);
# 2. an nn.Sequential model: its children (a chain by construction);
# 3. repeated blocks at any depth: in every nn.ModuleList / nn.Sequential, each run of two or more
#    children of one class that hold parameters (the transformer layers of Hugging Face and
#    torchvision models, however deep they sit), outermost first; everything else is the root unit;
# 4. a model whose direct children, called in order, reproduce its output shapes (checked on meta;
#    a heuristic: it cannot see e.g. a residual around the children): its children;
# 5. else the whole model is one unit (named after its class, as the coarse graph's).
# The order is a pure function of the model's structure (and, for 4, its output shapes), so every
# worker of a job finds the same units (see worker/graph.py).
#
# Each unit is measured alone (worker/graph_measure.py) on the input it received in one forward of
# the whole model, recorded by forward pre-hooks (kwargs too). Replays are kept apart: a unit's
# recorded arguments are snapshotted when recorded and again for its replay (tensors detached and
# shared, every other object such as a key/value cache deep-copied), so a replay starts from what
# the unit saw in the forward and changes nothing another replay reads.

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from worker.job import JobError

__all__ = ["UnitCall", "find_units", "snapshot", "unit_inputs"]

# (call order, args, kwargs) of a unit's first call in one forward of the model
UnitCall = tuple[int, tuple[Any, ...], dict[str, Any]]


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


def unit_inputs(model: nn.Module, units: dict[str, nn.Module], x: Any) -> dict[str, UnitCall]:
    """name -> (call order, args, kwargs) of each unit's first call in one forward of the model."""
    calls: dict[str, UnitCall] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name not in calls:  # (copied now: the unit and those after it may change a cache object)
                calls[name] = (len(calls), snapshot(args), snapshot(kwargs))
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


def snapshot(value: Any) -> Any:
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


def _call(module: nn.Module, x: Any) -> Any:
    """`module` on a sample's inputs: a tuple is its positional arguments, anything else the one argument."""
    return module(*x) if isinstance(x, tuple) else module(x)


def _signature(value: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    leaves, _ = tree_flatten(value)
    return [(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]
