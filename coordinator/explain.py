"""`ctl plan --explain`: the current plan as the cost model sees it, as plain JSON-able data.

For the plan in force: the predicted step split per member into compute, overhead, waiting and the
all-reduce, memory per member against its limit, every candidate layout the planner weighed (its
predicted step and objective, or why it could not run), why it beat the runner-up (the best plan
that differs), the fitted constants it rests on (contention per host and each layout kind's learned
efficiency included), the placements of the
model's tensors (a pipeline's: which units each stage holds, and on whom), the prediction against
the steps measured so far in this epoch, what changed since the plan was made, and why the latest
better plan found since was not worth a switch (`kept`). Reads the state only.
"""

from __future__ import annotations

import statistics
from typing import Any

from coordinator import steps
from coordinator.phase import Phase, phase
from coordinator.state import State
from plan import Alternative, Plan, PlanResult
from plan.layout import describe, placements


def explain(state: State, now: Phase | None = None) -> dict[str, Any]:
    """`now`: the job's phase (coordinator.phase; the default assumes --min-workers 1)."""
    plan, result = state.plan, state.result
    now = now or phase(state)
    out: dict[str, Any] = {"status": result.status if result else None, "state": now.name}
    if plan is None:  # why nothing trains now (the planner's last answer may be older than the state)
        out["detail"] = now.reason
        return out
    out["detail"] = result.reason if result else ""
    devices = state.cluster.devices
    members = []
    for rank, c in enumerate(plan.costs):
        d = devices.get(c.name)
        members.append({"name": c.name, "rank": rank, "samples": c.samples, "speed": c.speed,
                        "compute_s": c.compute_s, "overhead_s": c.overhead_s, "wait_s": c.wait_s,
                        "comm_s": plan.comm_s, "memory_bytes": c.memory_bytes,
                        "memory_limit_bytes": d.memory_bytes if d else None,
                        "measured_speed": d.samples_per_s if d else None})
    out.update(predicted_step_s=plan.predicted_step_s, comm_s=plan.comm_s,
               objective_s=result.objective_s if result else None, members=members,
               standby=list(result.standby) if result else [])
    out["candidates"] = [{"layout": c.layout, "description": c.description, "members": len(c.members),
                          "predicted_step_s": c.predicted_step_s, "objective_s": c.objective_s,
                          "moved_bytes": c.moved_bytes, "why_not": c.why_not, "chosen": c.chosen}
                         for c in (result.candidates if result else ())]
    runner = result.runner_up if result else None
    if result is not None and runner is not None:
        out["runner_up"] = {"description": runner.description, "members": list(runner.plan.members),
                            "shares": list(runner.plan.shares), "predicted_step_s": runner.plan.predicted_step_s,
                            "objective_s": runner.objective_s, "moved_bytes": runner.moved_bytes}
        out["why"] = _why(result, runner)
    t = state.tracker
    if t is not None and t.epoch == state.epoch:
        out["measured"] = {"steps": len(t.measured),
                           "median_step_s": statistics.median(t.measured) if t.measured else None,
                           "median_error": steps.median_error(t),
                           "predicted_step_s": t.predicted_step_s}
    scope, fit = state.cluster.link_fit(plan.members)
    g = state.graph
    out["constants"] = {
        "link": {"alpha_s": fit.coef[0], "beta_s_per_byte": fit.coef[1], "measurements": fit.measured,
                 "scope": scope},
        "switch_s": state.cluster.switch_s(),
        "move_s_per_byte": state.cluster.migration.coef[1],
        "migration_measurements": state.cluster.migration.measured,
        "compute_factor": state.cluster.compute_factor(g.train_flops) if g else None,
        "contention": _contention(state),
        "efficiency": dict(sorted(state.cluster.efficiency.items())),  # layout kind -> compute time over the fits'
    }
    out["changed"] = list(state.changed)
    out["kept"] = state.kept
    if plan.pp > 1:
        out["stages"] = _stages(plan)
    elif g is not None and plan.tp == 1:  # (a tp layout's placements differ tensor by tensor)
        first = placements(g, plan.layout)[g.layers[0].name]
        out["placements"] = {kind: describe(spec) for kind, spec in first.items()}
    return out


def _stages(plan: Plan) -> list[dict[str, Any]]:
    """Per pipeline stage: its graph units and the members that hold them (the ranks of its pp coordinate)."""
    layout = plan.layout
    return [{"stage": s, "units": list(units),
             "members": [m for r, m in enumerate(plan.members) if layout.coords(r)[0] == s]}
            for s, units in enumerate(plan.stages)]


def _contention(state: State) -> dict[str, Any]:
    """Per host of the plan: its load (threads per core), exponent γ and each member's slowdown factor."""
    plan = state.plan
    assert plan is not None
    c = state.cluster
    out: dict[str, Any] = {}
    for host in sorted({c.devices[n].host for n in plan.members if n in c.devices}):
        on = [n for n in plan.members if n in c.devices and c.devices[n].host == host]
        kind = c.devices[on[0]].device_kind
        out[host] = {"load": round(c.load(host, plan.members), 3), "gamma": round(c.host_gamma(host, kind), 3),
                     "learned": host in c.gamma, "factor": {n: round(c.factor(n, plan.members), 3) for n in on}}
    return out


def _why(result: PlanResult, runner: Alternative) -> str:
    step, r_step = result.plan.predicted_step_s if result.plan else None, runner.plan.predicted_step_s
    if result.objective_s is None or step is None or r_step is None:
        return ""
    text = f"{runner.description} predicts {r_step * 1e3:.1f} ms a step against {step * 1e3:.1f} ms"
    if runner.moved_bytes != result.moved_bytes:
        text += f" and moves {runner.moved_bytes / 1e6:.1f} MB of state against {result.moved_bytes / 1e6:.1f} MB"
    gain = (runner.objective_s - result.objective_s) / runner.objective_s if runner.objective_s > 0 else 0.0
    if gain >= 0:
        return f"{text}: this plan is {gain:.1%} better, the amortised switch cost included"
    return f"{text}: it would be {-gain:.1%} better, but not by enough to be worth a new epoch"
