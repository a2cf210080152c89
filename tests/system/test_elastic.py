"""The elastic loop with real processes on loopback: kills, stops and joins during training.

Two runs of the same job are shared by several tests: an undisturbed one (tests/system/conftest.py),
and one in which a worker is SIGKILLed mid-run and a fourth worker joins later. The invariants of DESIGN.md
are asserted on their event logs and worker logs: survivors continue without restart, no step is lost
or applied twice, replicas hold bit-identical parameters, and the loss of every step equals the
undisturbed run's.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import NUM_STEPS
from localjob import LocalJob

JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'paced.py'}:job"

pytestmark = pytest.mark.timeout(240)


def plans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "plan"]


@pytest.fixture(scope="module")
def disturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 workers; SIGKILL w2 at step ~60; then w4 starts (and joins once built); run to the end."""
    with LocalJob(JOB, tmp_path_factory.mktemp("disturbed"), min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--digest-every", "1")
        job.wait_step(60, 120)
        pids = {n: p.pid for n, p in job.workers.items()}
        last_before_kill = max(job.steps())
        job.kill("w2")
        failure_plan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 30,
                                      "failure plan")
        job.add_worker("w4", "--digest-every", "1")  # ready some seconds later, mid-run
        exits = job.wait_workers(180)
        coordinator_exit = job.wait_coordinator(30)
        return {"job": job, "events": job.events(), "exits": exits, "coordinator_exit": coordinator_exit,
                "pids": pids, "last_before_kill": last_before_kill, "failure_plan": failure_plan,
                "liveness": job.liveness()}


def test_the_kill_and_the_join_are_handled_in_time(disturbed: dict[str, Any]) -> None:
    """Liveness, beside the loss curve: the survivors train again within the bound, the joiner is
    planned in, every step is committed once, and nobody sat out a group timeout."""
    assert disturbed["liveness"] == []


def test_kill_survivors_continue_without_restart(disturbed: dict[str, Any]) -> None:
    events, job = disturbed["events"], disturbed["job"]
    failed = [e for e in events if e["kind"] == "failed"]
    assert [(e["worker"], e["detected_by"]) for e in failed] == [("w2", "disconnect")]
    assert "w2" not in disturbed["failure_plan"]["layout"]["members"]
    epoch = disturbed["failure_plan"]["epoch"]
    after = [e["step"] for e in events if e["kind"] == "step" and e["epoch"] == epoch]
    assert after and after[0] <= disturbed["last_before_kill"] + 2, "survivors resumed where they were"
    # Same processes all along: each survivor joined once and exited 0 at the end.
    assert disturbed["exits"] == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0, "w4": 0}
    for name in ("w1", "w3"):
        assert job.workers[name].pid == disturbed["pids"][name]
        assert (job.state_dir / f"{name}.log").read_text().count("joining") == 1
    assert disturbed["coordinator_exit"] == 0


def test_no_step_lost_or_applied_twice(disturbed: dict[str, Any]) -> None:
    job = disturbed["job"]
    assert sorted(job.steps()) == list(range(1, NUM_STEPS + 1))
    # Every finisher applied the same sequence of updates: identical parameters at the end.
    finals = {name: job.digests(name)[NUM_STEPS] for name in ("w1", "w3", "w4")}
    assert len(set(finals.values())) == 1, finals


def test_joiner_bit_identical_after_first_step(disturbed: dict[str, Any]) -> None:
    job = disturbed["job"]
    joined = [e for e in disturbed["events"] if e["kind"] == "joined" and e["worker"] == "w4"]
    assert joined, "w4 joined"
    join_plan = [p for p in plans(disturbed["events"]) if p["reason"] == "join" and "w4" in p["layout"]["members"]]
    assert join_plan, "a plan took w4 in"
    w4 = job.digests("w4")
    first = min(w4)
    assert first < NUM_STEPS, "w4 trained before the end"
    for name in ("w1", "w3"):
        assert job.digests(name)[first] == w4[first], f"{name} and w4 differ after w4's first step {first}"
    resharded = [e for e in disturbed["events"] if e["kind"] == "reshard" and e["epoch"] == join_plan[0]["epoch"]]
    assert resharded and resharded[0]["bytes"] > 0, "the joiner received state"


def test_loss_curve_equals_undisturbed_run(disturbed: dict[str, Any], undisturbed: dict[int, float]) -> None:
    job = disturbed["job"]
    assert sorted(undisturbed) == sorted(job.losses()) == list(range(1, NUM_STEPS + 1))
    worst = job.loss_gap(undisturbed)
    assert worst <= 1e-4, f"largest relative loss difference {worst:.2e}"


