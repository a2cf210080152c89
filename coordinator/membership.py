"""Membership: who is in the job, which epoch is current, and when to re-plan.

Everything that affects membership lives here, as pure transitions with the time passed in:
``apply(state, event, config, now=...) -> (state, effects)``. The daemon turns effects into I/O
(messages, event-log lines) and never decides anything itself. Nothing here reads a clock.

Epochs: every plan the coordinator sends is a new epoch. A planned change (join, drain,
preemption notice) is sent with ``abort=False`` and the workers switch at a step boundary they
agree on through the data plane; the next planned change waits until every member acknowledged the
current one, so at most one planned change is in flight. A planned join whose delta missed the
members' vote (a step reported without ``switching``) may be sent again with ``abort=True``
(`_missed_vote`). A failure (socket monitor disconnect,
expired lease, a member leaving mid-plan) sends `Abort` to everyone and a new plan with
``abort=True`` at once, superseding anything pending. A worker that is not a member and talks as one
(it was fenced while stopped, say) gets ``ERR_STALE_EPOCH`` and joins again.

Step reports refine the cluster object (compute speed, overhead, the links' pure communication
time; `coordinator.steps`) and may reveal a straggler or a recovered device, which re-plans like a
join does. Where plans come from is `coordinator.replan`; the vocabulary (state, events, effects)
is `coordinator.state`, re-exported here.
"""

from __future__ import annotations

from dataclasses import replace

from coordinator import steps
from coordinator.replan import addressed, lose_state, replan
from coordinator.state import (
    Acked,
    Change,
    Checkpoint,
    CheckpointRequested,
    CheckpointWritten,
    Config,
    DrainRequested,
    Effect,
    Evaluated,
    Event,
    Finished,
    FollowUp,
    GraphReceived,
    Joined,
    LayoutRequested,
    Left,
    Log,
    Lost,
    MadeReady,
    ModelSaved,
    Planned,
    ReplanDue,
    Result,
    ResumeFailedReported,
    SaveRequested,
    Seen,
    Send,
    SlowdownRequested,
    State,
    StepDone,
    StateLostReported,
    StopRequested,
    Tick,
    Welcome,
    Worker,
    pin_text,
)
from plan import Cluster, Device, LayoutPin, PlanResult
from plan.cluster import kind_key
from plan.cost import step_comm_features
from plan.prediction import fits_comm, measured_overhead, per_pass, reported_compute, repredict
from transport import (ERR_NAME_TAKEN, ERR_STALE_EPOCH, PLANNED_EXITS, Abort, Ack, Checkpointed, CheckpointNow, Error,
                       Join, ResumeFailed, SaveModel, Slowdown, StepReport, Stop)

LOADING_LEASE_S = 30.0  # the lease of a worker that joined and is not ready yet (loading the job)

__all__ = ["Acked", "Checkpoint", "CheckpointRequested", "CheckpointWritten", "ResumeFailedReported", "Config", "DrainRequested", "Effect", "Evaluated", "Event", "Finished", "FollowUp",
           "GraphReceived", "Joined", "LayoutRequested", "Left", "Log", "Lost", "MadeReady", "ModelSaved", "Planned", "ReplanDue",
           "Result", "SaveRequested", "Seen", "Send", "SlowdownRequested", "State", "StateLostReported", "StepDone",
           "StopRequested",
           "Tick", "Welcome", "Worker", "apply", "replan"]


