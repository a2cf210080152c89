"""The global planner: which devices train, each one's share of the global batch, and why.

`make_plan(cluster, graph, previous, *, limits) -> PlanResult` is the one decision the coordinator
asks for whenever the cluster changes (a join, a failure, a drain, a straggler):

1. Device classes (`Cluster.classes`: same kind and memory cap, similar speed) go to the class-level
   solver (`plan.milp.solve_dp`: an exact search over ring sizes, or the PuLP MILP on HiGHS), which picks how many devices of each class take part, minimising the
   predicted step time plus the cost of moving state to devices that did not hold it, amortised
   over `horizon_steps`. Candidate link scopes are enumerated outside the MILP: every device
   (inter-host link if they span hosts) and, on a multi-host cluster, each of the few strongest
   hosts alone (intra-host link).
2. A cheap second step maps class counts to concrete devices, keeping members of the previous plan
   first (no state moves to them), and splits the batch per device by real speed and overhead
   (`assign`), so that every replica finishes compute + overhead together. Memory bounds no
   share: a device that holds the state and one sample runs a larger share as micro-batches of
   what fits (`micro_batched`); one that cannot hold the state is left out.
3. A few plain alternatives are scored with the same cost model (keep the current members,
   every device, the r fastest): the best of all wins, and the best one that differs is reported
   as the runner-up, so `ctl plan --explain` can say why the plan beat it.
4. Hysteresis: if the current plan, re-predicted with today's speeds, is within `MIN_GAIN` of the
   winner, it is kept (the same assignment, so no new epoch): a re-plan that saves 1% of the step
   but switches epochs, or moves the whole model, is not taken.

Excluding a device is a legal answer (too slow to pay for its share of the all-reduce, or out of
memory): it stays on standby and the reason says so. Without a graph of the model (its capture
failed) the planner falls back to shares by speed over every device (status "heuristic").
The `even` policy (benchmarks' baseline) splits the batch evenly over every usable device.
A pinned pipeline (`--layout pp=P`) is planned on its own (`plan._pipeline_pin`): the P fastest
devices, cut into stages by their speeds and memory; the current cut stays unless a new one gains
`MIN_GAIN`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from plan._pipeline_pin import describe as describe_pipeline
from plan._pipeline_pin import moved_bytes, pipeline_plan
from plan.cluster import Cluster
from plan.cost import max_micro_batch, samples_that_fit, sharded_static_bytes, static_bytes
from plan.graph import Graph
from plan.layout import LayoutPin
from plan.milp import ENGINES, DeviceClass, DpCosts, map_to_devices, solve_dp
from plan.prediction import MemberCost, Plan, micro_batched, micro_sizes, predict, predict_sharded, repredict
from plan.reshard import least_moving_order
from plan.shares import assign, split_shares

__all__ = ["Alternative", "MemberCost", "Plan", "PlanLimits", "PlanResult", "assign", "make_plan", "predict",
           "score_members", "split_shares"]

MIN_GAIN = 0.03  # a new plan must beat the current one by 3% of step time (noise is a few %)
HOST_CANDIDATES = 3  # single-host plans tried on a multi-host cluster
MAX_PREFIX_CANDIDATES = 64  # "the r fastest" alternatives are scored up to this many devices


@dataclass(frozen=True, slots=True, kw_only=True)
class Alternative:
    """A plan the winner was compared with."""

    description: str
    plan: Plan
    objective_s: float  # predicted step + amortised switch and migration cost
    moved_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLimits:
    global_batch: int
    max_workers: int | None = None
    time_limit_s: float = 0.5  # for the MILP
    horizon_steps: int = 200  # steps over which a switch's one-off cost is amortised
    policy: str = "milp"  # "milp" or "even"
    engine: str = "auto"  # of the class-level solve: "auto", "search" or "milp" (plan.milp)

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


# --- the planner ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ctx:
    cluster: Cluster
    graph: Graph
    previous: Plan | None
    limits: PlanLimits
    speeds: Mapping[str, float]
    fixed: Mapping[str, float]  # compute per step that does not grow with the share
    caps: Mapping[str, float | None]  # the most samples of a share (a member that fits one sample runs any share)
    holders: frozenset[str]  # devices that hold the training state now
    micro_caps: Mapping[str, float | None]  # the most samples trained at once beside the whole state

    def ranked(self, members: Sequence[str]) -> list[str]:
        return _ranked(self.previous, members)

    def balanced(self, members: Sequence[str]) -> Plan | None:
        members = self.ranked([m for m in members if (self.caps[m] or 0) >= 1])
        d = self.cluster.devices
        shares = assign([self.speeds[m] for m in members], [d[m].overhead_s + self.fixed[m] for m in members],
                        [self.caps[m] or 0.0 for m in members], self.limits.global_batch)
        if shares is None:
            return None
        kept = [(m, s) for m, s in zip(members, shares) if s > 0]
        return predict(self.cluster, self.graph, [m for m, _ in kept], [s for _, s in kept])

    def score(self, plan: Plan, description: str) -> Alternative:
        """Predicted step + the switch to it (forming the group, moving state to devices that do
        not hold it; nothing moves before any device holds state) spread over the horizon."""
        plan = micro_batched(plan, self.graph, self.micro_caps)
        moved = sum(m not in self.holders for m in plan.members) * self.graph.state_bytes if self.holders else 0
        switch = 0.0 if plan.same_assignment(self.previous) else self.cluster.switch_s() + self.cluster.move_s(moved)
        assert plan.predicted_step_s is not None
        return Alternative(description=description, plan=plan, moved_bytes=moved,
                           objective_s=plan.predicted_step_s + switch / self.limits.horizon_steps)


def _context(cluster: Cluster, graph: Graph, previous: Plan | None, limits: PlanLimits,
             holders: Collection[str] | None) -> _Ctx:
    speeds = cluster.speeds_for(graph.train_flops)
    micro_caps = {n: max_micro_batch(graph, d.memory_bytes, graph.optimizer_state_factor)
                  for n, d in cluster.devices.items()}
    # A replica that trains one sample at once beside its state runs any share, in micro-batches
    # (`micro_batched`): memory bounds the micro-batch, speed the share.
    caps = {n: float(limits.global_batch) if (c or 0) >= 1 else c for n, c in micro_caps.items()}
    held = (previous.members if previous else ()) if holders is None else holders
    holders = frozenset(m for m in held if m in cluster.devices)
    return _Ctx(cluster, graph, previous, limits, speeds, cluster.fixed_compute(), caps, holders, micro_caps)


def score_members(cluster: Cluster, graph: Graph, previous: Plan | None, members: Sequence[str], *,
                  limits: PlanLimits, holders: Collection[str] | None = None) -> Alternative | None:
    """`members` with balanced shares, scored as the planner scores its candidates (predicted step
    plus the amortised switch and migration cost); None if they cannot hold the batch. For checking
    the planner against an enumeration of every subset on small clusters."""
    ctx = _context(cluster, graph, previous, limits, holders)
    plan = ctx.balanced(members)
    if plan is None or len(plan.members) != len(members):
        return None
    return ctx.score(plan, "enumerated")


def make_plan(cluster: Cluster, graph: Graph | None, previous: Plan | None, *, limits: PlanLimits,
              holders: Collection[str] | None = None, pin: LayoutPin | None = None) -> PlanResult:
    """The best plan for `cluster` (see the module comment). `holders`: the devices that hold the
    training state (moving it elsewhere costs); default the previous plan's members. `pin`: layout
    degrees the operator fixed (`--layout`); the members are then cut to a number they divide, or,
    for a pipeline, to its stages."""
    if pin is not None and (pin.pp or 1) > 1:
        return _pipelined(cluster, graph, previous, pin, limits, holders)
    result = _make_plan(cluster, graph, previous, limits=limits, holders=holders)
    if graph is None:
        return _pinned(cluster, graph, result, pin, limits) if pin is not None and result.plan is not None else result
    ctx = _context(cluster, graph, previous, limits, holders)
    if pin is not None:
        if result.plan is None and pin.dp_shard != 1:
            # No replica fits, but the pin allows sharding: the members that can hold a shard.
            sharded = _sharded(ctx)
            if sharded is not None:
                result = replace(result, plan=sharded, status="optimal", reason="no replica fits")
        result = _pinned(cluster, graph, result, pin, limits) if result.plan is not None else result
    elif limits.policy != "even":
        result = _with_sharding(ctx, result)
    if result.plan is not None and result.plan.dp_shard == 1:  # a replica's share in micro-batches
        result = replace(result, plan=micro_batched(result.plan, graph, ctx.micro_caps))
    elif result.plan is not None:
        result = _least_moving(ctx, result)
    return result


def _least_moving(ctx: _Ctx, result: PlanResult) -> PlanResult:
    """A sharded plan whose members changed, in the rank order that moves the fewest bytes from
    what the holders hold (`plan.reshard.least_moving_order`: e.g. a 4th member placed between two
    holders moves a seventh less of the state than one appended), with those bytes as its
    `moved_bytes`. The members, their shares and the prediction are unchanged: only who holds
    which chunk."""
    plan, previous = result.plan, ctx.previous
    assert plan is not None
    if previous is None or (set(plan.members) == set(previous.members) and plan.dp_shard == previous.dp_shard):
        return result
    hosts = {n: d.host for n, d in ctx.cluster.devices.items()}
    order, fraction = least_moving_order(previous.layout, ctx.holders, plan.members, dp_shard=plan.dp_shard,
                                         hosts=hosts)
    return replace(result, plan=plan.reordered(order), moved_bytes=round(fraction * ctx.graph.state_bytes))


def _sharded(ctx: _Ctx) -> Plan | None:
    """The best fully sharded plan (FSDP2 over every member, a ring of copies): the most devices
    whose memory holds a member's shard, gathered unit and copy (fewer members hold bigger shards:
    the set is shrunk until it is stable), shares balanced within what fits beside that; None
    when fewer than two fit or they cannot hold the batch."""
    g, d = ctx.graph, ctx.cluster.devices
    members = sorted(d, key=lambda n: (-ctx.speeds[n], n))[: ctx.limits.max_workers or len(d)]
    while len(members) >= 2:
        static = sharded_static_bytes(g, len(members), optimizer_state_factor=g.optimizer_state_factor)
        caps = {n: samples_that_fit(d[n].memory_bytes, static, g.activation_bytes) for n in members}
        fit = [n for n in members if (caps[n] or 0) >= 1]
        if len(fit) == len(members):
            break
        members = fit
    if len(members) < 2:
        return None
    members = ctx.ranked(members)
    # A member runs its share in micro-batches of what fits beside its shard: memory bounds the
    # micro-batch, not the share.
    shares = assign([ctx.speeds[m] for m in members], [d[m].overhead_s + ctx.fixed[m] for m in members],
                    [float(ctx.limits.global_batch)] * len(members), ctx.limits.global_batch)
    if shares is None:
        return None
    return predict_sharded(ctx.cluster, g, members, shares, micro_sizes(shares, [caps[m] for m in members]))


def _hsdp(ctx: _Ctx) -> list[Plan]:
    """HSDP plans, one per shard degree S: R >= 2 replicas of S >= 2 members each, FSDP2 within a
    replica and each gradient shard summed across replicas. No ring of copies: every replica holds
    every shard, so any single failure loses nothing and a member needs no room for another's
    shard. The fastest devices that hold a shard beside one sample, as many whole replicas as
    they fill, shares balanced by speed."""
    g, d = ctx.graph, ctx.cluster.devices
    ranked = sorted(d, key=lambda n: (-ctx.speeds[n], n))[: ctx.limits.max_workers or len(d)]
    out: list[Plan] = []
    for shards in range(2, len(ranked) // 2 + 1):
        static = sharded_static_bytes(g, shards, copies=False, optimizer_state_factor=g.optimizer_state_factor)
        caps = {n: samples_that_fit(d[n].memory_bytes, static, g.activation_bytes) for n in ranked}
        fit = [n for n in ranked if (caps[n] or 0) >= 1]
        replicas = len(fit) // shards
        if replicas < 2:
            continue
        members = ctx.ranked(fit[: replicas * shards])
        shares = assign([ctx.speeds[m] for m in members], [d[m].overhead_s + ctx.fixed[m] for m in members],
                        [float(ctx.limits.global_batch)] * len(members), ctx.limits.global_batch)
        if shares is not None:
            out.append(predict_sharded(ctx.cluster, g, members, shares, micro_sizes(shares, [caps[m] for m in members]),
                                       replicas=replicas))
    return out


def _sharded_kind(plan: Plan) -> str:
    """How a sharded plan is named in reasons: "sharded over 3 members (FSDP2)" or "HSDP: 2 replicas
    of 2 shards"."""
    replicas = len(plan.members) // plan.dp_shard
    if replicas == 1:
        return f"sharded over {len(plan.members)} members (FSDP2)"
    return f"HSDP: {replicas} replicas of {plan.dp_shard} shards"


