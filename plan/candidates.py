"""Candidate layouts: every way of training the planner weighs, enumerated outside any solve. Pure.

`make_plan` (plan.planner) asks for the candidates over the ready devices, scores each one by the
same objective and takes the least; this module builds and scores them.

* Replicated data parallel: the class-level solve's plan (`plan._replicated`: its alternatives and
  runner-up are its own), one candidate.
* FSDP over k members (`dp_shard=k`, each member also keeping a copy of another's shard): k = the
  most devices whose memory holds a member's shard (fewer members hold bigger shards: the set is
  shrunk until it is stable), at most --max-workers.
* HSDP r x s (r >= 2 replicas of s >= 2 shards, no copies: the other replicas hold them): every
  shard degree s that fits, or at scale those worth trying (`_hsdp_degrees`: the fewest shards that
  fit, the fewest that use the most devices, powers of two; MAX_HSDP_DEGREES), each with as many
  whole replicas as the devices that hold its shard fill.
* FSDP and HSDP are built over every ready device (the fastest that fit), and again over the
  replicated plan's devices (its link scope: one host, say) and over the devices that hold the
  state (sharding them moves least), where those are other devices.
* Pipelines pp=P, P = 2 .. min(devices, units, --max-workers), when the model's units form a
  sequence (`Graph.sequential`; otherwise one row says why none can be cut): the P fastest devices
  cut into stages by `plan.pipeline.best_pipeline` (`plan._pipeline_pin`); and each depth as W
  pipelines (dp x pp), with each stage sharded over W (FSDP x pp) and, from W = 4, as 2 replicas of
  stages sharded over W / 2 (HSDP x pp: the replicas keep each other's state, no copies), for the
  widths W `_widths` gives (2, 4, ..., the widest the devices allow).
* A pin (`--layout`) of data-parallel degrees weighs the one shape it names over every ready
  device (`_pinned_shape`: a degree left free fills them, `dp=1` is FSDP over all, `fsdp=2` over 5
  is 2 replicas of 2; over fewer where memory leaves some out) in place of the FSDP and HSDP
  candidates, and the planner keeps the candidates it admits (`admitted`).

Invariants: a candidate's members are ready devices, at most --max-workers of them, each holding
what the layout gives it beside at least one sample (a larger share runs in micro-batches); one
that cannot run has no plan and says why (`Weighed.why_not`). Every plan is scored by `Ctx.score`:
predicted step + (forming the group + moving state to the devices that do not hold it) / horizon,
the bytes moved being whole replicas to newcomers when both layouts are replicated, else what the
reshard would send (`plan._pipeline_pin.moved_bytes`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plan._pipeline_pin import NOT_A_SEQUENCE, Cuts, moved_bytes, pipeline_plan
from plan.cluster import Cluster, kind_key
from plan.cost import max_micro_batch, samples_that_fit, sharded_static_bytes
from plan.graph import Graph
from plan.layout import Layout, LayoutPin
from plan.pipeline import step_floor
from plan.prediction import Plan, micro_batched, micro_sizes, predict, predict_sharded, stage_devices
from plan.shares import assign

if TYPE_CHECKING:
    from plan.planner import PlanLimits

MAX_HSDP_DEGREES = 6  # HSDP shard degrees weighed when more fit (1,024 devices: up to 511); up to 6, all
MAX_PIPELINE_WIDTHS = 4  # data-parallel widths of each pipeline depth weighed (dp x pp, FSDP x pp)


@dataclass(frozen=True, slots=True, kw_only=True)
class Alternative:
    """A plan the winner was compared with."""

    description: str
    plan: Plan
    objective_s: float  # predicted step + amortised switch and migration cost
    moved_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One layout the planner weighed, as `ctl plan --explain` lists it."""

    layout: str  # its degrees: "dp_replicate=3", "dp_shard=5", "dp_replicate=2 x dp_shard=2", "pp=2"
    description: str = ""  # which plan of that layout: "the solver's plan", "the 3 fastest devices", ...
    members: tuple[str, ...] = ()
    predicted_step_s: float | None = None
    objective_s: float | None = None  # predicted step + amortised switch and migration cost
    moved_bytes: int = 0
    why_not: str = ""  # why no prediction: memory, too few devices, a model that cannot be cut, a bound
    chosen: bool = False