MAX_GAP = 100_000  # a gap of unlogged steps longer than this is not tracked (it is not a restart's)


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
            if name in state.recovering:  # a member of the journaled plan is back (it trained on meanwhile)
                state = replace(state, recovering=state.recovering - {name})
                return _recovered(state, config, now) if not state.recovering else (state, [])
            if state.recovered_plan is not None:  # a newcomer while the plan is not back: planned after
                return state, []
            return replan(state, config, "join", abort=False, now=now)
        case Seen(name, epoch, step):
            if name not in state.workers:
                return state, [_fence(name)]
            return _nudge(_touch(state, name, now, step=step), name, epoch, config, now)
        case GraphReceived(graph):
            return (state if state.graph is not None else replace(state, graph=graph)), []
        case StepDone(report):
            return _step_done(state, report, config, now)
        case Acked(ack):
            return _acked(state, ack, config, now)
        case Left(name, reason, error, where):
            return _left(state, name, reason, config, now, cause={"error": error, "where": where} if error else {})
        case Lost(name, detected_by):
            return _lost(state, name, detected_by, config, now)
        case Tick():
            previous, state = state.last_tick, replace(state, last_tick=now)
            if previous and now - previous > config.lease_s:
                # The coordinator itself did not run for a while (a long solve, a starved process):
                # the heartbeats of that time are still queued, unread. Nobody is late for that gap.
                gap = now - previous
                return replace(state, workers={n: replace(w, last_seen=min(now, w.last_seen + gap))
                                               for n, w in state.workers.items()}), []
            if state.recovered_plan is not None and (not state.recovering
                                                     or now - state.recovery_since > config.recovery_grace_s):
                return _recovered(state, config, now)  # whoever is not back by now has failed
            effects: list[Effect] = []
            replan_due = False
            gone: dict[str, str] = {}  # worker -> how its failure was detected, in the order found
            for w in state.workers.values():
                late = (w.leaving is not None and now - w.leaving_since > config.drain_deadline_s
                        and state.in_play(w.name))  # (planned out and switched: it is only exiting)
                # A worker still loading the job (importing its libraries, building the model) holds
                # no state and is in no plan: its heartbeats may stall behind a native import, and a
                # failure then would only make it join again. It gets LOADING_LEASE_S.
                lease = config.lease_s if w.ready or state.in_play(w.name) else max(config.lease_s, LOADING_LEASE_S)
                if now - w.last_seen > lease or late:
                    if late and now - w.last_seen <= lease:
                        # It could not hand its state over in time (a spot notice gives ~30 s): it
                        # is let go as if it had failed, and its part comes from the redundancy.
                        effects += [Log("drain_deadline", {"worker": w.name, "reason": w.leaving,
                                                           "seconds": round(now - w.leaving_since, 3)}),
                                    Send(w.name, Stop(reason=f"{w.leaving}: the drain deadline passed"))]
                    gone[w.name] = "drain_deadline" if late else "lease"
            for name in _unacknowledged(state, config, now):  # no plan stays pending past its bound
                gone.setdefault(name, "ack_timeout")
            for name, detected_by in gone.items():
                state, more = _lost(state, name, detected_by, config, now)
                replan_due |= any(isinstance(e, FollowUp) for e in more)
                effects += [e for e in more if not isinstance(e, FollowUp)]
            if replan_due:  # one re-plan for every worker lost at this tick
                effects.append(FollowUp(ReplanDue("failure", abort=True)))
            return state, effects
        case DrainRequested(name):
            return _drain(state, name, "drained", config, now)
        case SlowdownRequested(name, factor):
            if name not in state.workers:
                return state, []
            return state, [Send(name, Slowdown(factor=factor)), Log("slowdown", {"worker": name, "factor": factor})]
        case LayoutRequested(pin):
            return _relayout(state, pin, config, now)
        case ModelSaved(msg):
            if msg.error and not msg.final and msg.path not in state.saves:
                return state, []  # answered already (a gather a failure interrupted: each member says so)
            state = replace(state, saves=state.saves - {msg.path})
            if msg.error:
                return state, [Log("save_failed", {"worker": msg.name, "step": msg.step, "path": msg.path,
                                                   "error": msg.error})]
            return state, [Log("finished" if msg.final else "saved", {"step": msg.step, "path": msg.path,
                                                                      "bytes": msg.bytes, "worker": msg.name})]
        case Evaluated(msg):
            if msg.skipped:
                if msg.step == state.eval_skipped or (state.last_eval and state.last_eval[0] == msg.step):
                    return state, []  # said already (every member that saw the failure says it)
                return replace(state, eval_skipped=msg.step), [Log("eval_skipped", {"step": msg.step,
                                                                                  "reason": msg.skipped})]
            state = replace(state, last_eval=(msg.step, msg.loss, msg.samples))
            return state, [Log("eval", {"step": msg.step, "loss": msg.loss, "samples": msg.samples})]
        case SaveRequested(path):
            if state.plan is None or not state.plan.members:
                return state, []
            writer = state.plan.members[0]  # replicas are identical: the first member writes
            # Sharded or pipelined: every member gathers (a collective) at the same step boundary;
            # rank 0 writes.
            to = (writer,) if state.plan.layout.whole_replicas else state.plan.members
            return replace(state, saves=state.saves | {path}), [*(Send(n, SaveModel(path=path)) for n in to),
                           Log("save_requested", {"path": path, "worker": writer})]
        case ReplanDue(reason, abort):
            return replan(state, config, reason, abort=abort, now=now)
        case StateLostReported(msg):
            if state.stopping or state.resume is not None:
                return state, []  # said already (every member that found it says it)
            said = Log("state_lost", {"epoch": msg.epoch, "worker": msg.name, "detail": msg.detail,
                                      "resume_from": state.checkpoints[-1].path if state.checkpoints else None})
            if state.checkpoints:  # more failed than the redundancy covers: back to the newest checkpoint
                state, _ = lose_state(state)
                return state, [said, *(Send(n, Abort(epoch=state.epoch, reason="the state is lost: resuming"))
                                       for n in state.workers), FollowUp(ReplanDue("resume", abort=True))]
            state, effects = _stop(state, f"the training state is lost: {msg.detail}")
            return state, [said, *effects]
        case CheckpointRequested(reason):
            if state.plan is None or state.finished or state.stopping or not config.checkpoint_dir:
                return state, []
            return state, [*(Send(n, CheckpointNow(reason=reason)) for n in state.plan.members),
                           Log("checkpoint_requested", {"reason": reason, "step": state.last_step})]
        case CheckpointWritten(msg):
            return _checkpointed(state, msg, config)
        case ResumeFailedReported(msg):
            return _resume_failed(state, msg)
        case StopRequested(reason):
            return _stop(state, reason)
    raise AssertionError(f"unhandled event {event!r}")