def _sharded_standby_reason(ctx: _Ctx, name: str, plan: Plan) -> str:
    replicas = len(plan.members) // plan.dp_shard
    g = ctx.graph
    static = sharded_static_bytes(g, plan.dp_shard, copies=replicas == 1, optimizer_state_factor=g.optimizer_state_factor)
    if (samples_that_fit(ctx.cluster.devices[name].memory_bytes, static, g.activation_bytes) or 0) < 1:
        return "its memory cannot hold a shard"
    if replicas > 1:
        return f"HSDP takes whole replicas of {plan.dp_shard}: it would start another"
    if ctx.limits.max_workers is not None and len(plan.members) >= ctx.limits.max_workers:
        return f"--max-workers {ctx.limits.max_workers}"
    return "left out of the sharded plan"


def _with_sharding(ctx: _Ctx, replicated: PlanResult) -> PlanResult:
    """The layout decision: the best sharded layout (fully sharded or HSDP, by the same objective)
    exactly when it is faster than the replicated plan by the cost model (by MIN_GAIN) or when no
    replicated plan fits; the reason says which, with the other as runner-up."""
    candidates = [ctx.score(p, _sharded_kind(p)) for p in (_sharded(ctx), *_hsdp(ctx))
                  if p is not None and p.predicted_step_s is not None]
    if not candidates:
        return replicated
    alt = min(candidates, key=lambda a: a.objective_s)
    sharded, kind = alt.plan, alt.description
    assert sharded.predicted_step_s is not None
    out = tuple(sorted(set(ctx.cluster.devices) - set(sharded.members)))
    out_why = tuple(_sharded_standby_reason(ctx, n, sharded) for n in out)
    copy_note = (" with a copy of another's shard" if len(sharded.members) == sharded.dp_shard
                 else " (the other replicas hold the copies)")
    state = ctx.graph.param_bytes * (2.0 + ctx.graph.optimizer_state_factor)
    if replicated.plan is None:
        biggest = max(dev.memory_bytes for dev in ctx.cluster.devices.values())
        why = (f"{kind}: no replica fits (parameters, gradients and optimizer state need {state / 2**20:.1f} MiB, "
               f"the largest device has {biggest / 2**20:.1f} MiB); each member holds "
               f"{max(c.memory_bytes for c in sharded.costs) / 2**20:.1f} MiB or less{copy_note} ({replicated.reason})")
        others = [a for a in candidates if a is not alt]
        runner = min(others, key=lambda a: a.objective_s) if others else None
        return PlanResult(plan=sharded, status="optimal", reason=why, objective_s=alt.objective_s, runner_up=runner,
                          standby=out, standby_why=out_why)
    assert replicated.objective_s is not None and replicated.plan.predicted_step_s is not None
    if replicated.plan.dp_shard > 1:  # the planner kept the current (sharded) plan: a new one must beat it
        if alt.objective_s < replicated.objective_s * (1 - MIN_GAIN) and not sharded.same_assignment(replicated.plan):
            return replace(replicated, plan=sharded, objective_s=alt.objective_s, reason=f"{kind}, re-balanced")
        return replicated
    if alt.objective_s < replicated.objective_s * (1 - MIN_GAIN):
        runner = Alternative(description="replicated", plan=replicated.plan, objective_s=replicated.objective_s,
                             moved_bytes=replicated.moved_bytes)
        why = (f"{kind}: predicted {sharded.predicted_step_s * 1e3:.1f} "
               f"against {replicated.plan.predicted_step_s * 1e3:.1f} ms/step replicated")
        return replace(replicated, plan=sharded, reason=why, objective_s=alt.objective_s, runner_up=runner,
                       standby=out, standby_why=out_why)
    return replace(replicated, reason=f"{replicated.reason}; replicated: {kind} "
                                      f"would take {sharded.predicted_step_s * 1e3:.1f} ms/step")


