"""A tensor-parallel job end to end, with the real coordinator and workers on loopback: `--layout
tp=2` splits the GPT example's attention (q, k, v column-wise, the projection row-wise) and MLP
across two members with DTensor, each holding its half of those Linears.

- tp=2, two replicas of tp=2 (`tp=2,dp=2`) and a pipeline of tp stages (`pp=2,tp=2`): every step's
  loss, learning rate and gradient norm equal the single-process recipe's within 1e-4, the plan's
  layout carries tp, and the trained model is written whole (gathered from the split tensors),
  loadable into the plain model; through a SIGKILL of a member of each of two replicas of tp=2 (`tp=2,dp=2`) and of a pipeline of tp stages
  (the worker on standby takes its slices from the copy the ring keeps, or the other replica; nothing
  is lost).
- Live, on a running job (`ctl layout`): replicas -> tp=2 -> a pipeline -> tp=2 -> FSDP, every change
  entered without a restart, the curve the single-process one throughout; a tp the model cannot run
  is refused by ctl too.
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


@pytest.mark.timeout(500)
@pytest.mark.parametrize("layout, workers, phase, degrees", [
    ("tp=2", 2, "backward", {"tp": 2, "dp_replicate": 1}),
    ("tp=2,dp=2", 4, "backward", {"tp": 2, "dp_replicate": 2}),
    ("pp=2,tp=2", 4, "forward", {"tp": 2, "pp": 2}),
    ("tp=2,fsdp=2", 4, "backward", {"tp": 2, "dp_shard": 2}),
], ids=["tp", "dp-x-tp", "pp-x-tp", "fsdp-x-tp"])
def test_a_tp_layout_is_exact_through_a_kill(tmp_path: Path, layout: str, workers: int, phase: str,
                                             degrees: dict[str, int]) -> None:
    """`layout` over `workers`, one more on standby; the first member is SIGKILLed paused in the
    `phase` of step 12: the standby worker takes its slices (from the copy the ring keeps, or the other
    replica), no step is lost, every step is the single-process recipe's, and the model written at
    the end (gathered from the split tensors) is the single-process one."""
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    names = [f"w{i + 1}" for i in range(workers)]
    spare = f"w{workers + 1}"
    with LocalJob(JOB, tmp_path, min_workers=workers, coordinator_args=["--layout", layout]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", f"{phase}@12")
        for name in names[1:]:
            job.add_worker(name)
        job.wait_step(2, 300)
        first = _tp_plans(job)[0]["layout"]
        assert all(first[k] == v for k, v in degrees.items()), first
        job.add_worker(spare)
        job.wait_event(lambda e: e["kind"] == "standby" and e.get("worker") == spare, 180, f"{spare} on standby")
        _wait_for_log(job, "w1", f"pausing at {phase} of step 12")
        job.kill("w1")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        after = failure["layout"]
        assert sorted(after["members"]) == [*names[1:], spare] and all(after[k] == v for k, v in degrees.items()), after
        exits = job.wait_workers(400)
        assert exits == {"w1": -signal.SIGKILL, **{n: 0 for n in [*names[1:], spare]}}, job.tails(exits)
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


@pytest.mark.timeout(500)
def test_four_workers_move_between_the_tp_hybrids_live(tmp_path: Path) -> None:
    """Four workers under `--layout tp=2,dp=2`, then `ctl layout` to FSDP x tp (each tp member's
    part sharded over two), to pp x tp, and to FSDP over all four: every change live, only what
    changes owner moved, every step the single-process recipe's."""
    reference = single_process()
    names = ["w1", "w2", "w3", "w4"]
    with LocalJob(JOB, tmp_path, min_workers=4, coordinator_args=["--layout", "tp=2,dp=2"]) as job:
        job.start()
        for name in names:
            job.add_worker(name, "--slowdown", "2")  # (margin for three changes before step 40)
        job.wait_step(3, 180)
        first = _tp_plans(job)[0]["layout"]
        assert (first["dp_replicate"], first["dp_shard"], first["tp"]) == (2, 1, 2), first
        for spec, degrees in (("fsdp=2,tp=2", (1, 1, 2, 2)), ("pp=2,tp=2", (2, 1, 1, 2)), ("fsdp=4", (1, 1, 4, 1))):
            seen = len(job.events())
            assert job.ctl("layout", spec) == {"layout": spec}
            layout = _relaid(job, spec, seen)["layout"]
            assert (layout["pp"], layout["dp_replicate"], layout["dp_shard"], layout["tp"]) == degrees, (spec, layout)
        exits = job.wait_workers(300)
        assert exits == {name: 0 for name in names}, job.tails(exits)
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


@pytest.mark.timeout(600)
def test_the_full_mesh_is_exact(tmp_path: Path) -> None:
    """Every degree at once: `--layout pp=2,fsdp=2,tp=2` over eight workers (two stages, each
    sharded with FSDP2 over two tp pairs); every step is the single-process recipe's and the model
    written at the end is the single-process one."""
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    names = [f"w{i + 1}" for i in range(8)]
    with LocalJob(JOB, tmp_path, min_workers=8, coordinator_args=["--layout", "pp=2,fsdp=2,tp=2"]) as job:
        job.start()
        for name in names:
            job.add_worker(name)
        exits = job.wait_workers(500)
        assert exits == {name: 0 for name in names}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        for plan in _tp_plans(job):
            layout = plan["layout"]
            assert (layout["pp"], layout["dp_replicate"], layout["dp_shard"], layout["tp"]) == (2, 1, 2, 2), layout
        _assert_exact(events, reference)
        finished = [e for e in events if e["kind"] == "finished"]
        _check_the_trained_model(tmp_path, finished, job.tail("coordinator.out", 100_000), trained)
