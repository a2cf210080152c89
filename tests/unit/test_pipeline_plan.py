"""The pipeline axis's planning (plan/pipeline.py): exact cuts for unlike devices, checked against brute
force; uneven cuts for a slow or small device; micro-batches that need no divisibility; the step."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from plan.cost import Link
from plan.graph import Graph, Layer
from plan.pipeline import StageDevice, best_pipeline, cut_stages, micro_batches, micro_split, step_s, time_pipeline


def _graph(flops: list[float], params: int = 1000, acts: int = 100, boundary: int = 64) -> Graph:
    return Graph(layers=tuple(Layer(name=str(i), kind="block", forward_flops=f, param_bytes=params,
                                    activation_bytes=acts, boundary_bytes=boundary) for i, f in enumerate(flops)))


def _dev(name: str, speed: float, memory: float = math.inf, fixed: float = 0.0) -> StageDevice:
    return StageDevice(name=name, samples_per_s=speed, memory_bytes=memory, fixed_s=fixed)


def test_micro_batches_are_contiguous_sizes_that_need_no_divisibility() -> None:
    assert micro_batches(10, 4) == (3, 3, 2, 2) and sum(micro_batches(7, 7)) == 7
    with pytest.raises(ValueError):
        micro_batches(3, 4)


def test_a_plans_micro_batches_are_the_ones_the_worker_runs() -> None:
    """A plan carries only the largest micro-batch; the worker runs ceil(n / b) of them. Every split
    the planner picks comes back from its largest size (16 samples in 7 would not: 3 gives 6)."""
    assert micro_split(16, 3) == micro_batches(16, 6) and micro_split(10, 3) == (3, 3, 2, 2)
    with pytest.raises(ValueError):
        micro_split(4, 0)
    graph = _graph([1.0] * 6)
    for samples in range(1, 70):
        for devices in ([_dev("a", 10.0, fixed=0.01), _dev("b", 10.0, fixed=0.01)],
                        [_dev("a", 10.0), _dev("b", 5.0), _dev("c", 10.0)]):
            plan = best_pipeline(graph, devices, samples)
            assert plan is not None and plan.micro == micro_split(samples, plan.micro[0]), (samples, plan.micro)


def test_a_cut_in_force_is_predicted_again_as_the_planner_predicted_it() -> None:
    graph = _graph([1.0, 2.0, 3.0, 1.0, 1.0], boundary=10**5)
    devices = [_dev("a", 10.0, memory=1e9, fixed=0.002), _dev("b", 4.0, fixed=0.001)]
    link = Link(alpha_s=1e-4, beta_s_per_byte=1e-9)
    plan = best_pipeline(graph, devices, 13, link=link)
    assert plan is not None
    by_name = {d.name: d for d in devices}
    again = time_pipeline(graph, [by_name[n] for n in plan.devices], plan.stages, plan.micro, link=link)
    assert again == plan
    assert all(0 < compute < plan.step_s for compute in plan.compute_s) and plan.memory_bytes[0] > 0
    with pytest.raises(ValueError, match="do not cut"):
        time_pipeline(graph, devices, [("0", "1"), ("3", "4")], plan.micro)


def test_equal_stages_pay_the_familiar_bubble() -> None:
    assert step_s([0.1] * 4, 8) == pytest.approx((8 + 4 - 1) * 0.1)
    assert step_s([0.1, 0.3], 5) == pytest.approx(0.4 + 4 * 0.3), "the slowest stage paces the rest"


def _brute(graph: Graph, devices: list[StageDevice], micro: int) -> float:
    """The least slowest-stage time over every cut, by enumeration."""
    n, p = len(graph.layers), len(devices)
    total = graph.train_flops
    best = math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        times = [sum(x.train_flops for x in graph.layers[a:b]) / total * (micro / d.samples_per_s + d.fixed_s)
                 for a, b, d in zip(bounds, bounds[1:], devices)]
        best = min(best, max(times))
    return best


def test_the_cuts_are_exact_for_any_row_of_devices() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n, p = rng.randint(1, 9), rng.randint(1, 4)
        graph = _graph([rng.choice([1.0, 2.0, 5.0, 13.0]) for _ in range(n)])
        devices = [_dev(f"d{i}", rng.choice([1.0, 2.0, 3.0]), fixed=rng.choice([0.0, 0.01])) for i in range(p)]
        found = cut_stages(graph, devices, 4)
        if p > n:
            assert found is None
            continue
        assert found is not None
        starts, times = found
        assert starts[0] == 0 and list(starts) == sorted(set(starts)) and len(starts) == p
        assert max(times) == pytest.approx(_brute(graph, devices, 4)), (graph, devices)


def test_a_slow_device_gets_fewer_units_and_a_small_one_what_fits() -> None:
    graph = _graph([1.0] * 12)
    starts, _ = cut_stages(graph, [_dev("a", 2.0), _dev("b", 2.0), _dev("slow", 1.0)], 4) or ((), ())
    sizes = [b - a for a, b in zip(starts, [*starts[1:], 12])]
    assert sizes[2] < sizes[0] and sizes[2] < sizes[1] and sum(sizes) == 12, sizes
    # Memory: three units' state (with Adam, 4x parameters) and 1F1B's in-flight activations fit "small".
    small = 3 * (1000 * 4) + 3 * 100 * 4 * 1
    starts, _ = cut_stages(graph, [_dev("big", 1.0), _dev("small", 1.0, memory=small)], 4) or ((), ())
    assert 12 - starts[1] <= 3, starts
    assert cut_stages(graph, [_dev("a", 1.0, memory=10), _dev("b", 1.0, memory=10)], 4) is None


def test_uneven_cuts_come_near_the_sum_of_the_speeds_and_beat_even_ones() -> None:
    """Two devices at full speed and one at half (the heterogeneous pipeline of the benchmark): the
    planned pipeline's throughput against the ideal (every device busy, the sum of their speeds),
    and against even cuts on the same devices."""
    graph = _graph([1.0] * 24)
    devices = [_dev("a", 100.0), _dev("b", 100.0), _dev("slow", 50.0)]
    plan = best_pipeline(graph, devices, 64)
    assert plan is not None
    throughput = 64 / plan.step_s  # the ideal is 250 samples/s; even cuts would give ~150
    assert throughput >= 0.85 * 250.0, (throughput, plan)
    even = [0, 8, 16]
    times = []
    for a, b, d in zip(even, [*even[1:], 24], devices):
        times.append(plan.micro[0] * (b - a) / (24 * d.samples_per_s))
    even_step = step_s(times, len(plan.micro))
    assert even_step >= 1.3 * plan.step_s, (even_step, plan)
    sizes = [len(s) for s in plan.stages]
    assert sizes[plan.devices.index("slow")] < min(sizes[plan.devices.index(n)] for n in ("a", "b"))


def test_the_slow_device_is_placed_where_it_costs_least_and_links_count() -> None:
    graph = _graph([1.0] * 6, boundary=10**6)
    link = Link(alpha_s=1e-3, beta_s_per_byte=1e-8)
    plan = best_pipeline(graph, [_dev("a", 10.0), _dev("b", 10.0)], 8, link=link)
    assert plan is not None and len(plan.stages) == 2
    with_sends = plan.step_s
    without = best_pipeline(graph, [_dev("a", 10.0), _dev("b", 10.0)], 8)
    assert without is not None and with_sends > without.step_s, "the boundary's sends cost time"


def test_micro_batches_of_two_sizes_are_predicted_at_their_own_pace() -> None:
    graph = _graph([1.0] * 4)
    devices = [_dev("a", 10.0), _dev("b", 10.0)]
    plan = best_pipeline(graph, devices, 5, max_micro=2)  # 5 samples: (5) or (3, 2)
    assert plan is not None
    if plan.micro == (3, 2):  # stages of 2 units each: 0.15 s for 3 samples, 0.1 s for 2
        assert plan.step_s == pytest.approx(0.15 + 0.15 + 0.1)
    else:
        assert plan.step_s == pytest.approx(0.25 + 0.25)
    assert plan.micro == (3, 2), "two micro-batches beat one: the second stage starts earlier"
