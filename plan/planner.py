"""The global planner: which devices train, in which layout, each one's share of the batch, and why.

`make_plan(cluster, graph, previous, *, limits, holders, pin) -> PlanResult` is the one decision
the coordinator asks for whenever the cluster changes (a join, a failure, a drain, a straggler).
It is one pipeline:

1. The ready devices -> candidate layouts, enumerated outside any solve (`plan.candidates`):
   replicated data parallel (the class-level solve with its plain alternatives,
   `plan._replicated`), FSDP over k members, HSDP r x s, and pipelines pp=P when the model's units
   form a sequence. A candidate that cannot run (memory, too few devices, a model that cannot be
   cut) says why; the others are predicted by the cost model.
2. Every candidate is scored by one objective: the predicted step plus the switch to it (forming
   the group, moving state to devices that do not hold it) amortised over `horizon_steps`. A pin
   (`--layout`) keeps only the candidates it admits (and adds the shape it names).
3. The winner has the least objective. Hysteresis: if the current plan, re-predicted with
   today's speeds, is within `MIN_GAIN` of the winner, it is kept (the same assignment, so no new
   epoch): a re-plan that saves 1% of the step but switches epochs, or moves the whole model, is
   not taken.
4. The answer lists every candidate weighed (`PlanResult.candidates`: `ctl plan --explain` prints
   them), the runner-up (the best plan that differs), and why each ready device left out is.

Excluding a device is a legal answer (too slow to pay for its share of the communication, out of
memory, or every layout that uses it predicted slower than the winner): it stays on standby and
the reason says so, naming the best layout that uses it. Before any step is measured the speeds
are a guess: the replicated candidate takes every usable device and no pipeline is weighed
unless nothing else fits. Without a graph of the model (its capture failed) the planner falls
back to shares by speed over every device (status "heuristic"); the `even` policy (benchmarks'
baseline) splits the batch evenly over every usable device; neither weighs layouts, and a pin cuts
their members to its degrees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from plan._pipeline_pin import NOT_A_SEQUENCE
from plan._pipeline_pin import describe as describe_pipeline
from plan._replicated import Replicated, current, no_replica, replicated, standby_reason, usable
from plan.candidates import (Alternative, Candidate, Ctx, Weighed, admitted, context, describe, kind, pipelines, sharded,
                             whole)
from plan.cluster import Cluster
from plan.cost import samples_that_fit, sharded_static_bytes
from plan.graph import Graph
from plan.layout import LayoutPin
from plan.milp import ENGINES
from plan.prediction import MemberCost, Plan, micro_batched, micro_sizes, predict, predict_sharded
from plan.reshard import least_moving_order
from plan.shares import assign, split_shares
from plan.tensor import pinned_pipeline_tensor, pinned_tensor_parallel, tensor_parallel

__all__ = ["Alternative", "Candidate", "MemberCost", "Plan", "PlanLimits", "PlanResult", "assign", "make_plan",
           "predict", "score_members", "split_shares"]

MIN_GAIN = 0.03  # a new plan must beat the current one by 3% of step time (noise is a few %)
LEAST_MOVING_UP_TO = 64  # members of a sharded plan ranked where they move least (beyond: rank order)
TP_GUESSED = ("no step measured yet: tensor parallelism is weighed once speeds are measured (its gain is "
              "compute against many small all-reduces, both guessed until then)")
GUESSED = ("no step measured yet: pipelines are weighed once speeds are measured (a cut on guessed speeds "
           "can be far off)")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLimits:
    global_batch: int
    max_workers: int | None = None
    time_limit_s: float = 0.5  # for the MILP
    horizon_steps: int = 200  # steps over which a switch's one-off cost is amortised
    policy: str = "milp"  # "milp" or "even"
    engine: str = "auto"  # of the class-level solve: "auto", "search" or "milp" (plan.milp)
    tp_degrees: tuple[int, ...] = ()  # the tensor-parallel degrees the job admits (> 1): weighed unpinned

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.policy not in ("milp", "even"):
            raise ValueError(f"policy must be 'milp' or 'even', got {self.policy!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.horizon_steps < 1 or self.time_limit_s <= 0:
            raise ValueError("horizon_steps must be >= 1 and time_limit_s positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The plan (None when nothing can train), the solver status and a reason a person can read."""

    plan: Plan | None
    status: str  # "optimal", "time-limited", "fallback", "infeasible", "heuristic", "even"
    reason: str
    objective_s: float | None = None
    runner_up: Alternative | None = None
    standby: tuple[str, ...] = ()  # ready devices the plan leaves out
    standby_why: tuple[str, ...] = ()  # why, one per standby device
    moved_bytes: int = 0
    candidates: tuple[Candidate, ...] = ()  # the layouts weighed (that a pin admits), the chosen one marked


