"""Fitted constants: link α/β from measured all-reduces, the migration cost, speeds and overheads."""

from __future__ import annotations

import pytest

from plan import Cluster, Device
from plan.cluster import WARMUP_STEPS
from plan.cost import Link, allreduce_s
from plan.fit import TwoTermFit


def test_alpha_and_beta_are_recovered_from_rings_of_different_sizes() -> None:
    true = Link(alpha_s=2e-4, beta_s_per_byte=3e-9)
    c = Cluster()
    for ranks in (2, 3, 4, 8):
        for n in (1e6, 4e6):
            c = c.with_allreduce(ranks, n, allreduce_s(n, ranks, true), cross_host=False)
    fitted = c.link(["x"])
    assert fitted.alpha_s == pytest.approx(2e-4, rel=1e-6)
    assert fitted.beta_s_per_byte == pytest.approx(3e-9, rel=1e-6)
    assert c.inter_host.measured == 0, "intra-host measurements leave the inter-host link alone"


def test_one_ring_size_scales_the_prior_and_matches_the_measurement() -> None:
    c = Cluster().with_allreduce(3, 4e6, 0.02, cross_host=False)
    link = c.link(["x"])
    assert allreduce_s(4e6, 3, link) == pytest.approx(0.02)
    prior = Cluster().link(["x"])
    assert link.alpha_s / link.beta_s_per_byte == pytest.approx(prior.alpha_s / prior.beta_s_per_byte)


def test_a_fit_never_goes_negative_and_ignores_garbage() -> None:
    fit = TwoTermFit(prior=(1.0, 1.0))
    # y = 3·f1 with f0 noise that would make an unconstrained c0 negative
    for f0, f1 in ((1, 1), (2, 1), (1, 3), (3, 2)):
        fit = fit.observe(f0, f1, 3.0 * f1 - 0.1 * f0)
    assert fit.coef[0] >= 0 and fit.coef[1] >= 0
    assert fit.coef[1] == pytest.approx(3.0, rel=0.1)
    assert fit.observe(float("nan"), 1, 1).measured == fit.measured
    assert fit.observe(1, 1, -1).measured == fit.measured
    with pytest.raises(ValueError):
        TwoTermFit(prior=(-1.0, 0.0))


def test_migration_fit_separates_switch_and_transfer() -> None:
    c = Cluster()
    for n in (0.0, 1e8, 3e8):
        c = c.with_reshard(n, 0.02 + n * 2e-9)
    assert c.switch_s() == pytest.approx(0.02, rel=1e-6)
    assert c.move_s(1e8) == pytest.approx(0.2, rel=1e-6)


def test_speed_and_overhead_estimates_follow_measurements() -> None:
    c = Cluster().with_device(Device(name="a", host="h", kind="cpu", flops=1e9, memory_bytes=1 << 30))
    assert c.speeds()["a"] == pytest.approx(1e9)
    for _ in range(WARMUP_STEPS):  # the first steps pay for lazy set-up and are not fitted
        c = c.with_measurement("a", 40, 9.0)
    assert c.devices["a"].samples_per_s is None  # nothing measured: calibrated FLOP/s on scale 1
    assert c.speeds_for(1e7)["a"] == pytest.approx(100.0)  # FLOP/s / FLOPs per sample
    for _ in range(30):
        c = c.with_measurement("a", 40, 0.2, overhead_s=0.01)
    assert c.speeds()["a"] == pytest.approx(200.0)  # one share size: all of it counts per sample
    assert c.devices["a"].overhead_s == pytest.approx(0.01)
    assert c.compute_factor(1e7) == pytest.approx(0.5)
    assert c.with_speed("a", 50.0).speeds()["a"] == 50.0
    # Two share sizes tell the fixed part (20 ms) from the per-sample part (4 ms per sample).
    for samples in (10, 30) * 8:  # (a full window: the older 40-sample steps are gone)
        c = c.with_measurement("a", samples, 0.02 + 0.004 * samples)
    assert c.devices["a"].compute_fixed_s == pytest.approx(0.02, rel=1e-6)
    assert c.speeds()["a"] == pytest.approx(250.0, rel=1e-6)
    slower = c.with_speed_change("a", ((30, 0.42),) * 4)  # 3x the modelled 0.14 s
    assert slower.devices["a"].compute_fixed_s == pytest.approx(0.06) and slower.speeds()["a"] == pytest.approx(250 / 3)
    assert slower.devices["a"].compute_window == ((30, 0.42),) * 4
    # One slow step among many does not tilt the line (medians per share size).
    robust = c.with_measurement("a", 30, 5.0)
    assert robust.devices["a"].compute_fixed_s == pytest.approx(0.02, rel=1e-6)


def test_classes_group_similar_devices_of_one_kind_and_cap() -> None:
    c = Cluster()
    for name, kind in (("a", "cpu"), ("b", "cpu"), ("c", "cpu"), ("g", "cuda:0")):
        c = c.with_device(Device(name=name, host="h", kind=kind, flops=1e9, memory_bytes=1 << 30))
    speeds = {"a": 100.0, "b": 105.0, "c": 150.0, "g": 100.0}
    caps: dict[str, float | None] = {"a": 10.0, "b": 10.0, "c": 10.0, "g": 10.0}
    groups = dict(c.classes(speeds, caps))
    assert sorted(map(sorted, groups.values())) == [["a", "b"], ["c"], ["g"]]
    caps["b"] = 5.0
    assert len(c.classes(speeds, caps)) == 4
