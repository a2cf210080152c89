"""The coordinator's journal (`coordinator.journal`) and the recovery transitions in membership: a
snapshot round-trips through SQLite, a damaged file is named, and a restarted coordinator puts the
journaled plan back once its members register again, or re-plans without those that do not."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from dataclasses import replace

from test_membership import LEASE_S, Sim, _config, _join_msg, deltas, logs, report, sent

from coordinator import membership as m
from coordinator.journal import Journal, JournalDamaged, recover, snapshot
from coordinator.state import State
from transport import Abort, Checkpointed


def _journaled(tmp_path: Path) -> tuple[Sim, dict[str, object]]:
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a", "b")
    sim(m.CheckpointWritten(Checkpointed(name="a", step=5, path="/ck/step-5", seconds=0.1, bytes=10, error="")))
    for step in (5, 6, 7):  # (an epoch's first steps are never measured: the last one is)
        sim(report("a", step))
    journal = Journal(tmp_path / "journal.sqlite")
    assert journal.load() is None
    journal.save(snapshot(sim.state, {"workers": "tcp://127.0.0.1:5555"}))
    journal.close()
    again = Journal(tmp_path / "journal.sqlite")
    values = again.load()
    again.close()
    assert values is not None
    return sim, values


def test_a_journaled_delta_keeps_the_layout_it_follows(tmp_path: Path) -> None:
    """A delta after the first carries the layout its members hold (`previous`): it survives the journal."""
    sim = Sim(config=_config())
    sim.running("a", "b")
    sim(m.Joined(_join_msg("c")))
    sim(m.MadeReady("c"))
    delta = sim.state.delta
    assert delta is not None and delta.epoch == 2 and delta.previous is not None
    assert delta.previous.members == ["a", "b"] and "c" in delta.members
    journal = Journal(tmp_path / "journal.sqlite")
    assert journal.load() is None
    journal.save(snapshot(sim.state, {}))
    journal.close()
    again = Journal(tmp_path / "journal.sqlite")
    values = again.load()
    again.close()
    assert values is not None and recover(values, now=1.0).delta == delta


def _back(name: str) -> m.Joined:
    """A member of the journaled epoch 1 registering again, at step 9."""
    return m.Joined(replace(_join_msg(name), epoch=1, step=9))


def test_a_snapshot_round_trips_and_recovers_the_plan(tmp_path: Path) -> None:
    sim, values = _journaled(tmp_path)
    assert values["endpoints"] == {"workers": "tcp://127.0.0.1:5555"}
    state = recover(values, now=50.0)
    assert (state.epoch, state.last_step, [c.step for c in state.checkpoints]) == (1, 7, [5])
    assert state.recovering == {"a", "b"} and state.recovered_plan is not None
    assert state.recovered_plan.members == ("a", "b") and state.delta == sim.state.delta
    assert set(state.recovered_devices) == {"a", "b"}


def test_members_back_put_the_plan_back_without_a_new_epoch(tmp_path: Path) -> None:
    _, values = _journaled(tmp_path)
    sim = Sim(config=_config(checkpoint_dir="/ck"), state=recover(values, now=100.0))
    effects = sim(_back("a")) + sim(m.MadeReady("a"))
    assert not deltas(effects) and sim.state.plan is None, "not before every member is back"
    assert sim.state.workers["a"].epoch == 1 and sim.state.workers["a"].step == 9
    assert sim.state.in_play("a") and sim.state.in_play("b"), "their step reports count meanwhile"
    sim(_back("b"))
    effects = sim(m.MadeReady("b"))
    assert logs(effects, "recovered") == [{"epoch": 1, "members": ["a", "b"], "missing": [], "step": 9,
                                           "seconds": 0.0}], "where the members said they are"
    assert not deltas(effects) and not sent(effects, Abort), "training never stopped: nothing to send"
    assert sim.state.plan is not None and sim.state.plan.members == ("a", "b") and not sim.state.pending
    assert sim.state.epoch == 1
    assert sim.state.cluster.devices["a"].reports > 0, "its measurements came back from the journal"


def test_a_member_not_back_within_the_grace_is_failed_and_the_rest_replan(tmp_path: Path) -> None:
    _, values = _journaled(tmp_path)
    sim = Sim(config=_config(checkpoint_dir="/ck"), state=recover(values, now=100.0))
    sim(_back("a"))
    sim(m.MadeReady("a"))
    sim.now += sim.config.recovery_grace_s + LEASE_S
    effects = sim(m.Tick())
    assert logs(effects, "recovered")[0]["missing"] == ["b"]
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "recovery"}]
    assert set(sent(effects, Abort)) == {"a"}
    delta = deltas(effects)["a"]
    assert delta.abort and delta.epoch == 2 and delta.members == ["a"] and delta.resume_path == ""


def test_a_damaged_journal_is_named(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 2000)
    with pytest.raises(JournalDamaged, match="journal.sqlite"):
        Journal(path).load()


def test_reports_sent_again_out_of_order_are_all_logged(tmp_path: Path) -> None:
    _, values = _journaled(tmp_path)
    sim = Sim(config=_config(checkpoint_dir="/ck"), state=recover(values, now=100.0))
    for name in ("a", "b"):
        sim(_back(name))
        sim(m.MadeReady(name))
    logged = [s for step in (8, 9, 14, 10, 11, 14, 12, 13, 15) for s in [x["step"] for x in logs(sim(report("a", step)), "step")]]
    assert sorted(logged) == list(range(8, 16)) and len(logged) == 8, logged


def test_a_member_back_from_the_epoch_before_makes_the_plan_switch_again(tmp_path: Path) -> None:
    """The coordinator died with its plan not in place everywhere: a member registers again at the
    epoch before. It is back (not a newcomer), and the members re-plan once all are."""
    _, values = _journaled(tmp_path)
    sim = Sim(config=_config(checkpoint_dir="/ck"), state=recover(values, now=100.0))
    sim(_back("a"))
    sim(m.MadeReady("a"))
    sim(m.Joined(replace(_join_msg("b"), epoch=0, step=9)))
    effects = sim(m.MadeReady("b"))
    assert logs(effects, "recovered")[0]["missing"] == []
    delta = deltas(effects)["a"]
    assert delta.abort and delta.epoch == 2 and set(delta.members) == {"a", "b"}


def test_the_journal_holds_a_change_before_any_event_announces_it(tmp_path: Path) -> None:
    """Write-ahead: when the `checkpoint` event is written, the journal already lists that
    checkpoint, so a coordinator killed right after the event restarts knowing it (found in CI: the
    event was logged, the coordinator killed, and its successor resumed from nothing)."""
    from coordinator.daemon import Core, CoordinatorConfig
    from coordinator.events import EventLog
    from coordinator.jobinfo import JobInfo

    cfg = CoordinatorConfig(bind="", control="", state_dir=tmp_path, keys=None, checkpoint_dir=Path("/ck"), quiet=True)
    info = JobInfo(ref="job.py:job", path="job.py", name="job", source="", sha256="0" * 64, global_batch=8,
                   num_steps=100, seed=0, num_params=10, description="")
    log, journal = EventLog(tmp_path / "events.jsonl"), Journal(tmp_path / "journal.sqlite")
    assert journal.load() is None  # (a fresh journal)
    core = Core(cfg, info, None, None, log, run_id="1", journal=journal)  # type: ignore[arg-type]  (no socket used)
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a", "b")
    core.state = sim.state
    journaled_at_event: list[list[int]] = []
    write = log.write

    def write_and_look(kind: str, **fields: object) -> None:
        if kind == "checkpoint":
            reader = Journal(tmp_path / "journal.sqlite")
            values = reader.load()
            reader.close()
            assert values is not None
            journaled_at_event.append([c.step for c in recover(values, now=0.0).checkpoints])
        write(kind, **fields)

    log.write = write_and_look  # type: ignore[method-assign]
    core.apply(m.CheckpointWritten(Checkpointed(name="a", step=5, path="/ck/step-5", seconds=0.1, bytes=10, error="")))
    assert journaled_at_event == [[5]]
    journal.close()  # a journal that cannot be written any more (a full disk): said, and the job goes on
    core.apply(m.CheckpointWritten(Checkpointed(name="b", step=6, path="/ck/step-6", seconds=0.1, bytes=10, error="")))
    log.close()
    assert [c.step for c in core.state.checkpoints] == [5, 6]


def test_a_restart_takes_the_job_from_the_journal_only_while_its_file_is_unchanged(tmp_path: Path) -> None:
    """A restarted coordinator listens first: the journal's facts of the job replace inspecting it (a
    subprocess that imports torch) as long as the reference and the file's text are the same."""
    from coordinator.jobinfo import JobInfo, facts, journaled_job

    source = "def job():\n    ...\n"
    path = tmp_path / "job.py"
    path.write_text(source)
    sha = hashlib.sha256(source.encode()).hexdigest()
    job = JobInfo(ref=f"{path}:job", path=str(path), name="job", source=source, sha256=sha, global_batch=16,
                  num_steps=40, seed=3, num_params=1234, description="a job")
    journal = Journal(tmp_path / "journal.sqlite")
    journal.load()
    journal.save(snapshot(State(), {}, job=facts(job)))
    journal.close()
    assert journaled_job(tmp_path / "journal.sqlite", job.ref) == job
    assert journaled_job(tmp_path / "journal.sqlite", f"{path}:other") is None, "another reference: inspected"
    path.write_text(source + "# edited\n")
    assert journaled_job(tmp_path / "journal.sqlite", job.ref) is None, "an edited file: inspected"
    assert journaled_job(tmp_path / "none.sqlite", job.ref) is None
