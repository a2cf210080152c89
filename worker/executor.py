"""What every layout's executor offers the loop, and what a step may ask of the loop.

An executor (`Executor`) runs one layout on this member: it owns the model (or this member's part
of it: a shard, a stage), the optimizer, the gradient buffers, the copy it keeps of another
member's state (`worker.parallel.copies`) and the step's pending gradients. It takes one exact
step (`step`), says what it holds as a `LocalState` for the next epoch's reshard (`local_state`),
evaluates and writes the whole model. One executor per layout kind, each in its own file of
`worker.parallel` and registered in its table (`worker.parallel.EXECUTORS`): the loop
(`worker.trainer`) never branches on the layout kind.

The loop (`Loop`) owns the rest: the step counter, the agent, the epoch's group and its abortable
waits, reports, checkpoints and the epoch's entry. A step updates the loop's fields (step,
computing, final_writer) in an order fault tolerance depends on; each executor's step says it.

Also here, the pieces every step shares: the `--pause-at` and `--slowdown` test knobs (sleeps given
up with the epoch), the float64 squared norm of a gradient, and telling a peer's failure from the
job's own error.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plan.graph import Graph
from plan.layout import Layout
from plan.placement import TensorShape
from transport import PlanDelta
from worker.agent import Agent
from worker.comm import Superseded
from worker.config import TrainerConfig
from worker.group import Group
from worker.job import Job, sample_ids
from worker.parallel.buffers import BufferSync
from worker.parallel.copies import Copies
from worker.parallel.slices import PARAM, LocalState, from_module
from worker.parallel.update import GRAD

__all__ = ["Executor", "Loop", "computing", "is_comm_error", "local_grad", "slot_samples", "squared_norm", "stretch"]


class Loop(Protocol):
    """What a step may ask of the loop that runs it (`worker.trainer.Trainer`)."""

    job: Job
    agent: Agent
    config: TrainerConfig
    device: torch.device
    name: str
    step: int  # optimizer steps applied
    computing: int  # the epoch of the step whose compute is in flight (0: none)
    paused_step: bool  # a --pause-at knob inside a step fired (once)
    final_writer: bool  # rank 0 of the group that committed the last step
    base_lrs: list[float]
    shapes: dict[str, tuple[int, ...]]  # every parameter's shape, by name

    @property
    def tensors(self) -> list[TensorShape]: ...  # every parameter as placement sees it (rows, elements, unit)
    def wait(self, g: Group, work: Any, buf: torch.Tensor | None = None) -> None: ...
    def give_up_if_superseded(self, *_: Any) -> None: ...
    def after_step(self, g: Group, loss: float, samples: int, compute_s: float, comm_s: float, step_s: float,
                   lr: float, grad_norm: float, *, switching: bool = False) -> None: ...
    def checkpoint_if_due(self, g: Group, *, asked: bool) -> None: ...
    def write(self, directory: str, final: bool, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None: ...
    def save_interrupted(self, directory: str) -> None: ...
    def log(self, text: str) -> None: ...
    def graph(self) -> Graph: ...
    def units(self) -> list[str]: ...


class Executor(ABC):
    """The state one layout runs on this member (see the module comment); subclasses implement
    `fits`, `build`, `step`, `save` and, where they hold part of the state, `local_state`."""

    whole: ClassVar[bool] = False  # this executor holds the whole model as a plain module (a replica)
    owns_default_group = False  # it registered the epoch's group as c10d's default (FSDP2)
    defer_copy_update: ClassVar[bool] = False  # apply the copy's update later, in a wait (`Copies.update`)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, at: tuple[Layout, int] | None = None,
                 copies: Copies | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.at = at  # the layout and rank it was built for (None: a replica, whatever the layout)
        # Redundancy (sharded and pipeline layouts): who keeps a copy of this member's state and
        # whose state it keeps; whether this step's gradients are held but not applied; the
        # clipping coefficient of the last step applied (for a roll forward after a failure).
        self.copies = copies or Copies.none()
        self.pending = False
        self.coefficient = 1.0
        self.redundancy_s = 0.0  # the last step's time on its copies (exchange + update), for --trace-steps
        self._buffers: BufferSync | None = None

    # --- the table's interface -------------------------------------------------------------------

    @staticmethod
    @abstractmethod
    def fits(layout: Layout) -> bool:
        """Whether this executor runs `layout`."""

    @classmethod
    @abstractmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        """This member's executor of the epoch's layout, loaded from `local` (exactly its part, which
        the entry's reshard brought; a replica: everything)."""

    @abstractmethod
    def step(self, t: Loop, g: Group) -> PlanDelta | None:
        """One exact step; returns the delta to switch to when every member voted for it."""

    @abstractmethod
    def save(self, t: Loop, g: Group | None, directory: str, *, final: bool) -> None:
        """Write the whole model and optimizer state to `directory` (each layout its way: a replica
        writes its own, shards and stages gather first over `g`, every member calling it)."""

    def evaluate(self, t: Loop, g: Group) -> None:
        """The held-out loss at this step boundary (`worker.evaluate`)."""
        from worker.evaluate import evaluate

        evaluate(t, g, self.model, lockstep=not self.whole)

    # --- what it holds ---------------------------------------------------------------------------

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_state(self, step: int) -> LocalState:
        """What this member holds now, as slices (views of the executor's tensors): its own part,
        the gradients of a pending step, and the copy it keeps of another member's part."""
        return from_module(step, self.model, self.optimizer)

    def _with_redundancy(self, local: LocalState, named: Any) -> LocalState:
        """`local` with the pending step's gradients on its pieces (`named`: (fqn, parameter) of
        this member's part) and the copy's pieces (with the keys of tensors it did not hold)."""
        local.pending, local.coefficient = self.pending, self.coefficient
        if self.pending:  # the interrupted step's gradients, kept for a roll forward
            for fqn, p in named:
                grad = local_grad(p)
                at = 0  # (a tensor's pieces are consecutive parts of its local elements: one, or a
                for piece in local.pieces.get(fqn, []):  # row-wise split's one per row)
                    n = piece.hi - piece.lo
                    piece.data[GRAD] = grad.reshape(-1)[at:at + n] if grad is not None else torch.zeros_like(piece.data[PARAM])
                    at += n
        if self.copies.copy is not None:
            local.adopt(self.copies.copy, self.copies.pieces(self.pending))
        return local

    def buffers(self) -> BufferSync:
        """The sync of the model's buffers (the same on every member: `worker.parallel.buffers`)."""
        if self._buffers is None or self._buffers.model is not self.model:
            self._buffers = BufferSync(self.model)
        return self._buffers

    def restore_buffers(self) -> None:
        """A step given up: the buffers it changed go back."""
        if self._buffers is not None:
            self._buffers.restore()

    # --- the end of a step whose vote is one all-reduce (sharded and pipeline layouts) ------------------

    def _votes(self, t: Loop, g: Group, loss_sum: torch.Tensor, squares: torch.Tensor
               ) -> tuple[torch.Tensor, PlanDelta | None]:
        """The step's last all-reduce, float64: this member's loss sum, its squared gradient norm
        (over the replicas: each distinct parameter once), the switch vote (a planned delta held,
        asked now: one that arrived during the compute is voted on in this step), a `ctl save` and a
        checkpoint this member was asked for (writing either is a collective: all of them take it at
        the same step boundary); and the delta voted for."""
        pause_for_plan(t, g)
        pending = t.agent.pending_planned(g.epoch)
        flags = [pending is not None, t.agent.save_waiting(), t.agent.checkpoint_waiting()]
        buf = torch.stack([loss_sum.double().cpu(), squares.cpu() / g.layout.dp_replicate,
                           *(torch.tensor(1.0 if f else 0.0, dtype=torch.float64) for f in flags)])
        return buf.to(t.device), pending

    def _apply(self, t: Loop, grads: list[torch.Tensor], grad_norm: float, step: Callable[[], None]) -> float:
        """Clip as `torch.nn.utils.clip_grad_norm_` does in one process (the global norm), set the
        schedule's learning rate, `step()` the optimizer, and the same update on the copy kept of
        another member (`worker.parallel.copies`); returns the learning rate."""
        coefficient = 1.0
        if t.job.grad_clip is not None:
            coefficient = min(1.0, t.job.grad_clip / (grad_norm + 1e-6))
        if coefficient != 1.0:  # (x * 1.0 is x: a step the clip does not bite leaves its gradients as they are)
            for gr in grads:  # (one by one: foreach fails on a mix of DTensors and plain tensors)
                gr.mul_(coefficient)
        lr, multiplier = set_lr(t, self.optimizer)
        step()
        t_copies = time.perf_counter()
        self.copies.update(t.job.optimizer, t.shapes, lambda i: t.base_lrs[i] * multiplier, coefficient,
                           defer=self.defer_copy_update)
        self.redundancy_s += time.perf_counter() - t_copies
        self.pending, self.coefficient = False, coefficient
        return lr

    def _end(self, t: Loop, g: Group, buf: torch.Tensor, pending: PlanDelta | None, samples: int,
             times: tuple[float, float, float], lr: float, grad_norm: float) -> PlanDelta | None:
        """The step is applied: count it, report it (`times`: compute, communication, the whole step),
        write the whole model at the job's end and where every member was asked to (each layout
        gathers its way: `save`), a checkpoint that is due; the delta every member voted for, if any."""
        t.step += 1
        members = len(g.members)
        agreed = round(float(buf[2])) == members and pending is not None
        t.after_step(g, float(buf[0]) / t.job.global_batch, samples, *times, lr, grad_norm, switching=agreed)
        if t.step == t.job.num_steps and t.config.final_dir:
            self.save(t, g, t.config.final_dir, final=True)
        if round(float(buf[3])) == members:
            requested = t.agent.take_save()
            if requested is not None:
                pause_before_save(t, g)
                try:
                    self.save(t, g, requested, final=False)
                except BaseException:  # (a member failed during the gather: the step is given up)
                    t.save_interrupted(requested)
                    raise
        t.checkpoint_if_due(g, asked=round(float(buf[4])) == members)
        return pending if agreed else None

    def on_meta(self) -> bool:
        """The model is still the structure a worker starts with, never materialised."""
        return any(p.is_meta for p in self.model.parameters())

    def close(self) -> None:
        """The executor is replaced or its state dropped: let go of what it registered, hooked or
        keeps a copy of."""
        self.copies, self.pending = Copies.none(), False


# --- what every step shares ------------------------------------------------------------------------


@contextlib.contextmanager
def computing(t: Loop, g: Group, what: str) -> Iterator[None]:
    """A step's compute, whose collectives (FSDP2's gathers, DTensor's all-reduces) may fail with a
    peer: such a failure, or any once the epoch is superseded, gives the step up (Superseded, naming
    `what` failed); the job's own errors go through. `Loop.computing` is set meanwhile (the abandon
    points' hooks read it)."""
    t.computing = g.epoch
    try:
        yield
    except Superseded:
        raise
    except Exception as e:
        if is_comm_error(e) or t.agent.superseded(g.epoch):
            raise Superseded(f"{what} failed: {str(e).splitlines()[0][:200]}") from None
        raise
    finally:
        t.computing = 0


def stretch(t: Loop, g: Group, compute_s: float, samples: int) -> float:
    """The --slowdown test knob: this member's compute (`compute_s`) stretched by its factor, slept
    (given up with the epoch); the compute it then took."""
    factor = t.agent.slowdown
    if factor <= 1.0 or not samples:
        return compute_s
    t0 = time.perf_counter()
    sleep(t, g, (factor - 1.0) * compute_s)
    return compute_s + time.perf_counter() - t0


def slot_samples(t: Loop, g: Group) -> torch.Tensor:
    """The sample ids of this step that this member's data-parallel slot computes (`Layout.batch_slice`:
    every stage and tp rank of the slot computes the same)."""
    start, stop = g.layout.batch_slice(g.rank)
    return sample_ids(t.job.seed, t.step, len(t.job.dataset), t.job.global_batch)[start:stop]


def sleep(t: Loop, g: Group, seconds: float, why: str = "the --slowdown stretch",
          until: Callable[[], bool] = lambda: False) -> None:
    """Sleep inside a step (the --slowdown knob's extra compute, a --pause-at pause), given up as the
    step's real compute would be: Superseded the moment its epoch is. Ends early once `until()`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not until():
        if t.agent.superseded(g.epoch):
            raise Superseded(f"given up in {why}")
        time.sleep(min(left, 0.02))


def autocast(t: Loop) -> Any:
    """The forward under `Job.compute_dtype` (a no-op without one)."""
    dtype = t.job.compute_dtype
    return torch.autocast(t.device.type, dtype=getattr(torch, dtype), enabled=dtype is not None) \
        if dtype else contextlib.nullcontext()


def pause(t: Loop, g: Group, phase: str) -> None:
    """The --pause-at knob: sleep where a test wants to kill or stop this worker, for 60 s or until
    the epoch is superseded (then the step is given up there, as its compute would be). Once."""
    if t.config.pause_at == (phase, t.step + 1) and not t.paused_step:
        t.paused_step = True  # (once: a step given up here is done again without a pause)
        t.log(f"pausing at {phase} of step {t.step + 1} (--pause-at)")
        sleep(t, g, 60, f"the --pause-at pause at {phase}")


def pause_before_save(t: Loop, g: Group) -> None:
    """The --pause-at save knob: before the first `ctl save` taken at or after the end of its step
    (a save lands at whichever step boundary every member agrees on), sleep as `pause` does, while
    the others gather the model. Once."""
    at = t.config.pause_at
    if at is None or at[0] != "save" or t.step < at[1] or t.paused_step:
        return
    t.paused_step = True
    t.log(f"pausing at the save after step {t.step} (--pause-at)")
    sleep(t, g, 60, "the --pause-at pause at the save")


def pause_for_plan(t: Loop, g: Group) -> None:
    """The --pause-at vote knob: just before this member's switch vote, wait (at most 60 s, given up
    with the epoch) until a planned delta arrives. The others, waiting for it in the step's last
    collective, voted before the delta came: a test's deterministic missed vote."""
    if t.config.pause_at != ("vote", t.step + 1) or t.paused_step:
        return
    t.paused_step = True
    t.log(f"pausing at the vote of step {t.step + 1} until a plan arrives (--pause-at)")
    sleep(t, g, 60, "the --pause-at pause at the vote", until=lambda: t.agent.pending_planned(g.epoch) is not None)


def set_lr(t: Loop, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Every parameter group's learning rate for the step about to be applied, from its base (a
    state received from a peer carries the lr it last used: exact under churn); (the first group's
    lr, the schedule's multiplier)."""
    multiplier = t.job.lr_multiplier(t.step)
    for group, base in zip(optimizer.param_groups, t.base_lrs):
        group["lr"] = base * multiplier
    return (t.base_lrs[0] * multiplier if t.base_lrs else 0.0), multiplier


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