def ack_due(state: State, config: Config) -> float:
    """When every member of the latest plan must have acknowledged it: `ack_timeout_s` after it went
    out, plus two of its predicted steps (a planned switch waits for the members' step boundary)."""
    step_s = state.plan.predicted_step_s if state.plan is not None and state.plan.predicted_step_s else 0.0
    return state.planned_at + config.ack_timeout_s + 2 * step_s


def _unacknowledged(state: State, config: Config, now: float) -> list[str]:
    """Members of the pending plan that did not acknowledge it by its due time (nudged meanwhile, if
    they heartbeat an older epoch): stuck, so declared failed. A restarted coordinator's plan has its
    own bound (`recovery_grace_s`)."""
    if not state.pending or state.plan is None or state.recovering or not state.planned_at:
        return []
    if now <= ack_due(state, config):
        return []
    return [n for n in state.plan.members if n not in state.acked and n in state.workers]


def _nudge(state: State, name: str, epoch: int, config: Config, now: float) -> Result:
    """A member (or a sender) of the pending plan still heartbeats an older epoch a lease after the
    plan went out: it may have lost the delta (a reconnect, a fenced worker re-joining), so send it
    again. A worker that has it already just replaces it with the same message."""
    w = state.workers[name]
    lagging = (state.pending and state.delta is not None and state.plan is not None
               and (name in state.plan.members or name in state.delta.senders)
               and name not in state.acked and epoch < state.epoch)
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
    back = msg.name in state.recovering  # (at the journaled epoch, or the one before it if the plan was pending)
    worker = Worker(name=msg.name, host=msg.host, device=msg.device, pid=msg.pid, joined_at=now,
                    last_seen=now, epoch=msg.epoch if back else 0, step=msg.step if back else 0)
    device = Device(name=msg.name, host=msg.host, kind=msg.device, flops=max(msg.flops, 1.0),
                    memory_bytes=msg.memory_bytes, threads=max(msg.threads, 1), host_cores=msg.cores)
    if back and msg.name in state.recovered_devices:  # what was measured of it before the restart
        device = state.recovered_devices[msg.name]
    state = replace(state, workers={**state.workers, msg.name: worker},
                    cluster=state.cluster.with_device(device).with_peer_calibration(msg.name))
    effects: list[Effect] = [Welcome(msg.name),
                             Log("joined", {"worker": msg.name, "host": msg.host, "device": msg.device})]
    if state.finished or state.stopping:
        return state, effects + [Send(msg.name, Stop(reason="the job is over"))]
    return state, effects