def _pinned(cluster: Cluster, graph: Graph | None, result: PlanResult, pin: LayoutPin, limits: PlanLimits) -> PlanResult:
    """`result` cut to the pinned degrees: the fastest members that fill replicas × shards, their
    shares re-balanced (a sharded member may have none: it still holds its shard)."""
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


def _pipelined(cluster: Cluster, graph: Graph | None, previous: Plan | None, pin: LayoutPin, limits: PlanLimits,
               holders: Collection[str] | None) -> PlanResult:
    """The pinned pipeline (`plan._pipeline_pin`) over the ready devices, every other one on standby;
    the current cut, re-predicted, when the new one gains less than MIN_GAIN of a step."""
    assert pin.pp is not None
    before = previous.layout if previous else None
    found = pipeline_plan(cluster, graph, _ranked(previous, list(cluster.devices)), before, pin.pp,
                          global_batch=limits.global_batch, pin=pin.describe())
    if isinstance(found, str):
        return PlanResult(plan=None, status="infeasible", reason=found)
    assert graph is not None and found.predicted_step_s is not None
    speeds = cluster.speeds_for(graph.train_flops)
    plan, why = found, f"layout pinned by --layout {pin.describe()}: {describe_pipeline(found, speeds)}"
    if (previous is not None and previous.pp == found.pp and set(previous.members) <= set(cluster.devices)
            and previous.global_batch == limits.global_batch and not found.same_assignment(previous)):
        current = repredict(cluster, graph, previous)
        assert current.predicted_step_s is not None
        if found.predicted_step_s > current.predicted_step_s * (1 - MIN_GAIN):
            plan, why = current, (f"layout pinned by --layout {pin.describe()}: kept the current cut "
                                  f"({describe_pipeline(current, speeds)}): the best other "
                                  f"({describe_pipeline(found, speeds)}) gains less than {MIN_GAIN:.0%} of a step")
    held = (previous.members if previous else ()) if holders is None else holders
    moved = moved_bytes(graph, before, [m for m in held if m in cluster.devices], plan)
    switch = 0.0 if plan.same_assignment(previous) else cluster.switch_s() + cluster.move_s(moved)
    assert plan.predicted_step_s is not None
    standby = tuple(sorted(set(cluster.devices) - set(plan.members)))
    return PlanResult(plan=plan, status="optimal", reason=why, moved_bytes=moved, standby=standby,
                      objective_s=plan.predicted_step_s + switch / limits.horizon_steps,
                      standby_why=("not in the pinned layout",) * len(standby))