@dataclass(frozen=True, slots=True)
class Weighed:
    """A candidate as the planner handles it: its degrees (pp, replicas, shards; replicas None when
    unknown), its scored plan, or why it has none."""

    layout: str
    shape: tuple[int, int | None, int]
    scored: Alternative | None = None
    why_not: str = ""
    unscored: Alternative | None = None  # predicted, not scored (its step alone lost: `why_not` says so)

    def row(self, *, chosen: bool = False) -> Candidate:
        a = self.scored
        if a is None:
            u = self.unscored
            return Candidate(layout=self.layout, why_not=self.why_not, description=u.description if u else "",
                             members=u.plan.members if u else (), predicted_step_s=u.plan.predicted_step_s if u else None)
        return Candidate(layout=self.layout, description=a.description, members=a.plan.members,
                         predicted_step_s=a.plan.predicted_step_s, objective_s=a.objective_s,
                         moved_bytes=a.moved_bytes, chosen=chosen)


# --- the context every candidate is built and scored in -------------------------------------------


@dataclass(frozen=True, slots=True)
class Ctx:
    cluster: Cluster
    graph: Graph
    previous: Plan | None
    limits: PlanLimits
    speeds: Mapping[str, float]
    fixed: Mapping[str, float]  # compute per step that does not grow with the share
    caps: Mapping[str, float | None]  # the most samples of a share (a member that fits one sample runs any share)
    holders: frozenset[str]  # devices that hold the training state now
    micro_caps: Mapping[str, float | None]  # the most samples trained at once beside the whole state
    before: Layout | None  # the previous plan's layout (built once: a thousand members take milliseconds)

    def ranked(self, members: Sequence[str]) -> list[str]:
        return ranked(self.previous, members)

    def fastest(self) -> list[str]:
        """Every ready device, fastest first (ties by name)."""
        return sorted(self.cluster.devices, key=lambda n: (-self.speeds[n], n))

    def balanced(self, members: Sequence[str]) -> Plan | None:
        """`members` that hold a replica, replicated, shares balanced by speed and overhead."""
        members = self.ranked([m for m in members if (self.caps[m] or 0) >= 1])
        shares = self.shares_for(members, [self.caps[m] or 0.0 for m in members])
        if shares is None:
            return None
        kept = [(m, s) for m, s in zip(members, shares) if s > 0]
        return predict(self.cluster, self.graph, [m for m, _ in kept], [s for _, s in kept])

    def shares_for(self, members: Sequence[str], caps: Sequence[float]) -> list[int] | None:
        d = self.cluster.devices
        return assign([self.speeds[m] for m in members], [d[m].overhead_s + self.fixed[m] for m in members],
                      caps, self.limits.global_batch)

    def moved(self, plan: Plan) -> int:
        """State bytes the switch to `plan` sends: to each newcomer a whole replica when both
        layouts are replicated, else what the reshard moves; nothing before anyone holds state."""
        if not self.holders:
            return 0
        before = self.before
        if whole(plan) and (before is None or before.whole_replicas):
            return sum(m not in self.holders for m in plan.members) * self.graph.state_bytes
        if before is None:  # holders without a plan (survivors waiting): whole replicas
            held = sorted(self.holders)
            before = Layout.replicated(held, [1] * len(held))
        return moved_bytes(self.graph, before, self.holders, plan)

    def score(self, plan: Plan, description: str) -> Alternative:
        """Predicted step + the switch to it (forming the group, moving state to devices that do
        not hold it) spread over the horizon."""
        plan = micro_batched(plan, self.graph, self.micro_caps)
        moved = self.moved(plan)
        switch = 0.0 if plan.same_assignment(self.previous) else self.cluster.switch_s() + self.cluster.move_s(moved)
        assert plan.predicted_step_s is not None
        return Alternative(description=description, plan=plan, moved_bytes=moved,
                           objective_s=plan.predicted_step_s + switch / self.limits.horizon_steps)


def whole(plan: Plan) -> bool:
    """`plan.layout.whole_replicas` without building the layout (every member a replica)."""
    return plan.pp == 1 and plan.dp_shard == 1 and plan.tp == 1


def context(cluster: Cluster, graph: Graph, previous: Plan | None, limits: PlanLimits,
            holders: Collection[str] | None) -> Ctx:
    speeds = cluster.speeds_for(graph.train_flops)
    micro_caps = {n: max_micro_batch(graph, d.memory_bytes, graph.optimizer_state_factor)
                  for n, d in cluster.devices.items()}
    # A replica that trains one sample at once beside its state runs any share, in micro-batches
    # (`micro_batched`): memory bounds the micro-batch, speed the share.
    caps = {n: float(limits.global_batch) if (c or 0) >= 1 else c for n, c in micro_caps.items()}
    held = (previous.members if previous else ()) if holders is None else holders
    return Ctx(cluster, graph, previous, limits, speeds, cluster.fixed_compute(), caps,
               frozenset(m for m in held if m in cluster.devices), micro_caps,
               previous.layout if previous is not None else None)