def test_stopped_worker_is_fenced_and_rejoins(tmp_path: Path, undisturbed: dict[int, float]) -> None:
    """SIGSTOP: excluded after the lease, the rest continue; SIGCONT: it is fenced (its epoch is
    gone), drops its state, joins again and finishes in step with the others."""
    with LocalJob(JOB, tmp_path, min_workers=3, lease_s=1.0) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--digest-every", "1")
        job.wait_step(40, 120)
        job.signal("w2", signal.SIGSTOP)
        failed = job.wait_event(lambda e: e["kind"] == "failed", 30, "failed")
        assert (failed["worker"], failed["detected_by"]) == ("w2", "lease")
        plan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 10, "failure plan")
        assert plan["layout"]["members"] == ["w1", "w3"]
        progressed = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 30,
                                    "a step without w2")
        job.signal("w2", signal.SIGCONT)
        job.wait_event(lambda e: e["kind"] == "plan" and "w2" in (e["layout"] or {}).get("members", [])
                       and e["epoch"] > plan["epoch"], 60, "w2 planned in again")
        # Its first words after SIGCONT spoke for a membership it had lost: refused (told to join
        # again) and counted, never applied.
        assert job.ctl("status")["refused"].get("stale", 0) >= 1
        exits = job.wait_workers(180)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        assert progressed["step"] < NUM_STEPS
        assert sorted(job.steps()) == list(range(1, NUM_STEPS + 1))
        finals = {name: job.digests(name)[NUM_STEPS] for name in ("w1", "w2", "w3")}
        assert len(set(finals.values())) == 1, finals
        assert "fenced" in (tmp_path / "w2.log").read_text()
        assert job.liveness() == []
        worst = job.loss_gap(undisturbed)
        assert worst <= 1e-4, f"largest relative loss difference {worst:.2e}"
        assert not [e for e in job.events() if e["kind"] == "left" and e["reason"].startswith("error")]


def test_preempted_and_drained_workers_leave_cleanly(tmp_path: Path, undisturbed: dict[int, float]) -> None:
    """SIGTERM (a spot preemption notice) and `ctl drain` plan a worker out at a step boundary:
    it exits 0, nobody is aborted, the others train on to the end with the same loss curve."""
    with LocalJob(JOB, tmp_path, min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--digest-every", "1")
        job.wait_step(40, 120)
        job.signal("w2", signal.SIGTERM)
        left = job.wait_event(lambda e: e["kind"] == "left" and e["worker"] == "w2", 30, "w2 left")
        assert left["reason"] == "preempted"
        assert job.workers["w2"].wait(timeout=30) == 0
        job.wait_step(left_step(job) + 20, 60)
        drained = job.ctl("drain", "w3")
        assert drained == {"draining": "w3"}
        left = job.wait_event(lambda e: e["kind"] == "left" and e["worker"] == "w3", 30, "w3 left")
        assert left["reason"] == "drained"
        exits = job.wait_workers(180)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] in ("failed",)]
        # (The cost model may also re-plan on its own measurements: calibration, stragglers.)
        measured = ("calibration", "straggler", "recovered")
        assert [p["reason"] for p in plans(events) if p["reason"] not in measured] == ["join", "preempted", "drained"]
        assert plans(events)[-1]["layout"]["members"] == ["w1"]
        assert sorted(job.steps()) == list(range(1, NUM_STEPS + 1))
        assert job.loss_gap(undisturbed) <= 1e-4
        # Planned changes abandon nothing: every epoch switch happened at a step boundary.
        for name in ("w1", "w2", "w3"):
            assert "abandoned" not in (tmp_path / f"{name}.log").read_text()


def left_step(job: LocalJob) -> int:
    return max(job.steps())


def test_coordinator_sigterm_stops_workers_cleanly(tmp_path: Path) -> None:
    with LocalJob(JOB, tmp_path, min_workers=2) as job:
        job.start()
        for name in ("w1", "w2"):
            job.add_worker(name)
        job.wait_step(20, 120)
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGTERM)
        assert job.wait_coordinator(30) == 0
        assert job.wait_workers(30) == {"w1": 0, "w2": 0}
        assert max(job.steps()) < NUM_STEPS
        reasons = {e["worker"]: e["reason"] for e in job.events() if e["kind"] == "left"}
        assert reasons == {"w1": "stopped", "w2": "stopped"}


def test_bad_job_is_refused_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad_job.py"
    bad.write_text("def job():\n    raise RuntimeError('no data here')\n")
    job = LocalJob(f"{bad}:job", tmp_path / "state")
    with pytest.raises(RuntimeError, match="no data here"):
        job.start()
    job.close()
    missing = LocalJob(f"{tmp_path / 'nope.py'}:job", tmp_path / "state2")
    with pytest.raises(RuntimeError, match="nope.py"):
        missing.start()
    missing.close()


def test_standby_worker_takes_over_a_failed_member(tmp_path: Path) -> None:
    """--max-workers 2 keeps a third worker on standby; when a member is killed, the standby is
    planned in and receives the state, and training goes on to the end."""
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--max-workers", "2"]) as job:
        job.start()
        for name in ("w1", "w2"):
            job.add_worker(name, "--digest-every", "1")
        job.wait_step(10, 120)
        job.add_worker("w3", "--digest-every", "1")
        job.wait_event(lambda e: e["kind"] == "joined" and e["worker"] == "w3", 60, "w3 joined")
        job.wait_step(max(job.steps()) + 20, 60)
        assert all(p["layout"]["members"] == ["w1", "w2"] for p in plans(job.events())), "w3 waits"
        job.kill("w1")
        plan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 30, "failure plan")
        assert sorted(plan["layout"]["members"]) == ["w2", "w3"]
        exits = job.wait_workers(180)
        assert exits == {"w1": -signal.SIGKILL, "w2": 0, "w3": 0}
        assert job.wait_coordinator(30) == 0
        assert sorted(job.steps()) == list(range(1, NUM_STEPS + 1))
        assert job.digests("w2")[NUM_STEPS] == job.digests("w3")[NUM_STEPS]