def _step_done(state: State, r: StepReport, config: Config, now: float) -> Result:
    if r.name not in state.workers:
        return state, [_fence(r.name)]
    state = _touch(state, r.name, now, step=r.step)
    tracker = state.tracker
    calm = config.stability == "calm"
    host = state.workers[r.name].host
    load = tracker.loads.get(host, 0.0) if calm and tracker is not None and tracker.epoch == r.epoch else 0.0
    cluster = state.cluster
    settled = not steps.settling(tracker, r)
    baselining = steps.baselining(tracker, r)
    layout_kind = tracker.kind if tracker is not None and tracker.epoch == r.epoch else None  # (what it ran in)
    efficiency = None  # (this layout kind's, as its first steps teach it: what this step is fitted with)
    if baselining and layout_kind is not None and tracker is not None:
        tracker, efficiency, learned = steps.efficiency_of_kind(tracker, r)
        if learned and efficiency is not None:
            cluster = cluster.with_efficiency(layout_kind, efficiency)
    if settled:  # (an epoch's entry stretches its first steps: never fitted)
        plan = state.plan if r.epoch == state.epoch else None
        overhead = measured_overhead(plan, r.step_s, r.compute_s, r.comm_s)
        # (a measured member's baseline steps wait for the watch: `Cluster.with_measurement`'s hold)
        hold = baselining and tracker is not None and r.name in tracker.measured_members
        cluster = cluster.with_measurement(r.name, *per_pass(plan, cluster, r.name, r.samples, r.compute_s),
                                           overhead_s=overhead, load=load, kind=layout_kind, efficiency=efficiency,
                                           hold=hold)
    effects: list[Effect] = []
    changes: list[Change] = []
    step_done = False  # every member's report of r.step is in
    if tracker is not None:
        tracker, findings = steps.observe(tracker, r)
        step_done = any(isinstance(f, steps.Measured) for f in findings)
        for f in findings:
            match f:
                case steps.Measured(ranks=ranks, comm_s=comm_s, settled=True) if (
                        state.graph is not None and fits_comm(state.plan)):
                    # The step's communication as the cost model has it: an all-reduce, or
                    # FSDP's gathers and scatters with the copies (the workers time those too).
                    # Never an epoch's first steps: a member still entering holds the others there.
                    # (Nor a pipeline's: its sends between stages are no collective of this model.)
                    shards = state.plan.dp_shard if state.plan is not None and tracker.epoch == state.epoch else 1
                    f0, f1 = step_comm_features(state.graph, ranks, shards)
                    across = cluster.spans_hosts(tracker.members)
                    cluster = cluster.with_comm(f0, f1, comm_s, cross_host=across)
                    if across and links_moved(state, cluster, tracker.epoch):
                        # The links between hosts, measured now, move this plan's step far from its
                        # prediction: the layouts are weighed again (a plan that does not pay is kept).
                        changes.append(Change("links"))
                        state = replace(state, links_checked=True,
                                        changed=(*state.changed, "the measured links between hosts")[-8:])
                case steps.SpeedChange(name=name, kind=kind, speed=speed, expected=expected, recent=recent):
                    plan = state.plan if tracker.epoch == state.epoch else None
                    passes = tuple(per_pass(plan, cluster, name, s, t) for s, t in recent)
                    # A calibration of a member measured before this epoch: the model was right
                    # a moment ago. At about the share it was measured at, on cores of its own, the
                    # device changed speed around the switch (a change that began in the last
                    # epoch's final steps, too few to be found there); at a share far from it, or
                    # on cores other workers share, it did, or the model missed (`replan`'s
                    # EXTRAPOLATED_GAIN). Either way its baseline is its speed at this share now.
                    # (An unmeasured member's steps are its first measurements: already the model.)
                    measured_before = kind == "calibration" and name in tracker.measured_members
                    alone = load <= 1.0  # (on cores shared with other workers, who computes how much moves it too)
                    miss = ("changed" if alone and _at_known_share(cluster, name, passes[-1][0]) else "unsure"
                            ) if measured_before else None
                    changes.append(Change(kind, miss))
                    if kind != "calibration" or measured_before:
                        cluster = cluster.with_speed_change(name, passes, load=load, kind=layout_kind)
                    if kind != "calibration":
                        effects.append(Log(kind, {"worker": name, "speed": round(speed, 3),
                                                  "expected": round(expected, 3), "step": r.step}))
                    verb = "measured" if kind == "calibration" else "now"
                    changed = f"{name} {verb} {speed:.3g} samples/s, expected {expected:.3g} ({kind})"
                    state = replace(state, changed=(*state.changed, changed)[-8:])
    state = replace(state, cluster=cluster, tracker=tracker)
    if changes and not step_done and tracker is not None and tracker.epoch == r.epoch:
        # The rest of this step's reports are still to come: a re-plan now would start an epoch in
        # which they count for nothing, and a change they show (two members set back to full speed
        # together) would be found only an epoch later, after a plan made without it.
        state, changes = replace(state, changes_waiting=(*state.changes_waiting, *changes)), []
    elif step_done and state.changes_waiting:
        state, changes = replace(state, changes_waiting=()), [*state.changes_waiting, *changes]
    if r.step > state.last_step or r.step in state.unlogged:
        # A step not logged yet: the next one, or one of a gap (reports sent again to a restarted
        # coordinator arrive from every member at once, a later step of one before earlier ones of another).
        unlogged = state.unlogged - {r.step}
        if r.step > state.last_step + 1 and state.recovery_since:
            unlogged |= frozenset(range(state.last_step + 1, r.step)) if r.step - state.last_step < MAX_GAP else frozenset()
        done = not state.finished and r.step >= config.num_steps
        if done:  # members leave by themselves after the last step; standby workers are told to
            members = set(state.plan.members) if state.plan else set()
            told = [n for n in state.workers if n not in members]
            effects += [Send(n, Stop(reason="the job is over")) for n in told]
            # (told to go: its closed connection is it going, should that reach us before its Leave)
            state = replace(state, workers={n: replace(w, leaving="stopped", leaving_since=now) if n in told else w
                                            for n, w in state.workers.items()})
        predicted = state.plan.predicted_step_s if state.plan is not None and r.epoch == state.epoch else None
        if r.step > state.last_step:
            state = replace(state, last_lr=r.lr, last_grad_norm=r.grad_norm, last_step_at=now)
        state = replace(state, last_step=max(state.last_step, r.step), finished=state.finished or done,
                        unlogged=unlogged)
        effects.append(Log("step", {"step": r.step, "epoch": r.epoch, "loss": r.loss, "samples": r.global_batch,
                                    "step_s": r.step_s, "predicted_s": predicted, "lr": r.lr,
                                    "grad_norm": r.grad_norm}))
        if r.epoch < state.epoch and not r.switching and state.abandon_if_missed:
            state, more = _missed_vote(state, r.step, now)
            effects += more
    if calm and changes and any(w.host == host and not w.ready for w in state.workers.values()):
        # A worker on this host is still loading (importing torch, building the job): it loads the
        # cores for a few seconds and then joins, which re-plans and re-measures anyway. What its
        # neighbours' steps show meanwhile is that, not a change of theirs.
        changes = []
    reasons = {c.reason for c in changes}
    misses = {c.miss for c in changes if c.miss is not None}
    if calm and changes and reasons <= {"calibration"} and not state.calibrating and not misses:
        # Every member was measured or has a measured twin when this plan was made: a newcomer's
        # first steps off a twin's speed are folded into the estimates, not news worth a re-plan.
        # A lasting change (straggler, recovered, contention), or a measured member's speed moved
        # at the switch, still re-plans (and the pay-off rule weighs it).
        changes = []
    if changes and not state.finished:
        reason = min(reasons, key=("straggler", "recovered", "contention", "calibration", "links").index)
        extrapolated = reasons == {"calibration"} and misses == {"unsure"}
        state, more = replan(state, config, reason, abort=False, now=now, extrapolated=extrapolated)
        effects += more
    return state, effects