def ranked(previous: Plan | None, members: Sequence[str]) -> list[str]:
    """Rank order: members of the previous plan keep theirs, newcomers follow in name order."""
    before = list(previous.members) if previous else []
    wanted, had = set(members), set(before)
    return [m for m in before if m in wanted] + sorted(m for m in members if m not in had)


# --- names -------------------------------------------------------------------------------------------


def describe(plan: Plan) -> str:
    """`plan.layout.describe()` without building the layout."""
    if plan.tp > 1:
        return plan.layout.describe()
    return shape_text(len(plan.members) // (plan.pp * plan.dp_shard), plan.dp_shard, plan.pp)


def shape_text(replicas: int | None, shards: int, pp: int = 1) -> str:
    """A shape's degrees as `Layout.describe` writes them ("dp_replicate" alone: any count)."""
    if replicas is None:
        return "dp_replicate"
    parts = [f"{dim}={n}" for dim, n in (("pp", pp), ("dp_replicate", replicas), ("dp_shard", shards)) if n > 1]
    return " x ".join(parts) if parts else "1 member"


def kind(plan: Plan) -> str:
    """How a plan's layout is named in reasons: "sharded over 3 members (FSDP2)", "HSDP: 2 replicas
    of 2 shards", "a pipeline of 3 stages", "replicated over 3 members"."""
    n = len(plan.members)
    if plan.tp > 1:
        replicas = n // (plan.tp * plan.pp * plan.dp_shard)
        what = (f"a pipeline of {plan.pp} stages, each split over {plan.tp} members (tensor parallel)" if plan.pp > 1
                else f"tensor parallel over {plan.tp} members")
        if plan.dp_shard > 1:
            what += f", each member's part sharded over {plan.dp_shard} (FSDP2)"
        return what + (f", {replicas} replicas" if replicas > 1 else "")
    if plan.pp > 1:
        return f"a pipeline of {plan.pp} stages"
    if plan.dp_shard > 1:
        replicas = n // plan.dp_shard
        return f"sharded over {n} members (FSDP2)" if replicas == 1 else f"HSDP: {replicas} replicas of {plan.dp_shard} shards"
    return f"replicated over {n} member{'s' if n != 1 else ''}"


def admitted(pin: LayoutPin | None, shape: tuple[int, int | None, int]) -> bool:
    """Whether `pin` admits a layout of this shape (pp, replicas, shards; replicas None: any count):
    `LayoutPin.admits`, and a pin of data-parallel degrees admits no pipeline (as a pipeline pin fixes
    them at 1: pp goes alone for now, and `--layout dp=1` means sharded over the members)."""
    if pin is None:
        return True
    pp, replicas, shards = shape
    if pp > 1 and pin.pp is None and (pin.dp_replicate is not None or pin.dp_shard is not None):
        return False
    if replicas is None:
        replicas = pin.dp_replicate or 1
    stages = tuple((str(s),) for s in range(pp)) if pp > 1 else ()
    size = pp * replicas * shards
    stand_in = Layout(members=tuple(str(i) for i in range(size)), shares=(1,) * size, dp_replicate=replicas,
                      dp_shard=shards, pp=pp, stages=stages)
    return pin.admits(stand_in)


# --- sharded: FSDP and HSDP ----------------------------------------------------------------------------


def sharded(ctx: Ctx, *, pin: LayoutPin | None, same_as: Sequence[str] = (), above: float = math.inf) -> list[Weighed]:
    """The FSDP and HSDP candidates (module comment) over every ready device, and, where they are
    other devices, over `same_as` (the replicated plan's: its link scope) and over the devices that
    hold the state (sharding them moves least). One whose predicted step is no less than `above`
    (the best objective found) is not scored: its objective would be more."""
    fastest = ctx.fastest()
    pools = [("", fastest)]
    for note, names in ((" of the replicated plan's devices", set(same_as)),
                        (" of the devices that hold the state", set(ctx.holders))):
        # (a pool within a twentieth of one already weighed, as 1,021 holders of 1,022 devices, adds
        # candidates that differ by a device or so: not weighed again)
        if len(names) >= 2 and all(len(names ^ {*pool}) > len(pool) // 20 for _, pool in pools):
            pools.append((note, [n for n in fastest if n in names]))
    cap = ctx.limits.max_workers
    out: list[Weighed] = []
    seen: set[tuple[int, int, frozenset[str]]] = set()
    for note, pool in pools:
        n = min(len(pool), cap or len(pool))
        most = _most_sharded(ctx, pool)
        shapes = [(1, most)] if most >= 2 else [(1, max(n, 2))] if not note else []  # (one that cannot run says why)
        shapes += [(r, s) for s, r in _hsdp_degrees(ctx, pool)]
        pinned = _pinned_shape(pin, n) if pin is not None else None
        if isinstance(pinned, str):
            assert pin is not None
            if not note:
                out.append(Weighed(pin.describe(), (1, pin.dp_replicate, pin.dp_shard or 1),
                                   why_not=f"--layout {pin.describe()} {pinned}"))
        elif pinned is not None:
            assert pin is not None
            if note:  # a pin's shape fills every ready device (`--layout dp=1`: FSDP over all of them)
                continue
            out.append(_pinned_weighed(ctx, pool, pin, pinned))
            continue
        for shape in dict.fromkeys(shapes):
            if not admitted(pin, (1, *shape)):
                continue
            weighed = _shaped(ctx, pool, *shape, what=shape_text(*shape), note=note, above=above)
            if weighed.scored is not None:
                above = min(above, weighed.scored.objective_s)
            key = (*shape, frozenset(weighed.scored.plan.members if weighed.scored else ()))
            if key not in seen and (weighed.scored is not None or not note):
                seen.add(key)
                out.append(weighed)
    return out


def _most_sharded(ctx: Ctx, pool: list[str]) -> int:
    """The most members (at most --max-workers) of `pool` whose memory holds a member's shard of
    FSDP over that many (0: not 2)."""
    g, d = ctx.graph, ctx.cluster.devices
    members, cap = pool, ctx.limits.max_workers or len(pool)
    while (k := min(len(members), cap)) >= 2:
        static = sharded_static_bytes(g, k, optimizer_state_factor=g.optimizer_state_factor)
        fit = [n for n in members if (samples_that_fit(d[n].memory_bytes, static, g.activation_bytes) or 0) >= 1]
        if len(fit) >= k:
            return k
        members = fit
    return 0


def _hsdp_degrees(ctx: Ctx, pool: list[str]) -> list[tuple[int, int]]:
    """(shards, replicas) of the HSDP layouts worth trying over `pool`: every shard degree when
    there are at most MAX_HSDP_DEGREES, else the fewest shards that fit (the least gathered per
    member), the fewest that use the most devices, and powers of two. Replicas: as many whole ones
    as the devices that hold the shard fill (at least 2; at most --max-workers members)."""
    g = ctx.graph
    cap = ctx.limits.max_workers or len(pool)
    memories = sorted(ctx.cluster.devices[n].memory_bytes for n in pool)
    used: dict[int, int] = {}
    for s in range(2, min(len(pool), cap) // 2 + 1):
        static = sharded_static_bytes(g, s, copies=False, optimizer_state_factor=g.optimizer_state_factor)
        fit = len(memories) - bisect.bisect_left(memories, static + max(g.activation_bytes, 0))
        if min(fit, cap) // s >= 2:
            used[s] = min(fit, cap) // s
    if len(used) > MAX_HSDP_DEGREES:
        first = min(used)
        widest = min(used, key=lambda s: (-used[s] * s, s))
        powers = [s for s in used if s & (s - 1) == 0 and s > first]
        keep = set(list(dict.fromkeys([first, widest, *powers]))[:MAX_HSDP_DEGREES])
        used = {s: r for s, r in used.items() if s in keep}
    return sorted(used.items())


def _pinned_shape(pin: LayoutPin, n: int) -> tuple[int, int] | str | None:
    """The (replicas, shards) a pin of data-parallel degrees names over `n` devices (a degree left
    free fills them: `fsdp=2` over 5 is 2 replicas of 2), why it cannot be met, or None: it pins
    none (a pipeline, or tp alone)."""
    replicas, shards = pin.dp_replicate, pin.dp_shard
    if (pin.pp or 1) > 1 or (replicas is None and shards is None):
        return None
    if replicas is not None and shards is not None:
        size = replicas * shards
    elif replicas is not None:
        size = replicas * (n // replicas)
    else:
        assert shards is not None
        size = shards * (n // shards)
    if size < 1 or size > n:
        return f"needs {max(size, replicas or shards or 1)} members; {n} can train now"
    return (replicas if replicas is not None else size // (shards or 1),
            shards if shards is not None else size // (replicas or size))


def _pinned_weighed(ctx: Ctx, pool: list[str], pin: LayoutPin, pinned: tuple[int, int]) -> Weighed:
    """The pinned shape over `pool`; where a degree left free cannot fill every device for memory,
    over the most devices that hold a member's part (the free degree shrinks until it is stable)."""
    what = f"--layout {pin.describe()}"
    first = weighed = _shaped(ctx, pool, *pinned, what=what)
    shape = pinned
    for _ in range(8):  # (each round fits fewer devices; a few rounds settle it)
        if weighed.scored is not None or (pin.dp_replicate is not None and pin.dp_shard is not None):
            break
        fit = _fitting(ctx, pool, *shape)
        smaller = _pinned_shape(pin, fit) if fit < shape[0] * shape[1] else None
        if not isinstance(smaller, tuple) or smaller == shape:
            break
        shape = smaller
        weighed = _shaped(ctx, pool, *shape, what=what)
    return weighed if weighed.scored is not None else first


def _fitting(ctx: Ctx, pool: list[str], replicas: int, shards: int) -> int:
    """How many devices of `pool` hold what `replicas` x `shards` gives a member beside one sample."""
    if shards == 1:
        return sum((ctx.caps[m] or 0) >= 1 for m in pool)
    g, d = ctx.graph, ctx.cluster.devices
    static = sharded_static_bytes(g, shards, copies=replicas == 1, optimizer_state_factor=g.optimizer_state_factor)
    return sum((samples_that_fit(d[m].memory_bytes, static, g.activation_bytes) or 0) >= 1 for m in pool)


def _shaped(ctx: Ctx, pool: list[str], replicas: int, shards: int, *, what: str, note: str = "",
            above: float = math.inf) -> Weighed:
    """`replicas` x `shards` over the fastest devices of `pool` that hold what it gives a member,
    shares balanced by speed; or why it cannot run (`what` opens the reason; `note` ends the
    description)."""
    g, d = ctx.graph, ctx.cluster.devices
    size, shape = replicas * shards, (1, replicas, shards)
    layout = shape_text(replicas, shards)
    cap = ctx.limits.max_workers
    if cap is not None and size > cap:
        return Weighed(layout, shape, why_not=f"{what} needs {size} members, but --max-workers is {cap}")
    if size > len(pool):
        return Weighed(layout, shape, why_not=f"{what} needs {size} members; {len(pool)} can train now")
    if shards == 1:  # replicated: each member holds the whole state
        usable = [m for m in pool if (ctx.caps[m] or 0) >= 1]
        plan = ctx.balanced(usable[:size]) if len(usable) >= size else None
        if plan is None or len(plan.members) != size:
            return Weighed(layout, shape, why_not=f"{what} needs {size} members that each hold a replica beside "
                                                  f"one sample; {len(usable)} do")
        return Weighed(layout, shape, ctx.score(plan, f"the {size} fastest devices{note}"))
    static = sharded_static_bytes(g, shards, copies=replicas == 1, optimizer_state_factor=g.optimizer_state_factor)
    caps = {n: samples_that_fit(d[n].memory_bytes, static, g.activation_bytes) for n in pool}
    fit = [n for n in pool if (caps[n] or 0) >= 1]
    if len(fit) < size:
        short = [n for n in pool[:size] if (caps[n] or 0) < 1]
        return Weighed(layout, shape, why_not=(
            f"{what} does not fit: a member needs {static / 2**20:.1f} MiB for its shard"
            f"{' and a copy of another' if replicas == 1 else ''} plus {g.activation_bytes / 2**10:.1f} KiB per "
            f"sample; {', '.join(f'{m} has {d[m].memory_bytes / 2**20:.1f} MiB' for m in short)}"))
    members = ctx.ranked(fit[:size])
    # A member runs its share in micro-batches of what fits beside its shard: memory bounds the
    # micro-batch, not the share.
    shares = ctx.shares_for(members, [float(ctx.limits.global_batch)] * size)
    assert shares is not None, "uncapped shares always hold the batch"
    plan = predict_sharded(ctx.cluster, g, members, shares, micro_sizes(shares, [caps[m] for m in members]),
                           replicas=replicas)
    if (lost := _loses(plan, above)):
        return Weighed(layout, shape, why_not=lost, unscored=Alternative(description=kind(plan) + note, plan=plan,
                                                                         objective_s=plan.predicted_step_s or 0.0,
                                                                         moved_bytes=0))
    return Weighed(layout, shape, ctx.score(plan, kind(plan) + note))


def _loses(plan: Plan, above: float) -> str:
    """Why `plan` is not scored, or "": its predicted step alone is no less than `above`, the best
    objective found, so its objective (the step and more) would be too; scoring it would weigh a
    reshard of every member."""
    step = plan.predicted_step_s
    if step is None or step < above:
        return ""
    return f"predicts {step * 1e3:.1f} ms a step, no less than the best found ({above * 1e3:.1f} ms)"


# --- pipelines ---------------------------------------------------------------------------------------


def pipelines(ctx: Ctx, *, pin: LayoutPin | None, unless: str = "", above: float = math.inf) -> list[Weighed]:
    """The pipeline candidates (module comment): the pinned shape, or every depth worth weighing,
    alone and as dp x pp, FSDP x pp and HSDP x pp of the widths `_widths` gives; `unless`: why none is weighed
    now (each says so). A shape whose floor (`step_floor` on its fastest devices with one
    pipeline's samples: no cut of its devices is faster) is not below `above`, the best objective
    found, is not cut."""
    g = ctx.graph
    shapes: list[tuple[int, int, int]]
    if pin is not None and pin.pp is not None and pin.pp > 1:
        shapes, what = [(pin.pp, pin.dp_replicate or 1, pin.dp_shard or 1)], f"--layout {pin.describe()}"
    else:
        if not g.sequential:
            return [Weighed("pp", (2, 1, 1), why_not=NOT_A_SEQUENCE)]
        devices = min(len(ctx.cluster.devices), ctx.limits.max_workers or len(ctx.cluster.devices))
        most = min(devices, len(g.layers))
        shapes, what = [(p, 1, 1) for p in range(2, max(most, 2) + 1)], ""
        for p in range(2, most + 1):
            for w in _widths(devices // p):
                shapes += [(p, w, 1), (p, 1, w)] + ([(p, 2, w // 2)] if w >= 4 else [])
    names = ctx.ranked(list(ctx.cluster.devices))  # (pipeline_plan takes the fastest of them)
    rank = {m: i for i, m in enumerate(names)}
    by_speed = sorted(names, key=lambda m: (-ctx.speeds[m], rank[m]))  # (as pipeline_plan takes them)
    out = []
    cuts: Cuts = {}
    for shape in shapes:
        p, replicas, shards = shape
        name = shape_text(replicas, shards, p)
        if not admitted(pin, shape):
            continue
        if unless:
            out.append(Weighed(name, shape, why_not=unless))
            continue
        if not what and p * replicas * shards <= len(names) and above < math.inf:
            width = replicas * shards
            samples = -(-ctx.limits.global_batch // width)  # (one pipeline's share)
            # (each stage's devices are the next `width` by speed, and the cut is for their slowest)
            slowest = [by_speed[(i + 1) * width - 1] for i in range(p)]
            floor = step_floor(g, stage_devices(ctx.cluster, g, slowest, kind_key(p, shards)), samples)
            if floor >= above:
                out.append(Weighed(name, shape, why_not=(
                    f"not cut: on its {p * width} fastest devices no cut takes less than {floor * 1e3:.1f} ms a step (their "
                    f"compute of {samples} samples' micro-batches at best spread), no less than the best found "
                    f"({above * 1e3:.1f} ms)")))
                continue
        found = pipeline_plan(ctx.cluster, g, names, ctx.before, p, global_batch=ctx.limits.global_batch,
                              what=what or name, replicas=replicas, shards=shards, cuts=cuts)
        if isinstance(found, str):
            out.append(Weighed(name, shape, why_not=found))
        elif not what and (lost := _loses(found, above)):
            out.append(Weighed(name, shape, why_not=lost))
        else:
            scored = ctx.score(found, kind(found))
            out.append(Weighed(name, shape, scored))
            above = min(above, scored.objective_s)
    return out


def _widths(most: int) -> list[int]:
    """The data-parallel widths of pipelines weighed (replicas, or shards per stage): 2 and 4, the
    powers of two between, and `most` (the widest the devices allow), at most MAX_PIPELINE_WIDTHS."""
    if most < 2:
        return []
    powers = [w for w in (2 ** k for k in range(1, most.bit_length())) if w <= most]
    return sorted(set(powers[:MAX_PIPELINE_WIDTHS - 1] + [most]))