def make_plan(cluster: Cluster, graph: Graph | None, previous: Plan | None, *, limits: PlanLimits,
              holders: Collection[str] | None = None, pin: LayoutPin | None = None) -> PlanResult:
    """The best plan for `cluster` (see the module comment). `holders`: the devices that hold the
    training state (moving it elsewhere costs); default the previous plan's members. `pin`: layout
    degrees the operator fixed (`--layout`)."""
    if not cluster.devices:
        return PlanResult(plan=None, status="infeasible", reason="no ready devices")
    pipeline_pin = pin is not None and (pin.pp or 1) > 1
    if graph is None:
        if pin is not None and pipeline_pin:
            return PlanResult(plan=None, status="infeasible", reason=f"--layout {pin.describe()}: {NOT_A_SEQUENCE}")
        result = _by_speed(cluster, previous.members if previous else tuple(holders or ()), limits)
        return _pinned(cluster, graph, result, pin, limits) if pin is not None and result.plan is not None else result
    ctx = context(cluster, graph, previous, limits, holders)
    if limits.policy == "even" and not pipeline_pin and (pin is None or (pin.tp or 1) == 1):
        return _even(ctx, pin)
    return _choose(ctx, pin)


def score_members(cluster: Cluster, graph: Graph, previous: Plan | None, members: Sequence[str], *,
                  limits: PlanLimits, holders: Collection[str] | None = None) -> Alternative | None:
    """`members` with balanced shares, scored as the planner scores its candidates (predicted step
    plus the amortised switch and migration cost); None if they cannot hold the batch. For checking
    the planner against an enumeration of every subset on small clusters."""
    ctx = context(cluster, graph, previous, limits, holders)
    plan = ctx.balanced(members)
    if plan is None or len(plan.members) != len(members):
        return None
    return ctx.score(plan, "enumerated")


# --- the choice ------------------------------------------------------------------------------------


