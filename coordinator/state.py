"""The coordinator's state, the events that change it and the effects it asks for: plain, frozen data.

`coordinator.membership.apply` maps (state, event) to (state, effects); `coordinator.replan` makes
plans inside it; the daemon turns effects into I/O. This module holds only the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from coordinator.steps import Tracker
from plan import Cluster, Device, Graph, LayoutPin, Plan, PlanResult
from transport import (Ack, Checkpointed, EvalReport, Join, Message, PlanDelta, ResumeFailed, Saved, StateLost,
                       StepReport)


# --join-wait-max's default: a newcomer waits at most this long for the members' step boundary, so a
# 10M-parameter model's join trains within about a second of its ready even where one more worker adds
# little and the cost-model rule alone would let it wait a whole step. Its price is the members' work
# on an abandoned step, under one step each, once per join.
JOIN_WAIT_MAX_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """What membership and the planner need of the job and the coordinator's flags."""

    global_batch: int
    num_steps: int
    lease_s: float = 1.5
    min_workers: int = 1
    max_workers: int | None = None
    planner: str = "milp"  # "milp" or "even" (a baseline for benchmarks)
    solve_time_limit_s: float = 0.5
    solver: str = "auto"  # the class-level engine: "auto", "search" or "milp"
    horizon_steps: int = 200  # a switch's one-off cost is spread over this many steps (or what is left)
    stability: str = "calm"  # "calm": contention model, change points, re-plans that pay; "legacy": before (#9)
    drain_deadline_s: float = 25.0  # a drained or preempted member must have handed its state over by then
    # A plan's members must acknowledge it within this, plus two of its predicted steps (a planned
    # switch waits for a step boundary); a member that has not is declared failed ("ack_timeout").
    ack_timeout_s: float = 20.0
    checkpoint_dir: str = ""  # where the workers write durable checkpoints ("": none)
    checkpoint_keep: int = 3  # the newest this many are kept (0: all)
    recovery_grace_s: float = 10.0  # a restarted coordinator waits this long for the plan's members to come back
    join_abandons: str = "auto"  # a join abandons the step in flight: "auto" (when it pays), "always", "never"
    join_wait_max_s: float | None = JOIN_WAIT_MAX_S  # under "auto": also when the rest of the step is longer (None: no bound)
    tp_degrees: tuple[int, ...] = ()  # the tensor-parallel degrees the job admits (> 1): the planner weighs them


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A complete durable checkpoint: the state after `step`, at `path` (`worker.checkpoint`)."""

    step: int
    path: str
    bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Worker:
    name: str
    host: str
    device: str
    pid: int
    joined_at: float
    last_seen: float
    epoch: int = 0  # last epoch it acknowledged
    step: int = 0  # steps it has applied, as last reported
    ready: bool = False  # job loaded and model built: plans may include it
    leaving: str | None = None  # why it is being planned out ("drained", "preempted")
    leaving_since: float = 0.0  # when it was asked to go (its drain deadline counts from here)
    nudged_at: float = 0.0  # when the latest plan was last (re)sent to it


class Change(NamedTuple):
    """What a step report showed that may ask for a re-plan: a reason (`replan`'s), and for a
    calibration of a member measured before the epoch, what its miss says: "changed" (at about the
    share it was measured at, membership's KNOWN_SHARE, on cores of its own: its speed changed) or
    "unsure" (the model may have missed: another share, or cores shared with other workers)."""

    reason: str
    miss: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class State:
    workers: dict[str, Worker] = field(default_factory=dict)
    cluster: Cluster = field(default_factory=Cluster)
    graph: Graph | None = None  # the model as the first worker captured it
    epoch: int = 0  # epoch of `plan`, the latest plan sent (0: none yet)
    plan: Plan | None = None
    result: PlanResult | None = None  # the planner's latest answer (explained by `ctl plan --explain`)
    tracker: Tracker | None = None  # measured steps of `plan`'s epoch
    delta: PlanDelta | None = None  # the latest plan as sent, re-sent to a member that lost it
    acked: frozenset[str] = frozenset()  # members of `plan` that acknowledged it
    # Workers that hold the training state while `plan` is not in place everywhere: members of the
    # previous plan that acknowledged it, or survivors waiting for a plan that fits.
    running: frozenset[str] = frozenset()
    reshard_bytes: int = 0  # summed over the acks of `epoch`
    reshard_s: float = 0.0  # slowest ack of `epoch`
    reshard_largest_sender: int = 0  # bytes the busiest sender of `epoch`'s reshard sent
    replan_wanted: str | None = None  # a planned change waiting for the current one to land
    # Why the members should abandon their next step should they miss the vote on the planned join
    # `delta` (it reached one of them after its vote): they would run a whole step more for it.
    # "" when they should not (the policy or the cost model), or the delta already aborts.
    abandon_if_missed: str = ""
    standby: frozenset[str] = frozenset()  # ready workers the latest plan left out
    changed: tuple[str, ...] = ()  # what changed since the latest plan (speeds), said by the next re-plan
    kept: str | None = None  # why the latest re-plan that found a better plan kept the current one
    calibrating: bool = True  # the latest plan rests on a guess for some member (not measured yet)
    links_checked: bool = False  # the latest plan's step was re-predicted with the links it measured (`links`)
    changes_waiting: tuple[Change, ...] = ()  # found in a step whose other reports are still to come
    saves: frozenset[str] = frozenset()  # `ctl save` paths asked for and not yet answered (saved or failed)
    last_step: int = 0  # highest step reported (and logged)
    last_step_at: float = 0.0  # when its first report arrived (the members then began the next step)
    formed_at: float = 0.0  # when the last member of the epoch acked it (the members then began its first step)
    planned_at: float = 0.0  # when the latest plan's delta went out (its acknowledgements are due by `ack_due`)
    last_lr: float | None = None  # learning rate and gradient norm (before clipping) of that step
    last_grad_norm: float | None = None
    last_eval: tuple[int, float, int] | None = None  # (step, loss, samples) of the latest evaluation
    eval_skipped: int = -1  # the latest step whose evaluation was reported skipped (said once)
    finished: bool = False  # some worker ran the last step
    checkpoints: tuple[Checkpoint, ...] = ()  # complete checkpoints known to be intact, oldest first
    # More failed at once than the redundancy covers: the checkpoint the next plan's members load,
    # and the step that had been reached (what the resume redoes), until the resumed epoch is in place.
    resume: Checkpoint | None = None
    lost_at: int = 0
    # A coordinator restarted from its journal (`coordinator.journal`): the journaled plan's members
    # not registered again yet (they train on meanwhile), the plan to put back once they are, their
    # journaled devices (calibration and measurements), who had acknowledged it, and since when.
    recovering: frozenset[str] = frozenset()
    recovered_plan: Plan | None = None
    recovered_devices: dict[str, Device] = field(default_factory=dict)
    recovered_acked: frozenset[str] = frozenset()
    recovery_since: float = 0.0
    unlogged: frozenset[int] = frozenset()  # steps below `last_step` not logged yet (after a restart)
    slices_possible: bool = False  # a sharded or pipelined plan was sent since the last replicated one in place everywhere
    # The layout pin in force (None: the planner chooses): --layout at the start, then each `ctl
    # layout`. It lives here, not in Config, because the operator changes it on a running job and
    # a restarted coordinator must know it (`coordinator.journal`).
    layout: LayoutPin | None = None
    last_tick: float = 0.0  # when the latest Tick was applied (a long gap: the coordinator stalled)
    stopping: bool = False

    def in_play(self, name: str) -> bool:
        """Whether the group in flight needs `name`: a member of the latest plan, or of the one it
        replaces while the switch has not happened everywhere."""
        return ((self.plan is not None and name in self.plan.members) or name in self.running
                or (self.recovered_plan is not None and name in self.recovered_plan.members))

    @property
    def pending(self) -> bool:
        """The latest plan is not yet acknowledged by all of its members."""
        return self.plan is not None and not set(self.plan.members) <= self.acked

    @property
    def holders(self) -> list[str]:
        """Workers holding the training state, in rank order of the latest plan where they are in it."""
        held = (self.running | self.acked) & set(self.workers)
        order = list(self.plan.members) if self.plan else []
        return sorted(held, key=lambda n: (order.index(n) if n in order else len(order), n))


def pin_text(pin: LayoutPin | None) -> str:
    """A pin as `ctl layout` and the events write it: "pp=2", "dp=2,fsdp=2", or "auto" (no pin)."""
    return "auto" if pin is None else pin.describe()


def workers_needed(pin: LayoutPin | None, min_workers: int) -> int:
    """Ready workers the first plan (and the one after a total loss) waits for: --min-workers, or the
    members the pin in force implies (`pp=3`, `dp=2,fsdp=2`), whichever is more. Taken from the pin
    in force, not from the start-up flag alone, so that `ctl layout auto` lets a job that waited for
    a pinned layout's members start with the workers it has."""
    implied = pin.members if pin is not None else None
    return max(min_workers, implied or 1, 1)


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Joined:
    msg: Join


@dataclass(frozen=True, slots=True)
class MadeReady:
    name: str


@dataclass(frozen=True, slots=True)
class GraphReceived:
    """The first worker's capture of the model (validated by the daemon)."""

    graph: Graph


@dataclass(frozen=True, slots=True)
class Seen:
    """A heartbeat."""

    name: str
    epoch: int
    step: int


@dataclass(frozen=True, slots=True)
class StepDone:
    report: StepReport


@dataclass(frozen=True, slots=True)
class Acked:
    ack: Ack


@dataclass(frozen=True, slots=True)
class Evaluated:
    """An evaluation on the held-out set, done (rank 0) or skipped (any member)."""

    msg: EvalReport


@dataclass(frozen=True, slots=True)
class SaveRequested:
    """`ctl save PATH` (the daemon checked that PATH can be written)."""

    path: str


@dataclass(frozen=True, slots=True)
class ModelSaved:
    """A worker wrote (or failed to write) the trained model."""

    msg: Saved


@dataclass(frozen=True, slots=True)
class Left:
    name: str
    reason: str
    error: str = ""  # the job's exception, "TypeName: message" (reason "error: ...")
    where: str = ""  # its innermost frame in the job's own code, "FILE:LINE in FUNCTION"


@dataclass(frozen=True, slots=True)
class Lost:
    name: str
    detected_by: str  # "disconnect" or "lease"


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class DrainRequested:
    name: str


@dataclass(frozen=True, slots=True)
class SlowdownRequested:
    name: str
    factor: float


@dataclass(frozen=True, slots=True)
class LayoutRequested:
    """`ctl layout SPEC`: pin the layout to `pin` (None: `auto`, the planner chooses) and re-plan."""

    pin: LayoutPin | None


@dataclass(frozen=True, slots=True)
class StopRequested:
    reason: str


@dataclass(frozen=True, slots=True)
class StateLostReported:
    """A member found slices of the training state that nobody holds (`transport.StateLost`)."""

    msg: StateLost


@dataclass(frozen=True, slots=True)
class CheckpointRequested:
    """`ctl checkpoint`, or the coordinator's SIGTERM: a durable checkpoint at the next step boundary."""

    reason: str


@dataclass(frozen=True, slots=True)
class CheckpointWritten:
    """Rank 0 of an epoch finished writing a checkpoint (or failed to)."""

    msg: Checkpointed


@dataclass(frozen=True, slots=True)
class ResumeFailedReported:
    """A member could not load the checkpoint it was told to resume from."""

    msg: ResumeFailed


@dataclass(frozen=True, slots=True)
class ReplanDue:
    """Re-plan now (a `FollowUp` of a failure, so that `Abort` goes out before the solve)."""

    reason: str
    abort: bool


Event = (Joined | MadeReady | GraphReceived | Seen | StepDone | Acked | Left | Lost | Tick | DrainRequested
         | SlowdownRequested | LayoutRequested | StopRequested | ReplanDue | ModelSaved | SaveRequested | Evaluated
         | StateLostReported | CheckpointRequested | CheckpointWritten | ResumeFailedReported)


# --- effects ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    to: str
    msg: Message


@dataclass(frozen=True, slots=True)
class Welcome:
    """Send the job's Welcome to a worker that was just admitted."""

    to: str


@dataclass(frozen=True, slots=True)
class Log:
    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan was made (or failed); the daemon times it and logs the `plan` event."""

    result: PlanResult
    epoch: int
    reason: str
    abandons_step: bool = False  # a join that abandons the members' step in flight (`replan`)


@dataclass(frozen=True, slots=True)
class Finished:
    """No worker is left and the job is over (ran its steps, or was stopped)."""

    reason: str


@dataclass(frozen=True, slots=True)
class FollowUp:
    """Apply `event` right after carrying out the effects before this one (and before any other
    event): a failure sends `Abort` and logs `failed` first, then solves the new plan."""

    event: Event


Effect = Send | Welcome | Log | Planned | Finished | FollowUp
Result = tuple[State, list[Effect]]
