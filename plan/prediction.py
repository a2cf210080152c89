"""A plan's predicted step: one assignment of shares to devices, scored by the cost model.

`Plan` is what the coordinator ships (members in rank order, their shares) plus the prediction
behind it (per member compute, overhead, waiting and memory; the all-reduce). `predict` fills it in
from the cluster's fitted estimates. Pure functions of plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from plan.cluster import Cluster
from plan.cost import allreduce_s, memory_bytes, sharded_static_bytes, step_comm_s
from plan.graph import Graph
from plan.layout import Layout


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
    """A data-parallel layout: `members` in rank order and each one's samples per global batch,
    with the cost model's prediction (None where it could not predict)."""

    members: tuple[str, ...]
    shares: tuple[int, ...]
    predicted_step_s: float | None = None
    comm_s: float | None = None
    costs: tuple[MemberCost, ...] = ()
    mode: str = "sync"
    dp_shard: int = 1  # members that split the state between them (1: every member a replica)
    micro: tuple[int, ...] = ()  # per member: samples per forward (0 or absent: the whole share at once)

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.shares), "one share per member"
        assert len(set(self.members)) == len(self.members), "members are unique"
        assert all(s >= 0 for s in self.shares), "shares are non-negative"

    @property
    def global_batch(self) -> int:
        return sum(self.shares)

    @property
    def layout(self) -> Layout:
        return Layout(members=self.members, shares=self.shares, dp_replicate=len(self.members) // self.dp_shard,
                      dp_shard=self.dp_shard)

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
        return other is not None and (self.members, self.shares, self.dp_shard, self.micro) == (
            other.members, other.shares, other.dp_shard, other.micro)



def predict(cluster: Cluster, graph: Graph | None, members: Sequence[str], shares: Sequence[int]) -> Plan:
    """The plan `members`/`shares` with the cost model's prediction of its step."""
    speeds = cluster.speeds_for(graph.train_flops if graph else 0.0)
    fixed = cluster.fixed_compute()
    costs = []
    busiest = 0.0
    for name, share in zip(members, shares):
        d = cluster.devices[name]
        compute = fixed[name] + share / speeds[name] if share > 0 else 0.0
        busiest = max(busiest, compute + d.overhead_s)
        costs.append(MemberCost(name=name, samples=share, speed=speeds[name], compute_s=compute,
                                overhead_s=d.overhead_s, wait_s=0.0, memory_bytes=0.0))
    comm = None if graph is None else allreduce_s(graph.param_bytes, len(members), cluster.link(members))
    costs = [replace(c, wait_s=busiest - c.compute_s - c.overhead_s,
                     memory_bytes=0.0 if graph is None else memory_bytes(graph, c.samples, graph.optimizer_state_factor))
             for c in costs]
    return Plan(members=tuple(members), shares=tuple(shares),
                predicted_step_s=None if comm is None else busiest + comm, comm_s=comm, costs=tuple(costs))


def predict_sharded(cluster: Cluster, graph: Graph, members: Sequence[str], shares: Sequence[int],
                    micro: Sequence[int] = (), *, replicas: int = 1) -> Plan:
    """`members` sharding the state between them (FSDP2, a ring of copies), or, with `replicas` > 1,
    HSDP: that many rows, each sharding the state (no copies: the rows hold every shard), with their
    shares (run as micro-batches of `micro` samples where given): the compute of `predict`, the
    step's communication, and each member's memory (its shard, plus one micro-batch's activations)."""
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
    costs = tuple(replace(c, memory_bytes=static + graph.activation_bytes * (m or c.samples))
                  for c, m in zip(base.costs, micro))
    return replace(base, predicted_step_s=busiest + comm, comm_s=comm, costs=costs, dp_shard=shards,
                   micro=micro if any(micro) else ())


def micro_batched(plan: Plan, graph: Graph | None, caps: Mapping[str, float | None]) -> Plan:
    """A replicated `plan` whose members run a share larger than their memory's cap (`caps`: the most
    samples a member trains at once beside its whole state) as micro-batches of that cap: the
    share is bounded by speed, the micro-batch by memory."""
    if graph is None or plan.dp_shard > 1:
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
    """`plan`'s members, shares and layout, predicted again (new speeds, fitted constants)."""
    if plan.dp_shard > 1 and graph is not None:
        return predict_sharded(cluster, graph, plan.members, plan.shares, plan.micro,
                               replicas=len(plan.members) // plan.dp_shard)
    fresh = predict(cluster, graph, plan.members, plan.shares)
    return _with_micro(fresh, graph, plan.micro) if plan.micro and graph is not None else fresh
