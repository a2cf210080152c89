"""Entering an epoch whose layout involves sharded state: who holds what, and the reshard into the
new layout.

Every member states what it holds (its step, and the element ranges of every parameter it has,
or nothing: a newcomer, a fenced worker), in two all-gathers over the epoch's raw group (sizes, then
the padded descriptions). The holders are the members at the highest step (one that fell a step
behind, or was fenced, holds nothing current). From that, every member derives the same transfer
list (`plan.reshard.plan_reshard`: the new layout's slices, each needed byte once, sources balanced),
and runs its part of it (`worker.parallel.slices.execute`). State that no holder has is `StateLost`:
the worker tells the coordinator, which stops the job naming it; nothing trains on made-up state.

Why all-gather rather than the coordinator's word: after an abandoned epoch the members may hold
different layouts (a failure can strike mid-reshard, when some members assembled their new slices
and others still hold the old ones); what each one says it holds is the only ground truth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from plan.layout import Layout
from plan.reshard import Holdings, ReshardPlan, TensorShape, holdings, plan_reshard
from worker.parallel import slices
from worker.parallel.slices import LocalState

Wait = Callable[[Any, torch.Tensor | None], None]


class StateLost(RuntimeError):
    """Slices of the training state that no member holds any more (named in the message)."""


def describe(tensors: Sequence[TensorShape], local: LocalState | None) -> torch.Tensor:
    """int64 [step, then per tensor (in `tensors` order): n, lo1, hi1, ..., lo_n, hi_n]; step -1: nothing."""
    if local is None:
        return torch.tensor([-1], dtype=torch.int64)
    out = [local.step]
    held = local.holdings()
    for t in tensors:
        ranges = held.get(t.name, [])
        out.append(len(ranges))
        for lo, hi in ranges:
            out += [lo, hi]
    return torch.tensor(out, dtype=torch.int64)


def read(tensors: Sequence[TensorShape], data: list[int]) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    step = data[0]
    if step < 0:
        return step, {}
    out: dict[str, list[tuple[int, int]]] = {}
    at = 1
    for t in tensors:
        n = data[at]
        at += 1
        ranges = [(data[at + 2 * i], data[at + 2 * i + 1]) for i in range(n)]
        at += 2 * n
        if ranges:
            out[t.name] = ranges
    return step, out


def exchange(pg: Any, rank: int, world: int, mine: torch.Tensor, wait: Wait) -> list[list[int]]:
    """Every member's description (see `describe`), by rank."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    wait(pg.allgather([sizes], [size]), None)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.int64)
    padded[:mine.numel()] = mine
    out = [torch.zeros(longest, dtype=torch.int64) for _ in range(world)]
    wait(pg.allgather([out], [padded]), None)
    return [o[:int(s.item())].tolist() for o, s in zip(out, sizes)]


def plan_entry(layout: Layout, tensors: Sequence[TensorShape], described: list[list[int]],
               ranks: Sequence[str]) -> tuple[int, list[str], Holdings, ReshardPlan]:
    """(step to continue from, holders, the new layout's holdings, the transfers); StateLost when
    some slice is held by nobody."""
    states = [read(tensors, d) for d in described]
    best = max(step for step, _ in states)
    holders = [ranks[r] for r, (step, _) in enumerate(states) if step == best and best >= 0]
    before: Holdings = {ranks[r]: held for r, (step, held) in enumerate(states) if ranks[r] in holders}
    after = holdings(layout, tensors)
    plan = plan_reshard(before, after)
    if plan.missing:
        raise StateLost(f"no member holds {plan.describe_missing()} of step {best}")
    return best, holders, after, plan


def enter(layout: Layout, tensors: Sequence[TensorShape], me: str, ranks: Sequence[str], local: LocalState | None,
          pg: Any, wait: Wait, device: torch.device,
          seed: Callable[[], LocalState]) -> tuple[LocalState, int, ReshardPlan]:
    """Run the reshard into `layout` for member `me` (ranks: the group's members by rank, `layout`'s
    members first); returns the new LocalState, the bytes received and the plan. When nobody holds
    any state (a fresh job, or one whose state was lost and restarts), every member takes the seeded
    state of step 0 (`seed`), which is the same everywhere."""
    rank = list(ranks).index(me)
    described = exchange(pg, rank, len(ranks), describe(tensors, local), wait)
    if all(d[0] < 0 for d in described):
        local = seed()
        described = [describe(tensors, local).tolist()] * len(ranks)
    _, holders, after, plan = plan_entry(layout, tensors, described, ranks)
    mine = local if me in holders else None
    new, received = slices.execute(plan, me, {n: i for i, n in enumerate(ranks)}, mine, after.get(me, {}),
                                   holders, pg, wait, device)
    return new, received, plan
