"""Membership: who is in the job, which epoch is current, and when to re-plan.

Everything that affects membership lives here, as pure transitions with the time passed in:
``apply(state, event, config, now=...) -> (state, effects)``. The daemon turns effects into I/O
(messages, event-log lines) and never decides anything itself. Nothing here reads a clock.

Epochs: every plan the coordinator sends is a new epoch. A planned change (join, drain,
preemption notice) is sent with ``abort=False`` and the workers switch at a step boundary they
agree on through the data plane; the next planned change waits until every member acknowledged the
current one, so at most one planned change is in flight. A failure (socket monitor disconnect,
expired lease, a member leaving mid-plan) sends `Abort` to everyone and a new plan with
``abort=True`` at once, superseding anything pending. A worker that is not a member and talks as one
(it was fenced while stopped, say) gets ``ERR_STALE_EPOCH`` and joins again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from plan import Cluster, Device, Plan, PlanLimits, PlanResult, make_plan
from transport import (
    ERR_NAME_TAKEN,
    ERR_STALE_EPOCH,
    Abort,
    Ack,
    Error,
    Join,
    Message,
    PlanDelta,
    StepReport,
    Stop,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    global_batch: int
    num_steps: int
    lease_s: float = 1.5
    min_workers: int = 1
    max_workers: int | None = None


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
    nudged_at: float = 0.0  # when the latest plan was last (re)sent to it


@dataclass(frozen=True, slots=True, kw_only=True)
class State:
    workers: dict[str, Worker] = field(default_factory=dict)
    cluster: Cluster = field(default_factory=Cluster)
    epoch: int = 0  # epoch of `plan`, the latest plan sent (0: none yet)
    plan: Plan | None = None
    delta: PlanDelta | None = None  # the latest plan as sent, re-sent to a member that lost it
    acked: frozenset[str] = frozenset()  # members of `plan` that acknowledged it
    running: frozenset[str] = frozenset()  # members of the previous plan, while `plan` is pending
    reshard_bytes: int = 0  # summed over the acks of `epoch`
    reshard_s: float = 0.0  # slowest ack of `epoch`
    replan_wanted: str | None = None  # a planned change waiting for the current one to land
    last_step: int = 0  # highest step reported (and logged)
    finished: bool = False  # some worker ran the last step
    stopping: bool = False

    def in_play(self, name: str) -> bool:
        """Whether the group in flight needs `name`: a member of the latest plan, or of the one it
        replaces while the switch has not happened everywhere."""
        return (self.plan is not None and name in self.plan.members) or name in self.running

    @property
    def pending(self) -> bool:
        """The latest plan is not yet acknowledged by all of its members."""
        return self.plan is not None and not set(self.plan.members) <= self.acked


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Joined:
    msg: Join


@dataclass(frozen=True, slots=True)
class MadeReady:
    name: str


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
class Left:
    name: str
    reason: str


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
class StopRequested:
    reason: str


Event = Joined | MadeReady | Seen | StepDone | Acked | Left | Lost | Tick | DrainRequested | StopRequested


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


@dataclass(frozen=True, slots=True)
class Finished:
    """No worker is left and the job is over (ran its steps, or was stopped)."""

    reason: str


Effect = Send | Welcome | Log | Planned | Finished
Result = tuple[State, list[Effect]]


# --- transitions -----------------------------------------------------------------------------


def apply(state: State, event: Event, config: Config, *, now: float) -> Result:
    """The new state and what to do, for one event."""
    match event:
        case Joined(msg):
            return _join(state, msg, config, now)
        case MadeReady(name):
            if name not in state.workers:
                return state, [_fence(name)]
            w = state.workers[name]
            state = replace(state, workers={**state.workers, name: replace(w, ready=True, last_seen=now)})
            return replan(state, config, "join", abort=False, now=now)
        case Seen(name, epoch, step):
            if name not in state.workers:
                return state, [_fence(name)]
            return _nudge(_touch(state, name, now, step=step), name, epoch, config, now)
        case StepDone(report):
            return _step_done(state, report, config, now)
        case Acked(ack):
            return _acked(state, ack, config, now)
        case Left(name, reason):
            return _left(state, name, reason, config, now)
        case Lost(name, detected_by):
            return _lost(state, name, detected_by, config, now)
        case Tick():
            effects: list[Effect] = []
            for w in list(state.workers.values()):
                if now - w.last_seen > config.lease_s:
                    state, more = _lost(state, w.name, "lease", config, now)
                    effects += more
            return state, effects
        case DrainRequested(name):
            return _drain(state, name, "drained", config, now)
        case StopRequested(reason):
            state = replace(state, stopping=True)
            effects = [Send(n, Stop(reason=reason)) for n in state.workers]
            return state, effects + _maybe_finished(state)
    raise AssertionError(f"unhandled event {event!r}")


def replan(state: State, config: Config, reason: str, *, abort: bool, now: float) -> Result:
    """Make a new plan if one is due, and send it as a new epoch."""
    if state.finished or state.stopping:
        return state, []
    if not abort and state.pending:
        return replace(state, replan_wanted=reason), []
    eligible = {n: w for n, w in state.workers.items() if w.ready and w.leaving is None}
    if state.plan is None and len(eligible) < config.min_workers:
        return state, []
    holders = [n for n in state.plan.members if n in state.workers] if state.plan else []
    if not eligible and holders:
        # Only leaving members hold the state and nobody can take it over: they train on.
        if not abort:
            detail = (f"no other worker to hand the state to: {', '.join(holders)} keep(s) training "
                      "until one joins")
            return replace(state, replan_wanted=None), [
                Planned(PlanResult(plan=None, status="infeasible", reason=detail), state.epoch, reason)]
        eligible = {n: state.workers[n] for n in holders}  # aborted: they need a new epoch anyway
    cluster = Cluster({n: d for n, d in state.cluster.devices.items() if n in eligible})
    limits = PlanLimits(global_batch=config.global_batch, max_workers=config.max_workers)
    result = make_plan(cluster, state.plan, limits=limits)
    new = result.plan
    if new is None:
        # Nobody can train, and nobody holds state any more: it is gone with them, and the next
        # workers start from the seed (durable checkpoints arrive with a later issue).
        lost = state.plan is not None
        if lost:
            result = replace(result, reason="no worker left: training state is lost; the next workers "
                                             "start from step 0")
        state = replace(state, plan=None, acked=frozenset(), running=frozenset(), replan_wanted=None,
                        last_step=0 if lost else state.last_step)
        return state, [Planned(result, state.epoch, reason)]
    handoff = None
    if holders and not set(holders) & set(new.members):
        # No state holder stays: keep one leaving holder for one epoch with no samples, so that it
        # hands its state to the newcomers inside the new group; the next plan lets it go.
        handoff = holders[0]
        new = replace(new, members=new.members + (handoff,), shares=new.shares + (0,))
    if not abort and state.plan is not None and new == state.plan:
        return replace(state, replan_wanted=None), []
    epoch = state.epoch + 1
    delta = PlanDelta(epoch=epoch, reason=reason, members=list(new.members), shares=list(new.shares),
                      global_batch=config.global_batch, abort=abort)
    old = set(state.plan.members) if state.plan else set()
    recipients = sorted((old | set(new.members)) & set(state.workers))
    workers = {n: replace(w, nudged_at=now) if n in recipients else w for n, w in state.workers.items()}
    state = replace(state, workers=workers, delta=delta)
    state = replace(state, epoch=epoch, plan=new, acked=frozenset(), reshard_bytes=0, reshard_s=0.0,
                    replan_wanted=f"{handoff} handed off" if handoff else None,
                    running=frozenset(old & set(state.workers)))
    effects: list[Effect] = [Planned(result, epoch, reason)]
    return state, effects + [Send(n, delta) for n in recipients]


def _nudge(state: State, name: str, epoch: int, config: Config, now: float) -> Result:
    """A member of the pending plan still heartbeats an older epoch a lease after the plan went out:
    it may have lost the delta (a reconnect, a fenced worker re-joining), so send it again. A worker
    that has it already just replaces it with the same message."""
    w = state.workers[name]
    lagging = (state.pending and state.delta is not None and state.plan is not None
               and name in state.plan.members and name not in state.acked and epoch < state.epoch)
    if not lagging or now - w.nudged_at < config.lease_s:
        return state, []
    delta = state.delta
    assert delta is not None
    state = replace(state, workers={**state.workers, name: replace(w, nudged_at=now)})
    return state, [Send(name, delta)]


def _join(state: State, msg: Join, config: Config, now: float) -> Result:
    if msg.name in state.workers:
        return state, [Send(msg.name, Error(code=ERR_NAME_TAKEN,
                                            message=f"a live worker is already named {msg.name!r}; "
                                                    "start this one with another --name"))]
    worker = Worker(name=msg.name, host=msg.host, device=msg.device, pid=msg.pid, joined_at=now,
                    last_seen=now)
    device = Device(name=msg.name, host=msg.host, kind=msg.device, flops=max(msg.flops, 1.0),
                    memory_bytes=msg.memory_bytes)
    state = replace(state, workers={**state.workers, msg.name: worker},
                    cluster=state.cluster.with_device(device))
    effects: list[Effect] = [Welcome(msg.name),
                             Log("joined", {"worker": msg.name, "host": msg.host, "device": msg.device})]
    if state.finished or state.stopping:
        return state, effects + [Send(msg.name, Stop(reason="the job is over"))]
    return state, effects


def _step_done(state: State, r: StepReport, config: Config, now: float) -> Result:
    if r.name not in state.workers:
        return state, [_fence(r.name)]
    state = _touch(state, r.name, now, step=r.step)
    state = replace(state, cluster=state.cluster.with_measurement(r.name, r.samples, r.compute_s))
    if r.step <= state.last_step:
        return state, []
    state = replace(state, last_step=r.step, finished=state.finished or r.step >= config.num_steps)
    return state, [Log("step", {"step": r.step, "epoch": r.epoch, "loss": r.loss,
                                "samples": r.global_batch, "step_s": r.step_s})]


def _acked(state: State, ack: Ack, config: Config, now: float) -> Result:
    if ack.name not in state.workers:
        return state, [_fence(ack.name)]
    state = _touch(state, ack.name, now, step=ack.step)
    w = state.workers[ack.name]
    state = replace(state, workers={**state.workers, ack.name: replace(w, epoch=ack.epoch)})
    if ack.epoch != state.epoch or state.plan is None or ack.name not in state.plan.members:
        return state, []
    state = replace(state, acked=state.acked | {ack.name},
                    reshard_bytes=state.reshard_bytes + ack.reshard_bytes,
                    reshard_s=max(state.reshard_s, ack.reshard_s))
    if state.pending:
        return state, []
    state = replace(state, running=frozenset())
    plan = state.plan
    assert plan is not None  # not pending, and ack.name was a member
    # Drained workers switched out with everyone else: now they can go.
    effects: list[Effect] = [Send(n, Stop(reason=w.leaving)) for n, w in state.workers.items()
                             if w.leaving is not None and n not in plan.members]
    effects += [Log("reshard", {"epoch": state.epoch, "bytes": state.reshard_bytes,
                                             "seconds": round(state.reshard_s, 4)})]
    if state.replan_wanted is not None:
        state, more = replan(state, config, state.replan_wanted, abort=False, now=now)
        effects += more
    return state, effects


def _left(state: State, name: str, reason: str, config: Config, now: float) -> Result:
    if name not in state.workers:
        return state, [Send(name, Stop(reason="not a member"))]
    in_latest = state.plan is not None and name in state.plan.members
    planned_out = reason in ("preempted", "drained")
    if in_latest and planned_out and not state.finished:
        return _drain(state, name, reason, config, now)
    clean = reason == "finished" or planned_out  # planned out: it left at the agreed switch
    in_plan = state.in_play(name) and not clean
    state = _remove(state, name)
    effects: list[Effect] = [Log("left", {"worker": name, "reason": reason}),
                             Send(name, Stop(reason="goodbye"))]
    if in_plan and not state.finished:
        effects += [Send(n, Abort(epoch=state.epoch, reason=f"{name} left")) for n in state.workers]
        state, more = replan(state, config, "leave", abort=True, now=now)
        effects += more
    return state, effects + _maybe_finished(state)


def _lost(state: State, name: str, detected_by: str, config: Config, now: float) -> Result:
    worker = state.workers.get(name)
    if worker is None:
        return state, []
    in_plan = state.in_play(name) and not state.stopping  # when stopping, nobody waits for anyone
    state = _remove(state, name)
    if state.stopping or (worker.leaving is not None and not in_plan):
        reason = worker.leaving or "stopped"
        return state, [Log("left", {"worker": name, "reason": reason})] + _maybe_finished(state)
    effects: list[Effect] = [Log("failed", {"worker": name, "detected_by": detected_by})]
    if in_plan and not state.finished:
        effects += [Send(n, Abort(epoch=state.epoch, reason=f"{name} failed")) for n in state.workers]
        state, more = replan(state, config, "failure", abort=True, now=now)
        effects += more
    return state, effects + _maybe_finished(state)


def _drain(state: State, name: str, why: str, config: Config, now: float) -> Result:
    worker = state.workers[name]
    if state.plan is None or name not in state.plan.members:
        state = _remove(state, name)
        return state, [Send(name, Stop(reason=why)), Log("left", {"worker": name, "reason": why})]
    state = replace(state, workers={**state.workers, name: replace(worker, leaving=why)})
    return replan(state, config, why, abort=False, now=now)


def _remove(state: State, name: str) -> State:
    workers = {n: w for n, w in state.workers.items() if n != name}
    return replace(state, workers=workers, cluster=state.cluster.without(name),
                   acked=state.acked - {name}, running=state.running - {name})


def _touch(state: State, name: str, now: float, *, step: int) -> State:
    w = state.workers[name]
    return replace(state, workers={**state.workers, name: replace(w, last_seen=now, step=max(w.step, step))})


def _fence(name: str) -> Send:
    return Send(name, Error(code=ERR_STALE_EPOCH,
                            message=f"{name!r} is not a member of the current epoch; join again"))


def _maybe_finished(state: State) -> list[Effect]:
    if state.workers or not (state.finished or state.stopping):
        return []
    return [Finished("finished" if state.finished else "stopped")]
