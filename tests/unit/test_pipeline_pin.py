"""`--layout pp=P`: the planner cuts the P fastest devices into stages by their speed and memory, lists
them in stage order, and says why when no pipeline can run; the coordinator ships, journals,
explains and hands over a pipeline's state as it does a sharded one's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_membership import Sim, deltas, the_delta, timed
from test_phase import _ask

from coordinator import membership as m
from coordinator.cli import parse_args
from coordinator.ctl import format_explain, format_plan
from coordinator.journal import Journal, recover, snapshot
from coordinator.state import workers_needed
from plan import Cluster, Device, Graph, Plan, PlanLimits, make_plan
from plan.graph import Layer
from plan.layout import parse_pin
from plan.pipeline import micro_split
from plan.prediction import FIXED_PRIOR_SAMPLES, fits_comm, measured_overhead, reported_compute, repredict
from transport import SaveModel, Saved

MB = 1_000_000
LIMITS = PlanLimits(global_batch=16)
PP2 = parse_pin("pp=2")


def _graph(flops: list[float], *, sequential: bool = True) -> Graph:
    """Units "0", "1", ... of these forward FLOPs, 1 MB of parameters each (Adam: 2 MB of state)."""
    return Graph(tuple(Layer(name=str(i), kind="block", forward_flops=f, param_bytes=MB, activation_bytes=1000,
                             boundary_bytes=100) for i, f in enumerate(flops)),
                 optimizer_state_bytes=2 * MB * len(flops), sequential=sequential)


GRAPH = _graph([1e6] * 6)


def _cluster(speeds: dict[str, float], memory: int = 1 << 34) -> Cluster:
    c = Cluster()
    for name, speed in speeds.items():
        c = c.with_device(Device(name=name, host="h", kind="cpu", flops=1e9, memory_bytes=memory, samples_per_s=speed))
    return c


def _stage_flops(graph: Graph, plan: Plan) -> dict[str, float]:
    train = {layer.name: layer.train_flops for layer in graph.layers}
    return {member: sum(train[u] for u in stage) for member, stage in zip(plan.members, plan.stages)}


def test_equal_devices_get_even_stages_on_the_whole_batch_in_the_micro_batches_the_worker_runs() -> None:
    result = make_plan(_cluster({"a": 100.0, "b": 100.0}), GRAPH, None, limits=LIMITS, pin=PP2)
    plan = result.plan
    assert plan is not None, result.reason
    assert plan.members == ("a", "b") and plan.stages == (("0", "1", "2"), ("3", "4", "5"))
    assert plan.shares == (16, 16) and plan.global_batch == 16, "both stages compute the same 16 samples"
    layout = plan.layout
    assert layout.pp == 2 and layout.global_batch == 16 and layout.to_dict()["stages"] == [["0", "1", "2"], ["3", "4", "5"]]
    sizes = micro_split(16, plan.micro[0])
    assert plan.micro == (sizes[0],) * 2 and sum(sizes) == 16
    assert result.reason.startswith("layout pinned by --layout pp=2: pp=2, stages [0 1 2] on a (100 samples/s), "
                                    f"[3 4 5] on b (100 samples/s), {len(sizes)} micro-batch"), result.reason
    assert plan.comm_s == 0.0 and all(c.samples == 16 and c.compute_s + c.wait_s == pytest.approx(plan.predicted_step_s)
                                      for c in plan.costs)


def test_a_slower_device_gets_the_cheaper_stage_and_members_follow_the_stages() -> None:
    plan = make_plan(_cluster({"a": 50.0, "b": 100.0}), GRAPH, None, limits=LIMITS, pin=PP2).plan
    assert plan is not None
    flops = _stage_flops(GRAPH, plan)
    assert flops["a"] < flops["b"], plan.stages
    # A heavy first unit: the fast device must hold it, so it goes first though "a" ranks first by name.
    heavy = _graph([5e6, 1e6, 1e6, 1e6, 1e6, 1e6])
    result = make_plan(_cluster({"a": 50.0, "b": 100.0}), heavy, None, limits=LIMITS, pin=PP2)
    assert result.plan is not None and result.plan.members == ("b", "a"), result.plan
    assert result.plan.stages[0][0] == "0" and "[0 1 2] on b" in result.reason, result.reason
    assert [c.name for c in result.plan.costs] == ["b", "a"]


def test_what_no_pipeline_can_run_is_refused_with_the_reason() -> None:
    seven = make_plan(_cluster({f"d{i}": 100.0 for i in range(7)}), GRAPH, None, limits=LIMITS, pin=parse_pin("pp=7"))
    assert seven.plan is None and seven.status == "infeasible"
    assert seven.reason == "--layout pp=7 needs 7 stages of at least one unit, but the model has 6 units"
    tangled = make_plan(_cluster({"a": 100.0, "b": 100.0}), _graph([1e6] * 6, sequential=False), None,
                        limits=LIMITS, pin=PP2)
    assert tangled.plan is None and tangled.reason == (
        "--layout pp=2: the model's units do not form a sequence (it is not an nn.Sequential of its units), "
        "so it cannot be cut into pipeline stages; a job gives its model as one with Job.sequence")
    alone = make_plan(_cluster({"a": 100.0}), GRAPH, None, limits=LIMITS, pin=PP2)
    assert alone.plan is None and alone.reason == "--layout pp=2 needs 2 members; 1 can train now"
    small = make_plan(_cluster({"a": 100.0, "b": 100.0}, memory=4 * MB), GRAPH, None, limits=LIMITS, pin=PP2)
    assert small.plan is None and small.reason.startswith("--layout pp=2 does not fit: no cut of the model's 6 units "
                                                          "into 2 stages fits"), small.reason


def test_the_fastest_train_the_rest_wait_and_a_straggler_is_cut_a_smaller_stage() -> None:
    c = _cluster({"a": 100.0, "b": 100.0, "c": 40.0})
    first = make_plan(c, GRAPH, None, limits=LIMITS, pin=PP2)
    assert first.plan is not None and first.plan.members == ("a", "b")
    assert first.standby == ("c",) and first.standby_why == ("not in the pinned layout",)
    assert repredict(c, GRAPH, first.plan) == first.plan, "a cut in force is predicted as it was planned"
    # At 80 samples/s the even cut is still the best: nothing moves.
    small = make_plan(c.with_speed("b", 80.0), GRAPH, first.plan, limits=LIMITS, pin=PP2)
    assert small.plan is not None and small.plan.same_assignment(first.plan) and small.moved_bytes == 0
    # A cut in force that the new best beats by less than 3% stays (hysteresis).
    recut = make_plan(c.with_speed("b", 75.0), GRAPH, first.plan, limits=LIMITS, pin=PP2).plan
    assert recut is not None and recut.stages[0] == ("0", "1", "2", "3")
    stays = make_plan(c.with_speed("b", 76.0), GRAPH, recut, limits=LIMITS, pin=PP2)
    assert stays.plan is not None and stays.plan.same_assignment(recut), stays.reason
    assert "kept the current cut" in stays.reason and "[0 1 2 3] on a" in stays.reason, stays.reason
    slow = make_plan(c.with_speed("b", 60.0), GRAPH, first.plan, limits=LIMITS, pin=PP2)
    assert slow.plan is not None and slow.plan.members == ("a", "b"), slow.reason
    assert len(slow.plan.stages[1]) < 3 and slow.plan.predicted_step_s is not None
    assert first.plan.predicted_step_s is not None and slow.plan.predicted_step_s > first.plan.predicted_step_s
    assert slow.moved_bytes == 0, "each member keeps a copy of the other's stage: a new cut of the two moves nothing"
    kept = make_plan(c.with_speed("b", 20.0), GRAPH, first.plan, limits=LIMITS, pin=PP2)
    assert kept.plan is not None and kept.plan.members == ("a", "c"), "a device slower than one waiting is replaced"


def test_the_members_that_stay_keep_their_stages_and_only_the_leavers_part_moves() -> None:
    """b and c held stages 1 and 2 (and, in the ring of copies, the stage before theirs); a leaves
    and d (as fast) comes: d takes stage 0 and b and c keep theirs, so only d receives: its stage
    and the copy it keeps of c's, four units of 3 MB (parameters and Adam's two moments). Had b
    and c moved up a stage, twice that would move."""
    pp3 = parse_pin("pp=3")
    first = make_plan(_cluster({"a": 100.0, "b": 100.0, "c": 100.0}), GRAPH, None, limits=LIMITS, pin=pp3).plan
    assert first is not None and first.members == ("a", "b", "c") and [len(s) for s in first.stages] == [2, 2, 2]
    result = make_plan(_cluster({"b": 100.0, "c": 100.0, "d": 100.0}), GRAPH, first, limits=LIMITS, pin=pp3,
                       holders=["b", "c"])
    assert result.plan is not None and result.plan.members == ("d", "b", "c") and result.plan.stages == first.stages
    assert result.moved_bytes == 4 * 3 * MB, result.moved_bytes


# --- the coordinator ---------------------------------------------------------------------------------


def test_the_flag_waits_for_p_workers_and_refuses_what_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--bind", "tcp://127.0.0.1:0", "--job", "x.py:job", "--insecure"]
    config, _ = parse_args([*base, "--layout", "pp=3"])
    assert config.layout == parse_pin("pp=3") and workers_needed(config.layout, config.min_workers) == 3
    assert "--layout pp=3 needs 3 members: training starts once 3 workers are ready" in capsys.readouterr().err
    for bad, said in ((["--layout", "pp=2,fsdp=2", "--max-workers", "3"], "needs 4 members, but --max-workers is 3"),
                      (["--layout", "pp=3", "--max-workers", "2"], "needs 3 members, but --max-workers is 2")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*base, *bad])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and said in err, err


def _pipeline_sim() -> Sim:
    """a and b train a `--layout pp=2` pipeline of GRAPH."""
    sim = Sim(state=m.State(layout=PP2))
    sim(m.GraphReceived(GRAPH))
    sim.running("a", "b")
    return sim


def test_the_coordinator_ships_the_cut_and_journals_it(tmp_path: Path) -> None:
    sim = _pipeline_sim()
    assert sim.state.delta is not None and sim.state.plan is not None
    layout = sim.state.delta.layout
    assert (layout.pp, layout.dp_replicate, layout.stages) == (2, 1, [["0", "1", "2"], ["3", "4", "5"]])
    assert layout.shares == [64, 64] and sim.state.delta.global_batch == 64
    journal = Journal(tmp_path / "journal.sqlite")
    journal.load()
    journal.save(snapshot(sim.state, {}))
    journal.close()
    again = Journal(tmp_path / "journal.sqlite")
    values = again.load()
    again.close()
    assert values is not None
    recovered = recover(values, now=1.0).recovered_plan
    assert recovered is not None and recovered.same_assignment(sim.state.plan), recovered
    assert recovered.pp == 2 and recovered.stages == (("0", "1", "2"), ("3", "4", "5"))


def test_a_stage_that_runs_as_predicted_is_no_speed_change() -> None:
    """A stage reports its compute as the whole model's (worker/step.py): the tracker expects that
    scale, so a stage computing just as planned is neither a calibration nor a straggler."""
    sim = _pipeline_sim()
    plan, tracker = sim.state.plan, sim.state.tracker
    assert plan is not None and tracker is not None
    speeds = sim.state.cluster.speeds_for(GRAPH.train_flops)
    passes = len(micro_split(64, plan.micro[0]))
    # the whole model's time for the 64 samples, with its fixed cost per pass (`FIXED_PRIOR_SAMPLES`)
    whole = {n: (64 + passes * FIXED_PRIOR_SAMPLES) / speeds[n] for n in plan.members}
    assert {n: w.expected_s for n, w in tracker.watches.items()} == pytest.approx(whole)
    assert plan.costs[0].compute_s == pytest.approx(whole["a"] / 2), "the stage computes half the model"
    effects = []
    for step in range(1, 13):
        for n in plan.members:
            effects += sim(timed(n, step, sim.state.epoch, 64, whole[n]))
    assert not [e for e in effects if isinstance(e, m.Log) and e.kind in ("calibration", "straggler", "recovered")]
    assert not deltas(effects), "nothing to re-plan"


def test_a_stages_report_is_fitted_per_pass() -> None:
    """A stage's report covers its micro-batches' passes, each with the device's fixed cost: a
    device measured before (speed v, fixed c per pass) whose reports are exactly what its model
    says keeps that model, fitted per pass (fitted whole, the fixed cost counted once would read as
    a slower device, and every prediction would charge it again once per micro-batch)."""
    sim = _pipeline_sim()
    plan = sim.state.plan
    assert plan is not None
    v, c = 50.0, 0.04
    sim.state = replace(sim.state, cluster=replace(sim.state.cluster, devices={
        n: replace(d, samples_per_s=v, compute_fixed_s=c, reports=10) for n, d in sim.state.cluster.devices.items()}))
    sizes = micro_split(64, plan.micro[0])
    assert len(sizes) > 1
    report = sum(c + b / v for b in sizes)
    for step in range(1, 13):
        for n in plan.members:
            sim(timed(n, step, sim.state.epoch, 64, report))
    for d in sim.state.cluster.devices.values():
        assert d.compute_fixed_s == pytest.approx(c) and d.samples_per_s == pytest.approx(v, rel=0.02), d
    # A device whose fixed cost is not measured (a pipeline never runs two share sizes): the
    # prediction charges FIXED_PRIOR_SAMPLES' worth per pass, and the fit reads the report so.
    sim = _pipeline_sim()
    speeds = sim.state.cluster.speeds_for(GRAPH.train_flops)
    report = {n: sum((b + FIXED_PRIOR_SAMPLES) / speeds[n] for b in sizes) for n in plan.members}
    for step in range(1, 13):
        for n in plan.members:
            sim(timed(n, step, sim.state.epoch, 64, report[n]))
    assert sim.state.cluster.speeds_for(GRAPH.train_flops) == pytest.approx(speeds, rel=0.02)
    again = make_plan(sim.state.cluster, GRAPH, None, limits=PlanLimits(global_batch=64), pin=PP2).plan
    assert again is not None and reported_compute(again, GRAPH) == pytest.approx(report, rel=0.02)


def test_plan_explain_describes_the_stages() -> None:
    sim = _pipeline_sim()
    plan = _ask(sim, "plan", "explain")
    explained = plan["explain"]
    assert isinstance(explained, dict) and "placements" not in explained
    assert explained["stages"] == [{"stage": 0, "units": ["0", "1", "2"], "members": ["a"]},
                                   {"stage": 1, "units": ["3", "4", "5"], "members": ["b"]}]
    text = format_explain(plan)
    assert "stage 0: units [0 1 2] on a" in text and "stage 1: units [3 4 5] on b" in text
    shown = format_plan(plan)
    assert "layout pipeline (pp=2)" in shown and "STAGE: UNITS" in shown and "1: 3 4 5" in shown, shown


def test_a_member_that_leaves_a_pipeline_sends_its_stage_and_every_stage_saves() -> None:
    """A stage's units are held by its member alone, as a shard is: a drained member hands them over as
    a sender; a save asks every member, as for a sharded layout."""
    sim = _pipeline_sim()
    effects = sim(m.SaveRequested("/out"))
    assert {e.to for e in effects if isinstance(e, m.Send) and isinstance(e.msg, SaveModel)} == {"a", "b"}
    sim.join("c", ready=False)
    sim.state = replace(sim.state, workers={n: replace(w, ready=True) for n, w in sim.state.workers.items()})
    effects = sim(m.DrainRequested("b"))
    d = the_delta(effects)
    assert set(d.members) == {"a", "c"} and d.layout.pp == 2 and d.senders == ["b"], d
    assert "b" in deltas(effects) and d.from_sharded


def test_a_save_a_failure_interrupted_is_answered_once() -> None:
    """Every member of a gather a failure cut short says so; `ctl save` gets one `save_failed`, and
    the same path asked again is answered by its write."""
    sim = _pipeline_sim()
    sim(m.SaveRequested("/out"))
    interrupted = [m.ModelSaved(Saved(name=n, step=3, path="/out", bytes=0, error="interrupted: ask again",
                                      final=False)) for n in ("a", "b")]
    said = [e for ev in interrupted for e in sim(ev) if isinstance(e, m.Log)]
    assert [(e.kind, e.fields["worker"]) for e in said] == [("save_failed", "a")], said
    sim(m.SaveRequested("/out"))
    written = sim(m.ModelSaved(Saved(name="a", step=4, path="/out", bytes=10, error="", final=False)))
    assert [e.kind for e in written if isinstance(e, m.Log)] == ["saved"] and not sim.state.saves


def test_a_stages_report_teaches_no_overhead_and_no_link() -> None:
    """A stage reports its compute at the whole model's scale, beyond its step time: step - compute -
    comm says nothing of its overhead (it would read 0 and drag the device's fit down), and its sends
    between stages are no collective of the link fit."""
    pipeline = make_plan(_cluster({"a": 100.0, "b": 100.0}), GRAPH, None, limits=LIMITS, pin=PP2).plan
    replicated = make_plan(_cluster({"a": 100.0, "b": 100.0}), GRAPH, None, limits=LIMITS).plan
    assert pipeline is not None and replicated is not None and replicated.pp == 1
    assert measured_overhead(pipeline, 0.2, 0.3, 0.05) is None and not fits_comm(pipeline)
    assert measured_overhead(replicated, 0.2, 0.1, 0.05) == pytest.approx(0.05) and fits_comm(replicated)


def test_replicated_pipelines_pair_like_devices_per_stage_and_split_the_batch() -> None:
    """`--layout pp=2,dp=2` over four devices, two fast and two at half speed: each stage position
    gets two devices of like speed (the fast pair and the slow pair, rank = stage x 2 + replica), the
    slow pair's stage holds fewer FLOPs, and each pipeline computes half the batch."""
    pin = parse_pin("pp=2,dp=2")
    assert pin.members == 4
    c = _cluster({"a": 100.0, "b": 50.0, "c": 100.0, "d": 50.0})
    result = make_plan(c, GRAPH, None, limits=LIMITS, pin=pin)
    plan = result.plan
    assert plan is not None, result.reason
    layout = plan.layout
    assert (layout.pp, layout.dp_replicate, layout.dp_shard) == (2, 2, 1)
    by_stage = [set(plan.members[0:2]), set(plan.members[2:4])]
    assert {"a", "c"} in by_stage and {"b", "d"} in by_stage, plan.members
    slow = by_stage.index({"b", "d"})
    flops = [sum(layer.train_flops for layer in GRAPH.layers if layer.name in stage) for stage in plan.stages]
    assert flops[slow] < flops[1 - slow], plan.stages
    assert plan.shares == (8, 8, 8, 8) and layout.global_batch == 16
    assert "2 pipelines" in result.reason, result.reason
