"""The replicated executor's state: a plain module and optimizer holding every element, built from a
`LocalState` and given back as one (`worker.parallel.slices.from_module`), so a replicated epoch
can follow a sharded one and the other way round. (Its step, with the gradient all-reduce, is
`worker.step.replicated`.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.job import Job
from worker.parallel.meta import meta_model
from worker.parallel.slices import PARAM, LocalState, from_module

__all__ = ["Replica", "apply_replicated", "extract_replicated"]


@dataclass(slots=True)
class Replica:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def apply_replicated(job: Job, local: LocalState, device: torch.device) -> Replica:
    """The job's whole model and optimizer on `device`, loaded from `local` (which holds every element)."""
    model = meta_model(job)
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            local.copy_to(fqn, PARAM, 0, p.numel(), p.view(-1))
        for name, buf in model.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    optimizer = job.optimizer(model.parameters())
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in model.named_parameters():
        state: dict[str, Any] = {key: local.fresh(fqn, key, 0, p.numel(), device).view_as(p)
                                 for key in local.keys.get(fqn, ()) if key != PARAM}
        state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.scalars.get(fqn, {}).items()})
        if state:
            optimizer.state[p] = state
    return Replica(model=model, optimizer=optimizer)


def extract_replicated(replica: Replica, step: int) -> LocalState:
    return from_module(step, replica.model, replica.optimizer)


# --- gradient buckets: communication overlapped with the backward ---------------------------------

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class GradBuckets:
    """Gradients all-reduced in buckets as the backward produces them, as DDP does, instead of one
    flat all-reduce after the whole backward, so communication overlaps the backward as it does in
    torchrun + DDP.

    Parameters are grouped, in reverse registration order (the order the backward reaches them), into
    buckets of about `bucket_bytes`; a hook on each parameter's gradient accumulation launches a
    bucket's all-reduce the moment its last gradient is in. A bucket's float32 buffer is reused from
    the last step only when that step's all-reduce was waited for to the end (`assign`); after an
    abandoned step it is a fresh one, so an op that completes late writes into memory nobody reads.
    (Fresh buffers every step would fault in 40 MB of pages a step on the 10M GPT.) `finish`
    launches what the backward did not reach (a member with no samples, unused parameters: zeros)
    and returns every (work, buffer) for the caller's abortable wait; `assign` then hands each
    parameter its summed gradient.
    """

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = params
        self.buckets: list[list[int]] = []
        size = 0
        for i in reversed(range(len(params))):
            if not self.buckets or size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += params[i].numel() * 4
        self.owner = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._launch: Any = None
        self._check: Any = None
        self._remaining: list[int] = []
        self.works: list[tuple[Any, torch.Tensor] | None] = []
        self._reusable: list[torch.Tensor | None] = [None] * len(self.buckets)  # (see the docstring)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
                         for i, p in enumerate(params)]

    def start(self, launch: Any, check: Any = None) -> None:
        """A new step: `launch(buffer) -> work` starts one bucket's all-reduce; `check()`, called as
        each gradient comes in, may raise to give the backward up (the step is abandoned)."""
        self._launch, self._check = launch, check
        self._remaining = [len(b) for b in self.buckets]
        self.works = [None] * len(self.buckets)

    def _hook(self, index: int) -> Any:
        def ready(_: torch.Tensor) -> None:
            if self._launch is None:
                return
            if self._check is not None:
                self._check()
            b = self.owner[index]
            self._remaining[b] -= 1
            if self._remaining[b] == 0:
                self._start(b)
        return ready

    def _start(self, b: int) -> None:
        parts = []
        for i in self.buckets[b]:
            p = self.params[i]
            parts.append(p.grad.reshape(-1).float() if p.grad is not None
                         else torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
        buf, self._reusable[b] = self._reusable[b], None
        buf = torch.cat(parts) if buf is None else torch.cat(parts, out=buf)
        self.works[b] = (self._launch(buf), buf)

    def finish(self) -> list[tuple[Any, torch.Tensor]]:
        """Launch the buckets the backward did not complete; every bucket's (work, buffer)."""
        for b, started in enumerate(self.works):
            if started is None:
                self._start(b)
        self._launch = None
        return [w for w in self.works if w is not None]

    def abandon(self) -> list[tuple[Any, torch.Tensor]]:
        """The step was given up in its backward: the (work, buffer) of every bucket already
        launched, for the caller to leave behind (`worker.comm.outlive`); none is reused."""
        launched = [w for w in self.works if w is not None]
        self._launch, self._check = None, None
        self.works = [None] * len(self.buckets)
        return launched

    def assign(self) -> None:
        """Give every parameter its summed gradient (in its own dtype) from the waited buffers (each
        reused by the next step, which starts by dropping these gradients)."""
        for b, (members, work) in enumerate(zip(self.buckets, self.works)):
            assert work is not None
            buf, offset = work[1], 0
            self._reusable[b] = buf
            for i in members:
                p = self.params[i]
                p.grad = buf[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