KNOWN_SHARE = 1.1  # a share within this factor of the one a device was last measured at is known to its model


def _at_known_share(cluster: Cluster, name: str, samples: int) -> bool:
    """Whether `samples` is within KNOWN_SHARE of the share `name` was measured at before its
    newest steps (those at `samples`): where its model was right, not extrapolated."""
    device = cluster.devices.get(name)
    if device is None:
        return False
    other = [n for n, _ in device.compute_window if n != samples]
    return not other or max(samples, other[-1]) <= KNOWN_SHARE * min(samples, other[-1])


LINKS_MOVED = 0.25  # a plan's step re-predicted with the measured links this far off its prediction re-plans


def links_moved(state: State, cluster: Cluster, epoch: int) -> bool:
    """Whether the latest plan (of `epoch`, not yet checked), re-predicted with `cluster`'s links as
    measured between its hosts, is more than LINKS_MOVED off the step it was planned for: once
    per plan, so a plan the pay-off rule keeps is not weighed again at every step."""
    plan = state.plan
    if plan is None or epoch != state.epoch or state.links_checked or plan.predicted_step_s is None:
        return False
    now = repredict(cluster, state.graph, plan).predicted_step_s
    return now is not None and abs(now - plan.predicted_step_s) > LINKS_MOVED * plan.predicted_step_s


