"""`ctl layout SPEC` through the pure core: the control handler checks SPEC and hands membership a
`LayoutRequested`; membership replaces the pin in force (`State.layout`) and re-plans at once with
reason "layout", past the pay-off rule; a pin that cannot be met waits for workers while the
current plan trains on; the pin survives the journal, and a restart's different --layout wins."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_membership import Sim, _config, _join_msg, deltas, logs, report, train
from test_pipeline_pin import GRAPH

from coordinator import membership as m
from coordinator.control import ControlView, answer_control
from coordinator.ctl import format_explain, format_layout, format_plan, format_status, parse_args
from coordinator.journal import Journal, recover, restart_layout, snapshot
from coordinator.phase import phase
from plan.layout import LayoutError, parse_pin
from plan.prediction import repredict
from transport import ControlRequest, PlanDelta


def _view(sim: Sim, **kw: Any) -> ControlView:
    return ControlView(state=sim.state, job_ref="job.py:job", num_steps=sim.config.num_steps, global_batch=64,
                       uptime_s=1.0, min_workers=sim.config.min_workers, max_workers=sim.config.max_workers, **kw)


def ctl(sim: Sim, command: str, *args: str) -> tuple[dict[str, Any], str, list[m.Effect]]:
    """The reply to a control command (data, error) and the effects of applying its events, as the daemon does."""
    reply, events = answer_control(_view(sim), ControlRequest(command=command, args=list(args)), now=sim.now)
    effects: list[m.Effect] = []
    for event in events:
        effects += sim(event)
    return reply.data, reply.error, effects


def planned(effects: list[m.Effect]) -> list[m.Planned]:
    return [e for e in effects if isinstance(e, m.Planned)]


def replicated(*names: str, **config: Any) -> Sim:
    """`names` train replicated (no --layout) on the 6-unit sequential graph, the first plan in place."""
    sim = Sim(config=_config(**config))
    sim(m.GraphReceived(GRAPH))
    sim.running(*names)
    assert sim.state.plan is not None and sim.state.plan.layout.whole_replicas and sim.state.layout is None
    return sim


def _switched(sim: Sim, effects: list[m.Effect]) -> PlanDelta:
    """The one re-plan in `effects`, a new epoch for "layout", acknowledged by its members."""
    [p] = planned(effects)
    assert p.reason == "layout" and p.result.plan is not None, p.result.reason
    delta = next(iter(deltas(effects).values()))
    assert delta.reason == "layout" and delta.epoch == sim.state.epoch
    sim.ack_all()
    return delta


def test_a_pin_set_live_replans_at_once_to_a_pipeline_then_fsdp_then_auto() -> None:
    sim = replicated("a", "b")
    assert sim.state.plan is not None
    replicas_s = sim.state.plan.predicted_step_s
    data, error, effects = ctl(sim, "layout", "pp=2")
    assert data == {"layout": "pp=2"} and not error
    assert logs(effects, "layout") == [{"layout": "pp=2", "previous": "auto", "source": "ctl"}]
    assert sim.state.layout == parse_pin("pp=2")
    assert not logs(effects, "kept"), "an operator's layout is not weighed by the pay-off rule"
    delta = _switched(sim, effects)
    assert delta.layout.pp == 2 and len(delta.layout.stages) == 2 and delta.abort is False
    assert sim.state.plan is not None and sim.state.plan.layout.pp == 2
    assert sim.state.plan.predicted_step_s > replicas_s, "taken though predicted slower (no pay-off rule)"

    data, _, effects = ctl(sim, "layout", "fsdp=2")
    assert data == {"layout": "fsdp=2"}
    assert logs(effects, "layout") == [{"layout": "fsdp=2", "previous": "pp=2", "source": "ctl"}]
    delta = _switched(sim, effects)
    assert (delta.layout.pp, delta.layout.dp_shard, delta.layout.dp_replicate) == (1, 2, 1)
    assert sorted(delta.senders) == [], "both members stay: they reshard among themselves"

    data, _, effects = ctl(sim, "layout", "auto")
    assert data == {"layout": "auto"} and sim.state.layout is None
    assert logs(effects, "layout") == [{"layout": "auto", "previous": "fsdp=2", "source": "ctl"}]
    delta = _switched(sim, effects)
    assert delta.layout.dp_replicate == 2 and delta.layout.dp_shard == 1, "the planner's choice: replicas again"


@pytest.mark.parametrize("spec, said", [
    ("pp=x", "layout: 'pp=x' is not NAME=N with NAME one of dp, fsdp, pp, tp (e.g. layout dp=2,fsdp=2)"),
    ("dp=2,dp=3", "layout: dp given twice"),
    ("", "is not NAME=N"),
    ("dp=4,fsdp=2", "layout dp=4,fsdp=2 needs 8 members, but --max-workers is 4"),
])
def test_a_bad_spec_is_refused_and_changes_nothing(spec: str, said: str) -> None:
    sim = replicated("a", "b", max_workers=4)
    before = sim.state
    data, error, effects = ctl(sim, "layout", spec)
    assert said in error and data == {} and effects == [], error
    assert sim.state is before


def test_layout_takes_one_spec() -> None:
    sim = replicated("a", "b")
    for args in ([], ["pp=2", "fsdp=2"]):
        _, error, effects = ctl(sim, "layout", *args)
        assert "layout takes one SPEC" in error and "auto" in error and effects == []


def test_a_pin_that_needs_more_workers_waits_for_them_while_the_plan_trains_on() -> None:
    sim = replicated("a", "b")
    running = sim.state.plan
    _, _, effects = ctl(sim, "layout", "pp=3")
    [p] = planned(effects)
    assert p.reason == "layout" and p.result.status == "infeasible" and p.result.plan is None
    assert "needs 3 members" in p.result.reason and "the current plan trains on" in p.result.reason
    assert not deltas(effects) and sim.state.plan is running and sim.state.layout == parse_pin("pp=3")
    assert phase(sim.state).name == "training"
    effects = sim.join("c")  # the third worker: its join re-plans under the pin
    delta = next(iter(deltas(effects).values()))
    assert delta.layout.pp == 3 and sorted(delta.members) == ["a", "b", "c"]


def test_min_workers_follows_the_pin_in_force() -> None:
    """A job started with --layout pp=3 waits for three ready workers (the pin, not --min-workers, holds
    it back); `ctl layout auto` lets it start with the two it has."""
    sim = Sim(state=m.State(layout=parse_pin("pp=3")))
    sim(m.GraphReceived(GRAPH))
    assert not deltas(sim.join("a") + sim.join("b"))
    now = phase(sim.state, min_workers=1)
    assert now.name == "waiting_for_workers" and now.reason == "waiting for workers: 2 ready, the layout pinned to pp=3 needs 3"
    _, _, effects = ctl(sim, "layout", "auto")
    delta = _switched(sim, effects)
    assert sorted(delta.members) == ["a", "b"] and delta.epoch == 1


def test_a_change_during_a_switch_waits_for_it_and_no_speed_re_plan_replaces_it() -> None:
    sim = replicated("a", "b")
    sim.join("c")  # a planned join: epoch 2 in flight
    assert sim.state.pending and sim.state.epoch == 2
    _, _, effects = ctl(sim, "layout", "pp=3")
    assert not planned(effects) and sim.state.replan_wanted == "layout"
    sim(m.ReplanDue("straggler", abort=False))  # a re-plan the pay-off rule could turn down
    assert sim.state.replan_wanted == "layout", "the operator's change is not lost behind it"
    effects = [e for name in ("a", "b", "c") for e in sim.ack(name, epoch=2)]  # the join lands ...
    delta = next(iter(deltas(effects).values()))  # ... and the layout follows at once
    assert delta.epoch == 3 and delta.reason == "layout" and delta.layout.pp == 3


def test_the_same_layout_again_makes_no_new_epoch() -> None:
    sim = replicated("a", "b")
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    epoch = sim.state.epoch
    _, _, effects = ctl(sim, "layout", "pp=2")
    assert logs(effects, "layout") and not deltas(effects) and sim.state.epoch == epoch
    [kept] = logs(effects, "kept")
    assert kept["reason"] == "layout" and kept["detail"].startswith("the running plan (pp=2) is the one"), kept
    assert sim.state.kept is None, "nothing better was turned down (plan --explain says nothing of it)"


def test_finished_or_stopping_jobs_refuse_a_layout() -> None:
    sim = replicated("a", "b")
    sim.state = replace(sim.state, finished=True)
    _, error, effects = ctl(sim, "layout", "pp=2")
    assert "finished" in error and effects == []


def test_status_and_plan_show_the_pin() -> None:
    sim = replicated("a", "b")
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    status, _, _ = ctl(sim, "status")
    plan, _, _ = ctl(sim, "plan")
    assert status["layout_pin"] == plan["layout_pin"] == "pp=2"
    assert "layout pinned to pp=2" in format_status(status) and "(pinned to pp=2)" in format_plan(plan)
    assert format_layout({"layout": "pp=2"}).startswith("re-planning with the layout pinned to pp=2: the workers")
    assert format_layout({"layout": "auto"}).startswith("re-planning with no layout pin (the planner chooses)")


def test_ctl_takes_the_command() -> None:
    a = parse_args(["--control", "tcp://127.0.0.1:5556", "layout", "dp=2,fsdp=2", "--json"])
    assert (a.command, a.spec, a.json) == ("layout", "dp=2,fsdp=2", True)


# --- the journal ---------------------------------------------------------------------------------


def _journal(sim: Sim, tmp_path: Path, flag: str | None) -> dict[str, Any]:
    journal = Journal(tmp_path / "journal.sqlite")
    journal.load()
    journal.save(snapshot(sim.state, {}, flag=parse_pin(flag) if flag else None))
    journal.close()
    again = Journal(tmp_path / "journal.sqlite")
    values = again.load()
    again.close()
    assert values is not None
    return values


def _back(sim: Sim, *names: str) -> list[m.Effect]:
    effects: list[m.Effect] = []
    for name in names:
        effects += sim(m.Joined(replace(_join_msg(name), epoch=sim.state.epoch, step=sim.state.last_step)))
        effects += sim(m.MadeReady(name))
    return effects


def test_the_pin_survives_a_restart_with_the_same_command_line(tmp_path: Path) -> None:
    sim = replicated("a", "b")
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    sim(report("a", 1, epoch=sim.state.epoch))
    values = _journal(sim, tmp_path, flag=None)
    assert (values["layout"], values["layout_flag"]) == ("pp=2", "auto")
    assert restart_layout(values, None) == (parse_pin("pp=2"), None)
    again = Sim(config=sim.config, state=recover(values, now=sim.now))
    assert again.state.layout == parse_pin("pp=2") and again.state.replan_wanted is None
    effects = _back(again, "a", "b")
    assert logs(effects, "recovered") and not deltas(effects), "the journaled pipeline is put back as it was"


def test_a_restart_with_another_layout_takes_it_and_replans(tmp_path: Path) -> None:
    sim = replicated("a", "b")
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    values = _journal(sim, tmp_path, flag=None)
    fsdp = parse_pin("fsdp=2")
    assert restart_layout(values, fsdp) == (fsdp, "pp=2")
    again = Sim(config=sim.config, state=recover(values, now=sim.now, flag=fsdp))
    assert again.state.layout == fsdp and again.state.replan_wanted == "layout"
    effects = _back(again, "a", "b")
    delta = next(iter(deltas(effects).values()))
    assert delta.reason == "layout" and delta.layout.dp_shard == 2 and delta.layout.pp == 1


def test_a_restart_without_the_layout_it_was_started_with_lifts_the_pin(tmp_path: Path) -> None:
    sim = Sim(state=m.State(layout=parse_pin("fsdp=1")))
    sim(m.GraphReceived(GRAPH))
    sim.running("a", "b")
    values = _journal(sim, tmp_path, flag="fsdp=1")
    assert restart_layout(values, None) == (None, "fsdp=1")
    assert restart_layout(values, parse_pin("fsdp=1")) == (parse_pin("fsdp=1"), None)
    assert restart_layout({k: v for k, v in values.items() if k != "layout"}, None) == (None, None), \
        "a journal from before pins were journaled: the command line"
    with pytest.raises(LayoutError):
        parse_pin("bogus")
    assert restart_layout({**values, "layout": "bogus"}, None) == (None, "bogus")


def test_the_daemon_journals_the_pin_and_a_restart_with_another_layout_says_it_won(tmp_path: Path) -> None:
    """The daemon's side: `Core` journals the pin with its --layout at every change, and a Core started
    on that journal keeps it (same --layout) or takes its own and logs a `layout` event (another)."""
    from coordinator.daemon import Core, CoordinatorConfig
    from coordinator.events import EventLog
    from coordinator.jobinfo import JobInfo

    info = JobInfo(ref="job.py:job", path="job.py", name="job", source="", sha256="0" * 64, global_batch=64,
                   num_steps=100, seed=0, num_params=10, description="")

    def start(flag: str | None) -> Core:
        cfg = CoordinatorConfig(bind="", control="", state_dir=tmp_path, keys=None, quiet=True,
                                layout=parse_pin(flag) if flag else None)
        journal = Journal(tmp_path / "journal.sqlite")
        values = journal.load()
        return Core(cfg, info, None, None, EventLog(tmp_path / "events.jsonl"), run_id="1",  # type: ignore[arg-type]
                    journal=journal, journaled=values)  # (no socket is used)

    def stop(core: Core) -> list[dict[str, Any]]:
        assert core.journal is not None
        core.journal.close()
        events = list(core.log.events)
        core.log.close()
        return events

    first = start(None)
    assert first.state.layout is None
    first.state = replace(replicated("a", "b").state, layout=None)
    first.apply(m.LayoutRequested(parse_pin("pp=2")))
    assert first.state.plan is not None and first.state.plan.layout.pp == 2
    stop(first)

    same = start(None)  # a supervisor repeating the command line: the pin `ctl layout` set holds
    assert same.state.layout == parse_pin("pp=2") and same.state.replan_wanted is None
    events = stop(same)
    assert [e for e in events if e["kind"] == "layout"][-1]["source"] == "ctl"
    assert events[-1]["kind"] == "restarted" and events[-1]["layout"] == "pp=2"

    other = start("fsdp=2")  # the operator's latest word: the command line
    assert other.state.layout == parse_pin("fsdp=2") and other.state.replan_wanted == "layout"
    events = stop(other)
    assert events[-2]["kind"] == "restarted" and events[-2]["layout"] == "fsdp=2"
    assert {k: v for k, v in events[-1].items() if k != "ts"} == {
        "kind": "layout", "layout": "fsdp=2", "previous": "pp=2", "source": "command line"}


def test_a_layout_kind_that_computes_slower_than_predicted_is_learned_and_the_fits_stay_in_their_units() -> None:
    """Measured in data parallel, then pinned to a pipeline whose stages compute 1.6 times what the
    plan predicted: the kind "pp" learns an efficiency of 1.6 (its compute time over the fits'
    units), the devices' fits keep their data-parallel speeds (the pipeline's steps are divided by it
    before they are fitted), and the next pipeline is predicted at 1.6 times the compute of the
    first."""
    sim = replicated("a", "b")
    train(sim, 14, {"a": 0.01, "b": 0.01})  # measured (the heuristic plan, then the calibrated one)
    assert sim.state.cluster.efficiency_of("dp") == pytest.approx(1.0, rel=0.05)
    replicas = sim.state.plan
    assert replicas is not None
    before = repredict(sim.state.cluster, GRAPH, replicas)
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    first, tracker = sim.state.plan, sim.state.tracker
    assert first is not None and first.pp == 2 and tracker is not None and tracker.measured_members == {"a", "b"}
    shares = dict(zip(first.members, first.shares))  # (train takes seconds a sample)
    train(sim, 12, {n: 1.6 * c / shares[n] for n, c in tracker.planned.items()})
    assert sim.state.cluster.efficiency_of("pp") == pytest.approx(1.6, rel=0.05)
    after = repredict(sim.state.cluster, GRAPH, replicas)  # (the fits stay in data parallel's units)
    assert [c.compute_s for c in after.costs] == pytest.approx([c.compute_s for c in before.costs], rel=0.05)
    _switched(sim, ctl(sim, "layout", "dp=2")[2])
    train(sim, 12, {"a": 0.01, "b": 0.01})
    assert sim.state.cluster.efficiency_of("dp") == pytest.approx(1.0, rel=0.05)
    _switched(sim, ctl(sim, "layout", "pp=2")[2])
    again = sim.state.plan
    assert again is not None and again.pp == 2 and again.stages == first.stages
    for c, d in zip(first.costs, again.costs):
        assert d.compute_s == pytest.approx(1.6 * c.compute_s, rel=0.1), "predicted at the learned efficiency"
    shown = format_explain(ctl(sim, "plan", "explain")[0])  # (what `ctl plan --explain` prints)
    assert "layout efficiency" in shown and "pp 1.60" in shown, shown
    # A member three times slower than predicted from the pipeline epoch's start: a straggler, not a
    # slower layout (the kind's efficiency is what its members share: with two, the faster one's), and
    # fitted in data parallel's units (its speed change converted by the kind it was measured in).
    tracker = sim.state.tracker
    assert tracker is not None
    shares = dict(zip(again.members, again.shares))
    slow = {n: c / shares[n] * (3.0 if n == "a" else 1.0) for n, c in tracker.planned.items()}
    effects = train(sim, 8, slow)
    assert [f["worker"] for f in logs(effects, "straggler")] == ["a"]
    assert sim.state.cluster.efficiency_of("pp") == pytest.approx(1.6, rel=0.02), "the straggler moved the kind"
    [p] = planned(effects)
    assert p.result.plan is not None and len(p.result.plan.stages[p.result.plan.members.index("a")]) < 3, \
        "the straggler's stage is cut shorter (its fit bent by its slow steps gave it more)"
    sim.ack_all()
    train(sim, 6, slow)  # (re-cut stages: this replay charges the same per sample, a few % off the new cut's plan)
    assert sim.state.cluster.efficiency_of("pp") == pytest.approx(1.6, rel=0.05)
    after = repredict(sim.state.cluster, GRAPH, replicas)
    # (unconverted, the pipeline's 1.6 came on top: 4.8x; half the straggler taken for the kind's: 1.5x)
    assert 2.6 * before.costs[0].compute_s < after.costs[0].compute_s < 3.6 * before.costs[0].compute_s
    assert after.costs[1].compute_s == pytest.approx(before.costs[1].compute_s, rel=0.1)
