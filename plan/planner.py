"""The planner: which devices train and what share of every global batch each one takes.

This first planner puts every eligible device in one data-parallel group and splits the global
batch in proportion to estimated speed, so that all replicas finish their compute together. It has
the seam the MILP planner drops into: `make_plan(cluster, previous, *, limits) -> PlanResult`.

Rank order is kept stable across plans (members of the previous plan keep their relative order,
newcomers are appended in name order) so that a re-plan moves as little as possible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plan.cluster import Cluster


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A data-parallel layout: `members` in rank order and each one's samples per global batch."""

    members: tuple[str, ...]
    shares: tuple[int, ...]
    predicted_step_s: float | None = None

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.shares), "one share per member"
        assert len(set(self.members)) == len(self.members), "members are unique"
        assert all(s >= 0 for s in self.shares), "shares are non-negative"

    @property
    def global_batch(self) -> int:
        return sum(self.shares)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanLimits:
    global_batch: int
    max_workers: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The plan (None when nothing can train), the solver status and a reason a person can read."""

    plan: Plan | None
    status: str  # "optimal", "fallback", "infeasible"
    reason: str


def split_shares(total: int, weights: list[float]) -> list[int]:
    """Split `total` samples in proportion to `weights` (largest remainder, ties to lower index).

    Every weight gets at least one sample while there are enough to go round (taken from the
    largest shares), so that no replica sits in the group doing nothing.
    """
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


def make_plan(cluster: Cluster, previous: Plan | None, *, limits: PlanLimits) -> PlanResult:
    """All devices (up to `max_workers`) in data parallel, shares by speed."""
    speeds = cluster.speeds()
    if not speeds:
        return PlanResult(plan=None, status="infeasible", reason="no devices")
    # Members of the previous plan stay (a swap would move state for a guess at speed); free
    # slots up to max_workers go to the fastest newcomers.
    kept = [m for m in (previous.members if previous else ()) if m in speeds][: limits.max_workers]
    newcomers = sorted((n for n in speeds if n not in kept), key=lambda n: (-speeds[n], n))
    if limits.max_workers is not None:
        newcomers = newcomers[: max(limits.max_workers - len(kept), 0)]
    members = kept + sorted(newcomers)
    weights = [speeds[m] for m in members]
    shares = split_shares(limits.global_batch, weights)
    measured = all(cluster.devices[m].samples_per_s for m in members)
    # Compute time of the slowest replica; only meaningful once every member has measured steps
    # (calibrated FLOP/s are not samples/s). The cost model of the next issue replaces this.
    slowest = max(s / speeds[m] for m, s in zip(members, shares)) if measured else None
    plan = Plan(members=tuple(members), shares=tuple(shares), predicted_step_s=slowest)
    left_out = len(speeds) - len(members)
    reason = f"{len(members)} replicas, shares by speed" + (f", {left_out} on standby" if left_out else "")
    return PlanResult(plan=plan, status="optimal", reason=reason)
