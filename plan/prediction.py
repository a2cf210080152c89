"""A plan's predicted step: one assignment of shares to devices, scored by the cost model.

`Plan` is what the coordinator ships (members in rank order, their shares, the layout's degrees and
pipeline stages) plus the prediction behind it (per member compute, overhead, waiting and memory;
the all-reduce). `predict` fills it in from the cluster's fitted estimates for data parallelism,
`pipelined` for a pipeline (`plan.pipeline`). Pure functions of plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from plan.cluster import Cluster, kind_key
from plan.cost import allreduce_s, memory_bytes, sharded_static_bytes, static_bytes, step_comm_s
from plan.graph import Graph
from plan.layout import Layout
from plan.pipeline import PipelinePlan, StageDevice, micro_split, time_pipeline


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberCost:
    """One member's part of a predicted step (seconds, bytes)."""

    name: str
    samples: int
    speed: float  # samples/s the plan assumes
    compute_s: float
    overhead_s: float
    wait_s: float
    memory_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A layout: `members` in rank order and each one's samples per global batch, with the cost
    model's prediction (None where it could not predict). Data parallel (replicas, shards), or a
    pipeline: with pp = P (alone, for now) rank r holds stage r, `stages[r]`, and every member computes
    on the whole batch, so each share is the global batch."""

    members: tuple[str, ...]
    shares: tuple[int, ...]
    predicted_step_s: float | None = None
    comm_s: float | None = None
    costs: tuple[MemberCost, ...] = ()
    mode: str = "sync"
    dp_shard: int = 1  # members that split the state between them (1: every member a replica)
    micro: tuple[int, ...] = ()  # per member: samples per forward (0 or absent: the whole share at once)
    pp: int = 1  # pipeline stages
    stages: tuple[tuple[str, ...], ...] = ()  # graph units per pipeline stage, in order (() when pp = 1)
    tp: int = 1  # members that split the model's Linears between them (tensor parallel)

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.shares), "one share per member"
        assert len(set(self.members)) == len(self.members), "members are unique"
        assert all(s >= 0 for s in self.shares), "shares are non-negative"

    @property
    def global_batch(self) -> int:
        """The samples of a step: one share per data-parallel slot (the stages of a pipeline share theirs)."""
        return self.layout.global_batch

    @property
    def layout(self) -> Layout:
        return Layout(members=self.members, shares=self.shares, pp=self.pp, stages=self.stages, tp=self.tp,
                      dp_replicate=len(self.members) // (self.dp_shard * self.pp * self.tp), dp_shard=self.dp_shard)

    def reordered(self, members: Sequence[str]) -> Plan:
        """The same plan with its members in rank order `members` (each keeps its share, cost and
        micro-batch)."""
        assert sorted(members) == sorted(self.members), "a reorder of the same members"
        at = [self.members.index(m) for m in members]
        by_name = {c.name: c for c in self.costs}
        return replace(self, members=tuple(members), shares=tuple(self.shares[i] for i in at),
                       costs=tuple(by_name[m] for m in members if m in by_name),
                       micro=tuple(self.micro[i] for i in at) if self.micro else ())

    def same_assignment(self, other: Plan | None) -> bool:
        return other is not None and (self.members, self.shares, self.dp_shard, self.pp, self.stages, self.micro,
                                      self.tp) == (other.members, other.shares, other.dp_shard, other.pp,
                                                   other.stages, other.micro, other.tp)


def predict(cluster: Cluster, graph: Graph | None, members: Sequence[str], shares: Sequence[int]) -> Plan:
    """The plan `members`/`shares` with the cost model's prediction of its step (replicated data
    parallel, on the cluster `calibrated` for it, unless the caller calibrated it for its layout)."""
    cluster = cluster.calibrated(kind_key())
    speeds = cluster.speeds_for(graph.train_flops if graph else 0.0)
    fixed = cluster.fixed_compute()
    overheads = [cluster.devices[name].overhead_s for name in members]
    computes = [fixed[name] + share / speeds[name] if share > 0 else 0.0 for name, share in zip(members, shares)]
    busiest = max((c + o for c, o in zip(computes, overheads)), default=0.0)
    comm = None if graph is None else allreduce_s(graph.param_bytes, len(members), cluster.link(members))
    # (memory_bytes(graph, share), its parts taken once: a thousand members sum the layers once)
    static = 0.0 if graph is None else static_bytes(graph.param_bytes, graph.optimizer_state_factor)
    per_sample = 0.0 if graph is None else graph.activation_bytes
    costs = tuple(MemberCost(name=name, samples=share, speed=speeds[name], compute_s=compute, overhead_s=overhead,
                             wait_s=busiest - compute - overhead,
                             memory_bytes=0.0 if graph is None else static + per_sample * share)
                  for name, share, compute, overhead in zip(members, shares, computes, overheads))
    return Plan(members=tuple(members), shares=tuple(shares),
                predicted_step_s=None if comm is None else busiest + comm, comm_s=comm, costs=costs)


def predict_sharded(cluster: Cluster, graph: Graph, members: Sequence[str], shares: Sequence[int],
                    micro: Sequence[int] = (), *, replicas: int = 1) -> Plan:
    """`members` sharding the state between them (FSDP2, a ring of copies), or, with `replicas` > 1,
    HSDP: that many rows, each sharding the state (no copies: the rows hold every shard), with their
    shares (run as micro-batches of `micro` samples where given): the compute of `predict`, the
    step's communication, and each member's memory (its shard, plus one micro-batch's activations)."""
    cluster = cluster.calibrated(kind_key(dp_shard=2))
    base = predict(cluster, graph, members, shares)
    n = len(members)
    if replicas < 1 or n % replicas:
        raise ValueError(f"{n} members do not split into {replicas} replicas")
    shards = n // replicas
    link = cluster.link(members)
    comm = step_comm_s(graph, n, shards, link)
    static = sharded_static_bytes(graph, shards, copies=replicas == 1, optimizer_state_factor=graph.optimizer_state_factor)
    busiest = max((c.compute_s + c.overhead_s for c in base.costs), default=0.0)
    micro = tuple(micro) or (0,) * n
    per_sample = graph.activation_bytes
    costs = tuple(MemberCost(name=c.name, samples=c.samples, speed=c.speed, compute_s=c.compute_s,
                             overhead_s=c.overhead_s, wait_s=c.wait_s, memory_bytes=static + per_sample * (m or c.samples))
                  for c, m in zip(base.costs, micro))
    return replace(base, predicted_step_s=busiest + comm, comm_s=comm, costs=costs, dp_shard=shards,
                   micro=micro if any(micro) else ())


# A pass's fixed cost (kernel launches, Python), in samples' worth of compute, until a device's is
# measured (`Cluster.fixed_compute`, fitted from steps of different shares, which a pipeline, every
# member on the whole batch, never has). Without one, 1-sample micro-batches look free of overhead and
# win. Measured on a 2-core CPU for the test GPT (job_short): a forward and backward costs 8-17 ms
# beside 5.6 ms per sample.
FIXED_PRIOR_SAMPLES = 2.0


def stage_devices(cluster: Cluster, graph: Graph, members: Sequence[str], kind: str = "pp") -> list[StageDevice]:
    """`members` as pipeline stage devices: each one's speed on the whole model (a stage takes its
    units' share of it), memory, and fixed compute per forward and backward, paid per micro-batch;
    on the cluster `calibrated` for the layout `kind` (unless the caller calibrated it)."""
    cluster = cluster.calibrated(kind)
    speeds = cluster.speeds_for(graph.train_flops)
    fixed = cluster.fixed_compute()
    return [StageDevice(name=m, samples_per_s=speeds[m], memory_bytes=cluster.devices[m].memory_bytes,
                        fixed_s=fixed[m] if fixed[m] > 0 else FIXED_PRIOR_SAMPLES / speeds[m]) for m in members]


def pipelined(cluster: Cluster, graph: Graph, pipeline: PipelinePlan,
              replicas: Sequence[Sequence[str]] = (), shares: Sequence[int] = (), shards: int = 1) -> Plan:
    """The plan of `pipeline`: its devices in rank order (rank r holds stage r), every member on the
    whole batch in the pipeline's micro-batches. A member's compute is its stage's over the step, then
    its overhead (the optimizer step and gradient copies: its units' share of the parameters, of
    what its device measured per step, as data parallelism counts it whole); it waits the rest (the
    bubble, its boundary sends). The step ends with the last overhead.

    Replicated pipelines (dp x pp): `replicas[s]` are stage s's devices, one per pipeline, and
    `shares[r]` pipeline r's samples; `pipeline` is the cut on each stage's slowest device for the
    largest share (every pipeline waits for the slowest at the step's end), and each stage's
    gradients are all-reduced over its replicas before the step ends. Members are in mesh order:
    stage-major, rank s·R + r. `shards` > 1 (FSDP x pp): `replicas[s]` are stage s's devices in
    (replica, shard) order, each stage's state split over its shards, which gather its units'
    parameters in every micro-batch's forward and backward and reduce-scatter their gradients (the
    sharded step's communication, at the stage's share of the parameters, once per micro-batch, on
    top of the pipeline's step: an upper bound where it overlaps the compute)."""
    samples, p = sum(pipeline.micro), len(pipeline.devices)
    groups = [list(g) for g in replicas] or [[d] for d in pipeline.devices]
    slots = list(shares) or [samples]
    speeds = cluster.speeds_for(graph.train_flops)
    params = {layer.name: layer.param_bytes for layer in graph.layers}
    whole = sum(params.values()) or 1
    stage_bytes = [sum(params[u] for u in stage) for stage in pipeline.stages]
    if shards > 1:
        m = len(pipeline.micro)
        sums = [m * step_comm_s(graph, len(g), shards, cluster.link(g)) * b / whole for b, g in zip(stage_bytes, groups)]
    else:
        sums = [allreduce_s(b, len(g), cluster.link(g)) for b, g in zip(stage_bytes, groups)]
    overheads = [[cluster.devices[m].overhead_s * b / whole for m in g] for b, g in zip(stage_bytes, groups)]
    step = pipeline.step_s + max(s + max(o) for s, o in zip(sums, overheads))
    members = [m for g in groups for m in g]
    costs = tuple(MemberCost(name=m, samples=slots[r], speed=speeds[m], compute_s=pipeline.compute_s[s],
                             overhead_s=overheads[s][r], wait_s=step - pipeline.compute_s[s] - overheads[s][r],
                             memory_bytes=pipeline.memory_bytes[s])
                  for s, g in enumerate(groups) for r, m in enumerate(g))
    return Plan(members=tuple(members), shares=tuple(slots) * p, predicted_step_s=step, comm_s=max(sums),
                costs=costs, micro=(pipeline.micro[0],) * len(members), pp=p, stages=pipeline.stages, dp_shard=shards)


def reported_compute(plan: Plan, graph: Graph | None) -> dict[str, float]:
    """Per member, the compute seconds its step reports should show if the plan's prediction holds:
    its predicted compute, except that a pipeline stage and a tp member report theirs as the whole model's
    (over its units' share of the training FLOPs, worker/parallel/staged.py: so its speed reads as the device's),
    and so is expected at that scale."""
    if graph is not None and plan.tp > 1:  # (a tp member reports its compute as the whole model's too)
        from plan.tensor import compute_fraction

        split = compute_fraction(graph, plan.tp)
        whole = reported_compute(replace(plan, tp=1), graph) if plan.pp > 1 else {c.name: c.compute_s for c in plan.costs}
        return {name: s / split for name, s in whole.items()}
    if plan.pp == 1 or graph is None:
        return {c.name: c.compute_s for c in plan.costs}
    flops = {layer.name: layer.train_flops for layer in graph.layers}
    stage_of = {m: plan.stages[plan.layout.coords(r)[0]] for r, m in enumerate(plan.members)}
    out = {}
    for c in plan.costs:
        mine = sum(flops[u] for u in stage_of[c.name])
        out[c.name] = c.compute_s * graph.train_flops / mine if mine > 0 else c.compute_s
    return out


def passes(plan: Plan | None, name: str) -> int:
    """How many forward and backward passes a member's step runs under `plan`: its share's
    micro-batches (1 without any)."""
    if plan is None or not plan.micro or name not in plan.members:
        return 1
    i = plan.members.index(name)
    share, micro = plan.shares[i], plan.micro[i]
    return len(micro_split(share, micro)) if share > 0 and micro > 0 else 1


def per_pass(plan: Plan | None, cluster: Cluster, name: str, samples: int, compute_s: float) -> tuple[int, float]:
    """A member's step report (`samples`, `compute_s`) as the cluster fits it: one pass, in samples'
    worth, and its seconds. The report covers every pass of its micro-batches, each paying the
    device's fixed cost, as the prediction charges it (fitted whole, the fixed cost counted once
    would be charged again once per micro-batch). A pipeline's prediction charges an unmeasured
    fixed cost as FIXED_PRIOR_SAMPLES' worth (`stage_devices`): such a pass counts that much more,
    so that the fit predicts the report back."""
    n = passes(plan, name)
    worth = samples / n
    if plan is not None and plan.pp > 1 and cluster.fixed_compute().get(name, 0.0) <= 0:
        worth += FIXED_PRIOR_SAMPLES
    return max(1, round(worth)), compute_s / n


def measured_overhead(plan: Plan | None, step_s: float, compute_s: float, comm_s: float) -> float | None:
    """The per-step overhead (outside compute and communication) one member's step report shows
    under `plan`, for the cluster's fit; None where its reports cannot show it: a pipeline stage
    reports its compute at the whole model's scale (`reported_compute`), beyond its step time."""
    if plan is not None and plan.pp > 1:
        return None
    return max(0.0, step_s - compute_s - comm_s)


def fits_comm(plan: Plan | None) -> bool:
    """Whether a step's communication under `plan` is what the cost model's link fit models (an
    all-reduce, or FSDP's gathers and scatters with the copies); a pipeline's sends between stages
    are not."""
    return plan is None or plan.pp == 1


def micro_batched(plan: Plan, graph: Graph | None, caps: Mapping[str, float | None]) -> Plan:
    """A replicated `plan` whose members run a share larger than their memory's cap (`caps`: the most
    samples a member trains at once beside its whole state) as micro-batches of that cap: the
    share is bounded by speed, the micro-batch by memory. (A pipeline's micro-batches are its own.)"""
    if graph is None or plan.pp > 1 or plan.dp_shard > 1 or plan.tp > 1:  # (not whole replicas; cheaper than plan.layout)
        return plan
    return _with_micro(plan, graph, micro_sizes(plan.shares, [caps.get(m) for m in plan.members]))


def micro_sizes(shares: Sequence[int], caps: Sequence[float | None]) -> tuple[int, ...]:
    """Per member: 0 when its share fits at once beside its state (`caps`: the most samples that
    do), else the micro-batch of that many samples its share runs in."""
    return tuple(0 if s <= (c or 0) else int(c or 0) for s, c in zip(shares, caps))


def _with_micro(plan: Plan, graph: Graph, micro: tuple[int, ...]) -> Plan:
    costs = tuple(replace(c, memory_bytes=memory_bytes(graph, m or c.samples, graph.optimizer_state_factor))
                  for c, m in zip(plan.costs, micro))
    return replace(plan, costs=costs, micro=micro if any(micro) else ())


def repredict(cluster: Cluster, graph: Graph | None, plan: Plan) -> Plan:
    """`plan`'s members, shares and layout, predicted again (new speeds, fitted constants); a
    pipeline keeps its cut and micro-batches (with no graph there is nothing to predict it from)."""
    if plan.tp > 1:
        if graph is None:
            return plan
        from plan.tensor import repredict_tensor  # (plan.tensor builds on this module)

        return repredict_tensor(cluster, graph, plan)
    if plan.pp > 1:
        if graph is None:
            return plan
        r = len(plan.members) // plan.pp  # (dp x pp, FSDP x pp: a stage's members are consecutive ranks)
        groups = [plan.members[s * r:(s + 1) * r] for s in range(plan.pp)]
        kind = kind_key(plan.pp, plan.dp_shard)
        devices = [min(stage_devices(cluster, graph, g, kind), key=lambda d: d.samples_per_s) for g in groups]
        timed = time_pipeline(graph, devices, plan.stages, micro_split(max(plan.shares), plan.micro[0]),
                              link=cluster.link(plan.members))
        if r == 1:
            return pipelined(cluster, graph, timed)
        return pipelined(cluster, graph, timed, replicas=groups, shares=plan.shares[:r], shards=plan.dp_shard)
    if plan.dp_shard > 1 and graph is not None:
        return predict_sharded(cluster, graph, plan.members, plan.shares, plan.micro,
                               replicas=len(plan.members) // plan.dp_shard)
    fresh = predict(cluster, graph, plan.members, plan.shares)
    return _with_micro(fresh, graph, plan.micro) if plan.micro and graph is not None else fresh
