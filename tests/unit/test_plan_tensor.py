"""Tensor-parallel layouts as the planner weighs them (plan.tensor): a pin's members and shares, the
prediction, a failure's re-plan keeping the survivors' positions, and why one cannot run."""

from __future__ import annotations

import dataclasses

from test_planner_candidates import cluster, small

from plan import PlanLimits, make_plan
from plan.graph import Graph, TensorInfo
from plan.layout import parse_pin
from plan.tensor import compute_fraction


def split_graph() -> Graph:
    """`small()` whose units each hold a 1 MB matrix split by tp and a small unsplit vector."""
    g = small()
    tensors = []
    for layer in g.layers:
        tensors.append(TensorInfo(fqn=f"{layer.name}.w", shape=(500, 500), dtype="float32", unit=layer.name, tp_dim=0))
        tensors.append(TensorInfo(fqn=f"{layer.name}.b", shape=(500,), dtype="float32", unit=layer.name))
    return dataclasses.replace(g, tensors=tuple(tensors))


def test_a_tp_pin_is_planned_as_replicas_of_tp_groups_computing_their_fraction() -> None:
    graph = split_graph()
    assert 0.5 < compute_fraction(graph, 2) < 0.51  # (the split half, and the bias whole)
    c = cluster({f"d{i}": 100.0 + i for i in range(5)})
    result = make_plan(c, graph, None, limits=PlanLimits(global_batch=40), pin=parse_pin("tp=2"))
    plan = result.plan
    assert plan is not None and plan.layout.describe() == "dp_replicate=2 x tp=2", result.reason
    assert len(result.standby) == 1 and plan.layout.shares[0] == plan.layout.shares[1], plan.layout
    assert sum(plan.layout.shares[::2]) == 40  # (a tp pair computes its slot's samples together)
    one = next(cost for cost in plan.costs if cost.name == plan.members[0])
    assert one.compute_s < one.samples / one.speed, "each member computes its fraction of the model"


def test_a_failure_keeps_every_survivor_at_its_rank() -> None:
    graph = split_graph()
    four = cluster({f"d{i}": 100.0 for i in range(4)})
    first = make_plan(four, graph, None, limits=PlanLimits(global_batch=40), pin=parse_pin("tp=2,dp=2"))
    assert first.plan is not None
    dead = first.plan.members[1]
    after = cluster({**{m: 100.0 for m in first.plan.members if m != dead}, "new": 100.0})
    again = make_plan(after, graph, first.plan, limits=PlanLimits(global_batch=40), pin=parse_pin("tp=2,dp=2"))
    assert again.plan is not None
    assert [m if m != "new" else dead for m in again.plan.members] == list(first.plan.members), again.plan.members


def test_a_job_without_a_tp_plan_gets_no_tp_and_the_reason() -> None:
    c = cluster({"a": 100.0, "b": 100.0})
    result = make_plan(c, small(), None, limits=PlanLimits(global_batch=8), pin=parse_pin("tp=2"))
    assert result.plan is None and "no tensor-parallel plan" in result.reason, result.reason
    short = make_plan(cluster({"a": 100.0}), split_graph(), None, limits=PlanLimits(global_batch=8), pin=parse_pin("tp=2"))
    assert short.plan is None and "needs 2 members; 1 can train now" in short.reason, short.reason


def test_a_pinned_pipeline_of_tp_stages_puts_each_tp_group_on_one_stage() -> None:
    graph = split_graph()
    c = cluster({f"d{i}": 100.0 for i in range(4)})
    result = make_plan(c, graph, None, limits=PlanLimits(global_batch=8), pin=parse_pin("pp=2,tp=2"))
    plan = result.plan
    assert plan is not None and plan.layout.describe() == "pp=2 x tp=2", result.reason
    layout = plan.layout
    assert [u for stage in layout.stages for u in stage] == [layer.name for layer in graph.layers]
    assert {layout.coords(r)[0] for r in layout.tp_group(0)} == {0} and len(set(layout.shares)) == 1


def test_a_pinned_fsdp_x_tp_shards_each_tp_members_part_and_holds_less_than_dp_x_tp() -> None:
    """`tp=2,fsdp=2` on four devices: two data-parallel slots (each a tp pair, each its own share)
    sharding the pairs' parts between them; a member's memory is its shard of its part (and a
    copy), less than a dp x tp member's whole part, and FSDP2's gathers cost more than the
    replicas' all-reduce of the same part."""
    graph = split_graph()
    c = cluster({f"d{i}": 100.0 for i in range(4)})
    limits = PlanLimits(global_batch=40)
    sharded = make_plan(c, graph, None, limits=limits, pin=parse_pin("tp=2,fsdp=2")).plan
    replicas = make_plan(c, graph, None, limits=limits, pin=parse_pin("tp=2,dp=2")).plan
    assert sharded is not None and replicas is not None
    layout = sharded.layout
    assert layout.describe() == "dp_shard=2 x tp=2" and sum(layout.shares[::2]) == 40, layout
    assert layout.shares[0] == layout.shares[1] and layout.tp_group(0) == [0, 1] and layout.shard_group(0) == [0, 2]
    assert max(m.memory_bytes for m in sharded.costs) < max(m.memory_bytes for m in replicas.costs)
    assert sharded.comm_s is not None and replicas.comm_s is not None and sharded.comm_s > replicas.comm_s
    assert "sharded over 2 (FSDP2)" in make_plan(c, graph, None, limits=limits, pin=parse_pin("tp=2,fsdp=2")).reason


