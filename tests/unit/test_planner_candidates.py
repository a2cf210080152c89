"""The planner as one pipeline of candidate layouts (plan.candidates): replicated, FSDP over k, HSDP
r x s and pipelines pp=P are enumerated, pruned by memory with a reason, predicted and scored by one
objective; the winner is the least, and the result lists every candidate weighed."""

from __future__ import annotations

import itertools
import random

import pytest
from bench_make_plan import gpt_10m
from test_membership import Sim
from test_phase import _ask

from coordinator import membership as m
from coordinator.ctl import format_explain
from plan import Cluster, Device, Graph, PlanLimits, make_plan
from plan._pipeline_pin import NOT_A_SEQUENCE, moved_bytes
from plan.graph import Layer
from plan.layout import Layout, parse_pin
from plan.pipeline import StageDevice, best_pipeline, step_floor
from plan.placement import TensorShape
from plan.prediction import Plan, predict_sharded
from plan.reshard import ORDER_ROWS, copy_ring, holdings, plan_reshard, survivors

MB, MIB = 1_000_000, 2**20


def small(*, sequential: bool = True) -> Graph:
    """6 units of 1 MB of parameters (test_pipeline_pin's GRAPH)."""
    return Graph(tuple(Layer(name=str(i), kind="block", forward_flops=1e6, param_bytes=MB, activation_bytes=1000,
                             boundary_bytes=100) for i in range(6)),
                 optimizer_state_bytes=2 * MB * 6, sequential=sequential)


def cluster(speeds: dict[str, float], *, memory: float = 1 << 34, hosts: dict[str, str] | None = None) -> Cluster:
    c = Cluster()
    for name, speed in speeds.items():
        c = c.with_device(Device(name=name, host=(hosts or {}).get(name, "h"), kind="cpu", flops=1e9,
                                 memory_bytes=int(memory), samples_per_s=speed))
    return c


def test_a_fifth_worker_beside_hsdp_2x2_is_weighed_in_every_layout_that_uses_it() -> None:
    """The seen case: four workers of the 10M GPT under a memory limit no replica fits (164.4 MiB of
    state; 160 MiB each, over what a quarter shard needs) train as HSDP 2 x 2; a fifth joins. FSDP
    over five (and every pipeline over it) is weighed by the same objective: with a global batch of
    40 it pays (8 samples each instead of 10) and the fifth trains; with 16 the slowest share is 4
    samples either way and five shards gather more, so the fifth waits, and its reason names the
    layout that beat using it with both predicted step times."""
    graph = gpt_10m()
    four = cluster({f"w{i}": 20.0 for i in range(1, 5)}, memory=160 * MIB)
    five = four.with_device(Device(name="w5", host="h", kind="cpu", flops=1e9, memory_bytes=160 * MIB,
                                   samples_per_s=20.0))
    for batch in (40, 16):
        limits = PlanLimits(global_batch=batch)
        first = make_plan(four, graph, None, limits=limits)
        assert first.plan is not None and first.plan.layout.describe() == "dp_replicate=2 x dp_shard=2", first.reason
        joined = make_plan(five, graph, first.plan, limits=limits)
        assert joined.plan is not None, joined.reason
        rows = {c.layout: c for c in joined.candidates}
        assert rows["dp_replicate"].why_not.startswith("no device holds a replica"), rows["dp_replicate"]
        fsdp5 = rows["dp_shard=5"]
        assert sorted(fsdp5.members) == ["w1", "w2", "w3", "w4", "w5"] and not fsdp5.why_not
        assert fsdp5.predicted_step_s is not None and fsdp5.objective_s is not None
        assert fsdp5.moved_bytes > 0, "every member's shard changes: the switch costs"
        assert all(f"pp={p}" in rows for p in (2, 3, 4, 5)), sorted(rows)
        chosen = [c for c in joined.candidates if c.chosen]
        assert len(chosen) == 1 and chosen[0].members == joined.plan.members
        runnable = [c for c in joined.candidates if c.objective_s is not None]
        assert joined.objective_s == min(c.objective_s for c in runnable if c.objective_s is not None)
        if batch == 40:
            assert joined.plan.layout.describe() == "dp_shard=5" and joined.standby == (), joined.reason
            continue
        assert joined.plan.layout.describe() == "dp_replicate=2 x dp_shard=2" and joined.standby == ("w5",)
        assert joined.plan.predicted_step_s is not None and fsdp5.predicted_step_s > joined.plan.predicted_step_s
        [why] = joined.standby_why
        assert why == (f"dp_replicate=2 x dp_shard=2 over 4 predicts {joined.plan.predicted_step_s * 1e3:.1f} ms/step "
                       f"(objective {joined.objective_s * 1e3:.1f} ms); the best layout that uses it, dp_shard=5 "
                       f"over 5, predicts {fsdp5.predicted_step_s * 1e3:.1f} ms/step "
                       f"(objective {fsdp5.objective_s * 1e3:.1f} ms)"), why
        assert "whole replicas" not in joined.reason and f"w5 ({why})" in joined.reason


