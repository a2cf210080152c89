"""The replicated executor: a plain module and optimizer holding every element, built from a
`LocalState` and given back as one (`worker.parallel.slices.from_module`), so a replicated epoch
can follow a sharded or pipeline one and the other way round; its step, with the gradients
all-reduced in buckets as the backward fills them (`GradBuckets`), as DDP does."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plan.layout import Layout
from transport import PlanDelta
from worker import comm
from worker.comm import AllOf, Superseded
from worker.executor import Executor, Loop, autocast, pause, pause_for_plan, set_lr, sleep, squared_norm
from worker.group import Group
from worker.job import Job, sample_ids, share_slice
from worker.parallel.meta import meta_model
from worker.parallel.slices import LocalState, from_module, to_module

__all__ = ["GradBuckets", "Replica", "ReplicaExecutor", "apply_replicated", "extract_replicated"]


@dataclass(slots=True)
class Replica:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def apply_replicated(job: Job, local: LocalState, device: torch.device) -> Replica:
    """The job's whole model and optimizer on `device`, loaded from `local` (which holds every element)."""
    model = meta_model(job)
    return Replica(model=model, optimizer=to_module(local, model, job.optimizer, device))


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


# --- the executor ------------------------------------------------------------------------------------


class ReplicaExecutor(Executor):
    """A whole replica: every layout of whole replicas (plain data parallel, one member alone), and
    the model a worker starts with (its structure on the meta device until a layout needs it)."""

    whole = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.buckets: GradBuckets | None = None  # the step's gradient buckets (hooks on this model)
        # The step's abandon points: hooks on the units that give its compute up once `computing`,
        # the epoch of the step in flight, is superseded.
        self.hooks: tuple[weakref.ref[nn.Module], list[Any]] | None = None

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.whole_replicas

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        replica = apply_replicated(t.job, local, t.device)
        return cls(replica.model, replica.optimizer)

    def close(self) -> None:
        """The hooks on a replica that is replaced go with it."""
        super().close()
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        if self.hooks is not None:
            for handle in self.hooks[1]:
                handle.remove()
            self.hooks = None

    def save(self, t: Loop, g: Group | None, directory: str, *, final: bool) -> None:
        """Replicas are identical: the member asked writes its own."""
        t.write(directory, final, self.model.state_dict(), self.optimizer.state_dict())

    def step(self, t: Loop, g: Group) -> PlanDelta | None:
        """One exact data-parallel step: this replica's contiguous slice of the global batch (in the
        plan's micro-batches where a share does not fit memory at once), its summed loss over the
        global batch, its gradients all-reduced (SUM) in buckets as the backward fills them, then one
        small buffer with the loss sum and the votes (the switch; a checkpoint every member was asked
        for). Returns the delta to switch to when all ranks agreed."""
        t0 = time.perf_counter()
        job, G = t.job, t.job.global_batch
        ids = sample_ids(job.seed, t.step, len(job.dataset), G)[share_slice(g.shares, g.rank)]
        for p in self.params:
            p.grad = None
        buckets = self._grad_buckets()
        buffers = self.buffers()
        buffers.begin()
        self.abandon_points(t)
        t.computing = g.epoch  # (until the compute ends: the units' hooks may give the step up)
        # Micro-batches: gradients accumulate over the passes, and the buckets go out during the
        # last pass's backward only.
        size = g.micro[g.rank] or len(ids) or 1
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        loss_sum: torch.Tensor | float = 0.0
        try:
            for i, chunk in enumerate(chunks):
                if i == len(chunks) - 1:
                    buckets.start(lambda b: g.pg.allreduce([b]), t.give_up_if_superseded)  # each bucket goes
                    # out as soon as the backward fills it
                inputs, targets = job.dataset[chunk]
                inputs, targets = inputs.to(t.device), targets.to(t.device)
                with autocast(t):
                    outputs = self.model(inputs)
                loss = job.loss(outputs, targets)
                pause(t, g, "forward")
                (loss / G).backward()  # type: ignore[no-untyped-call]
                loss_sum = loss_sum + loss.detach()  # stays on the device: no sync before the all-reduce
            if not chunks:  # no samples: the buckets still go out (zeros), in `finish`
                buckets.start(lambda b: g.pg.allreduce([b]))
            compute_s = time.perf_counter() - t0
            factor = t.agent.slowdown
            if factor > 1.0 and len(ids):  # the --slowdown test knob: stretch this step's compute
                if t.device.type == "cuda":
                    torch.cuda.synchronize(t.device)
                    compute_s = time.perf_counter() - t0
                sleep(t, g, (factor - 1.0) * compute_s)
                compute_s = time.perf_counter() - t0
        except Superseded:  # given up in the compute: the buckets already out must not block anyone
            comm.outlive(g.pg, buckets.abandon())
            raise
        t.computing = 0

        # The vote and the loss: the switch to a planned delta all replicas hold, and the loss sum.
        # Asked now, not at the step's start: a delta that arrived during the compute is voted on
        # in this step (a join waits about half a step less).
        pause_for_plan(t, g)
        pending = t.agent.pending_planned(g.epoch)
        buf = torch.zeros(3, dtype=torch.float32, device=t.device)
        buf[0] = loss_sum
        buf[1] = 1.0 if pending is not None else 0.0
        buf[2] = 1.0 if t.agent.checkpoint_waiting() else 0.0  # a checkpoint every member was asked for
        t_comm = time.perf_counter()
        works = [*buckets.finish(), (g.pg.allreduce([buf]), buf)]
        if buffers:  # (the members' updates of the model's buffers this step, weighted by their shares)
            deltas = buffers.deltas(len(ids), G)
            works.append((g.pg.allreduce([deltas]), deltas))
        t.wait(g, AllOf(works))  # one hand-off to the waiting thread for all of them
        comm_s = time.perf_counter() - t_comm
        if buffers:
            buffers.apply(works.pop()[1])

        summed = [out for _, out in works[:-1]]
        grad_norm = float(torch.stack([squared_norm(b) for b in summed]).sum().sqrt())  # every parameter
        if job.grad_clip is not None:  # as torch.nn.utils.clip_grad_norm_ does in one process
            coefficient = min(1.0, job.grad_clip / (grad_norm + 1e-6))
            for b in summed:
                b.mul_(coefficient)
        buckets.assign()
        lr, _ = set_lr(t, self.optimizer)
        self.optimizer.step()
        t.step += 1
        t.final_writer = t.step == job.num_steps and g.rank == 0
        agreed = round(float(buf[1])) == len(g.members) and pending is not None
        t.after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm,
                     switching=agreed)
        requested = t.agent.take_save()
        if requested is not None:  # `ctl save PATH`: at this step boundary
            self.save(t, g, requested, final=False)
        t.checkpoint_if_due(g, asked=round(float(buf[2])) == len(g.members))
        return pending if agreed else None

    def _grad_buckets(self) -> GradBuckets:
        """The gradient buckets of this replica's parameters (made at its first step)."""
        if self.buckets is None:
            self.buckets = GradBuckets(self.params)
        return self.buckets

    def abandon_points(self, t: Loop) -> None:
        """Forward pre-hooks on the replica's units (and its root) that give the step up once its
        epoch is superseded (`Loop.give_up_if_superseded`): a replicated step otherwise first
        waits, and so first notices an abort, after its whole backward. (The gradients' arrivals
        are the backward's abandon points: `GradBuckets.start`.)"""
        if self.hooks is not None and self.hooks[0]() is self.model:
            return
        names = {n for n, _ in self.model.named_modules()}
        modules = [self.model, *(self.model.get_submodule(u) for u in t.units() if u in names)]
        # (a weak reference: the hooks must not keep a replica alive once another executor replaced it)
        self.hooks = (weakref.ref(self.model), [m.register_forward_pre_hook(t.give_up_if_superseded)
                                                for m in modules])
