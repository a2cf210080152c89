"""A tensor-parallel job end to end, with the real coordinator and workers on loopback: `--layout
tp=2` splits the GPT example's attention (q, k, v column-wise, the projection row-wise) and MLP
across two members with DTensor, each holding its half of those Linears.

- Two members train tp=2: every step's loss, learning rate and gradient norm equal the
  single-process recipe's within 1e-4, the plan's layout carries tp, and the trained model is
  written whole (gathered from the split tensors), loadable into the plain model.
- SIGKILL of a tp member in the backward: the worker on standby takes its half from the copy the
  other member keeps (a ring of copies covers tp slices); nothing is lost, the curve is the same.
- Live, on a running job (`ctl layout`): replicas -> tp=2 -> a pipeline -> tp=2 -> FSDP, every change
  entered without a restart, the curve the single-process one throughout; a tp the model cannot run
  is refused by ctl too.
- Two replicas of tp=2 (`tp=2,dp=2`, four workers): exact; SIGKILL of one member in the backward,
  a fifth worker takes its slices from the other replica, nothing lost.
- A pipeline of tp stages (`pp=2,tp=2`, four workers): exact, the written model whole; SIGKILL of a
  member in the forward, a fifth worker takes its slices from the copy the ring keeps.
- A pinned tp the model cannot run (3 does not divide the 4 heads) is refused at start with the reason.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from localjob import LocalJob
from test_recipe import JOB, _check_the_trained_model, single_process
from test_layout_change import _relaid
from test_sharded import _assert_exact, _wait_for_log

ROOT = Path(__file__).resolve().parents[2]


def _tp_plans(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["kind"] == "plan" and e.get("layout")]


@pytest.mark.timeout(400)
def test_tensor_parallel_is_exact_and_writes_the_whole_model(tmp_path: Path) -> None:
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "tp=2"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        plans = _tp_plans(job)
        assert plans and all(p["layout"]["tp"] == 2 and p["layout"]["dp_replicate"] == 1 for p in plans), plans
        _assert_exact(events, reference)
        finished = [e for e in events if e["kind"] == "finished"]
        _check_the_trained_model(tmp_path, finished, job.tail("coordinator.out", 100_000), trained)


@pytest.mark.timeout(400)
def test_a_tp_member_killed_in_the_backward_loses_nothing(tmp_path: Path) -> None:
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "tp=2"]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", "backward@12")
        job.add_worker("w2")
        job.wait_step(2, 180)
        job.add_worker("w3")
        job.wait_event(lambda e: e["kind"] == "standby" and e.get("worker") == "w3", 120, "w3 on standby")
        _wait_for_log(job, "w1", "pausing at backward of step 12")
        job.kill("w1")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert sorted(failure["layout"]["members"]) == ["w2", "w3"] and failure["layout"]["tp"] == 2
        exits = job.wait_workers(300)
        assert exits == {"w1": -signal.SIGKILL, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


@pytest.mark.timeout(500)
def test_replicas_of_tensor_parallel_groups_are_exact_and_survive_a_kill(tmp_path: Path) -> None:
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=4, coordinator_args=["--layout", "tp=2,dp=2"]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", "backward@12")
        for name in ("w2", "w3", "w4"):
            job.add_worker(name)
        job.wait_step(2, 300)
        job.add_worker("w5")
        job.wait_event(lambda e: e["kind"] == "standby" and e.get("worker") == "w5", 180, "w5 on standby")
        _wait_for_log(job, "w1", "pausing at backward of step 12")
        job.kill("w1")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        layout = failure["layout"]
        assert sorted(layout["members"]) == ["w2", "w3", "w4", "w5"] and (layout["tp"], layout["dp_replicate"]) == (2, 2)
        exits = job.wait_workers(400)
        assert exits == {"w1": -signal.SIGKILL, "w2": 0, "w3": 0, "w4": 0, "w5": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


@pytest.mark.timeout(500)
def test_a_pipeline_of_tensor_parallel_stages_is_exact_through_a_kill(tmp_path: Path) -> None:
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    with LocalJob(JOB, tmp_path, min_workers=4, coordinator_args=["--layout", "pp=2,tp=2"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2", "--pause-at", "forward@12")
        for name in ("w3", "w4"):
            job.add_worker(name)
        job.wait_step(2, 300)
        first = _tp_plans(job)[0]["layout"]
        assert (first["pp"], first["tp"], len(first["stages"])) == (2, 2, 2), first
        job.add_worker("w5")
        job.wait_event(lambda e: e["kind"] == "standby" and e.get("worker") == "w5", 180, "w5 on standby")
        _wait_for_log(job, "w2", "pausing at forward of step 12")
        job.kill("w2")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        layout = failure["layout"]
        assert sorted(layout["members"]) == ["w1", "w3", "w4", "w5"] and (layout["pp"], layout["tp"]) == (2, 2)
        exits = job.wait_workers(400)
        assert exits == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0, "w4": 0, "w5": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)
        finished = [e for e in events if e["kind"] == "finished"]
        _check_the_trained_model(tmp_path, finished, job.tail("coordinator.out", 100_000), trained)


@pytest.mark.timeout(400)
def test_a_running_job_moves_between_tp_and_every_other_layout_live(tmp_path: Path) -> None:
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2) as job:
        job.start()
        job.add_worker("w1", "--slowdown", "3")  # (margin for four changes before step 40)
        job.add_worker("w2", "--slowdown", "3")
        job.wait_step(3, 180)
        with pytest.raises(RuntimeError, match="tp=3 cannot run"):
            job.ctl("layout", "tp=3")
        for spec, degrees in (("tp=2", (1, 1, 1, 2)), ("pp=2", (2, 1, 1, 1)), ("tp=2", (1, 1, 1, 2)),
                              ("dp=1", (1, 1, 2, 1))):
            seen = len(job.events())
            assert job.ctl("layout", spec) == {"layout": spec}
            plan = _relaid(job, spec, seen)
            layout = plan["layout"]
            assert (layout["pp"], layout["dp_replicate"], layout["dp_shard"], layout["tp"]) == degrees, (spec, layout)
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


def test_a_tp_degree_that_does_not_divide_the_heads_is_refused_at_start(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", JOB,
                           "--layout", "tp=3", "--state-dir", str(tmp_path / "state"), "--insecure"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "tp=3 cannot run" in proc.stderr and "4 attention heads" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