def _choose(ctx: Ctx, pin: LayoutPin | None) -> PlanResult:
    """Enumerate, filter by the pin, take the least objective, keep the current plan unless the
    winner gains MIN_GAIN (module comment)."""
    guess = not any(d.samples_per_s for d in ctx.cluster.devices.values())
    weighed: list[Weighed] = []
    rep: Replicated | None = None
    if pin is not None and (pin.tp or 1) > 1:  # (a tp pin: its one shape; unpinned, tp is weighed below)
        weighed = pinned_pipeline_tensor(ctx, pin) if (pin.pp or 1) > 1 else pinned_tensor_parallel(ctx, pin)
    elif pin is None or (pin.pp or 1) == 1:
        rep = replicated(ctx)
        best_rep = rep.best
        weighed.append(Weighed(describe(best_rep.plan) if best_rep else "dp_replicate",
                               (1, len(best_rep.plan.members) if best_rep else None, 1), best_rep,
                               "" if best_rep else no_replica(ctx, rep.reason)))
        weighed += sharded(ctx, pin=pin, same_as=best_rep.plan.members if best_rep else (),
                           above=best_rep.objective_s if best_rep is not None and pin is None else math.inf)
        weighed = [w for w in weighed if admitted(pin, w.shape)]
    # Speeds that are only a guess: no pipeline (its cut rests on them) unless nothing else runs,
    # and no tensor parallelism (its gain is a prediction of compute against many small all-reduces).
    unless = GUESSED if guess and pin is None and any(w.scored for w in weighed) else ""
    if pin is None and ctx.limits.tp_degrees:
        found = min((w.scored.objective_s for w in weighed if w.scored is not None), default=math.inf)
        weighed += tensor_parallel(ctx, found) if not unless else [
            Weighed(f"tp={tp}", (1, None, 1), why_not=TP_GUESSED) for tp in ctx.limits.tp_degrees]
    if pin is None or (pin.tp or 1) == 1:
        weighed += pipelines(ctx, pin=pin, unless=unless,
                             above=min((w.scored.objective_s for w in weighed if w.scored is not None), default=math.inf))
    weighed = _distinct(weighed)
    rows = tuple(w.row() for w in weighed)
    runnable = [w.scored for w in weighed if w.scored is not None]
    if not runnable:
        return PlanResult(plan=None, status="infeasible", reason=_none_runs(weighed, rep, pin), candidates=rows)

    best = min(runnable, key=lambda a: a.objective_s)
    chosen, kept = best, False
    now = None if guess else current(ctx, rep.keep if rep is not None else None)
    if (now is not None and _still_pinned(pin, now, runnable) and not best.plan.same_assignment(now.plan)
            and _gauge(best, rep) > _gauge(now, rep) * (1 - MIN_GAIN)):
        chosen, kept = now, True
    final = _least_moving(ctx, chosen)  # (a sharded plan's ranks where its members' shards move least)
    rows = tuple(Weighed(w.layout, w.shape, final).row(chosen=True) if w.scored is chosen else w.row()
                 for w in weighed)
    if kept:
        rows += (Weighed(describe(final.plan), _shape(final.plan), final).row(chosen=True),)
    others = [a for a in (*runnable, *(rep.alternatives if rep else ())) if a is not chosen]
    runner = best if kept else _runner_up(chosen, others)
    standby = tuple(sorted(set(ctx.cluster.devices) - set(chosen.plan.members)))
    using: dict[str, Alternative] = {}  # per device, the best candidate that uses it
    for a in sorted(runnable, key=lambda a: -a.objective_s):
        using.update((m, a) for m in a.plan.members)
    why_out = tuple(_standby_why(ctx, n, chosen, using.get(n), pin, kept=kept) for n in standby)
    # (for the reason's comparison, the candidates predicted but not scored count at their step)
    reason = _reason(ctx, chosen, best, runnable + [w.unscored for w in weighed if w.unscored is not None], rep, pin,
                     kept=kept)
    if standby:
        reason += "; on standby: " + ", ".join(f"{n} ({r})" for n, r in zip(standby, why_out))
    status = rep.status if rep is not None and rep.best is not None else "optimal"
    return PlanResult(plan=final.plan, status=status, reason=reason, objective_s=final.objective_s,
                      runner_up=runner, standby=standby, standby_why=why_out, moved_bytes=final.moved_bytes,
                      candidates=rows)


def _still_pinned(pin: LayoutPin | None, now: Alternative, runnable: list[Alternative]) -> bool:
    """Whether the current plan may be kept under `pin`: the pin admits its degrees and, beyond
    whole replicas (how many the solve decides), a degree the pin leaves free still fills the ready
    devices as a candidate does (`--layout dp=1` over 4 devices is FSDP over 4: FSDP over 3 is no
    longer the pinned layout once a fourth joins)."""
    shape = _shape(now.plan)
    if not admitted(pin, shape):
        return False
    return pin is None or whole(now.plan) or any(_shape(a.plan) == shape for a in runnable)


def _distinct(weighed: list[Weighed]) -> list[Weighed]:
    """`weighed` without a plan found twice (the same layout of the same devices), the first kept."""
    seen: set[tuple[tuple[int, int | None, int], int, frozenset[str]]] = set()
    out = []
    for w in weighed:
        key = (w.shape, w.scored.plan.tp if w.scored is not None else 1,
               frozenset(w.scored.plan.members if w.scored is not None else ()))
        if w.scored is None or key not in seen:
            seen.add(key)
            out.append(w)
    return out


def _gauge(a: Alternative, rep: Replicated | None) -> float:
    """What hysteresis compares: the objective; a pinned pipeline (no replicated candidate) weighs
    its cut alone, by the predicted step, since the operator chose the layout."""
    return a.objective_s if rep is not None else a.plan.predicted_step_s or 0.0