def _ranked(previous: Plan | None, members: Sequence[str]) -> list[str]:
    """Rank order: members of the previous plan keep theirs, newcomers follow in name order."""
    before = list(previous.members) if previous else []
    return [m for m in before if m in members] + sorted(m for m in members if m not in before)


def _make_plan(cluster: Cluster, graph: Graph | None, previous: Plan | None, *, limits: PlanLimits,
               holders: Collection[str] | None = None) -> PlanResult:
    if not cluster.devices:
        return PlanResult(plan=None, status="infeasible", reason="no ready devices")
    if graph is None:
        return _by_speed(cluster, previous.members if previous else tuple(holders or ()), limits)
    ctx = _context(cluster, graph, previous, limits, holders)
    speeds = ctx.speeds
    usable = sorted((n for n in cluster.devices if (ctx.caps[n] or 0) >= 1), key=lambda n: (-speeds[n], n))
    if limits.policy == "even":
        return _even(ctx, usable)
    if not any(d.samples_per_s for d in cluster.devices.values()):
        return _uncalibrated(ctx, usable)

    solved: list[tuple[Alternative, str, str]] = []  # (scored plan, status, reason)
    infeasible: list[str] = []
    for scope in _scopes(cluster, usable, speeds):
        outcome = _solve(ctx, scope)
        if isinstance(outcome, str):
            infeasible.append(outcome)
        else:
            solved.append(outcome)
    if not solved:
        reason = infeasible[0] if infeasible else _nothing_fits(ctx)
        return PlanResult(plan=None, status="infeasible", reason=reason)

    best, status, reason = min(solved, key=lambda s: s[0].objective_s)
    keep = _keep_members(ctx, usable)
    alternatives = [a for a, _, _ in solved if a is not best] + _alternatives(ctx, usable, keep)
    for alt in alternatives:
        if alt.objective_s < best.objective_s - 1e-12:  # a plain plan beat the class-level solve
            best, reason = alt, f"{reason}; {alt.description} scored better"
    runner = _runner_up(best, alternatives)
    chosen, why = best, reason
    current = _current(ctx, keep)
    if (current is not None and not best.plan.same_assignment(current.plan)
            and best.objective_s > current.objective_s * (1 - MIN_GAIN)):
        chosen, runner = current, best
        why = (f"kept {current.description}: the best other plan ({_summary(best)}) gains less than "
               f"{MIN_GAIN:.0%} of a step")
    standby = tuple(sorted(set(cluster.devices) - set(chosen.plan.members)))
    reasons = tuple(_standby_reason(ctx, n, chosen, kept=chosen is not best) for n in standby)
    if standby:
        why += "; on standby: " + ", ".join(f"{n} ({r})" for n, r in zip(standby, reasons))
    return PlanResult(plan=chosen.plan, status=status, reason=why, objective_s=chosen.objective_s,
                      runner_up=runner, standby=standby, standby_why=reasons, moved_bytes=chosen.moved_bytes)


