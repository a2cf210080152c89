"""The cost model's formulas against hand-computed values."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from plan import Cluster, Device, predict
from plan.cost import (Link, allgather_s, allreduce_s, bubble_fraction, max_micro_batch, memory_bytes, p2p_s,
                       pipeline_step_s, reduce_scatter_s, relative_error, samples_that_fit)
from plan.graph import Graph, Layer, Replicate, Shard, TensorSpec

LINK = Link(alpha_s=1e-3, beta_s_per_byte=1e-9)


def graph() -> Graph:
    return Graph((Layer(name="a", kind="block", forward_flops=1e9, param_bytes=4_000_000, activation_bytes=1000),
                  Layer(name="b", kind="head", forward_flops=2e9, backward_flops=3e9, param_bytes=1_000_000,
                        activation_bytes=500, boundary_bytes=64)))


def test_collectives_by_hand() -> None:
    n = 1e8
    assert allreduce_s(n, 4, LINK) == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4 * 1e8 * 1e-9)  # 0.156
    assert allreduce_s(n, 4, LINK) == pytest.approx(0.156)
    assert allgather_s(n, 4, LINK) == pytest.approx(3e-3 + 0.075)
    assert reduce_scatter_s(n, 4, LINK) == pytest.approx(0.078)
    assert p2p_s(n, LINK) == pytest.approx(0.101)
    for f in (allreduce_s, allgather_s, reduce_scatter_s):
        assert f(n, 1, LINK) == 0.0


def test_compute_factor_is_fitted_from_measured_speed() -> None:
    g = graph()
    assert g.train_flops == pytest.approx(3e9 + 5e9)
    c = Cluster().with_device(Device(name="a", host="h", kind="cpu", flops=8e10, memory_bytes=1 << 30))
    assert c.compute_factor(g.train_flops) is None, "nothing measured: no factor"
    # 8e10 FLOP/s over 8e9 FLOPs a sample is 10 samples/s on paper; it measures 1.5x slower.
    c = c.with_device(Device(name="a", host="h", kind="cpu", flops=8e10, memory_bytes=1 << 30,
                             samples_per_s=10 / 1.5))
    assert c.compute_factor(g.train_flops) == pytest.approx(1.5)
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)


def test_a_layout_kinds_efficiency_scales_its_predictions_and_converts_its_measurements() -> None:
    """A kind's efficiency is its compute time over the fits' units: a plan of that kind is predicted
    on a view whose speeds are divided by it (a view is calibrated once: the outermost caller's kind
    holds), and a step measured in that kind is divided by it before it is fitted."""
    from plan.cluster import kind_key

    assert [kind_key(), kind_key(2), kind_key(dp_shard=4), kind_key(2, 2, 2)] == ["dp", "pp", "fsdp", "pp+fsdp+tp"]
    c = Cluster(unit_kind="dp").with_device(Device(name="a", host="h", kind="cpu", flops=1e10,
                                                   memory_bytes=1 << 30, samples_per_s=100.0, compute_fixed_s=0.01))
    c = c.with_efficiency("pp", 2.0).with_efficiency("tp", 100.0).with_efficiency("dp", 0.25)
    assert c.efficiency_of("dp") == 1.0 and c.efficiency_known("dp"), "the fits' own kind stays at 1"
    assert c.efficiency_known("pp") and not c.efficiency_known("fsdp")
    assert c.efficiency_of("tp") == 4.0 and c.efficiency_of("fsdp") == 1.0, "bounded; unknown kinds at 1"
    pp = c.calibrated("pp")
    assert pp.devices["a"].samples_per_s == 50.0 and pp.devices["a"].compute_fixed_s == 0.02
    assert pp.calibrated("dp") is pp and c.calibrated("pp") is pp
    assert predict(pp, graph(), ["a"], [10]).costs[0].compute_s == pytest.approx(
        2 * predict(c, graph(), ["a"], [10]).costs[0].compute_s)
    # 10 samples measured in 0.4 s under "pp" are 0.2 s in the fits' units, as under "dp"
    raw = c
    for _ in range(4):
        raw = raw.with_measurement("a", 10, 0.2, kind="dp")
        c = c.with_measurement("a", 10, 0.4, kind="pp")
    assert c.devices["a"].compute_window == raw.devices["a"].compute_window
    first = Cluster().with_device(replace(c.devices["a"], samples_per_s=None, reports=5))
    assert first.unit_kind is None and first.with_measurement("a", 10, 0.4, kind="pp").unit_kind == "pp", \
        "the first kind fitted is the fits' unit"


def test_memory_sums() -> None:
    g = graph()
    params = 5_000_000
    # params + grads + Adam (2x params) + activations x micro-batch
    assert memory_bytes(g, 8) == params * 4 + 1500 * 8
    assert memory_bytes(g, 8, optimizer_state_factor=0) == params * 2 + 1500 * 8
    assert max_micro_batch(g, params * 4 + 1500 * 10 + 7) == 10
    assert max_micro_batch(g, params * 4 - 1) is None
    assert samples_that_fit(100, 40, 0) == math.inf and samples_that_fit(100, 40, 7) == 8


def test_predicted_data_parallel_step_by_hand() -> None:
    g = graph()  # 5 MB of parameters, 1500 B of activations per sample
    c = Cluster()
    for name, speed, overhead in (("fast", 10.0, 0.1), ("slow", 2.5, 0.0)):
        c = c.with_device(Device(name=name, host="h", kind="cpu", flops=1e9, memory_bytes=1 << 30,
                                 samples_per_s=speed, overhead_s=overhead))
    p = predict(c, g, ["fast", "slow"], [20, 5])
    comm = allreduce_s(5_000_000, 2, c.link(["fast", "slow"]))
    costs = {m.name: m for m in p.costs}
    assert costs["fast"].compute_s == pytest.approx(2.0) and costs["slow"].compute_s == pytest.approx(2.0)
    assert p.comm_s == pytest.approx(comm)
    assert p.predicted_step_s == pytest.approx(2.1 + comm)  # max(compute + overhead) + all-reduce
    assert costs["fast"].wait_s == pytest.approx(0.0) and costs["slow"].wait_s == pytest.approx(0.1)
    assert costs["fast"].memory_bytes == 20_000_000 + 1500 * 20


def test_pipeline_step_and_bubble_by_hand() -> None:
    # 4 stages, 8 micro-batches, slowest stage 0.1 s a micro-batch: (8 + 3) x 0.1 s.
    assert pipeline_step_s([0.05, 0.1, 0.08, 0.07], 8) == pytest.approx(1.1)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    # plus, per micro-batch, each boundary forward and its gradient back: 2 x (1 ms + 1 MB x 1 ns/B)
    assert pipeline_step_s([0.1, 0.1], 2, [1e6], LINK) == pytest.approx(3 * 0.1 + 2 * 2 * (1e-3 + 1e-3))
    assert bubble_fraction(1, 8) == 0.0
    with pytest.raises(ValueError):
        pipeline_step_s([0.1, 0.1], 2, [1e6, 1e6], LINK)


def test_graph_json_round_trip_and_validation() -> None:
    g = graph()
    assert Graph.from_dict(g.to_dict()) == g
    assert Graph.from_dict({"layers": [{"name": "x", "forward_flops": 5}]}).layers[0].backward_flops == 10
    chain = Graph(g.layers, sequential=True)
    assert Graph.from_dict(chain.to_dict()) == chain and chain.to_dict()["sequential"] is True
    assert not Graph.from_dict({"layers": [{"name": "x", "forward_flops": 5}]}).sequential, "absent (older graphs)"
    for bad, words in [({"layers": []}, "non-empty"),
                       ({"layers": [{"name": "x", "forward_flops": 1}], "sequential": 1}, "true or false"),
                       ({"layers": [{"name": "x"}]}, "forward_flops"),
                       ({"layers": [{"name": "x", "forward_flops": -1}]}, ">= 0"),
                       ({"layers": [{"name": "x", "forward_flops": math.nan}]}, "finite"),
                       ({"layers": [{"name": "x", "forward_flops": 1, "colour": 1}]}, "unknown"),
                       ({"layers": [{"name": "x", "forward_flops": 1}, {"name": "x", "forward_flops": 1}]},
                        "duplicate")]:
        with pytest.raises(ValueError, match=words):
            Graph.from_dict(bad)


def test_tensor_spec() -> None:
    spec = TensorSpec((2, 4), (Replicate(), Shard(0)))
    assert spec.local_fraction() == 0.25
    with pytest.raises(ValueError):
        TensorSpec((2,), (Replicate(), Shard(1)))