def _shape(plan: Plan) -> tuple[int, int, int]:
    """(pp, dp_replicate, dp_shard) of `plan` (without building its layout)."""
    return plan.pp, len(plan.members) // (plan.pp * plan.dp_shard * plan.tp), plan.dp_shard


def _none_runs(weighed: list[Weighed], rep: Replicated | None, pin: LayoutPin | None) -> str:
    """Why nothing can train: the pinned shape's reason, else the replicated candidate's."""
    if pin is not None:
        said = [w.why_not for w in weighed if w.why_not.startswith("--layout")] or [w.why_not for w in weighed]
        return said[0] if said else f"--layout {pin.describe()}: no layout weighed has these degrees"
    assert rep is not None
    return rep.reason


def _runner_up(chosen: Alternative, others: list[Alternative]) -> Alternative | None:
    """The best plan that differs from `chosen`: in its members or its layout where one does."""
    mine = (set(chosen.plan.members), _shape(chosen.plan))
    differ = [a for a in others if (set(a.plan.members), _shape(a.plan)) != mine]
    differ = differ or [a for a in others if not a.plan.same_assignment(chosen.plan)]
    return min(differ, key=lambda a: a.objective_s) if differ else None


def _ms(a: Alternative) -> str:
    assert a.plan.predicted_step_s is not None
    return f"{a.plan.predicted_step_s * 1e3:.1f}"


def _summary(a: Alternative) -> str:
    return f"{a.description}: {len(a.plan.members)} devices, {a.plan.predicted_step_s:.4g} s/step"


def _reason(ctx: Ctx, chosen: Alternative, best: Alternative, runnable: list[Alternative], rep: Replicated | None,
            pin: LayoutPin | None, *, kept: bool) -> str:
    plan, speeds = chosen.plan, dict(ctx.speeds)
    pinned = f"layout pinned by --layout {pin.describe()}" if pin is not None else ""
    if kept:
        other = describe_pipeline(best.plan, speeds) if best.plan.pp > 1 else _summary(best)
        text = (f"kept the current cut ({describe_pipeline(plan, speeds)}): the best other ({other})"
                if plan.pp > 1 else f"kept {chosen.description}: the best other plan ({other})")
        text += f" gains less than {MIN_GAIN:.0%} of a step"
        return f"{pinned}: {text}" if pinned else text
    if plan.tp > 1 and pinned:
        stages = f", stages {' | '.join(' '.join(s) for s in plan.stages)}" if plan.pp > 1 else ""
        return f"{pinned}: {kind(plan)}{stages}, predicted {_ms(chosen)} ms/step"
    if plan.pp > 1 and pinned:
        return f"{pinned}: {describe_pipeline(plan, speeds)}"
    solved = rep.reason if rep is not None else ""
    replica = rep.best if rep is not None else None
    if whole(plan):
        text = solved
        rest = [a for a in runnable if not whole(a.plan)]
        if rest and not pinned:
            fastest = min(rest, key=lambda a: a.objective_s)
            text += f"; replicated: {fastest.description} would take {_ms(fastest)} ms/step"
    elif replica is None:
        state = ctx.graph.param_bytes * (2.0 + ctx.graph.optimizer_state_factor)
        biggest = max(dev.memory_bytes for dev in ctx.cluster.devices.values())
        text = (f"{kind(plan)}: no replica fits (parameters, gradients and optimizer state need "
                f"{state / 2**20:.1f} MiB, the largest device has {biggest / 2**20:.1f} MiB); ")
        if plan.pp > 1:
            text += describe_pipeline(plan, speeds)
        else:
            copies = (" with a copy of another's shard" if len(plan.members) == plan.dp_shard
                      else " (the other replicas hold the copies)")
            text += f"each member holds {max(c.memory_bytes for c in plan.costs) / 2**20:.1f} MiB or less{copies}"
        text += f" ({solved})"
    else:
        detail = f" ({describe_pipeline(plan, speeds)})" if plan.pp > 1 else ""
        text = f"{kind(plan)}{detail}: predicted {_ms(chosen)} against {_ms(replica)} ms/step replicated"
    return f"{text}; {pinned}: {describe(plan)}" if pinned else text