def _scopes(cluster: Cluster, usable: list[str], speeds: Mapping[str, float]) -> list[list[str]]:
    """Every usable device, and on a multi-host cluster each of the strongest hosts alone."""
    scopes = [usable]
    hosts: dict[str, list[str]] = {}
    for n in usable:
        hosts.setdefault(cluster.devices[n].host, []).append(n)
    if len(hosts) > 1:
        strongest = sorted(hosts.values(), key=lambda ns: -sum(speeds[n] for n in ns))
        scopes += strongest[:HOST_CANDIDATES]
    return scopes


def _solve(ctx: _Ctx, scope: list[str]) -> tuple[Alternative, str, str] | str:
    """The class-level solve over `scope`; returns the scored plan, or why nothing fits."""
    if not scope:
        return "no device can hold the model"
    g, cluster = ctx.graph, ctx.cluster
    groups = cluster.classes(ctx.speeds, ctx.caps, names=scope)
    classes = [DeviceClass(name=cname, available=len(ms),
                           samples_per_s=sum(ctx.speeds[m] for m in ms) / len(ms),
                           memory_bytes=min(cluster.devices[m].memory_bytes for m in ms)) for cname, ms in groups]
    # Every device in scope fits one sample beside its state, and runs a larger share as
    # micro-batches: memory bounds no share here (the activations per sample count as none).
    costs = replace(DpCosts.from_graph(g, cluster.link(scope), optimizer_state_factor=g.optimizer_state_factor),
                    activation_bytes_per_sample=0.0)
    previous_counts = ({cname: sum(m in ctx.holders for m in ms) for cname, ms in groups}
                       if ctx.holders else None)
    result = solve_dp(classes, costs, ctx.limits.global_batch, time_limit_s=ctx.limits.time_limit_s,
                      previous_counts=previous_counts,
                      migration_s_per_device=cluster.move_s(g.state_bytes),
                      horizon_steps=ctx.limits.horizon_steps, max_devices=ctx.limits.max_workers,
                      engine=ctx.limits.engine)
    if result.status == "infeasible":
        return result.reason
    order = {cname: ms for cname, ms in groups}  # fastest first within a class
    plan = ctx.balanced(map_to_devices(result.counts, order, ctx.ranked(list(ctx.holders))))
    if plan is None:
        return f"the solver's counts ({result.reason}) do not hold the batch per device"
    return ctx.score(plan, "the solver's plan"), result.status, result.reason