def test_every_candidate_is_listed_with_its_prediction_or_why_it_cannot_run() -> None:
    c = cluster({"a": 100.0, "b": 100.0, "c": 100.0})
    result = make_plan(c, small(), None, limits=PlanLimits(global_batch=48))
    assert result.plan is not None and result.plan.layout.describe() == "dp_replicate=3", result.reason
    assert [r.layout for r in result.candidates] == ["dp_replicate=3", "dp_shard=3", "pp=2", "pp=3"]
    assert [r.chosen for r in result.candidates] == [True, False, False, False]
    chosen, fsdp = result.candidates[:2]
    assert not chosen.why_not and chosen.predicted_step_s is not None and chosen.objective_s == result.objective_s
    # FSDP over the three predicts a slower step than the replicas' objective: it is not scored (no
    # switch cost weighed), and its row says so with its prediction.
    assert fsdp.description == "sharded over 3 members (FSDP2)" and fsdp.predicted_step_s is not None
    assert result.objective_s is not None and fsdp.predicted_step_s >= result.objective_s and fsdp.objective_s is None
    assert fsdp.why_not == (f"predicts {fsdp.predicted_step_s * 1e3:.1f} ms a step, no less than the best found "
                            f"({result.objective_s * 1e3:.1f} ms)")
    # Three devices at 100 samples/s take 160 ms for the batch of 48 in any pipeline, plus its
    # bubble and a pass's fixed cost per micro-batch: no cut of them can beat 3 replicas.
    for p, row in zip((2, 3), result.candidates[2:]):
        assert row.predicted_step_s is None and row.why_not.startswith(
            f"not cut: on its {p} fastest devices no cut takes less than"), row
        floor = float(row.why_not.split("less than ")[1].split(" ms")[0])
        assert result.objective_s is not None and floor >= 160.0 and floor >= result.objective_s * 1e3
    # A model whose units are not a sequence gets no pipeline candidate, and one row says why.
    tangled = make_plan(c, small(sequential=False), None, limits=PlanLimits(global_batch=48))
    [pp] = [r for r in tangled.candidates if r.layout.startswith("pp")]
    assert pp.layout == "pp" and pp.why_not == NOT_A_SEQUENCE and "do not form a sequence" in pp.why_not
    # Four devices: HSDP 2 x 2 too; a memory that holds no shard of two says so.
    four = make_plan(cluster({n: 100.0 for n in "abcd"}), small(), None, limits=PlanLimits(global_batch=48))
    assert "dp_replicate=2 x dp_shard=2" in [r.layout for r in four.candidates]
    tiny = make_plan(cluster({"a": 100.0, "b": 100.0}, memory=MB), small(), None, limits=PlanLimits(global_batch=8))
    assert tiny.plan is None and tiny.status == "infeasible"
    whys = {r.layout: r.why_not for r in tiny.candidates}
    assert whys["dp_shard=2"].startswith("dp_shard=2 does not fit: a member needs"), whys
    assert whys["pp=2"].startswith("pp=2 does not fit: no cut of the model's 6 units into 2 stages"), whys


def test_no_pipeline_wins_where_data_parallel_is_plainly_better_and_one_wins_where_it_pays() -> None:
    """Equal devices on one host, a small model: replicas (or sharding) beat every pipeline, whose
    stages wait out the bubble. Two hosts over a slow link and a model whose gradients dwarf its
    activations (400 MB against 1 kB at a boundary): the all-reduce costs seconds, one device alone
    takes the whole batch, and a pipeline of the two wins."""
    for n, batch in itertools.product((2, 3, 4), (16, 64)):
        c = cluster({f"d{i}": 100.0 for i in range(n)})
        result = make_plan(c, small(), None, limits=PlanLimits(global_batch=batch))
        assert result.plan is not None and result.plan.pp == 1, result.reason
        pipes = [r for r in result.candidates if r.layout.startswith("pp=")]
        pure = [r.layout for r in pipes if " x " not in r.layout]
        hybrids = sorted(r.layout for r in pipes if " x " in r.layout)
        assert result.objective_s is not None and len(pure) == n - 1, result.candidates
        assert hybrids == (["pp=2 x dp_replicate=2", "pp=2 x dp_shard=2"] if n == 4 else []), hybrids
        assert all(r.why_not.startswith("not cut") if r.objective_s is None else r.objective_s > result.objective_s * 1.2
                   for r in pipes), result.candidates
    heavy = Graph(tuple(Layer(name=str(i), kind="block", forward_flops=1e6, param_bytes=50 * MB, activation_bytes=1000,
                              boundary_bytes=1000) for i in range(8)), sequential=True)
    apart = cluster({"a": 100.0, "b": 100.0}, hosts={"a": "A", "b": "B"})
    result = make_plan(apart, heavy, None, limits=PlanLimits(global_batch=64))
    assert result.plan is not None and result.plan.layout.describe() == "pp=2", result.reason
    assert result.reason.startswith("a pipeline of 2 stages (pp=2, stages"), result.reason
    [chosen] = [r for r in result.candidates if r.chosen]
    assert chosen.layout == "pp=2" and chosen.description == "a pipeline of 2 stages"
    assert result.runner_up is not None and result.runner_up.plan.pp == 1


