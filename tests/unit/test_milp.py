"""The data-parallel planner against brute force over class counts, with optimal continuous shares
and with integer shares; the MILP against the exact search."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

import pytest

import plan.milp
from plan.cost import Link, allreduce_s
from plan.milp import MIP_GAP, DeviceClass, DpCosts, MilpResult, map_to_devices, solve_dp

COSTS = DpCosts(allreduce_bytes=1e9, static_bytes=1e9, activation_bytes_per_sample=1e6,
                link=Link(alpha_s=0.05, beta_s_per_byte=1e-9))


def best_makespan(counts: dict[str, int], classes: list[DeviceClass], costs: DpCosts, batch: int) -> float:
    """Bisection on T: the least T with sum of n_c * min(speed_c * T, cap_c) >= batch."""
    caps = {c.name: costs.max_samples(c.memory_bytes) or 0.0 for c in classes}
    speed = {c.name: c.samples_per_s for c in classes}

    def holds(t: float) -> float:
        return sum(n * min(speed[c] * t, caps[c]) for c, n in counts.items())

    if sum(counts.values()) == 0 or holds(1e12) < batch:
        return math.inf
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if holds(mid) >= batch else (mid, hi)
    return hi


def brute(classes: list[DeviceClass], costs: DpCosts, batch: int,
          prev: dict[str, int] | None = None, mig: float = 0.0) -> tuple[float, dict[str, int]]:
    best: tuple[float, dict[str, int]] = (math.inf, {})
    for combo in itertools.product(*(range(c.available + 1) for c in classes)):
        counts = {c.name: n for c, n in zip(classes, combo)}
        moved = sum(max(0, n - (prev or {}).get(c, 0)) for c, n in counts.items()) if prev is not None else 0
        obj = best_makespan(counts, classes, costs, batch) + allreduce_s(costs.allreduce_bytes, sum(combo),
                                                                         costs.link) + mig * moved
        if obj < best[0]:
            best = (obj, counts)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force_on_random_small_clusters(seed: int) -> None:
    rng = random.Random(seed)
    classes = [DeviceClass(name=f"c{i}", available=rng.randint(1, 4), samples_per_s=rng.uniform(20, 400),
                           memory_bytes=math.inf if i == 0 else 1e9 + 1e6 * rng.randint(300, 3000))
               for i in range(rng.randint(2, 4))]
    batch = 20_000
    best, counts = brute(classes, COSTS, batch)
    result = solve_dp(classes, COSTS, batch, time_limit_s=10)
    assert result.status == "optimal", result.reason
    assert result.predicted_step_s is not None
    assert best * 0.999 <= result.predicted_step_s <= best * 1.02, (result.counts, counts)
    assert sum(sum(s) for s in result.shares.values()) == batch
    for c in classes:
        assert len(result.shares[c.name]) == result.counts[c.name]
        cap = COSTS.max_samples(c.memory_bytes)
        assert cap is not None and all(s <= cap for s in result.shares[c.name])


def test_a_class_too_slow_to_be_worth_it_is_left_out() -> None:
    classes = [DeviceClass(name="fast", available=4, samples_per_s=1000),
               DeviceClass(name="snail", available=4, samples_per_s=1)]
    result = solve_dp(classes, COSTS, 4000, time_limit_s=10)
    assert result.status == "optimal"
    assert result.counts == {"fast": 4, "snail": 0}
    assert result.shares["fast"] == (1000, 1000, 1000, 1000)


def test_memory_limited_class_takes_fewer_samples_or_none() -> None:
    small = DeviceClass(name="small", available=2, samples_per_s=1000, memory_bytes=1e9 + 1e6 * 100)
    big = DeviceClass(name="big", available=2, samples_per_s=500)
    result = solve_dp([small, big], COSTS, 4000, time_limit_s=10)
    assert result.status == "optimal"
    assert all(s <= 100 for s in result.shares["small"])  # capped, though it is the fastest
    assert sum(result.shares["big"]) >= 3800
    tiny = DeviceClass(name="tiny", available=4, samples_per_s=1000, memory_bytes=5e8)
    result = solve_dp([tiny, big], COSTS, 4000, time_limit_s=10)
    assert result.counts["tiny"] == 0 and result.status == "optimal"


def test_infeasible_cluster_says_what_would_fit() -> None:
    classes = [DeviceClass(name="tiny", available=4, samples_per_s=1000, memory_bytes=5e8),
               DeviceClass(name="small", available=2, samples_per_s=10, memory_bytes=1e9 + 1e6 * 100)]
    result = solve_dp(classes, COSTS, 4000, time_limit_s=10)
    assert result.status == "infeasible"
    assert result.predicted_step_s is None
    assert "at most 200" in result.reason and "tiny" in result.reason, result.reason


def test_migration_cost_keeps_the_previous_plan() -> None:
    # Adding one more slow device saves about 1% of step time; moving it costs 10 s, over 100 steps.
    costs = DpCosts(allreduce_bytes=1e6, static_bytes=0, activation_bytes_per_sample=0,
                    link=Link(alpha_s=0.0, beta_s_per_byte=1e-9))
    classes = [DeviceClass(name="a", available=4, samples_per_s=100),
               DeviceClass(name="b", available=1, samples_per_s=4)]
    free = solve_dp(classes, costs, 4000, time_limit_s=10)
    assert free.counts == {"a": 4, "b": 1}
    stay = solve_dp(classes, costs, 4000, time_limit_s=10, previous_counts={"a": 4, "b": 0},
                    migration_s_per_device=10.0, horizon_steps=100)
    assert stay.counts == {"a": 4, "b": 0}
    assert stay.predicted_step_s is not None and free.predicted_step_s is not None
    assert 0.005 < stay.predicted_step_s / free.predicted_step_s - 1 < 0.02


def test_map_to_devices_keeps_previous_members() -> None:
    members = {"a": ["a1", "a2", "a3"], "b": ["b1", "b2"]}
    chosen = map_to_devices({"a": 2, "b": 1}, members, ["b2", "a3", "x9"])
    assert chosen == ["b2", "a3", "a1"]


def integer_makespan(counts: dict[str, int], classes: list[DeviceClass], costs: DpCosts, batch: int) -> float:
    """Least makespan in integer shares: unit samples one at a time to the device that finishes it
    first (optimal for identical unit jobs). A device left with none only lengthens the ring, so the
    brute force below never prefers such counts."""
    caps = {c.name: min(batch, costs.max_samples(c.memory_bytes) or 0.0) for c in classes}
    speed = {c.name: c.samples_per_s for c in classes}
    heap = [(1 / speed[c], c, i) for c, n in counts.items() for i in range(n) if caps[c] >= 1]
    heapq.heapify(heap)
    share = {(c, i): 0 for _, c, i in heap}
    for _ in range(batch):
        if not heap:
            return math.inf
        _, c, i = heapq.heappop(heap)
        share[c, i] += 1
        if share[c, i] + 1 <= caps[c]:
            heapq.heappush(heap, ((share[c, i] + 1) / speed[c], c, i))
    return max((s / speed[c] for (c, _), s in share.items()), default=math.inf)


def brute_integer(classes: list[DeviceClass], costs: DpCosts, batch: int, prev: dict[str, int] | None,
                  mig: float, max_devices: int | None) -> float:
    best = math.inf
    for combo in itertools.product(*(range(c.available + 1) for c in classes)):
        ranks = sum(combo)
        if ranks == 0 or ranks > (max_devices or ranks):
            continue
        counts = {c.name: n for c, n in zip(classes, combo)}
        moved = sum(max(0, n - prev.get(c, 0)) for c, n in counts.items()) if prev is not None else 0
        best = min(best, integer_makespan(counts, classes, costs, batch)
                   + allreduce_s(costs.allreduce_bytes, ranks, costs.link) + mig * moved)
    return best


@dataclass(frozen=True)
class Case:
    """3-5 classes of 1-3 devices, a small batch, memory caps, sometimes migration and a device limit."""

    classes: list[DeviceClass]
    costs: DpCosts
    batch: int
    prev: dict[str, int] | None
    migration_s_per_device: float
    horizon_steps: int
    max_devices: int | None

    def solve(self, time_limit_s: float = 1.0) -> MilpResult:
        return solve_dp(self.classes, self.costs, self.batch, time_limit_s=time_limit_s,
                        previous_counts=self.prev, migration_s_per_device=self.migration_s_per_device,
                        horizon_steps=self.horizon_steps, max_devices=self.max_devices)


def random_case(seed: int) -> Case:
    rng = random.Random(seed)
    costs = DpCosts(allreduce_bytes=10 ** rng.uniform(6, 9), static_bytes=1e9, activation_bytes_per_sample=1e6,
                    link=Link(alpha_s=10 ** rng.uniform(-5, -1.3), beta_s_per_byte=10 ** rng.uniform(-10, -8)))
    classes = [DeviceClass(name=f"c{i}", available=rng.randint(1, 3), samples_per_s=10 ** rng.uniform(0.5, 2.5),
                           memory_bytes=rng.choice([math.inf, 1e9 + 1e6 * rng.randint(1, 20)]))
               for i in range(rng.randint(3, 5))]
    prev = {c.name: rng.randint(0, c.available) for c in classes} if rng.random() < 0.6 else None
    return Case(classes=classes, costs=costs, batch=rng.randint(3, 120), prev=prev,
                migration_s_per_device=10 ** rng.uniform(-2, 2), horizon_steps=rng.choice([10, 100]),
                max_devices=rng.choice([None, None, rng.randint(1, 6)]))


def check_plan(result: MilpResult, classes: list[DeviceClass], costs: DpCosts, batch: int) -> None:
    assert sum(sum(s) for s in result.shares.values()) == batch
    for c in classes:
        assert len(result.shares[c.name]) == result.counts[c.name]
        cap = costs.max_samples(c.memory_bytes)
        assert all(1 <= s <= (cap or 0) for s in result.shares[c.name]), (c, result.shares)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_in_integer_shares(seed: int) -> None:
    case = random_case(seed)
    mig = case.migration_s_per_device / case.horizon_steps if case.prev is not None else 0.0
    best = brute_integer(case.classes, case.costs, case.batch, case.prev, mig, case.max_devices)
    result = case.solve()
    if math.isinf(best):
        assert result.status == "infeasible", result.reason
        return
    assert result.status == "optimal", result.reason
    assert result.objective_s is not None and result.lower_bound_s is not None
    assert best * (1 - 1e-9) <= result.objective_s <= best * (1 + MIP_GAP), (result.counts, result.reason)
    assert result.lower_bound_s <= best * (1 + 1e-9)
    assert sum(result.counts.values()) <= (case.max_devices or case.batch)
    check_plan(result, case.classes, case.costs, case.batch)


@pytest.mark.parametrize("seed", range(12))
def test_milp_agrees_with_the_search(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    case = random_case(100 + seed)
    searched = case.solve()
    monkeypatch.setattr(plan.milp, "_MAX_PAIRS", 0)  # every problem is too big for the search
    solved = case.solve(time_limit_s=10)
    if searched.status == "infeasible":
        assert solved.status == "infeasible"
        return
    assert solved.status == "optimal" and "MILP" in solved.reason, solved.reason
    assert searched.objective_s is not None and solved.objective_s is not None
    assert abs(solved.objective_s - searched.objective_s) <= 2 * MIP_GAP * searched.objective_s
    check_plan(solved, case.classes, case.costs, case.batch)


def test_max_devices_limits_the_plan_and_the_fit() -> None:
    classes = [DeviceClass(name="fast", available=4, samples_per_s=1000),
               DeviceClass(name="slow", available=4, samples_per_s=100, memory_bytes=1e9 + 1e6 * 100)]
    free = solve_dp(classes, COSTS, 4000)
    assert sum(free.counts.values()) > 3
    capped = solve_dp(classes, COSTS, 4000, max_devices=3)
    assert capped.status == "optimal" and capped.counts == {"fast": 3, "slow": 0}
    assert capped.shares["fast"] == (1334, 1333, 1333)
    # 4000 samples fit in the slow class alone (4 x 100 would not), but not in 2 of its devices
    only_slow = [DeviceClass(name="slow", available=8, samples_per_s=100, memory_bytes=1e9 + 1e6 * 600)]
    assert solve_dp(only_slow, COSTS, 4000).status == "optimal"
    result = solve_dp(only_slow, COSTS, 4000, max_devices=6)
    assert result.status == "infeasible" and "at most 3600" in result.reason and "max_devices" in result.reason
    with pytest.raises(ValueError, match="max_devices"):
        solve_dp(classes, COSTS, 4000, max_devices=0)


def test_max_devices_holds_in_the_milp_and_its_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    classes = [DeviceClass(name="a", available=5, samples_per_s=50),
               DeviceClass(name="b", available=5, samples_per_s=40, memory_bytes=1e9 + 1e6 * 300)]
    monkeypatch.setattr(plan.milp, "_MAX_PAIRS", 0)
    solved = solve_dp(classes, COSTS, 2000, max_devices=4, time_limit_s=10)
    assert solved.status == "optimal" and sum(solved.counts.values()) <= 4
    # The real solver, out of time before it finds any integer solution: the fallback.
    fallback = solve_dp(classes, COSTS, 2000, max_devices=4, previous_counts={"a": 5, "b": 5}, time_limit_s=1e-9)
    assert fallback.status == "fallback" and fallback.counts == {"a": 4, "b": 0}, fallback.reason
    assert "most capacity" in fallback.reason and "no integer solution" in fallback.reason
    kept = solve_dp(classes, COSTS, 2000, max_devices=4, previous_counts={"a": 2, "b": 2}, time_limit_s=1e-9)
    assert kept.status == "fallback" and kept.counts == {"a": 2, "b": 2} and "previous" in kept.reason


def test_every_device_that_takes_part_trains_at_least_one_sample() -> None:
    # Without that rule a continuous model spreads 8 samples over all 64 devices of a fast link.
    costs = DpCosts(allreduce_bytes=1e6, static_bytes=0, activation_bytes_per_sample=0,
                    link=Link(alpha_s=1e-6, beta_s_per_byte=1e-12))
    result = solve_dp([DeviceClass(name="a", available=64, samples_per_s=10)], costs, 8)
    assert result.status == "optimal" and result.counts == {"a": 8}
    assert result.shares["a"] == (1,) * 8


def test_a_search_out_of_budget_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan.milp, "_CHECKS_PER_S", 0)  # the least budget: the first few pairs
    rng = random.Random(5)
    classes = [DeviceClass(name=f"c{i}", available=32, samples_per_s=rng.uniform(5, 100)) for i in range(8)]
    costs = DpCosts(allreduce_bytes=1e7, static_bytes=0, activation_bytes_per_sample=0,
                    link=Link(alpha_s=1e-5, beta_s_per_byte=1e-9))
    result = solve_dp(classes, costs, 300, previous_counts={"c0": 32}, migration_s_per_device=0.01)
    assert result.status == "time-limited", result.reason
    assert result.objective_s is not None and result.lower_bound_s is not None
    assert result.lower_bound_s < result.objective_s
    check_plan(result, classes, costs, 300)


def test_large_cluster_status_is_honest() -> None:
    rng = random.Random(256)
    classes = [DeviceClass(name=f"c{i}", available=32, samples_per_s=rng.uniform(5, 100),
                           memory_bytes=rng.choice([math.inf, 2e9, 3e9])) for i in range(8)]
    result = solve_dp(classes, COSTS, 8192, previous_counts={"c0": 32, "c3": 10}, migration_s_per_device=5.0)
    assert result.status in ("optimal", "time-limited"), result.reason
    assert result.objective_s is not None and result.lower_bound_s is not None
    assert result.lower_bound_s <= result.objective_s * (1 + 1e-9)
    if result.status == "optimal":
        assert result.objective_s - result.lower_bound_s <= MIP_GAP * result.objective_s
    check_plan(result, classes, COSTS, 8192)
