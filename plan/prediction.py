"""A plan's predicted step: one assignment of shares to devices, scored by the cost model.

`Plan` is what the coordinator ships (members in rank order, their shares) plus the prediction
behind it (per member compute, overhead, waiting and memory; the all-reduce). `predict` fills it in
from the cluster's fitted estimates; `assign` and `split_shares` turn speeds into integer shares.
Pure functions of plain data.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from plan.cluster import Cluster
from plan.cost import allreduce_s, static_bytes
from plan.graph import Graph, Layout


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

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.shares), "one share per member"
        assert len(set(self.members)) == len(self.members), "members are unique"
        assert all(s >= 0 for s in self.shares), "shares are non-negative"

    @property
    def global_batch(self) -> int:
        return sum(self.shares)

    @property
    def layout(self) -> Layout:
        return Layout(dp=len(self.members))

    def same_assignment(self, other: Plan | None) -> bool:
        return other is not None and (self.members, self.shares) == (other.members, other.shares)

    def speed_of(self, name: str) -> float | None:
        return next((c.speed for c in self.costs if c.name == name), None)


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
    comm = None
    static, act = 0.0, 0.0
    if graph is not None:
        comm = allreduce_s(graph.param_bytes, len(members), cluster.link(members))
        static, act = static_bytes(graph.param_bytes, graph.optimizer_state_factor), graph.activation_bytes
    costs = [replace(c, wait_s=busiest - c.compute_s - c.overhead_s, memory_bytes=static + act * c.samples)
             for c in costs]
    return Plan(members=tuple(members), shares=tuple(shares),
                predicted_step_s=None if comm is None else busiest + comm, comm_s=comm, costs=tuple(costs))


def assign(speeds: Sequence[float], overheads: Sequence[float], caps: Sequence[float], total: int) -> list[int] | None:
    """Integer shares summing to `total` that let every device finish compute + overhead together
    (water-filling on T: share_i = min(cap_i, speed_i·(T − overhead_i))), then rounded one sample at
    a time to whichever device would finish earliest. None if the caps cannot hold `total`."""
    n = len(speeds)
    if n == 0 or sum(min(c, float(total)) for c in caps) < total:
        return None

    def held(t: float) -> float:
        return sum(min(c, max(0.0, s * (t - o))) for s, o, c in zip(speeds, overheads, caps))

    lo, hi = 0.0, max(overheads) + total / min(speeds)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if held(mid) >= total else (mid, hi)
    exact = [min(c, max(0.0, s * (hi - o))) for s, o, c in zip(speeds, overheads, caps)]
    shares = [min(math.floor(x + 1e-9), int(min(c, total))) for x, c in zip(exact, caps)]
    while sum(shares) > total:  # floating-point slack: take back from the latest finisher
        i = max((i for i in range(n) if shares[i] > 0), key=lambda i: overheads[i] + shares[i] / speeds[i])
        shares[i] -= 1
    heap = [(overheads[i] + (shares[i] + 1) / speeds[i], i) for i in range(n) if shares[i] + 1 <= caps[i]]
    heapq.heapify(heap)
    left = total - sum(shares)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        shares[i] += 1
        left -= 1
        if shares[i] + 1 <= caps[i]:
            heapq.heappush(heap, (overheads[i] + (shares[i] + 1) / speeds[i], i))
    return shares if left == 0 else None


def split_shares(total: int, weights: list[float]) -> list[int]:
    """Split `total` in proportion to `weights` (largest remainder, ties to the lower index), every
    weight getting at least one sample while there are enough to go round."""
    n = len(weights)
    if n == 0:
        return []
    assert all(w > 0 for w in weights), "weights must be positive"
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    if total >= n:
        for i in range(n):
            if shares[i] == 0:
                shares[max(range(n), key=lambda k: (shares[k], -k))] -= 1
                shares[i] = 1
    return shares