def _keep_members(ctx: _Ctx, usable: list[str]) -> Alternative | None:
    """The devices that hold the state now (up to max_workers), re-balanced."""
    cap = ctx.limits.max_workers or len(usable)
    kept = ctx.ranked([m for m in ctx.holders if m in usable])[:cap]
    p = ctx.balanced(kept) if kept else None
    return ctx.score(p, f"keeping the current {len(kept)} members, re-balanced") if p is not None else None


def _alternatives(ctx: _Ctx, usable: list[str], keep: Alternative | None) -> list[Alternative]:
    """Plain plans scored with the same cost model (`keep` first)."""
    cap = ctx.limits.max_workers or len(usable)
    out: list[Alternative] = [keep] if keep is not None else []
    kept = list(keep.plan.members) if keep is not None else []
    everyone = kept + [n for n in usable if n not in kept]
    if (p := ctx.balanced(everyone[:cap])) is not None:
        out.append(ctx.score(p, f"every usable device ({min(cap, len(everyone))})"))
    if len(usable) <= MAX_PREFIX_CANDIDATES:
        for r in range(1, min(cap, len(usable))):
            if (p := ctx.balanced(usable[:r])) is not None:
                out.append(ctx.score(p, f"the {r} fastest devices"))
    return out


def _current(ctx: _Ctx, keep: Alternative | None) -> Alternative | None:
    """What "not changing" means now: the current plan as it is when all its members are still
    here, else (after a failure or a leave) its surviving members re-balanced."""
    previous = ctx.previous
    if (previous is not None and previous.global_batch == ctx.limits.global_batch
            and set(previous.members) <= set(ctx.cluster.devices)):
        return ctx.score(repredict(ctx.cluster, ctx.graph, previous), "the current plan")
    return keep