def _missed_vote(state: State, step: int, now: float) -> Result:
    """The members committed `step` of the old epoch without switching: the planned join delta
    reached one of them after its vote, and they have begun a whole step more of the old epoch
    before the newcomer is taken in. Where the join rule, weighed at that step's start, says to
    abandon it (`State.abandon_if_missed`), the delta goes out again, aborting: otherwise a join that
    came near the end of a step would wait for the whole step after it."""
    delta, plan = state.delta, state.plan
    if delta is None or delta.abort or not state.pending or plan is None:
        return replace(state, abandon_if_missed=""), []
    why = state.abandon_if_missed
    delta = replace(delta, abort=True)
    recipients, workers = addressed(state, set(state.running) | set(plan.members) | set(delta.senders), now)
    state = replace(state, delta=delta, workers=workers, abandon_if_missed="")
    return state, [Log("abandon", {"epoch": delta.epoch, "step": step + 1,
                                   "detail": f"step {step} was committed without the switch (the plan reached a member "
                                             f"after its vote); {why}"}),
                   *(Send(n, delta) for n in recipients)]


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
                    reshard_s=max(state.reshard_s, ack.reshard_s),
                    reshard_largest_sender=max(state.reshard_largest_sender, ack.reshard_largest_sender))
    if state.pending:
        return state, []
    # The migration fit learns from planned switches only: a failure's entry also holds the fault's
    # aftermath (survivors released from abandoned collectives at different times), and a resume
    # reads a checkpoint; neither is what moving state between live members costs.
    planned = state.delta is not None and state.delta.reason != "failure" and not state.delta.resume_path
    state = replace(state, running=frozenset(), formed_at=now,
                    cluster=state.cluster.with_reshard(state.reshard_bytes, state.reshard_s) if planned else state.cluster,
                    slices_possible=state.plan is not None and not state.plan.layout.whole_replicas)  # all switched
    plan = state.plan
    assert plan is not None  # not pending, and ack.name was a member
    # Drained workers switched out with everyone else: now they can go.
    effects: list[Effect] = [Send(n, Stop(reason=w.leaving)) for n, w in state.workers.items()
                             if w.leaving is not None and n not in plan.members]
    effects += [Log("reshard", {"epoch": state.epoch, "bytes": state.reshard_bytes,
                                "seconds": round(state.reshard_s, 4),
                                "largest_sender_bytes": state.reshard_largest_sender})]
    if state.resume is not None:  # every member loaded the checkpoint: the job goes on from it
        resumed = state.resume
        effects.append(Log("resumed", {"step": resumed.step, "path": resumed.path, "epoch": state.epoch,
                                       "redone": max(0, state.lost_at - resumed.step)}))
        state = replace(state, resume=None, lost_at=0)
    if state.replan_wanted is not None:
        state, more = replan(state, config, state.replan_wanted, abort=False, now=now)
        effects += more
    return state, effects


