"""The cost model's formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from plan.cost import (Link, Replica, allgather_s, allreduce_s, compute_s, fit_factor, max_micro_batch,
                       memory_bytes, p2p_s, predict_dp, reduce_scatter_s, relative_error)
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


def test_compute_and_fitted_factor_recovers_1_5x() -> None:
    g = graph()
    assert g.train_flops == pytest.approx(3e9 + 5e9)
    assert compute_s(10, g.train_flops, 8e10) == pytest.approx(1.0)
    predicted = [compute_s(s, g.train_flops, 8e10) for s in (4, 8, 16, 32)]
    measured = [1.5 * p for p in predicted]
    assert fit_factor(predicted, measured) == pytest.approx(1.5)
    noisy = [m * (1 + e) for m, e in zip(measured, (0.02, -0.02, 0.01, -0.01))]
    assert fit_factor(predicted, noisy) == pytest.approx(1.5, rel=0.02)
    assert fit_factor([], []) == 1.0
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)


def test_memory_sums() -> None:
    g = graph()
    params = 5_000_000
    # params + grads + Adam (2x params) + activations x micro-batch
    assert memory_bytes(g, 8) == params * 4 + 1500 * 8
    assert memory_bytes(g, 8, optimizer_state_factor=0) == params * 2 + 1500 * 8
    assert max_micro_batch(g, params * 4 + 1500 * 10 + 7) == 10
    assert max_micro_batch(g, params * 4 - 1) is None


def test_predict_dp() -> None:
    g = graph()
    p = predict_dp(g, [Replica(name="fast", effective_flops=8e10, samples=20),
                       Replica(name="slow", effective_flops=4e10, samples=5, factor=2.0)], LINK)
    assert p.compute_s == {"fast": pytest.approx(2.0), "slow": pytest.approx(2.0)}
    assert p.comm_s == pytest.approx(allreduce_s(5_000_000, 2, LINK))
    assert p.step_s == pytest.approx(2.0 + p.comm_s)
    assert p.wait_s["fast"] == pytest.approx(0.0)
    assert p.memory_bytes["fast"] == 20_000_000 + 1500 * 20


def test_graph_json_round_trip_and_validation() -> None:
    g = graph()
    assert Graph.from_dict(g.to_dict()) == g
    assert Graph.from_dict({"layers": [{"name": "x", "forward_flops": 5}]}).layers[0].backward_flops == 10
    for bad, words in [({"layers": []}, "non-empty"),
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