def _standby_why(ctx: Ctx, name: str, chosen: Alternative, other: Alternative | None, pin: LayoutPin | None, *,
                  kept: bool) -> str:
    """Why `name` is left out: memory, --max-workers, the pin, hysteresis, or (a layout that is not
    replicated) the best layout that uses it (`other`) and both predictions."""
    if whole(chosen.plan):
        why = standby_reason(ctx, name, chosen, kept=kept)
        fixed = pin is not None and pin.dp_replicate is not None  # (one that leaves dp free sizes no replica plan)
        return "not in the pinned layout" if fixed and not why.startswith(("its memory", "no room")) else why
    if pin is not None:
        return "not in the pinned layout"
    if ctx.limits.max_workers is not None and len(chosen.plan.members) >= ctx.limits.max_workers:
        return f"--max-workers {ctx.limits.max_workers}"
    if kept:
        return f"the current members are kept: a plan with it gains less than {MIN_GAIN:.0%} of a step"
    if other is None:
        return "its memory holds no part of any layout weighed"
    return (f"{describe(chosen.plan)} over {len(chosen.plan.members)} predicts {_ms(chosen)} ms/step "
            f"(objective {chosen.objective_s * 1e3:.1f} ms); the best layout that uses it, "
            f"{describe(other.plan)} over {len(other.plan.members)}, predicts {_ms(other)} ms/step "
            f"(objective {other.objective_s * 1e3:.1f} ms)")


def _least_moving(ctx: Ctx, chosen: Alternative) -> Alternative:
    """A sharded plan whose members changed, in the rank order that moves the fewest bytes from
    what the holders hold (`plan.reshard.least_moving_order`: e.g. a 4th member placed between two
    holders moves a seventh less of the state than one appended), with those bytes as its
    `moved_bytes`. The members, their shares and the prediction are unchanged: only who holds
    which chunk."""
    plan, previous = chosen.plan, ctx.previous
    if (plan.dp_shard == 1 or plan.pp > 1 or previous is None or len(plan.members) > LEAST_MOVING_UP_TO
            or (set(plan.members) == set(previous.members) and plan.dp_shard == previous.dp_shard)):
        return chosen  # (beyond LEAST_MOVING_UP_TO the search, a reshard per position tried, is O(n^3))
    hosts = {n: d.host for n, d in ctx.cluster.devices.items()}
    order, fraction = least_moving_order(ctx.before, ctx.holders, plan.members, dp_shard=plan.dp_shard, hosts=hosts)
    return replace(chosen, plan=plan.reordered(order), moved_bytes=round(fraction * ctx.graph.state_bytes))


# --- without the cost model's choice of layout --------------------------------------------------------


def _even(ctx: Ctx, pin: LayoutPin | None) -> PlanResult:
    """`--planner even`: every usable device (previous members first), the batch split evenly; a
    pin cuts the members to its degrees."""
    fits = usable(ctx)
    keep = [m for m in (ctx.previous.members if ctx.previous else ()) if m in fits]
    members = (keep + [n for n in fits if n not in keep])[: ctx.limits.max_workers or len(fits)]
    shares = split_shares(ctx.limits.global_batch, [1.0] * len(members))
    if not members or any(s > (ctx.caps[m] or 0) for m, s in zip(members, shares)):
        return PlanResult(plan=None, status="infeasible", reason="an even split does not fit in memory")
    plan = predict(ctx.cluster, ctx.graph, members, shares)
    result = PlanResult(plan=plan, status="even", objective_s=plan.predicted_step_s,
                        reason=f"even split over {len(members)} devices (--planner even)")
    if pin is not None:
        result = _pinned(ctx.cluster, ctx.graph, result, pin, ctx.limits)
    if result.plan is None:
        return result
    if result.plan.dp_shard > 1:
        assert result.objective_s is not None
        ranked = _least_moving(ctx, Alternative(description="", plan=result.plan, objective_s=result.objective_s,
                                                moved_bytes=result.moved_bytes))
        return replace(result, plan=ranked.plan, moved_bytes=ranked.moved_bytes)
    return replace(result, plan=micro_batched(result.plan, ctx.graph, ctx.micro_caps))


