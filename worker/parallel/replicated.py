"""The replicated executor's state: a plain module and optimizer holding every element, built from a
`LocalState` and given back as one (`worker.parallel.slices.from_module`), so a replicated epoch
can follow a sharded one and the other way round. (Its step, with the gradient all-reduce, is
`worker.trainer`'s until the trainer is split.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.job import Job
from worker.parallel.slices import PARAM, LocalState, from_module

__all__ = ["Replica", "apply_replicated", "extract_replicated"]


@dataclass(slots=True)
class Replica:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def apply_replicated(job: Job, local: LocalState, device: torch.device) -> Replica:
    """The job's whole model and optimizer on `device`, loaded from `local` (which holds every element)."""
    with torch.device("meta"):
        torch.manual_seed(job.seed)
        model = job.model()
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            p.view(-1).copy_(local.read(fqn, PARAM, 0, p.numel()))
        for name, buf in model.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    optimizer = job.optimizer(model.parameters())
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in model.named_parameters():
        state: dict[str, Any] = {key: local.read(fqn, key, 0, p.numel()).to(device).clone().view_as(p)
                                 for key in local.keys.get(fqn, ()) if key != PARAM}
        state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.scalars.get(fqn, {}).items()})
        if state:
            optimizer.state[p] = state
    return Replica(model=model, optimizer=optimizer)


def extract_replicated(replica: Replica, step: int) -> LocalState:
    return from_module(step, replica.model, replica.optimizer)
