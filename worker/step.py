"""One exact training step, in each layout: every member applies the full-batch gradient, and
every member learns two facts at once from the step's all-reduce: the global loss, and whether all
of them hold the next planned delta (the switch vote). When all do, they switch epochs right after
that step, with no extra round trip (the agreed step boundary).

`replicated`: a replica computes the summed loss of its contiguous slice of the step's global batch,
divides by the global batch size, and all-reduces (SUM) its gradients in buckets, each sent as soon
as the backward fills it (`worker.parallel.replicated.GradBuckets`), then one small buffer with the
loss sum and the votes (the switch; a durable checkpoint every member was asked for). `sharded`: FSDP2 on the epoch's registered group (`worker.parallel.fsdp`),
micro-batches in lockstep, the copies' gradient exchange (from then on the step may be rolled
forward: `Trainer.pending`), and one all-reduce of the loss, the squared gradient norm, the vote,
a pending `ctl save` and a pending checkpoint.

Both functions take the `Trainer` and update its fields (step, pending, coefficient, final_writer)
in an order that fault tolerance depends on; keep it. A collective is waited for with the trainer's
abortable `wait`; a superseded one raises `Superseded`, and the step is abandoned with no state
touched. Sharded, once the gradient exchange is done the step's gradients are held (`pending`): the
next epoch's entry rolls the step forward if any member applied it (`worker.epoch.enter`).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from transport import PlanDelta
from worker import comm
from worker.comm import AllOf, Superseded
from worker.group import Group
from worker.job import sample_ids, share_slice
from plan.pipeline import micro_split
from worker.parallel.fsdp import Sharded
from worker.parallel.pipeline import StageStep, one_f_one_b
from worker.parallel.replicated import GradBuckets
from worker.parallel.staged import Stage, neighbours

if TYPE_CHECKING:
    from worker.trainer import Trainer


def replicated(t: Trainer, g: Group) -> PlanDelta | None:
    """One exact data-parallel step of a replica; returns the delta to switch to when all ranks agreed."""
    t0 = time.perf_counter()
    job, G = t.job, t.job.global_batch
    ids = sample_ids(job.seed, t.step, len(job.dataset), G)[share_slice(g.shares, g.rank)]
    for p in t.params:
        p.grad = None
    buckets = _grad_buckets(t)
    buffers = t.buffers_of(t.model)
    buffers.begin()
    _abandon_points(t)
    t.computing = g.epoch  # (until the compute ends: the units' hooks may give the step up)
    # Micro-batches (the plan's, where a share does not fit memory at once): gradients accumulate
    # over the passes, and the buckets go out during the last pass's backward only.
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
            with _autocast(t):
                outputs = t.model(inputs)
            loss = job.loss(outputs, targets)
            _pause(t, g, "forward")
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
            _sleep(t, g, (factor - 1.0) * compute_s)
            compute_s = time.perf_counter() - t0
    except Superseded:  # given up in the compute: the buckets already out must not block anyone
        comm.outlive(g.pg, buckets.abandon())
        raise
    t.computing = 0

    # The vote and the loss: the switch to a planned delta all replicas hold, and the loss sum.
    # Asked now, not at the step's start: a delta that arrived during the compute is voted on
    # in this step (a join waits about half a step less).
    _pause_for_plan(t, g)
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
    multiplier = job.lr_multiplier(t.step)
    for group, base in zip(t.optimizer.param_groups, t.base_lrs):
        group["lr"] = base * multiplier
    lr = t.base_lrs[0] * multiplier if t.base_lrs else 0.0
    t.optimizer.step()
    t.step += 1
    t.final_writer = t.step == job.num_steps and g.rank == 0
    agreed = round(float(buf[1])) == len(g.members) and pending is not None
    t.after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm,
                 switching=agreed)
    requested = t.agent.take_save()
    if requested is not None:  # `ctl save PATH`: at this step boundary
        t.save(requested, final=False)
    t.checkpoint_if_due(g, asked=round(float(buf[2])) == len(g.members))
    return pending if agreed else None


def sharded(t: Trainer, g: Group, sharded: Sharded) -> PlanDelta | None:
    """One exact step with FSDP2: each member computes its slice of the batch (a member with no
    samples still takes part in every gather and reduce-scatter), gradients are summed into their
    shards by FSDP2's hooks, and one small all-reduce gives the global loss, the global gradient
    norm (over every shard) and the switch vote."""
    t0 = time.perf_counter()
    job, G = t.job, t.job.global_batch
    start, stop = g.layout.batch_slice(g.rank)
    ids = sample_ids(job.seed, t.step, len(job.dataset), G)[start:stop]
    sharded.optimizer.zero_grad(set_to_none=True)
    buffers = t.buffers_of(sharded.model)
    buffers.begin()
    sharded.comm.take()  # (FSDP2's gathers and scatters of this step from here on)
    if sharded.kept is not None:
        sharded.kept.clear()
    loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
    # Micro-batches: every member runs as many forward/backward passes as the member that needs
    # the most (each pass gathers the units), with no samples once its own share is done.
    size = g.micro[g.rank] or len(ids) or 1
    passes = max((-(-s // (m or s)) if s else 1) for s, m in zip(g.shares, g.micro))
    t.computing = g.epoch  # (until the compute ends: FSDP2's collectives may give the step up)
    try:
        for i in range(passes):
            chunk = ids[i * size:(i + 1) * size]
            if len(chunk):
                inputs, targets = job.dataset[chunk]
                loss = job.loss(sharded.model(inputs.to(t.device)), targets.to(t.device))
                _pause(t, g, "forward")
                (loss / G).backward()  # type: ignore[no-untyped-call]
                loss_sum = loss_sum + loss.detach().double()
            else:  # no samples left: the collectives of the pass still need this member
                inputs, targets = job.dataset[torch.arange(1)]
                (job.loss(sharded.model(inputs.to(t.device)), targets.to(t.device)) * 0).backward()  # type: ignore[no-untyped-call]
    except Superseded:
        raise
    except Exception as e:
        if is_comm_error(e) or t.agent.superseded(g.epoch):
            raise Superseded(f"the step's gathers failed: {str(e).splitlines()[0][:200]}") from None
        raise
    finally:
        t.computing = 0  # (evaluation and the final gather run FSDP2's hooks too: never given up)
    # This member's own compute: the step so far less FSDP2's collectives (where it also waited
    # for the slowest member), which count as communication, as the cost model has them.
    collectives_s = sharded.comm.take()
    compute_s = time.perf_counter() - t0 - collectives_s
    factor = t.agent.slowdown
    if factor > 1.0 and len(ids):  # the --slowdown test knob: its own compute stretched
        t_slow = time.perf_counter()
        _sleep(t, g, (factor - 1.0) * compute_s)
        compute_s += time.perf_counter() - t_slow
    _pause(t, g, "backward")
    # Every member gets its copy's gradients: from here on the step may be rolled forward.
    t_copies = time.perf_counter()
    if sharded.reduced_everywhere:  # (gloo: the reduce-scatters were all-reduces; no message needed)
        t.copies.take(((fqn, local_grad(p)) for fqn, p in sharded.params.items()), sharded.kept)
    else:
        t.copies.exchange(((p.to_local() if isinstance(p, DTensor) else p, local_grad(p))
                           for p in sharded.params.values()),
                          g.members, g.pg, lambda work, buf: t.wait(g, work, buf), t.device)
    t.redundancy_s = time.perf_counter() - t_copies  # (what the copies cost this step: --trace-steps)
    collectives_s += t.redundancy_s  # (the copies' exchange: communication too)
    _pause(t, g, "exchange")
    t.pending = True
    grads = [gr for p in t.params if (gr := local_grad(p)) is not None]
    squares = sum((squared_norm(gr) for gr in grads), torch.zeros((), dtype=torch.float64, device=t.device))
    # The vote: the switch to a planned delta, and a `ctl save` and a checkpoint every member has
    # (writing either is a collective: all of them take it at the same step boundary).
    _pause_for_plan(t, g)
    pending = t.agent.pending_planned(g.epoch)
    buf = torch.stack([loss_sum.cpu(), squares.cpu() / g.layout.dp_replicate,
                       torch.tensor(1.0 if pending is not None else 0.0, dtype=torch.float64),
                       torch.tensor(1.0 if t.agent.save_waiting() else 0.0, dtype=torch.float64),
                       torch.tensor(1.0 if t.agent.checkpoint_waiting() else 0.0, dtype=torch.float64)]).to(t.device)
    votes = len(buf)
    if buffers:  # (the members' updates of the model's buffers this step, weighted by their shares)
        buf = torch.cat([buf, buffers.deltas(len(ids), G)])
    t_comm = time.perf_counter()
    t.wait(g, g.pg.allreduce([buf]), buf)
    if buffers:
        buffers.apply(buf[votes:])
    comm_s = time.perf_counter() - t_comm + collectives_s
    grad_norm = float(buf[1].sqrt())
    _pause(t, g, "optimizer")
    if t.config.pause_at == ("abandon", t.step + 1):
        t.log(f"abandoning step {t.step + 1} after its all-reduce (--pause-at)")
        raise Superseded
    coefficient = 1.0
    if job.grad_clip is not None:
        coefficient = min(1.0, job.grad_clip / (grad_norm + 1e-6))
        for gr in grads:
            gr.mul_(coefficient)
    multiplier = job.lr_multiplier(t.step)
    for group, base in zip(sharded.optimizer.param_groups, t.base_lrs):
        group["lr"] = base * multiplier
    lr = t.base_lrs[0] * multiplier if t.base_lrs else 0.0
    sharded.stepper.step()  # (on the shards' local tensors: no DTensor dispatch)
    t_copies = time.perf_counter()
    t.copies.update(job.optimizer, t.shapes, lambda i: t.base_lrs[i] * multiplier, coefficient)
    t.redundancy_s += time.perf_counter() - t_copies
    t.pending, t.coefficient = False, coefficient
    t.step += 1
    agreed = round(float(buf[2])) == len(g.members) and pending is not None
    t.after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm,
                 switching=agreed)
    if t.step == job.num_steps and t.config.final_dir:  # every member gathers; rank 0 writes
        t.save_gathered(g, t.config.final_dir, final=True)
    if round(float(buf[3])) == len(g.members):
        requested = t.agent.take_save()
        if requested is not None:
            t.save_gathered(g, requested, final=False)
    t.checkpoint_if_due(g, asked=round(float(buf[4])) == len(g.members))
    return pending if agreed else None


def pipelined(t: Trainer, g: Group, stage: Stage) -> PlanDelta | None:
    """One exact step of a pipeline stage: its data-parallel slot's samples as contiguous
    micro-batches (`Group.micro`: the largest micro-batch's size; sizes differ by at most one), run
    through the stages in 1F1B order (`worker.parallel.pipeline`), the last stage summing the loss
    over the global batch; then one all-reduce of the loss, the squared gradient norm (every stage's
    parameters once), the vote, a pending `ctl save` and a pending checkpoint, and each stage steps
    its own optimizer. Every wait for a neighbour is the trainer's abortable one: a stage whose
    neighbour died gives the step up (Superseded) as soon as the epoch is superseded."""
    t0 = time.perf_counter()
    job, G = t.job, t.job.global_batch
    start, stop = g.layout.batch_slice(g.rank)
    ids = sample_ids(job.seed, t.step, len(job.dataset), G)[start:stop]
    stage.optimizer.zero_grad(set_to_none=True)
    size = g.micro[g.rank] or len(ids) or 1
    sizes = micro_split(len(ids), size) if len(ids) else ()  # (as the planner predicted them)
    chunks, at = [], 0
    for n in sizes:
        chunks.append(ids[at:at + n])
        at += n
    before, after = neighbours(g.layout, g.rank)
    waited = [0.0]  # seconds spent waiting for the neighbours (the bubble, their sends): not compute

    def wait(work: Any, buf: torch.Tensor | None) -> None:
        w0 = time.perf_counter()
        try:
            t.wait(g, work, buf)
        finally:
            waited[0] += time.perf_counter() - w0
    step = StageStep(module=stage.module, stage=stage.stage, stages=stage.stages, prev_rank=before, next_rank=after,
                     send=lambda x, dst, tag: g.pg.send([x], dst, tag), recv=lambda x, src, tag: g.pg.recv([x], src, tag),
                     wait=wait, sizes=sizes, device=t.device,
                     inputs=[job.dataset[c][0] for c in chunks] if before is None else (),
                     targets=[job.dataset[c][1] for c in chunks] if after is None else (),
                     loss=job.loss, global_batch=G)
    t.computing = g.epoch
    try:
        _pause(t, g, "forward")  # (before its first forward: its neighbours wait for it point to point)
        loss_sum = one_f_one_b(step)
    except Superseded:
        raise
    except Exception as e:
        if is_comm_error(e) or t.agent.superseded(g.epoch):
            raise Superseded(f"the pipeline's sends failed: {str(e).splitlines()[0][:200]}") from None
        raise
    finally:
        t.computing = 0
    # This stage's compute, reported as the whole model's for these samples (the coordinator reads
    # a member's speed in whole-model samples/s): the stage's time less its waits, over its units'
    # share of the model's FLOPs.
    compute_s = (time.perf_counter() - t0 - waited[0]) / _flops_fraction(t, stage)
    factor = t.agent.slowdown
    if factor > 1.0 and len(ids):  # the --slowdown test knob: this stage's compute stretched (the
        # pipeline waits for it at its next step's boundaries, as for a slow device)
        _sleep(t, g, (factor - 1.0) * (time.perf_counter() - t0 - waited[0]))
        compute_s *= factor
    _pause(t, g, "backward")
    # Every member gets its copy's gradients (its source's stage): from here on the step may be
    # rolled forward.
    t_copies = time.perf_counter()
    t.copies.exchange(((p, p.grad) for p in stage.module.parameters()), g.members, g.pg, wait, t.device)
    t.redundancy_s = time.perf_counter() - t_copies
    _pause(t, g, "exchange")
    t.pending = True
    grads = [gr for p in stage.module.parameters() if (gr := p.grad) is not None]
    squares = sum((squared_norm(gr) for gr in grads), torch.zeros((), dtype=torch.float64, device=t.device))
    _pause_for_plan(t, g)
    pending = t.agent.pending_planned(g.epoch)
    buf = torch.stack([loss_sum.double().cpu(), squares.cpu() / g.layout.dp_replicate,
                       torch.tensor(1.0 if pending is not None else 0.0, dtype=torch.float64),
                       torch.tensor(1.0 if t.agent.save_waiting() else 0.0, dtype=torch.float64),
                       torch.tensor(1.0 if t.agent.checkpoint_waiting() else 0.0, dtype=torch.float64)]).to(t.device)
    t_comm = time.perf_counter()
    t.wait(g, g.pg.allreduce([buf]), buf)
    comm_s = time.perf_counter() - t_comm + waited[0]
    grad_norm = float(buf[1].sqrt())
    _pause(t, g, "optimizer")
    coefficient = 1.0
    if job.grad_clip is not None:
        coefficient = min(1.0, job.grad_clip / (grad_norm + 1e-6))
        for gr in grads:
            gr.mul_(coefficient)
    multiplier = job.lr_multiplier(t.step)
    for group, base in zip(stage.optimizer.param_groups, t.base_lrs):
        group["lr"] = base * multiplier
    lr = t.base_lrs[0] * multiplier if t.base_lrs else 0.0
    stage.optimizer.step()
    t_copies = time.perf_counter()
    t.copies.update(job.optimizer, t.shapes, lambda i: t.base_lrs[i] * multiplier, coefficient)
    t.redundancy_s += time.perf_counter() - t_copies
    t.pending, t.coefficient = False, coefficient
    t.step += 1
    agreed = round(float(buf[2])) == len(g.members) and pending is not None
    t.after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm,
                 switching=agreed)
    if t.step == job.num_steps and t.config.final_dir:  # every stage sends its part; the first writes
        t.save_stages(g, t.config.final_dir, final=True)
    if round(float(buf[3])) == len(g.members):
        requested = t.agent.take_save()
        if requested is not None:
            t.save_stages(g, requested, final=False)
    t.checkpoint_if_due(g, asked=round(float(buf[4])) == len(g.members))
    return pending if agreed else None


def _flops_fraction(t: Trainer, stage: Stage) -> float:
    """The stage's units' share of the model's training FLOPs (1 when the graph does not say)."""
    layers = t.graph().layers
    total = sum(layer.train_flops for layer in layers)
    units = {name for name, _ in stage.module.named_children()}
    mine = sum(layer.train_flops for layer in layers if layer.name in units)
    return mine / total if total > 0 and mine > 0 else 1.0


def _grad_buckets(t: Trainer) -> GradBuckets:
    """The gradient buckets of the current replica's parameters (rebuilt with the model)."""
    if t.buckets is None or t.buckets.params is not t.params:
        if t.buckets is not None:
            t.buckets.close()
        t.buckets = GradBuckets(t.params)
    return t.buckets


def _abandon_points(t: Trainer) -> None:
    """Forward pre-hooks on the current replica's units (and its root) that give the step up once
    its epoch is superseded (`Trainer.give_up_if_superseded`): a replicated step otherwise first
    waits, and so first notices an abort, after its whole backward. (The gradients' arrivals are
    the backward's abandon points: `GradBuckets.start`.) A sharded step's are its FSDP2 gathers
    and reduce-scatters (`apply_fsdp`'s `give_up`)."""
    if t.abandon_points is not None and t.abandon_points[0]() is t.model:
        return
    if t.abandon_points is not None:  # (a replica gone since: its hooks go with it)
        for handle in t.abandon_points[1]:
            handle.remove()
    names = {n for n, _ in t.model.named_modules()}
    modules = [t.model, *(t.model.get_submodule(u) for u in t.units() if u in names)]
    # (a weak reference: the hooks must not keep a replica alive once a sharded executor replaced it)
    t.abandon_points = (weakref.ref(t.model), [m.register_forward_pre_hook(t.give_up_if_superseded)
                                               for m in modules])


def _sleep(t: Trainer, g: Group, seconds: float, why: str = "the --slowdown stretch",
           until: Callable[[], bool] = lambda: False) -> None:
    """Sleep inside a step (the --slowdown knob's extra compute, a --pause-at pause), given up as the
    step's real compute would be: Superseded the moment its epoch is. Ends early once `until()`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not until():
        if t.agent.superseded(g.epoch):
            raise Superseded(f"given up in {why}")
        time.sleep(min(left, 0.02))


def _autocast(t: Trainer) -> Any:
    """The replicated forward under `Job.compute_dtype` (a no-op without one)."""
    dtype = t.job.compute_dtype
    return torch.autocast(t.device.type, dtype=getattr(torch, dtype), enabled=dtype is not None) \
        if dtype else contextlib.nullcontext()


def _pause(t: Trainer, g: Group, phase: str) -> None:
    """The --pause-at knob: sleep where a test wants to kill or stop this worker, for 60 s or until
    the epoch is superseded (then the step is given up there, as its compute would be). Once."""
    if t.config.pause_at == (phase, t.step + 1) and not t.paused_step:
        t.paused_step = True  # (once: a step given up here is done again without a pause)
        t.log(f"pausing at {phase} of step {t.step + 1} (--pause-at)")
        _sleep(t, g, 60, f"the --pause-at pause at {phase}")


def _pause_for_plan(t: Trainer, g: Group) -> None:
    """The --pause-at vote knob: just before this member's switch vote, wait (at most 60 s, given up
    with the epoch) until a planned delta arrives. The others, waiting for it in the step's last
    collective, voted before the delta came: a test's deterministic missed vote."""
    if t.config.pause_at != ("vote", t.step + 1) or t.paused_step:
        return
    t.paused_step = True
    t.log(f"pausing at the vote of step {t.step + 1} until a plan arrives (--pause-at)")
    _sleep(t, g, 60, "the --pause-at pause at the vote", until=lambda: t.agent.pending_planned(g.epoch) is not None)


def is_comm_error(e: BaseException) -> bool:
    """An error from the data plane (a peer gone mid-collective), not from the job's own code."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out"))


NORM_CHUNK = 1 << 14


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of `x` as a float64 scalar, from float32 norms of 16K-element chunks
    summed in float64. On 10M elements one float32 norm is 3.6e-4 off (beyond the 1e-4 the loss
    curve is held to) and a float64 one copies every gradient first (about 5% of a 10M GPT step);
    chunks are 3e-8 off and take about 1 ms."""
    flat = x.reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    total: torch.Tensor = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), dim=1).double().pow(2).sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:]).double().pow(2)
    return total


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient, this member's shard of it when sharded (DTensor)."""
    grad = p.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad
