"""The pipeline executor's state: this member's stage of the model (a contiguous run of the graph's
units, `Layout.stages`) and an optimizer over its parameters only, built from a `LocalState` and
given back as one, so a pipeline epoch can follow a replicated or sharded one and the other way
round. (Its step is `worker.step.pipelined`; the schedule, 1F1B with point-to-point boundaries, is
`worker.parallel.pipeline`.)

A stage is built only for a model whose units form a sequence (`Graph.sequential`: an
`nn.Sequential` whose children are its units, in order). The stage is an `nn.Sequential` of this
member's units under their own names, so its parameters' names are the whole model's ("3.mlp.0.weight"
on the stage that holds unit "3"): the reshard, the checkpoint and `from_module` see the same names
in every layout. Nothing of the other stages is ever materialised.

Also here: the held-out loss through the pipeline (`evaluate_stage`: activations passed forward
only, the last stage sums the loss), and the whole state gathered to the first stage's rank for the
final model and `ctl save` (`gather_state`: each stage packs its part, `worker.state`, and sends it
point to point).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plan.layout import Layout
from worker import state
from worker.job import Job
from worker.parallel.meta import meta_model
from worker.parallel.pipeline import recv_tensor, send_tensor
from worker.parallel.slices import PARAM, LocalState

Wait = Callable[[Any, torch.Tensor | None], None]  # the trainer's abortable wait (raises when superseded)

__all__ = ["Stage", "apply_stage", "evaluate_stage", "gather_state", "neighbours"]


@dataclass(slots=True)
class Stage:
    """This member's stage: its units as one module, their optimizer, where it sits in the pipeline."""

    module: nn.Sequential
    optimizer: torch.optim.Optimizer
    stage: int
    stages: int


def neighbours(layout: Layout, rank: int) -> tuple[int | None, int | None]:
    """The ranks of the stages before and after `rank`'s in its pipeline (same data-parallel slot
    and tensor-parallel rank); None at either end."""
    pp, rep, shard, tp = layout.coords(rank)
    before = layout.rank_of(pp - 1, rep, shard, tp) if pp > 0 else None
    after = layout.rank_of(pp + 1, rep, shard, tp) if pp < layout.pp - 1 else None
    return before, after


def apply_stage(job: Job, layout: Layout, rank: int, local: LocalState, device: torch.device) -> Stage:
    """`rank`'s stage of the job's model on `device`, loaded from `local` (which holds every element
    of the stage's tensors: `plan.placement` gives a stage's ranks its units' tensors whole)."""
    stage = layout.coords(rank)[0]
    model = meta_model(job)
    module = nn.Sequential(OrderedDict((unit, model.get_submodule(unit)) for unit in layout.stages[stage]))
    module.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in module.named_parameters():
            local.copy_to(fqn, PARAM, 0, p.numel(), p.view(-1))
        for name, buf in module.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    optimizer = job.optimizer(module.parameters())
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in module.named_parameters():
        kept: dict[str, Any] = {key: local.fresh(fqn, key, 0, p.numel(), device).view_as(p)
                                for key in local.keys.get(fqn, ()) if key != PARAM}
        kept.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.scalars.get(fqn, {}).items()})
        if kept:
            optimizer.state[p] = kept
    return Stage(module=module, optimizer=optimizer, stage=stage, stages=layout.pp)


def evaluate_stage(stage: Stage, layout: Layout, rank: int, pg: Any, wait: Wait, job: Job, ids: torch.Tensor,
                   chunk: int, device: torch.device) -> tuple[float, int]:
    """This stage's part of the held-out loss over samples `ids` (its data-parallel slot's part), in
    chunks of `chunk`: the first stage reads the inputs, every stage passes its output on, and the
    last one sums the loss; (loss sum, samples) on the last stage, (0, 0) elsewhere."""
    before, after = neighbours(layout, rank)
    send = lambda t, dst, tag: pg.send([t], dst, tag)  # noqa: E731
    recv = lambda t, src, tag: pg.recv([t], src, tag)  # noqa: E731
    total, count = 0.0, 0
    stage.module.eval()
    try:
        with torch.no_grad():
            for k, start in enumerate(range(0, len(ids), chunk)):
                part = ids[start:start + chunk]
                inputs, targets = job.eval_dataset[part]
                x = inputs.to(device) if before is None else recv_tensor(recv, wait, before, k, device)
                out = stage.module(x)
                if after is not None:
                    sent: list[tuple[Any, torch.Tensor]] = []
                    send_tensor(send, out, after, k, device, sent)
                    for work, tensor in sent:
                        wait(work, tensor)
                else:
                    total += float(job.loss(out, targets.to(device)))
                    count += len(part)
    finally:
        stage.module.train()
    return total, count


def gather_state(stage: Stage, step: int, rank: int, ranks: Sequence[int], pg: Any, wait: Wait,
                 device: torch.device) -> list[dict[str, Any]] | None:
    """Every stage's whole state (`{"model": state_dict, "optimizer": {fqn: state}, "hyper": [...]}`),
    gathered to `ranks[0]` (the first stage of one pipeline), in stage order; None on the others.
    For the final model and `ctl save`: the file holds the whole model, as in every layout."""
    mine = {"step": step, "model": stage.module.state_dict(),
            "optimizer": _optimizer_by_name(stage), "hyper": [{k: v for k, v in g.items() if k != "params"}
                                                             for g in stage.optimizer.param_groups]}
    if rank != ranks[0]:
        packed = state.pack(mine, device)
        size = torch.tensor([packed.skeleton.numel()], dtype=torch.int64, device=device)
        for tag, tensor in enumerate([size, packed.skeleton, *packed.buffers]):
            wait(pg.send([tensor], ranks[0], tag), None)
        return None
    parts = [mine]
    for src in ranks[1:]:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        wait(pg.recv([size], src, 0), None)
        skeleton = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        wait(pg.recv([skeleton], src, 1), None)
        meta = state.read_meta(skeleton)
        buffers = state.empty_buffers(meta, device)
        for tag, buf in enumerate(buffers, start=2):
            wait(pg.recv([buf], src, tag), None)
        parts.append(state.unpack(meta, [b.cpu() for b in buffers]))
    return parts


def whole_state(parts: Sequence[dict[str, Any]], model_names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's state dict and its optimizer's (`optimizer.state_dict()`'s form: state keyed
    by the parameter's index in `model_names`, the whole model's `named_parameters()` order) from
    every stage's part (`gather_state`)."""
    model: dict[str, Any] = {}
    by_name: dict[str, Any] = {}
    for part in parts:
        model.update(part["model"])
        by_name.update(part["optimizer"])
    index = {fqn: i for i, fqn in enumerate(model_names)}
    hyper = parts[0]["hyper"]
    if len(hyper) != 1:  # (which parameter went to which group is the job's optimizer's own rule)
        raise ValueError(f"the whole optimizer state of a pipeline needs one parameter group, the job's optimizer "
                         f"has {len(hyper)}")
    optimizer = {"state": {index[fqn]: st for fqn, st in by_name.items()},
                 "param_groups": [{**hyper[0], "params": list(range(len(model_names)))}]}
    return model, optimizer


def _optimizer_by_name(stage: Stage) -> dict[str, Any]:
    names = {id(p): n for n, p in stage.module.named_parameters()}
    return {names[id(p)]: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in stage.optimizer.state.items() if id(p) in names}