def _runner_up(best: Alternative, alternatives: list[Alternative]) -> Alternative | None:
    others = [a for a in alternatives if set(a.plan.members) != set(best.plan.members)]
    if not others:
        others = [a for a in alternatives if not a.plan.same_assignment(best.plan)]
    return min(others, key=lambda a: a.objective_s) if others else None


def _summary(a: Alternative) -> str:
    return f"{a.description}: {len(a.plan.members)} devices, {a.plan.predicted_step_s:.4g} s/step"


def _standby_reason(ctx: _Ctx, name: str, chosen: Alternative, *, kept: bool) -> str:
    cap = ctx.caps[name]
    if cap is None:
        return "its memory cannot hold the model's state"
    if cap < 1:
        return "no room for one sample's activations"
    if ctx.limits.max_workers is not None and len(chosen.plan.members) >= ctx.limits.max_workers:
        return f"--max-workers {ctx.limits.max_workers}"
    if kept:
        return "the current members are kept: a plan with it gains less than 3% of a step"
    fixed = ctx.fixed.get(name, 0.0) + ctx.cluster.devices[name].overhead_s
    per_step = f" after {fixed * 1e3:.0f} ms per step whatever its share" if fixed >= 1e-3 else ""
    return f"too slow to pay for its part of the step's communication: {ctx.speeds[name]:.3g} samples/s{per_step}"


def _too_small(ctx: _Ctx, usable: list[str]) -> str:
    if not usable:
        return _nothing_fits(ctx)
    caps = {n: ctx.caps[n] or 0.0 for n in usable}
    total = sum(min(c, float(ctx.limits.global_batch)) for c in caps.values())
    each = "; ".join(f"{n}: {c:.0f} samples" for n, c in sorted(caps.items()))
    return (f"global batch {ctx.limits.global_batch} does not fit in memory; a global batch of at most "
            f"{total:.0f} would fit ({each})")


def _nothing_fits(ctx: _Ctx) -> str:
    static = static_bytes(ctx.graph.param_bytes, ctx.graph.optimizer_state_factor)
    parts = [f"{n}: {d.memory_bytes / 2**20:.1f} MiB" for n, d in sorted(ctx.cluster.devices.items())]
    return (f"no device can hold the model: parameters, gradients and optimizer state need "
            f"{static / 2**20:.1f} MiB plus {ctx.graph.activation_bytes / 2**10:.1f} KiB per sample "
            f"({'; '.join(parts)})")


def _uncalibrated(ctx: _Ctx, usable: list[str]) -> PlanResult:
    """Before any step is measured, FLOPs are all the cost model knows, and they can be off by
    orders of magnitude for small models (Python overhead, unformulated kernels): no device is
    left out on such a guess. Every usable device trains (up to max_workers), shares by calibrated
    FLOP/s within memory; the measured steps that follow re-plan with the real speeds."""
    plan = ctx.balanced(usable[: ctx.limits.max_workers or len(usable)])
    if plan is None:
        return PlanResult(plan=None, status="infeasible", reason=_too_small(ctx, usable))
    return PlanResult(plan=plan, status="heuristic", objective_s=plan.predicted_step_s,
                      reason=f"no step measured yet: every usable device ({len(plan.members)}), shares by "
                             "calibrated FLOP/s; re-planned once steps are measured")


def _even(ctx: _Ctx, usable: list[str]) -> PlanResult:
    keep = [m for m in (ctx.previous.members if ctx.previous else ()) if m in usable]
    members = (keep + [n for n in usable if n not in keep])[: ctx.limits.max_workers or len(usable)]
    shares = split_shares(ctx.limits.global_batch, [1.0] * len(members))
    if not members or any(s > (ctx.caps[m] or 0) for m, s in zip(members, shares)):
        return PlanResult(plan=None, status="infeasible", reason="an even split does not fit in memory")
    plan = predict(ctx.cluster, ctx.graph, members, shares)
    return PlanResult(plan=plan, status="even", reason=f"even split over {len(members)} devices (--planner even)",
                      objective_s=plan.predicted_step_s)


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