def _by_speed(cluster: Cluster, before: Sequence[str], limits: PlanLimits) -> PlanResult:
    """No graph of the model: every device (up to max_workers) in, shares by speed; devices of
    the previous plan (`before`) keep their ranks."""
    speeds = cluster.speeds()
    kept = [m for m in before if m in speeds][: limits.max_workers]
    newcomers = sorted((n for n in speeds if n not in kept), key=lambda n: (-speeds[n], n))
    if limits.max_workers is not None:
        newcomers = newcomers[: max(limits.max_workers - len(kept), 0)]
    members = kept + sorted(newcomers)
    shares = split_shares(limits.global_batch, [speeds[m] for m in members])
    plan = predict(cluster, None, members, shares)
    return PlanResult(plan=plan, status="heuristic",
                      reason=f"no graph of the model: {len(members)} replicas, shares by speed")


def _pinned(cluster: Cluster, graph: Graph | None, result: PlanResult, pin: LayoutPin, limits: PlanLimits) -> PlanResult:
    """`result` (made without weighing layouts: no graph, or `--planner even`) cut to the pinned
    degrees: the fastest members that fill replicas × shards, their shares re-balanced (a sharded
    member may have none: it still holds its shard)."""
    assert result.plan is not None
    members = list(result.plan.members)
    n = len(members)
    replicas, shards = pin.dp_replicate, pin.dp_shard
    if replicas is not None and shards is not None:
        size = replicas * shards
    elif replicas is not None:
        size = replicas * (n // replicas)
    elif shards is not None:
        size = shards * (n // shards)
    else:
        size = n
    if size < 1 or size > n:
        return PlanResult(plan=None, status="infeasible",
                          reason=f"--layout {pin.describe()} needs {max(size, replicas or shards or 1)} members; "
                                 f"{n} can train now")
    speeds = cluster.speeds_for(graph.train_flops if graph else 0.0)
    kept = sorted(members, key=lambda m: (-speeds[m], members.index(m)))[:size]
    kept = [m for m in members if m in kept]  # rank order stays
    d = cluster.devices
    shares = assign([speeds[m] for m in kept], [d[m].overhead_s for m in kept], [float(limits.global_batch)] * len(kept),
                    limits.global_batch) or split_shares(limits.global_batch, [speeds[m] for m in kept])
    dp_shard = shards if shards is not None else size // (replicas or size)
    if dp_shard > 1 and graph is not None:
        # Sharded or HSDP: each member must hold its shard (and, fully sharded, a copy of another's)
        # beside at least one sample's activations; a share that does not fit runs as micro-batches.
        full = dp_shard == size
        static = sharded_static_bytes(graph, dp_shard, copies=full, optimizer_state_factor=graph.optimizer_state_factor)
        caps = {m: samples_that_fit(d[m].memory_bytes, static, graph.activation_bytes) for m in kept}
        short = [m for m in kept if (caps[m] or 0) < 1]
        if short:
            return PlanResult(plan=None, status="infeasible",
                              reason=f"--layout {pin.describe()} does not fit: a member needs {static / 2**20:.1f} MiB "
                                     f"for its shard{' and a copy of another' if full else ''} plus "
                                     f"{graph.activation_bytes / 2**10:.1f} KiB per sample; "
                                     f"{', '.join(f'{m} has {d[m].memory_bytes / 2**20:.1f} MiB' for m in short)}")
        plan = predict_sharded(cluster, graph, kept, shares, micro_sizes(shares, [caps[m] for m in kept]),
                               replicas=size // dp_shard)
    else:
        plan = replace(predict(cluster, graph, kept, shares), dp_shard=dp_shard)
    cut = tuple(m for m in members if m not in kept)
    why = f"{result.reason}; layout pinned by --layout {pin.describe()}: {plan.layout.describe()}"
    return replace(result, plan=plan, reason=why, standby=result.standby + cut,
                   standby_why=result.standby_why + ("not in the pinned layout",) * len(cut))