def test_unpinned_the_planner_weighs_each_admitted_tp_degree_and_takes_tp_where_it_predicts_it_fastest() -> None:
    """Two measured devices on two hosts and a model whose parameters dwarf its activations: the
    replicas would all-reduce 6 MB a step, a tp pair only each split Linear's small activations,
    and each member computes the same (half the batch on the whole model, or the whole batch on
    half of it): with tp=2 admitted the planner takes it, and lists it; without, it never weighs it;
    on guessed speeds, it waits for measurements."""
    graph = split_graph()
    two = cluster({"a": 100.0, "b": 100.0}, hosts={"a": "h1", "b": "h2"})
    admitted = PlanLimits(global_batch=8, tp_degrees=(2,))
    result = make_plan(two, graph, None, limits=admitted)
    assert result.plan is not None and result.plan.tp == 2, result.reason
    assert any(c.layout == "tp=2" and c.chosen for c in result.candidates), result.candidates
    plain = make_plan(two, graph, None, limits=PlanLimits(global_batch=8))
    assert plain.plan is not None and plain.plan.tp == 1 and not any("tp" in c.layout for c in plain.candidates)
    guessed = cluster({"a": 0.0, "b": 0.0}, hosts={"a": "h1", "b": "h2"})
    first = make_plan(guessed, graph, None, limits=admitted)
    assert first.plan is not None and first.plan.tp == 1, first.reason


def test_the_full_mesh_pinned_puts_each_tp_group_on_one_stage_and_shards_it_with_its_peers() -> None:
    """`pp=2,fsdp=2,tp=2` over eight devices: two stages, each sharded over two tp pairs; a tp
    pair's members share a stage and a shard coordinate, every unit in one stage."""
    graph = split_graph()
    c = cluster({f"d{i}": 100.0 for i in range(8)})
    result = make_plan(c, graph, None, limits=PlanLimits(global_batch=16), pin=parse_pin("pp=2,fsdp=2,tp=2"))
    plan = result.plan
    assert plan is not None and plan.layout.describe() == "pp=2 x dp_shard=2 x tp=2", result.reason
    layout = plan.layout
    assert [u for stage in layout.stages for u in stage] == [layer.name for layer in graph.layers]
    for rank in range(8):
        pp, _, shard, _ = layout.coords(rank)
        assert {layout.coords(r)[:3] for r in layout.tp_group(rank)} == {(pp, 0, shard)}
    assert sum(layout.shares[r] for r in range(8) if layout.coords(r)[0] == 0 and layout.coords(r)[3] == 0) == 16


def test_every_tp_group_of_a_plan_computes_samples_however_slow() -> None:
    """dp x tp over a fast pair and a pair a hundred times slower: the balance would leave the slow
    pair idle; it gets at least one sample (an idle replica would hold its part for nothing)."""
    graph = split_graph()
    c = cluster({"a": 100.0, "b": 100.0, "c": 1.0, "d": 1.0})
    plan = make_plan(c, graph, None, limits=PlanLimits(global_batch=16), pin=parse_pin("tp=2,dp=2")).plan
    assert plan is not None and plan.layout.describe() == "dp_replicate=2 x tp=2"
    assert min(plan.shares) >= 1 and sum(plan.layout.shares[::2]) == 16, plan.shares


def test_a_tp_plan_is_predicted_again_as_it_was_planned_even_from_the_journal() -> None:
    """A restarted coordinator takes its plan back from the journal without a prediction: each tp
    layout is predicted again as the planner first predicted it (FSDP x tp with its shards, pp x
    tp from its cut), and re-planning from it (a new pin at the restart) does not fail."""
    from plan.prediction import repredict

    graph = split_graph()
    c = cluster({f"d{i}": 100.0 for i in range(4)})
    limits = PlanLimits(global_batch=16)
    for spec in ("tp=2,dp=2", "tp=2,fsdp=2", "pp=2,tp=2"):
        planned = make_plan(c, graph, None, limits=limits, pin=parse_pin(spec)).plan
        assert planned is not None and planned.predicted_step_s is not None
        journaled = dataclasses.replace(planned, predicted_step_s=None, comm_s=None, costs=())
        again = repredict(c, graph, journaled)
        assert again.layout == planned.layout and again.predicted_step_s is not None, spec
        assert abs(again.predicted_step_s - planned.predicted_step_s) <= 1e-9 * planned.predicted_step_s, spec
        moved = make_plan(c, graph, journaled, limits=limits, pin=parse_pin("dp=1"), holders=journaled.members)
        assert moved.plan is not None and moved.plan.layout.describe() == "dp_shard=4", (spec, moved.reason)
