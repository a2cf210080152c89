"""Re-planning inside membership: ask the planner, and turn its answer into a new epoch (or not).

`replan(state, config, reason, abort=..., now=...)` is called by the membership transitions on a
join (a worker made ready), a failure, a leave, a drain, a straggler and after a planned change
lands with another one waiting. It

* holds a planned change back while the previous one is not acknowledged everywhere (at most one
  planned change in flight); a failure (`abort=True`) supersedes anything pending;
* asks `plan.make_plan` over the ready, non-leaving devices, with the previous plan (or the
  survivors that hold the state) so the planner can weigh moving state;
* keeps one leaving state holder in the new epoch with no samples when no holder would stay, so
  that it hands the state over inside the new group;
* sends nothing when a planned re-plan gives the same assignment (no churn);
* when nothing fits (memory) keeps the state where it is: a running plan trains on, survivors of a
  failure wait for a device that fits; only when nobody holds the state is it reported lost.
"""

from __future__ import annotations

from dataclasses import replace

from coordinator import steps
from coordinator.state import Config, Effect, Log, Planned, Result, Send, State
from plan import PlanLimits, PlanResult, make_plan, predict
from transport import PlanDelta


def replan(state: State, config: Config, reason: str, *, abort: bool, now: float) -> Result:
    """Make a new plan if one is due, and send it as a new epoch."""
    if state.finished or state.stopping:
        return state, []
    if not abort and state.pending:
        return replace(state, replan_wanted=reason), []
    eligible = {n for n, w in state.workers.items() if w.ready and w.leaving is None}
    holders = state.holders
    if state.plan is None and not holders and len(eligible) < config.min_workers:
        return state, []
    if not eligible and holders:
        # Only leaving members hold the state and nobody can take it over: they train on.
        if not abort:
            detail = (f"no other worker to hand the state to: {', '.join(holders)} keep(s) training "
                      "until one joins")
            result = PlanResult(plan=None, status="infeasible", reason=detail)
            return replace(state, replan_wanted=None, result=result), [Planned(result, state.epoch, reason)]
        eligible = set(holders)  # aborted: they need a new epoch anyway
    cluster = state.cluster.subset(eligible)
    limits = PlanLimits(global_batch=config.global_batch, max_workers=config.max_workers,
                        time_limit_s=config.solve_time_limit_s, policy=config.planner, engine=config.solver,
                        horizon_steps=max(1, min(config.horizon_steps, config.num_steps - state.last_step)))
    result = make_plan(cluster, state.graph, state.plan, limits=limits, holders=holders)
    if result.plan is None:
        return _nothing_fits(state, result, holders, reason, abort=abort)
    new = result.plan
    handoff = None
    if holders and not set(holders) & set(new.members):
        # No state holder stays: keep one leaving holder for one epoch with no samples, so that it
        # hands its state to the newcomers inside the new group; the next plan lets it go.
        handoff = holders[0]
        new = predict(state.cluster, state.graph, (*new.members, handoff), (*new.shares, 0))
        result = replace(result, plan=new, reason=f"{result.reason}; {handoff} stays one epoch to hand off")
    benched = _standby_logs(state, result)
    state = replace(state, standby=frozenset(result.standby))
    if not abort and new.same_assignment(state.plan):
        # Same assignment, no new epoch; keep the refreshed prediction (new speeds, fitted constants).
        tracker = state.tracker
        if tracker is not None and tracker.epoch == state.epoch:
            tracker = replace(tracker, predicted_step_s=new.predicted_step_s)
        return replace(state, replan_wanted=None, result=result, plan=new, tracker=tracker), benched
    epoch = state.epoch + 1
    delta = PlanDelta(epoch=epoch, reason=reason, members=list(new.members), shares=list(new.shares),
                      global_batch=config.global_batch, abort=abort)
    old = set(state.plan.members) if state.plan else set()
    recipients = sorted((old | set(new.members)) & set(state.workers))
    workers = {n: replace(w, nudged_at=now) if n in recipients else w for n, w in state.workers.items()}
    tracker = steps.start(epoch, new.members, new.predicted_step_s, {c.name: c.compute_s for c in new.costs})
    state = replace(state, workers=workers, delta=delta, epoch=epoch, plan=new, result=result, tracker=tracker,
                    acked=frozenset(), reshard_bytes=0, reshard_s=0.0, running=frozenset(holders),
                    replan_wanted=f"{handoff} handed off" if handoff else None)
    effects: list[Effect] = [Planned(result, epoch, reason), *benched]
    return state, effects + [Send(n, delta) for n in recipients]


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
    lost = state.plan is not None or state.last_step > 0
    if lost:
        # Nobody can train, and nobody holds state any more: it is gone with them, and the next
        # workers start from the seed (durable checkpoints arrive with a later issue).
        result = replace(result, reason=f"{result.reason}; no worker holds the training state: it is lost, "
                                        "the next workers start from step 0")
    elif result.status == "infeasible":
        result = replace(result, reason=f"{result.reason}; training waits for a device that fits")
    state = replace(state, plan=None, result=result, tracker=None, acked=frozenset(), running=frozenset(),
                    replan_wanted=None, last_step=0 if lost else state.last_step)
    return state, [Planned(result, state.epoch, reason)]
