"""Re-planning inside membership: ask the planner, and turn its answer into a new epoch (or not).

`replan(state, config, reason, abort=..., now=...)` is called by the membership transitions on a
join (a worker made ready), a failure, a leave, a drain, a straggler, an operator's `ctl layout`
and after a planned change lands with another one waiting. It

* holds a planned change back while the previous one is not acknowledged everywhere (at most one
  planned change in flight); a failure (`abort=True`) supersedes anything pending;
* asks `plan.make_plan` over the ready, non-leaving devices, with the previous plan (or the
  survivors that hold the state) so the planner can weigh moving state, under the layout pin in
  force (`State.layout`: --layout, then `ctl layout`);
* keeps one leaving state holder in the new epoch with no samples when no holder would stay, so
  that it hands the state over inside the new group;
* sends nothing when a planned re-plan gives the same assignment (no churn);
* re-plans on a calibration (an epoch's measured baseline off the prediction) only while the plan
  rests on a guess for some member (`Cluster.is_guess`: not measured yet, and no measured twin on
  its host: the first plan, or a newcomer on new hardware);
* for a re-plan that no membership change forced (a straggler, a recovery, host contention, a
  model calibration), takes the better plan only when it pays: its predicted gain per step must be
  at least MIN_REL_GAIN of the step and twice the measured step-time noise of the epoch, and the
  gain over the horizon must exceed the switch's cost (forming a group, moving state), and the
  job must have steps enough left to settle and measure the new epoch. Otherwise
  the current plan stays and a `kept` event says why; a taken re-plan's detail says what changed
  and what it is predicted to gain. An operator's `layout` is not such a re-plan: a plan that
  differs is always taken;
* plans on the cluster as it will run: co-located workers' contention for their host's cores is
  predicted (`Cluster.contended`), so a join or a failure on a host is not read as stragglers;
* when nothing fits (memory) keeps the state where it is: a running plan trains on, survivors of a
  failure wait for a device that fits; only when nobody holds the state is it reported lost.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import NamedTuple

from coordinator import steps
from coordinator.state import Config, Effect, Log, Planned, Result, Send, State, Worker, pin_text, workers_needed
from plan import Plan, PlanLimits, PlanResult, make_plan, predict
from plan.cluster import kind_key
from plan.prediction import reported_compute, repredict
from transport import MeshLayout, PlanDelta

GAIN_REASONS = ("straggler", "recovered", "contention", "calibration", "links")  # re-plans that must pay for themselves
MIN_REL_GAIN = 0.03  # ... by at least this fraction of the step
# A measured member that misses its prediction at a share far from the one it was measured at, or
# on cores other workers share, may have changed speed, or the model missed (on shared cores by up
# to 2x, and a re-plan on it moves the shares and misses again): a new plan must gain this much.
EXTRAPOLATED_GAIN = 0.2
NOISE_WINDOW = 32  # measured steps the epoch's step-time noise is taken over
ABANDON_MARGIN = 0.8  # a join abandons the step in flight only within 80% of where it starts to pay


def replan(state: State, config: Config, reason: str, *, abort: bool, now: float,
           extrapolated: bool = False) -> Result:
    """Make a new plan if one is due, and send it as a new epoch. `extrapolated`: what asks for it is
    a measured member's miss where the model may be off (another share than it was measured at, or
    cores shared with other workers): a new plan must then gain EXTRAPOLATED_GAIN of the step."""
    if state.finished or state.stopping:
        return state, []
    if not abort and state.pending:
        return replace(state, replan_wanted=_wanted(state.replan_wanted, reason)), []
    eligible = {n for n, w in state.workers.items() if w.ready and w.leaving is None}
    said: list[Effect] = []
    if state.resume is None and not state.holders and state.last_step > 0 and eligible:
        # Every holder is gone at once (more than the redundancy covers): from the newest checkpoint.
        state, said = lose_state(state)
    holders = [] if state.resume is not None else state.holders  # a resume replaces what survivors hold
    if state.plan is None and not holders and len(eligible) < workers_needed(state.layout, config.min_workers):
        return state, said
    if not eligible and holders:
        # Only leaving members hold the state and nobody can take it over: they train on.
        if not abort:
            detail = (f"no other worker to hand the state to: {', '.join(holders)} keep(s) training "
                      "until one joins")
            result = PlanResult(plan=None, status="infeasible", reason=detail)
            return replace(state, replan_wanted=None, result=result), [Planned(result, state.epoch, reason)]
        eligible = set(holders)  # aborted: they need a new epoch anyway
    # The planner sees every eligible worker's speed as it would be with all of them training (the
    # usual outcome); a plan that leaves a co-located worker out is predicted a little pessimistically.
    calm = config.stability == "calm"
    cluster = state.cluster.subset(eligible)
    cluster = cluster.contended(eligible) if calm else cluster
    horizon = max(1, min(config.horizon_steps, config.num_steps - state.last_step))
    limits = PlanLimits(global_batch=config.global_batch, max_workers=config.max_workers,
                        time_limit_s=config.solve_time_limit_s, policy=config.planner, engine=config.solver,
                        horizon_steps=horizon, tp_degrees=config.tp_degrees)
    result = make_plan(cluster, state.graph, state.plan, limits=limits, holders=holders, pin=state.layout)
    if result.plan is None:
        state, effects = _nothing_fits(state, result, holders, reason, abort=abort)
        return state, [*said, *effects]
    new = result.plan
    handoff = None
    # Slices may be held (a layout whose members do not each hold the whole state, sharded or
    # pipelined, was sent since the last replicated one in place everywhere): every holder that
    # leaves (alive, planned out) sends what it holds in the new epoch's group, then goes. A
    # replicated state: any holder has it all, and one that leaves hands it over only when none
    # would stay: as a sender when the new layout is not replicated (the slice reshard takes a whole
    # replica), else as a member with no samples for one epoch.
    # (Whether anyone may hold slices decides how the members enter, too: their own holdings cannot,
    # since a fenced or standby worker may still hold an old sharded executor.)
    from_sharded = state.slices_possible or (state.plan is not None and not state.plan.layout.whole_replicas)
    leaving = [n for n in holders if n not in new.members]
    none_stays = bool(holders) and leaving == holders
    senders: list[str] = []
    if from_sharded:
        senders = leaving
    elif none_stays and not new.layout.whole_replicas:
        senders = leaving[:1]
    elif none_stays:
        # No state holder stays: keep one leaving holder for one epoch with no samples, so that it
        # hands its state to the newcomers inside the new group; the next plan lets it go.
        handoff = holders[0]
        members = (*new.members, handoff)
        new = predict(state.cluster.contended(members) if calm else state.cluster, state.graph, members,
                      (*new.shares, 0))
        if result.plan.micro:  # the members' micro-batches stay; the one handing off has no samples
            new = replace(new, micro=(*result.plan.micro, 0))
        result = replace(result, plan=new, reason=f"{result.reason}; {handoff} stays one epoch to hand off")
    # (Standby events only for a plan that is taken: a candidate that the current plan outlives
    # benches nobody.)
    benched = _standby_logs(state, result)
    if not abort and new.same_assignment(state.plan) and state.resume is None:
        # Same assignment, no new epoch; keep the refreshed prediction (new speeds, fitted constants).
        # A speed change answered so is still answered: the `kept` event says that the best plan
        # for the new speeds is the one running.
        tracker = state.tracker
        if tracker is not None and tracker.epoch == state.epoch:
            tracker = replace(tracker, predicted_step_s=new.predicted_step_s)
        told: list[Effect] = []
        kept = state.kept
        if reason in GAIN_REASONS:
            predicted = f"{new.predicted_step_s * 1e3:.1f} ms/step" if new.predicted_step_s else "no prediction"
            kept = (f"the best plan for the measured speeds is the one running (same members and shares, "
                    f"{predicted}){_changes(state)}")
            told = [Log("kept", {"reason": reason, "detail": kept})]
        elif reason == "layout":  # (said, so that the operator sees the change answered)
            told = [Log("kept", {"reason": reason, "detail": f"the running plan ({new.layout.describe()}) is the one "
                                                             f"the planner makes with the layout {pin_text(state.layout)}"})]
        return replace(state, replan_wanted=None, result=result, plan=new, tracker=tracker, kept=kept,
                       standby=frozenset(result.standby)), [*said, *told, *benched]
    # A join whose newcomer the plan leaves out changes only how the running members are laid out
    # (new speeds measured meanwhile): that must pay for itself too, as a speed change's re-plan.
    reorders = (reason == "join" and state.plan is not None and state.resume is None
                and set(new.members) == set(state.plan.members))
    if calm and not abort and (reason in GAIN_REASONS or reorders) and state.plan is not None:
        verdict = _worth_it(state, new, result, horizon, extrapolated)
        if not verdict.switch:  # the current plan stays, and so does its standby (and the newcomer's)
            kept_state = _keep(state, verdict.detail)
            if reorders:
                kept_state = replace(kept_state, standby=frozenset(result.standby))
            return kept_state, [*said, Log("kept", {"reason": reason, "detail": kept_state.kept}),
                                *(benched if reorders else [])]
        result = replace(result, reason=f"{result.reason}; {verdict.detail}")
    state = replace(state, standby=frozenset(result.standby))
    abandons, if_missed = False, ""
    if not abort and reason == "join" and config.join_abandons != "never":
        # The step in flight began at the last step's report, or, when it is the first of its epoch,
        # when the epoch formed (its entry is not part of it: after a switch, the last report is an
        # entry older).
        elapsed = now - max(state.last_step_at, state.formed_at)
        why = _abandon_for_join(state, new, config.join_abandons == "always", elapsed, config.join_wait_max_s)
        if why:
            abandons = abort = True  # the members abandon the step in flight, as for a failure
            result = replace(result, reason=f"{result.reason}; {why}")
        else:  # should the delta miss their vote, the join waits for the whole next step: weighed at its start
            if_missed = _abandon_for_join(state, new, config.join_abandons == "always", 0.0, config.join_wait_max_s)
    if state.changed:
        result = replace(result, reason=f"{result.reason}{_changes(state)}")
    epoch = state.epoch + 1
    resume = state.resume
    delta = PlanDelta(epoch=epoch, reason=reason, layout=MeshLayout(**new.layout.to_dict()),
                      global_batch=config.global_batch, abort=abort, senders=senders, micro_batch=list(new.micro),
                      resume_path=resume.path if resume else "", resume_step=resume.step if resume else 0,
                      from_sharded=from_sharded, previous=state.delta.layout if state.delta is not None else None)
    if resume is not None:
        result = replace(result, reason=f"{result.reason}; every member loads checkpoint {resume.path} "
                                        f"(step {resume.step})")
    old = set(state.plan.members) if state.plan else set()
    recipients, workers = addressed(state, old | set(new.members) | set(senders), now)
    hosts = {n: state.cluster.devices[n].host for n in new.members if n in state.cluster.devices}
    loads = {h: state.cluster.load(h, new.members) for h in set(hosts.values())}
    guessed = any(state.cluster.is_guess(n) for n in new.members)
    measured = frozenset(n for n in new.members if n in state.cluster.devices and state.cluster.devices[n].samples_per_s)
    kind = kind_key(new.pp, new.dp_shard, new.tp)
    tracker = steps.start(epoch, new.members, new.predicted_step_s, reported_compute(new, state.graph), hosts,
                          loads=loads, measured=measured, legacy=not calm, kind=kind,
                          efficiency=state.cluster.efficiency_of(kind),
                          learns=kind != state.cluster.unit_kind, kind_known=state.cluster.efficiency_known(kind))
    state = replace(state, slices_possible=from_sharded or not new.layout.whole_replicas)
    state = replace(state, workers=workers, delta=delta, epoch=epoch, plan=new, result=result, tracker=tracker,
                    acked=frozenset(), reshard_bytes=0, reshard_s=0.0, reshard_largest_sender=0, running=frozenset(holders),
                    changed=(), abandon_if_missed=if_missed, planned_at=now,
                    kept=None, calibrating=guessed, links_checked=False, changes_waiting=(),
                    replan_wanted=f"{handoff} handed off" if handoff else None)
    return state, [*said, Planned(result, epoch, reason, abandons_step=abandons), *benched,
                   *(Send(n, delta) for n in recipients)]


def _wanted(waiting: str | None, reason: str) -> str:
    """The re-plan to make once the change in flight lands, when `reason` asks for one meanwhile:
    the latest, except that one the pay-off rule may turn down (a GAIN_REASONS one) never replaces
    one that must happen (an operator's `layout`, a join, a hand-off), which would be lost with it."""
    if waiting is not None and waiting not in GAIN_REASONS and reason in GAIN_REASONS:
        return waiting
    return reason


def addressed(state: State, names: set[str], now: float) -> tuple[list[str], dict[str, Worker]]:
    """The live workers among `names` that a delta goes to (by name), and the workers with their
    nudge clock set to `now` (membership's `_nudge` sends it again a lease later to one that lags)."""
    recipients = sorted(names & set(state.workers))
    return recipients, {n: replace(w, nudged_at=now) if n in recipients else w for n, w in state.workers.items()}


def _abandon_for_join(state: State, new: Plan, always: bool, elapsed: float, wait_max: float | None = None) -> str:
    """Why the members should abandon the step in flight to take a newcomer in at once ("": they
    should not, and switch at the step boundary they vote on, up to a step later).

    Abandoning throws away what the step has run so far (`elapsed` of a step of `step_s`); waiting
    leaves the new plan idle for the rest of it. Over the time the step has left, the new plan
    (predicted `ratio` of the current plan's step time) does (step_s - elapsed) / (ratio × step_s)
    steps counted from the abandoned one, against the one step waiting commits: abandoning pays
    while elapsed < (1 - ratio) × step_s. With M equal members and one more of their kind that is
    the first 1/(M + 1) of the step; a join that makes the step no faster (a host's cores already
    busy) never abandons. ABANDON_MARGIN keeps clear of the prediction's error and the messages'
    latency. `always` (`--join-abandons always`): whenever a step is in flight. `wait_max`
    (`--join-wait-max`): also when the rest of the step is predicted to last longer than that, a
    bound on the newcomer's wait bought with the members' work on the step (the rule above alone
    lets a join wait up to a whole step where a newcomer adds little).
    A step already past its usual length is taken to end at once (a stuck one is the failure
    detector's, not this rule's); should it end before the delta reaches every member's vote, the
    members report it without switching and the coordinator weighs the next step with this rule at
    its start (`State.abandon_if_missed`, membership's `_missed_vote`). `elapsed`: how long the step
    in flight has run."""
    current, tracker = state.plan, state.tracker
    if current is None or state.last_step_at <= 0 or new.predicted_step_s is None or state.graph is None:
        return ""  # (no step committed yet: nothing in flight worth weighing)
    if not set(current.members) <= set(new.members):
        return ""  # (a join that also plans a member out is a different trade: it waits for the boundary)
    measured = tracker.measured[-NOISE_WINDOW:] if tracker is not None and tracker.epoch == state.epoch else ()
    step_s = statistics.median(measured) if measured else current.predicted_step_s  # (a young epoch: predicted)
    if not step_s:
        return ""
    if always:
        return f"the members abandon the step in flight ({elapsed:.2f} s of ~{step_s:.2f} s run): --join-abandons always"
    now_s = _current_step_s(state, current)
    if now_s:
        ratio = new.predicted_step_s / now_s
        limit = ABANDON_MARGIN * (1.0 - ratio) * step_s
        if elapsed < limit:
            return (f"the members abandon the step in flight: {elapsed:.2f} s of ~{step_s:.2f} s run, and the new "
                    f"plan (predicted {ratio:.2f}x the step time) gains more over the rest of it than it loses while "
                    f"less than {limit:.2f} s has run")
    rest = step_s - elapsed
    if wait_max is not None and rest > wait_max:
        return (f"the members abandon the step in flight: {elapsed:.2f} s of ~{step_s:.2f} s run, and the rest of it "
                f"(~{rest:.2f} s) would keep the newcomer waiting longer than --join-wait-max {wait_max:g} s")
    return ""


class Verdict(NamedTuple):
    switch: bool
    detail: str  # what the switch gains, or why it is not worth one


def _worth_it(state: State, new: Plan, result: PlanResult, horizon: int, extrapolated: bool = False) -> Verdict:
    """Whether `new` pays for a switch from the current plan."""
    current = state.plan
    assert current is not None
    if not set(current.members) <= set(state.cluster.devices) or new.predicted_step_s is None:
        return Verdict(True, "the current members cannot all train on")
    now_s = _current_step_s(state, current)
    if now_s is None or now_s <= 0:
        return Verdict(True, "no prediction for the current plan")
    gain = now_s - new.predicted_step_s
    if gain <= 0:
        return Verdict(False, f"the running plan is still the best: predicted {now_s * 1e3:.1f} ms/step, the best "
                              f"other {new.predicted_step_s * 1e3:.1f} ms/step")
    if horizon < steps.SETTLE + steps.BASELINE:
        return Verdict(False, f"not worth a switch: {horizon} steps left, fewer than a new epoch needs to "
                              f"settle and be measured ({steps.SETTLE + steps.BASELINE})")
    noise = _noise(state)
    # A plan that rests on a guess (a member not measured yet) is replaced by a measured one as soon
    # as that is 3% better; a measured plan only by one that beats the noise too.
    need = MIN_REL_GAIN if state.calibrating else max(MIN_REL_GAIN, 2 * noise)
    cost = state.cluster.switch_s() + state.cluster.move_s(result.moved_bytes)
    rule = "3%: the plan rests on a guess" if state.calibrating else f"3% or twice the measured noise {noise:.1%}"
    if extrapolated and EXTRAPOLATED_GAIN > need:
        need, rule = EXTRAPOLATED_GAIN, f"{EXTRAPOLATED_GAIN:.0%}: a member missed its prediction where the model may be off"
    numbers = (f"predicted {now_s * 1e3:.1f} -> {new.predicted_step_s * 1e3:.1f} ms/step ({gain / now_s:+.1%} of "
               f"the step; needed {need:.1%}: {rule}), switch cost "
               f"{cost * 1e3:.0f} ms against {max(gain, 0.0) * horizon * 1e3:.0f} ms gained over {horizon} steps")
    if gain / now_s < need or gain * horizon <= cost:
        return Verdict(False, f"not worth a switch: {numbers}")
    return Verdict(True, f"worth a switch: {numbers}")


def _current_step_s(state: State, current: Plan) -> float | None:
    """The running plan's step time as predicted now (its members' latest speeds and contention),
    on the same scale as a new plan's prediction."""
    return repredict(state.cluster.contended(current.members), state.graph, current).predicted_step_s


def _noise(state: State) -> float:
    """Relative spread of the current epoch's measured step times (`steps.level_noise`: each
    against the median of its own level); 0 before a few steps are measured."""
    t = state.tracker
    if t is None or t.epoch != state.epoch or len(t.measured) < 4:
        return 0.0
    return steps.level_noise(t, NOISE_WINDOW)


def _keep(state: State, why: str) -> State:
    """Keep the current plan (a re-plan that does not pay); its prediction is refreshed."""
    plan = state.plan
    assert plan is not None
    fresh = repredict(state.cluster.contended(plan.members), state.graph, plan)
    tracker = state.tracker
    if tracker is not None and tracker.epoch == state.epoch:
        tracker = replace(tracker, predicted_step_s=fresh.predicted_step_s)
    return replace(state, replan_wanted=None, kept=f"{why}{_changes(state)}", tracker=tracker, plan=fresh)


def _changes(state: State) -> str:
    """The suffix naming the speed changes behind a re-plan, "; changed: ..." ("" when none)."""
    return f"; changed: {'; '.join(state.changed)}" if state.changed else ""


def _standby_logs(state: State, result: PlanResult) -> list[Effect]:
    """A `standby` event for every ready worker the plan newly leaves out, with the reason."""
    return [Log("standby", {"worker": n, "why": why}) for n, why in zip(result.standby, result.standby_why)
            if n not in state.standby and n in state.workers]


def _nothing_fits(state: State, result: PlanResult, holders: list[str], reason: str, *, abort: bool) -> Result:
    """No plan: wait with the state where it is, or report it lost when nobody holds it."""
    if holders:
        if abort:  # the group is gone: the survivors keep their state and wait for a plan
            waiting = f"training waits for a device that fits; {', '.join(holders)} keep(s) the state"
            state = replace(state, plan=None, tracker=None, acked=frozenset(), running=frozenset(holders))
        else:  # a planned change that cannot be made: the current plan trains on
            waiting = "the current plan trains on"
        result = replace(result, reason=f"{result.reason}; {waiting}")
        return replace(state, result=result, replan_wanted=None), [Planned(result, state.epoch, reason)]
    said: list[Effect] = []
    if state.resume is None and (state.plan is not None or state.last_step > 0):
        # Nobody can train, and nobody holds state any more: it is gone with them.
        state, said = lose_state(state)
    if state.resume is not None:
        result = replace(result, reason=f"{result.reason}; no worker holds the training state: the next workers "
                                        f"resume from checkpoint {state.resume.path} (step {state.resume.step})")
    elif said:
        result = replace(result, reason=f"{result.reason}; no worker holds the training state and there is no "
                                        "checkpoint: it is lost, the next workers start from step 0")
    elif result.status == "infeasible":
        result = replace(result, reason=f"{result.reason}; training waits for a device that fits")
    state = replace(state, plan=None, result=result, tracker=None, acked=frozenset(), running=frozenset(),
                    replan_wanted=None)
    return state, [*said, Planned(result, state.epoch, reason)]


def lose_state(state: State) -> Result:
    """No worker holds the training state any more (every holder failed at once, or a slice and its
    copy): the next plan resumes from the newest intact checkpoint, redoing the steps after it; with
    none, training starts over from step 0. Says which in a `state_lost` event."""
    reached = max(state.last_step, state.lost_at)
    newest = state.checkpoints[-1] if state.checkpoints else None
    said = Log("state_lost", {"epoch": state.epoch, "step": reached, "detail": "no worker holds the training state",
                              "resume_from": newest.path if newest else None,
                              "redo": reached - newest.step if newest else reached})
    if newest is None:
        return replace(state, resume=None, lost_at=0, last_step=0, unlogged=frozenset()), [said]
    return replace(state, resume=newest, lost_at=reached, last_step=newest.step, unlogged=frozenset()), [said]