def _recovered(state: State, config: Config, now: float) -> Result:
    """The restarted coordinator puts the journaled plan back: at once when every member came back
    (training never stopped: nothing to send), or, when some did not within the grace or the plan
    was not in place everywhere at the crash, as after a failure: the others re-plan."""
    plan = state.recovered_plan
    assert plan is not None
    back = [n for n in plan.members if n in state.workers]
    missing = [n for n in plan.members if n not in state.workers]
    hosts = {n: state.cluster.devices[n].host for n in back}
    if not missing:
        plan = repredict(state.cluster.contended(back), state.graph, plan)
    kind = kind_key(plan.pp, plan.dp_shard, plan.tp)
    tracker = steps.start(state.epoch, plan.members, plan.predicted_step_s, reported_compute(plan, state.graph),
                          hosts, loads={h: state.cluster.load(h, back) for h in set(hosts.values())},
                          legacy=config.stability != "calm", kind=kind, efficiency=state.cluster.efficiency_of(kind),
                          learns=kind != state.cluster.unit_kind, kind_known=state.cluster.efficiency_known(kind))
    was_pending = (not set(plan.members) <= state.recovered_acked  # not in place everywhere at the crash
                   or any(state.workers[n].epoch != state.epoch for n in back))
    state = replace(state, plan=plan, acked=frozenset(back) & state.recovered_acked if was_pending else frozenset(back),
                    running=frozenset(back), tracker=tracker, recovering=frozenset(), recovered_plan=None,
                    recovered_devices={}, recovered_acked=frozenset(), result=PlanResult(plan=plan, status="recovered",
                                                                                      reason="from the journal"))
    reached = max([state.last_step, *(state.workers[n].step for n in back)])  # (each said so registering again)
    effects: list[Effect] = [Log("recovered", {"epoch": state.epoch, "members": back, "missing": missing,
                                               "step": reached,
                                               "seconds": round(now - state.recovery_since, 3)})]
    if not missing and not was_pending:
        state = replace(state, running=frozenset())
        newcomers = [n for n, w in state.workers.items() if w.ready and n not in plan.members]
        # (a layout pin changed meanwhile, by ctl or by the restart's --layout: re-planned now)
        wanted = state.replan_wanted or ("join" if newcomers else None)
        return state, effects + ([FollowUp(ReplanDue(wanted, abort=False))] if wanted else [])
    effects += [Log("failed", {"worker": n, "detected_by": "recovery"}) for n in missing]
    effects += [Send(n, Abort(epoch=state.epoch, reason="the coordinator restarted")) for n in state.workers]
    return state, [*effects, FollowUp(ReplanDue("recovery", abort=True))]


def _relayout(state: State, pin: LayoutPin | None, config: Config, now: float) -> Result:
    """`ctl layout`: the new pin replaces the one in force and the job re-plans under it at once, with
    reason "layout" (after the planned change in flight lands, if one is). No pay-off rule holds
    it back: a plan that differs from the running one is taken. One that cannot be made (too few
    ready workers, a layout that does not fit) leaves the running plan training, and the `plan`
    event (status infeasible) says why; the pin stays, so the layout is taken as soon as workers
    enough are ready (their join re-plans under it). A restarted coordinator still putting its
    journaled plan back re-plans once that is done (`_recovered`)."""
    if state.finished or state.stopping:
        return state, []
    said = Log("layout", {"layout": pin_text(pin), "previous": pin_text(state.layout), "source": "ctl"})
    state = replace(state, layout=pin)
    if state.recovered_plan is not None:
        return replace(state, replan_wanted="layout"), [said]
    state, effects = replan(state, config, "layout", abort=False, now=now)
    return state, [said, *effects]