def test_every_pipeline_hybrid_is_weighed_unpinned() -> None:
    """Eight devices: each depth alone, as replicas of pipelines, with sharded stages, and from a
    width of 4 as two replicas of stages sharded over the rest (HSDP x pp); each scored or pruned
    with its reason."""
    c = cluster({f"d{i}": 100.0 for i in range(8)})
    result = make_plan(c, small(), None, limits=PlanLimits(global_batch=64))
    rows = {r.layout: r for r in result.candidates if r.layout.startswith("pp=")}
    assert {"pp=2 x dp_replicate=4", "pp=2 x dp_shard=4", "pp=2 x dp_replicate=2 x dp_shard=2"} <= set(rows), rows
    assert "pp=3 x dp_replicate=2 x dp_shard=1" not in rows and "pp=4 x dp_replicate=2 x dp_shard=1" not in rows
    assert all((r.objective_s is None) == bool(r.why_not) for r in rows.values()), rows
    hsdp = make_plan(c, small(), None, limits=PlanLimits(global_batch=64), pin=parse_pin("pp=2,dp=2,fsdp=2"))
    assert hsdp.plan is not None and hsdp.plan.layout.describe() == "pp=2 x dp_replicate=2 x dp_shard=2", hsdp.reason


@pytest.mark.parametrize("seed", range(6))
def test_no_cut_beats_the_floor_a_pipeline_candidate_is_bounded_by(seed: int) -> None:
    rng = random.Random(seed)
    graph = Graph(tuple(Layer(name=str(i), kind="block", forward_flops=rng.uniform(1e5, 1e7), param_bytes=MB,
                              activation_bytes=1000, boundary_bytes=100) for i in range(rng.randint(2, 9))))
    for p in range(1, min(5, len(graph.layers)) + 1):
        devices = [StageDevice(name=f"d{i}", samples_per_s=rng.uniform(10, 400), fixed_s=rng.choice([0.0, 0.01]))
                   for i in range(p)]
        samples = rng.choice([1, 7, 16, 64])
        found = best_pipeline(graph, devices, samples)
        assert found is not None and step_floor(graph, devices, samples) <= found.step_s * (1 + 1e-12)


def test_before_any_step_is_measured_no_pipeline_is_weighed() -> None:
    c = Cluster()
    for name in "abc":
        c = c.with_device(Device(name=name, host="h", kind="cpu", flops=1e9, memory_bytes=1 << 34))
    result = make_plan(c, small(), None, limits=PlanLimits(global_batch=48))
    assert result.status == "heuristic" and result.plan is not None and result.plan.pp == 1
    pipes = [r for r in result.candidates if r.layout.startswith("pp=")]
    assert pipes and all(r.why_not.startswith("no step measured yet") for r in pipes)
    pinned = make_plan(c, small(), None, limits=PlanLimits(global_batch=48), pin=parse_pin("pp=3"))
    assert pinned.plan is not None and pinned.plan.pp == 3, "a pinned pipeline is planned on the guess"


def test_a_pin_keeps_the_candidates_it_admits() -> None:
    c = cluster({f"d{i}": 100.0 + i for i in range(5)})
    result = make_plan(c, small(), None, limits=PlanLimits(global_batch=40), pin=parse_pin("fsdp=2"))
    assert result.plan is not None and result.plan.layout.describe() == "dp_replicate=2 x dp_shard=2"
    assert result.candidates and all("dp_shard=2" in r.layout for r in result.candidates), result.candidates
    pp = make_plan(c, small(), None, limits=PlanLimits(global_batch=40), pin=parse_pin("pp=3"))
    assert [r.layout for r in pp.candidates] == ["pp=3"] and pp.candidates[0].chosen


