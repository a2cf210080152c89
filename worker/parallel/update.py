"""The job's optimizer step applied to slices held outside any model: a redundancy copy kept current
step by step, and a step rolled forward after a failure.

A sharded layout keeps a copy of every member's slices on another member (`plan.reshard.copy_ring`).
Rather than sending the updated slices (parameters and optimizer state: three times the gradient's
bytes with Adam) after every step, the owner sends its *gradient* slices to the keeper, and the
keeper applies the same update to its copy: the job's own optimizer, built over views of the copy
(reshaped to the parameters' rows, so a factory that groups parameters by shape groups them alike),
with the owner's hyper-parameters, learning rate and clipping coefficient. The optimizer's
arithmetic is element-wise, so the copy follows the owner's slices bit for bit
(tests/unit/test_update.py: slices against the whole parameter's update; the kill tests rebuild a
dead member's slices from its copy and keep the single-process loss curve).

The same function rolls a step forward: a member whose step was interrupted after every member had
its gradients (some members completed the step's last all-reduce and applied it, it did not)
applies it to its own slices and its copy with the gradients it kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from worker.parallel.slices import PARAM, LocalState, Piece

GRAD = "grad"  # a piece's pending gradient (never moved by a reshard: not a companion key)

# Optimizers whose multi-tensor (foreach) step is, element by element, the same arithmetic as their
# per-tensor step: where torch defaults to the per-tensor one (the CPU), the copy's update of many
# small tensors takes the multi-tensor one (one call per operation instead of one per tensor: 3.4 ->
# 2.6 ms for half of the small GPT) and stays bit for bit the owner's (tests/unit/test_update.py
# checks both against it). Of large tensors it is slower (measured, AdamW on one CPU thread, 24
# tensors: 16K elements each 2.2 -> 1.8 ms, 65K each 5.8 -> 10.0 ms: it makes its temporaries for
# every tensor at once), so only up to FOREACH_UP_TO elements per tensor on average.
SAME_ARITHMETIC_FOREACH = (torch.optim.Adam, torch.optim.AdamW)
FOREACH_UP_TO = 32_768


def apply_update(optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 local: LocalState, pieces: Mapping[str, list[Piece]], shapes: Mapping[str, tuple[int, ...]],
                 lr: Callable[[int], float], coefficient: float) -> int:
    """Apply one optimizer step, in place, to every piece of `pieces` that has a pending GRAD (which
    the clipping `coefficient` scales in place: a scaled copy cost a slice-sized buffer every step);
    `lr(group_index)` is the learning rate of each parameter group. Returns the number of pieces
    updated. The per-parameter scalars (Adam's `step`) in `local.scalars` advance with it."""
    params: list[torch.nn.Parameter] = []
    order: list[tuple[str, Piece]] = []
    runs: dict[int, list[Piece]] = {}  # id of a run's stand-in piece -> the pieces it joins
    for fqn, ps in pieces.items():
        for piece in _joined([q for q in ps if GRAD in q.data and q.hi > q.lo], runs):
            view = _rows(piece.data[PARAM], shapes[fqn])
            p = torch.nn.Parameter(view, requires_grad=True)
            p.grad = _rows(piece.data[GRAD], shapes[fqn])
            if coefficient != 1.0:  # in place: the pending gradient is this step's, used once
                p.grad.mul_(coefficient)
            params.append(p)
            order.append((fqn, piece))
    if not params:
        return 0
    optimizer = optimizer_factory(params)
    for index, (group, hyper) in enumerate(zip(optimizer.param_groups, local.hyper)):
        group.update({k: v for k, v in hyper.items() if k != "lr"})
        group["lr"] = lr(index)
        if (group.get("foreach") is None and type(optimizer) in SAME_ARITHMETIC_FOREACH and group["params"]
                and sum(p.numel() for p in group["params"]) <= FOREACH_UP_TO * len(group["params"])):
            group["foreach"] = True
    for p, (fqn, piece) in zip(params, order):
        state: dict[str, Any] = {k: _rows(v, shapes[fqn]) for k, v in piece.data.items() if k not in (PARAM, GRAD)}
        state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.scalars.get(fqn, {}).items()})
        if state:
            optimizer.state[p] = state
    with torch.no_grad():
        optimizer.step()
    updated = 0
    for p, (fqn, piece) in zip(params, order):
        after = optimizer.state.get(p, {})
        joined = runs.get(id(piece), [piece])
        for key, value in after.items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and key not in piece.data:
                flat, at = value.reshape(-1), 0  # a fresh job: the optimizer created its state now
                for q in joined:
                    q.data[key] = flat[at:at + q.hi - q.lo]
                    at += q.hi - q.lo
        updated += len(joined)
        for q in joined:
            q.data.pop(GRAD, None)
        local.keys[fqn] = tuple(joined[0].data)
        local.dtypes[fqn] = {k: str(v.dtype).removeprefix("torch.") for k, v in joined[0].data.items()}
    # Scalars (the step count) are one per parameter, the same for every slice: take the first.
    for p, (fqn, _) in zip(params, order):
        local.scalars[fqn] = {k: v for k, v in optimizer.state.get(p, {}).items()
                              if not (isinstance(v, torch.Tensor) and v.shape == p.shape)}
    return updated


def _joined(pieces: list[Piece], runs: dict[int, list[Piece]]) -> list[Piece]:
    """`pieces`, a run of them whose tensors (every key's) are consecutive views of one buffer
    stood in for by one piece over the whole run (recorded in `runs`, by the stand-in's id): an
    element-wise step of the run is the steps of its pieces, and a row-wise tp split's copy has a
    piece per row."""
    if len(pieces) < 2 or not _consecutive(pieces):
        return pieces
    first = pieces[0]
    total = sum(q.hi - q.lo for q in pieces)
    stand_in = Piece(first.lo, first.lo + total, {k: v.as_strided((total,), (1,)) for k, v in first.data.items()})
    runs[id(stand_in)] = pieces
    return [stand_in]


def _consecutive(pieces: list[Piece]) -> bool:
    keys = pieces[0].data.keys()
    for a, b in zip(pieces, pieces[1:]):
        if b.data.keys() != keys:
            return False
        for k in keys:
            x, y = a.data[k], b.data[k]
            if (x.dim() != 1 or y.dim() != 1 or not x.is_contiguous() or not y.is_contiguous() or x.dtype != y.dtype
                    or y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
                    or y.storage_offset() != x.storage_offset() + x.numel()):
                return False
    return True


def _rows(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A flat slice of whole rows viewed with the parameter's trailing dimensions (flat where it is
    part of a row: a row-wise tensor-parallel split's piece)."""
    if len(shape) <= 1:
        return flat
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    return flat.view(-1, *shape[1:]) if per_row and flat.numel() % per_row == 0 else flat
