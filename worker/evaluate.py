"""The held-out loss, at the step boundaries the job asks for (`Job.eval_every`, and the last step).

It runs in the epoch's group, right after a step: each member sums the loss over its contiguous
part of the held-out set (split like the batch, by the epoch's shares, among the members that have
samples), in chunks of `EVAL_CHUNK` samples to bound its memory, and one all-reduce of (loss sum,
samples) gives rank 0 the mean to report (`EvalReport`). In a sharded layout every member runs as
many forwards as the busiest one, since each forward gathers the units. The all-reduce is abortable
like a step's; a failure abandons the evaluation with the epoch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from plan.shares import split_shares
from transport import EvalReport
from worker.comm import Superseded
from worker.group import Group
from worker.job import share_slice

if TYPE_CHECKING:
    from worker.executor import Loop
    from worker.parallel.staged import Stage

EVAL_CHUNK = 256  # held-out samples evaluated at once (bounds the memory of an evaluation)


def evaluate(t: Loop, g: Group, model: nn.Module, *, lockstep: bool) -> None:
    """Every member sums the loss over its contiguous part of the held-out set (split like the
    batch, by the epoch's shares; the tp ranks of a data-parallel slot evaluate its part together, the
    first one counting it), the sums are all-reduced, and rank 0 reports the mean. A
    failure in between abandons it: every member that saw it says it was skipped. `lockstep`:
    every member runs as many forwards as the busiest one (a sharded model's forwards gather)."""
    job, layout = t.job, g.layout
    total = len(job.eval_dataset)
    # Split by data-parallel slot (the members of one, tp ranks, evaluate the same samples together,
    # and the first of them counts them)
    shares = [layout.shares[layout.dp_ranks(i)[0]] for i in range(layout.dp)]
    busy = [i for i, s in enumerate(shares) if s > 0] or [0]  # slots with samples split it
    counts = [0] * len(shares)
    for i, n in zip(busy, split_shares(total, [float(max(shares[i], 1)) for i in busy])):
        counts[i] = n
    part = share_slice(counts, layout.dp_index(g.rank))
    counted = layout.coords(g.rank)[3] == 0
    sums = torch.zeros(2, dtype=torch.float64, device=t.device)
    # Sharded: every member runs as many forwards as the busiest one (each gathers the units).
    rounds = -(-max(counts) // EVAL_CHUNK) if lockstep else -(-(part.stop - part.start) // EVAL_CHUNK)
    if rounds:
        model.eval()
        try:
            with torch.no_grad():
                for i in range(rounds):
                    start = part.start + i * EVAL_CHUNK
                    ids = torch.arange(start, min(start + EVAL_CHUNK, part.stop))
                    if not len(ids):  # a forward for the others' gathers, counted nowhere
                        model(job.eval_dataset[torch.arange(1)][0].to(t.device))
                        continue
                    inputs, targets = job.eval_dataset[ids]
                    outputs = model(inputs.to(t.device))
                    if counted:
                        sums[0] += job.loss(outputs, targets.to(t.device)).double()
                        sums[1] += len(ids)
        finally:
            model.train()
    _report(t, g, sums)


def evaluate_pipeline(t: Loop, g: Group, stage: Stage) -> None:
    """A pipeline's held-out loss: each data-parallel slot takes its part of the set (split by the
    slots' shares), passed through its stages; the last stage sums the loss; reported as above."""
    try:
        sums = _through_the_pipeline(t, g, stage)
    except Superseded:
        _skipped(t, g)
        raise
    _report(t, g, sums)


def _through_the_pipeline(t: Loop, g: Group, stage: Stage) -> torch.Tensor:
    from worker.parallel.staged import evaluate_stage

    layout = g.layout
    slots = [layout.shares[layout.dp_ranks(i)[0]] for i in range(layout.dp)]
    busy = [i for i, s in enumerate(slots) if s > 0] or [0]
    counts = [0] * len(slots)
    for i, n in zip(busy, split_shares(len(t.job.eval_dataset), [float(max(slots[i], 1)) for i in busy])):
        counts[i] = n
    part = share_slice(counts, layout.dp_index(g.rank))
    # (a sharded stage's members gather at every chunk: each runs as many as the slot with the most)
    passes = max(-(-n // EVAL_CHUNK) for n in counts) if layout.sharded else 0
    loss, samples = evaluate_stage(stage, layout, g.rank, g.pg, lambda work, buf: t.wait(g, work, buf), t.job,
                                   torch.arange(part.start, part.stop), EVAL_CHUNK, t.device, passes=passes)
    if layout.coords(g.rank)[3] != 0:  # (a last stage split by tp: its first tp rank counts the slot's loss)
        loss, samples = 0.0, 0
    return torch.tensor([loss, float(samples)], dtype=torch.float64, device=t.device)


def _report(t: Loop, g: Group, sums: torch.Tensor) -> None:
    """All-reduce the members' (loss sum, samples); rank 0 reports the mean."""
    try:
        t.wait(g, g.pg.allreduce([sums]), sums)
    except Superseded:
        _skipped(t, g)
        raise
    if g.rank == 0:
        loss, samples = float(sums[0] / sums[1]), int(sums[1])
        t.agent.send(EvalReport(name=t.name, step=t.step, loss=loss, samples=samples, skipped=""))
        t.log(f"eval after step {t.step}: loss {loss:.4f} over {samples} held-out samples")


def _skipped(t: Loop, g: Group) -> None:
    t.agent.send(EvalReport(name=t.name, step=t.step, loss=0.0, samples=0,
                            skipped=f"a failure interrupted it (epoch {g.epoch} abandoned)"))
