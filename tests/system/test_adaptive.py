"""The planner live, with real processes on loopback: a straggler is found from its step timings and
its share drops (and rises again when it recovers), a cluster with too little memory waits instead
of crashing, a worker with room for few samples runs the batch in micro-batches of what fits, and
`ctl plan --explain` tells why.
Through all of it the loss curve is the undisturbed run's and every replica ends identical.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from conftest import NUM_STEPS
from localjob import LocalJob

JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'paced.py'}:job"
GLOBAL_BATCH = 64

pytestmark = pytest.mark.timeout(240)


def plans(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["kind"] == "plan"]


def share(plan: dict[str, Any], name: str) -> int:
    layout = plan["layout"]
    return dict(zip(layout["members"], layout["shares"])).get(name, 0)


def assert_same_curve(job: LocalJob, undisturbed: dict[int, float]) -> None:
    assert sorted(job.losses()) == sorted(undisturbed) == list(range(1, NUM_STEPS + 1))
    worst = job.loss_gap(undisturbed)
    assert worst <= 1e-4, f"largest relative loss difference {worst:.2e}"


def test_straggler_is_found_its_share_drops_and_recovers(tmp_path: Path, undisturbed: dict[int, float]) -> None:
    with LocalJob(JOB, tmp_path, min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--digest-every", "1")
        job.wait_step(30, 120)
        before = plans(job)[-1]
        assert share(before, "w2") >= 15, before  # an even cluster: about 20 each
        # Five times slower: recovering from it predicts a ~25% faster step, clear of the calm
        # threshold (twice the measured step noise: 22% was seen on this machine under the suite,
        # which kept the plan for a three-times-slower worker's recovery, predicted 20%).
        assert job.ctl("slowdown", "w2", "5") == {"worker": "w2", "factor": 5.0}
        straggler = job.wait_event(lambda e: e["kind"] == "straggler", 60, "straggler event")
        assert straggler["worker"] == "w2"
        assert straggler["speed"] < straggler["expected"], straggler
        replan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "straggler", 30, "straggler plan")
        assert replan["status"] in ("optimal", "time-limited"), replan
        assert share(replan, "w2") <= share(before, "w2") / 2, replan["layout"]
        assert sorted(replan["layout"]["members"]) == ["w1", "w2", "w3"], "a slow worker still helps"
        job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == replan["epoch"], 30, "a step at new shares")
        explained = job.ctl("plan", "--explain")["explain"]
        assert explained["status"] == replan["status"]
        w2 = next(m for m in explained["members"] if m["name"] == "w2")
        w1 = next(m for m in explained["members"] if m["name"] == "w1")
        assert w2["speed"] < w1["speed"], (w1, w2)  # (its share dropped for its measured speed)
        assert explained["runner_up"] is not None and explained["why"]
        # Recovery: full speed again raises its share (once the new epoch has measured its baseline).
        job.wait_epoch_steps(replan["epoch"], 10, 30)
        job.ctl("slowdown", "w2", "1")
        recovered = job.wait_event(lambda e: e["kind"] == "recovered", 60, "recovered event")
        assert recovered["worker"] == "w2"
        back = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "recovered", 30, "recovery plan")
        assert share(back, "w2") >= 15, back["layout"]
        assert job.wait_workers(180) == {"w1": 0, "w2": 0, "w3": 0}
        assert job.wait_coordinator(30) == 0
        assert_same_curve(job, undisturbed)
        finals = {name: job.digests(name)[NUM_STEPS] for name in ("w1", "w2", "w3")}
        assert len(set(finals.values())) == 1, finals
        # No failure, nothing abandoned: every change was planned at a step boundary.
        assert not [e for e in job.events() if e["kind"] == "failed"]
        for name in ("w1", "w2", "w3"):
            assert "abandoned" not in job.tail(name, 10_000)


def test_too_little_memory_waits_then_a_worker_with_room_for_few_samples_trains_in_micro_batches(
        tmp_path: Path, undisturbed: dict[int, float]) -> None:
    """w0 cannot hold the state at all: the first plan is infeasible and nothing trains. w1 holds the
    state and 12 samples' activations, far fewer than the global batch of 64: it trains the whole
    batch as micro-batches of 12 (memory bounds the micro-batch, not the share), within its limit,
    on the undisturbed loss curve."""
    from worker.graph import capture_graph
    from worker.job import load_job

    source = Path(JOB.rsplit(":", 1)[0])
    graph = capture_graph(load_job(source.read_text(), "job", filename=str(source)))
    static = graph.param_bytes + (graph.optimizer_state_bytes or 0) + graph.param_bytes
    room = 12  # samples of activations w1 can hold: far less than the global batch of 64
    limit_gib = (static + room * graph.activation_bytes + graph.activation_bytes // 2) / 2**30
    with LocalJob(JOB, tmp_path, min_workers=1) as job:
        job.start()
        job.add_worker("w0", "--memory-limit", f"{static / 2 / 2**30:.12f}")
        waiting = job.wait_event(lambda e: e["kind"] == "plan", 90, "the first plan event")
        assert waiting["status"] == "infeasible" and waiting["layout"] is None, waiting
        assert "waits" in waiting["detail"], waiting["detail"]
        status = job.ctl("plan")
        assert status["plan"] is None and status["status"] == "infeasible"
        assert not job.steps(), "nothing trains while nothing fits"
        job.add_worker("w1", "--digest-every", "1", "--memory-limit", f"{limit_gib:.12f}")
        trained = job.wait_event(lambda e: e["kind"] == "plan" and e["layout"] is not None, 90, "a plan that fits")
        assert share(trained, "w1") == GLOBAL_BATCH and trained["micro_batch"] == [room], trained
        explained = job.ctl("plan", "--explain")["explain"]
        w1 = next(m for m in explained["members"] if m["name"] == "w1")
        assert w1["memory_bytes"] <= w1["memory_limit_bytes"]
        exits = job.wait_workers(180)
        assert exits["w1"] == 0, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        assert_same_curve(job, undisturbed)