def test_a_pin_of_dp_alone_shards_over_every_device_and_a_joiner_is_planned_in() -> None:
    """`--layout dp=1` is FSDP over every ready device: a fourth that joins FSDP over three is
    planned in even where it gains less than hysteresis asks (a slow one: the three-member plan is
    no longer the pinned layout, so hysteresis does not keep it). Seen: the joiner sat on standby,
    "not in the pinned layout". `fsdp=2` over 5 likewise fills: 2 replicas of 2."""
    limits = PlanLimits(global_batch=12)
    three = cluster({"w1": 100.0, "w2": 100.0, "w3": 100.0})
    first = make_plan(three, small(), None, limits=limits, pin=parse_pin("dp=1"))
    assert first.plan is not None and first.plan.layout.describe() == "dp_shard=3", first.reason
    four = three.with_device(Device(name="w4", host="h", kind="cpu", flops=1e9, memory_bytes=1 << 34,
                                    samples_per_s=5.0))
    joined = make_plan(four, small(), first.plan, limits=limits, pin=parse_pin("dp=1"))
    assert joined.plan is not None and joined.plan.layout.describe() == "dp_shard=4", joined.reason
    assert set(joined.plan.members) == {"w1", "w2", "w3", "w4"} and joined.standby == ()
    rows = [r for r in joined.candidates if r.objective_s is not None and r.layout.startswith("dp_shard")]
    assert [r.layout for r in rows] == ["dp_shard=4"], joined.candidates
    # Memory that leaves one device out: the free degree fills the devices that hold a shard.
    small_one = four.with_device(Device(name="w4", host="h", kind="cpu", flops=1e9, memory_bytes=MB,
                                        samples_per_s=100.0))
    short = make_plan(small_one, small(), first.plan, limits=limits, pin=parse_pin("dp=1"))
    assert short.plan is not None and short.plan.layout.describe() == "dp_shard=3", short.reason
    assert short.standby == ("w4",)


def test_moved_bytes_counts_what_the_reshard_sends() -> None:
    """`moved_bytes` counts, without choosing senders, what `plan_reshard` sends: between sharded,
    HSDP, replicated and pipeline layouts, survivors or not."""
    graph = small()
    c = cluster({n: 100.0 for n in "abcdef"})
    shapes = [TensorShape(layer.name, ORDER_ROWS, ORDER_ROWS, unit=layer.name) for layer in graph.layers]
    unit = {layer.name: layer.param_bytes * (1.0 + graph.optimizer_state_factor) for layer in graph.layers}
    pipeline = make_plan(c, graph, None, limits=PlanLimits(global_batch=12), pin=parse_pin("pp=3")).plan
    assert pipeline is not None
    layouts: list[Plan] = [
        predict_sharded(c, graph, list("abcd"), [3, 3, 3, 3]),
        predict_sharded(c, graph, list("abcd"), [3, 3, 3, 3], replicas=2),
        predict_sharded(c, graph, list("bcdef"), [3, 3, 2, 2, 2]),
        Plan(members=tuple("abc"), shares=(4, 4, 4)),
        pipeline,
    ]
    for before, after in itertools.permutations(layouts, 2):
        for holders in (before.members, before.members[1:]):
            held = survivors(holdings(before.layout, shapes, copy_ring(before.layout)), holders)
            reshard = plan_reshard(held, holdings(after.layout, shapes, copy_ring(after.layout)))
            expected = round(sum(t.elements * unit[t.tensor] for t in reshard.transfers) / ORDER_ROWS)
            got = moved_bytes(graph, before.layout, holders, after)
            assert abs(got - expected) <= 8, (before.layout.describe(), after.layout.describe(), holders, got, expected)
    assert moved_bytes(graph, None, ["a"], pipeline) == 0
    assert moved_bytes(graph, Layout.replicated(["a"], [12]), [], pipeline) == 0


def test_plan_explain_lists_the_candidates() -> None:
    sim = Sim()
    sim(m.GraphReceived(small()))
    sim.running("a", "b")
    asked = _ask(sim, "plan", "explain")
    explained = asked["explain"]
    assert isinstance(explained, dict)
    rows = explained["candidates"]
    assert [r["layout"] for r in rows] == ["dp_replicate=2", "dp_shard=2", "pp=2"], rows
    assert rows[0]["chosen"] and rows[0]["members"] == 2 and rows[0]["predicted_step_s"] > 0
    assert rows[2]["why_not"].startswith("no step measured yet"), rows[2]
    text = format_explain(asked)
    assert "candidates weighed" in text and "PREDICTED STEP" in text, text
    line = next(x for x in text.splitlines() if x.startswith("* dp_replicate=2"))
    assert "ms" in line and "every usable device (2)" in line, line
    assert any(x.startswith("  pp=2") and "no step measured yet" in x for x in text.splitlines()), text