def _checkpointed(state: State, msg: Checkpointed, config: Config) -> Result:
    fields = {"step": msg.step, "path": msg.path, "seconds": round(msg.seconds, 3), "bytes": msg.bytes,
              "worker": msg.name}
    if msg.error:
        return state, [Log("checkpoint_failed", {**fields, "error": msg.error})]
    known = sorted((*(c for c in state.checkpoints if c.path != msg.path),
                    Checkpoint(step=msg.step, path=msg.path, bytes=msg.bytes)), key=lambda c: c.step)
    if config.checkpoint_keep > 0:  # the writer keeps as many on disk
        known = known[-config.checkpoint_keep:]
    return replace(state, checkpoints=tuple(known)), [Log("checkpoint", fields)]


def _resume_failed(state: State, msg: ResumeFailed) -> Result:
    """The checkpoint being resumed from is damaged: forget it and resume from the one before (or,
    with none left, from step 0, said so)."""
    if state.resume is None or msg.path != state.resume.path:
        return state, []  # said already (every member that tried it says it)
    effects: list[Effect] = [Log("checkpoint_corrupt", {"path": msg.path, "step": state.resume.step,
                                                        "worker": msg.name, "detail": msg.detail})]
    state = replace(state, checkpoints=tuple(c for c in state.checkpoints if c.path != msg.path), resume=None)
    state, said = lose_state(state)
    effects += said
    effects += [Send(n, Abort(epoch=state.epoch, reason=f"checkpoint {msg.path} is damaged")) for n in state.workers]
    return state, [*effects, FollowUp(ReplanDue("resume", abort=True))]


def _left(state: State, name: str, reason: str, config: Config, now: float, *,
          cause: dict[str, str] | None = None) -> Result:
    """A worker leaves on purpose; `cause` (the job's exception and where in the job's code it was
    raised) goes into its `left` event."""
    if name not in state.workers:
        return state, [Send(name, Stop(reason="not a member"))]
    in_latest = state.plan is not None and name in state.plan.members
    planned_out = reason in PLANNED_EXITS
    if in_latest and planned_out and not state.finished:
        return _drain(state, name, reason, config, now)
    clean = reason == "finished" or planned_out  # planned out: it left at the agreed switch
    in_plan = state.in_play(name) and not clean
    state = _remove(state, name)
    effects: list[Effect] = [Log("left", {"worker": name, "reason": reason, **(cause or {})}),
                             Send(name, Stop(reason="goodbye"))]
    if in_plan and not state.finished:
        effects += [Send(n, Abort(epoch=state.epoch, reason=f"{name} left")) for n in state.workers]
        effects.append(FollowUp(ReplanDue("leave", abort=True)))
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
        effects.append(FollowUp(ReplanDue("failure", abort=True)))
    return state, effects + _maybe_finished(state)


def _drain(state: State, name: str, why: str, config: Config, now: float) -> Result:
    worker = state.workers[name]
    if state.plan is None or name not in state.plan.members:
        state = _remove(state, name)
        return state, [Send(name, Stop(reason=why)), Log("left", {"worker": name, "reason": why})]
    since = worker.leaving_since if worker.leaving is not None else now
    state = replace(state, workers={**state.workers, name: replace(worker, leaving=why, leaving_since=since)})
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


def _stop(state: State, reason: str) -> Result:
    """Stop the job: every worker is told why; the coordinator finishes once they are gone."""
    state = replace(state, stopping=True)
    return state, [*(Send(n, Stop(reason=reason)) for n in state.workers), *_maybe_finished(state)]


def _maybe_finished(state: State) -> list[Effect]:
    if state.workers or not (state.finished or state.stopping):
        return []
    return [Finished("finished" if state.finished else "stopped")]
