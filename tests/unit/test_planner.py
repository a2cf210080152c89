"""The first planner: data parallel over every ready device, shares by speed."""

from __future__ import annotations

import pytest

from plan import Cluster, Device, PlanLimits, make_plan, split_shares


def device(name: str, flops: float, samples_per_s: float | None = None) -> Device:
    return Device(name=name, host="h", kind="cpu", flops=flops, memory_bytes=1 << 30,
                  samples_per_s=samples_per_s)


@pytest.mark.parametrize("total,weights", [(64, [1, 1, 1]), (64, [1, 2, 3]), (7, [5, 1]), (3, [1, 1, 1, 1, 1]),
                                           (1000, [0.1, 10, 3.3])])
def test_split_shares_sums_and_is_proportional(total: int, weights: list[float]) -> None:
    shares = split_shares(total, weights)
    assert sum(shares) == total and all(s >= 0 for s in shares)
    if total >= len(weights):
        assert all(s >= 1 for s in shares), "every replica gets a sample when there are enough"
    exact = [total * w / sum(weights) for w in weights]
    assert all(abs(s - x) < 1 + len(weights) for s, x in zip(shares, exact))
    if all(x >= 1 for x in exact):
        assert all(abs(s - x) < 1 for s, x in zip(shares, exact)), "largest remainder is within 1"


def test_shares_follow_speed_and_ranks_stay_stable() -> None:
    cluster = Cluster().with_device(device("a", 1e9)).with_device(device("b", 3e9))
    first = make_plan(cluster, None, limits=PlanLimits(global_batch=64)).plan
    assert first is not None and first.members == ("a", "b") and first.shares == (16, 48)
    assert first.predicted_step_s is None, "no prediction before any step was measured"
    grown = cluster.with_device(device("c", 5e9))
    second = make_plan(grown, first, limits=PlanLimits(global_batch=64)).plan
    assert second is not None and second.members[:2] == ("a", "b"), "old ranks keep their order"
    assert second.members[2] == "c" and sum(second.shares) == 64


def test_measured_speed_overrides_calibration() -> None:
    cluster = Cluster().with_device(device("a", 1e9)).with_device(device("b", 1e9))
    for _ in range(20):  # b turns out three times slower than its calibration says
        cluster = cluster.with_measurement("a", 30, 0.1).with_measurement("b", 10, 0.1)
    plan = make_plan(cluster, None, limits=PlanLimits(global_batch=40)).plan
    assert plan is not None and dict(zip(plan.members, plan.shares)) == {"a": 30, "b": 10}
    assert plan.predicted_step_s == pytest.approx(0.1, rel=0.01)


def test_max_workers_keeps_the_fastest() -> None:
    cluster = Cluster()
    for name, flops in (("slow", 1e9), ("fast", 9e9), ("mid", 4e9)):
        cluster = cluster.with_device(device(name, flops))
    result = make_plan(cluster, None, limits=PlanLimits(global_batch=10, max_workers=2))
    assert result.plan is not None and set(result.plan.members) == {"fast", "mid"}
    assert "1 on standby" in result.reason


def test_no_device_is_infeasible() -> None:
    result = make_plan(Cluster(), None, limits=PlanLimits(global_batch=8))
    assert result.plan is None and result.status == "infeasible"


def test_max_workers_keeps_running_members_over_a_faster_newcomer() -> None:
    cluster = Cluster().with_device(device("a", 1e9)).with_device(device("b", 1e9))
    first = make_plan(cluster, None, limits=PlanLimits(global_batch=8, max_workers=2)).plan
    faster = cluster.with_device(device("c", 9e9))
    second = make_plan(faster, first, limits=PlanLimits(global_batch=8, max_workers=2)).plan
    assert second is not None and second.members == ("a", "b"), "no swap for a newcomer"
    gone = faster.without("a")
    third = make_plan(gone, second, limits=PlanLimits(global_batch=8, max_workers=2)).plan
    assert third is not None and third.members == ("b", "c"), "the standby fills the free slot"
