"""The MILP planner against brute force over class counts, with optimal continuous shares."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from plan.cost import Link, allreduce_s
from plan.milp import DeviceClass, DpCosts, map_to_devices, solve_dp

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
    best = (math.inf, {})
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


@pytest.mark.parametrize("devices", [8, 64, 256, 1024])
def test_solve_time_benchmark(devices: int) -> None:
    rng = random.Random(devices)
    classes = [DeviceClass(name=f"c{i}", available=devices // 8, samples_per_s=rng.uniform(5, 100),
                           memory_bytes=rng.choice([math.inf, 2e9, 3e9])) for i in range(8)]
    start = time.perf_counter()
    result = solve_dp(classes, COSTS, 8192, time_limit_s=1)
    print(f"\n{devices} devices: {time.perf_counter() - start:.3f} s, {result.status}, {result.reason}")
    assert result.status != "infeasible"
