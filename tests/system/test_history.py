"""What a coordinator says about the job's history and its present, with real processes:

- a coordinator SIGKILLed after a worker failure and some steps, and started again on the same
  state dir, answers `ctl events`, `ctl report` and its metrics for the whole job: the failure and
  the steps before the restart included, the event log's numbering kept, the restart marked;
- after a total loss (every worker SIGKILLed) under `--min-workers 2`, with one new worker ready,
  `ctl status` and `ctl plan --explain` say the job waits for workers (not "training", not the
  planner's "no ready devices"); a second worker resumes it from the checkpoint and status says so.

The metrics are compared at a quiet moment, as in test_metrics_endpoint.py: the workers are
SIGSTOPped (the lease is long, so nobody is declared failed) until the event log stops growing.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from localjob import LocalJob
from test_metrics_endpoint import PACED_JOB, _quiet, ctl, scrape, value


@pytest.mark.timeout(300)
def test_a_restarted_coordinator_answers_for_the_whole_job(tmp_path: Path) -> None:
    with LocalJob(PACED_JOB, tmp_path, min_workers=2, lease_s=60.0, metrics=True) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(10, 180)
        job.kill("w3")  # a real failure (its connection closes: detected at once, lease or not)
        job.wait_event(lambda e: e["kind"] == "failed" and e["worker"] == "w3", 30, "w3 failed")
        replanned = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 30, "the re-plan")
        job.wait_epoch_steps(replanned["epoch"], 5, 60)
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGKILL)
        job.wait_coordinator(30)
        before = job.events()
        steps_before = sum(e["kind"] == "step" for e in before)
        assert steps_before >= 15

        job.start()  # the same state dir (journal and events.jsonl); a new metrics port
        job.wait_event(lambda e: e["kind"] == "recovered", 60, "the members registered again")
        for name in ("w1", "w2"):
            job.signal(name, signal.SIGSTOP)
        try:
            events = _quiet(job)
            samples = scrape(job.metrics_url)
            listed = job.ctl("events")
            summary = job.ctl("report")
            status = job.ctl("status")
        finally:
            for name in ("w1", "w2"):
                job.signal(name, signal.SIGCONT)

        assert events[:len(before)] == before and len(events) > len(before)
        assert listed["events"] == events and listed["next"] == len(events), "ctl events: the whole log"
        [marked] = [e for e in events if e["kind"] == "restarted"]
        assert marked["events"] == len(before) and marked["skipped_lines"] == 0, marked

        steps = [e["step"] for e in events if e["kind"] == "step"]
        assert summary["events"] == len(events) and summary["steps"] == len(set(steps)) == len(steps)
        assert summary["first_step"] == 1 and summary["last_step"] == steps[-1]
        assert summary["marks"]["failed"] == 1 and summary["marks"]["restarted"] == 1, summary

        assert value(samples, "adaptrain_failures_total") == 1
        assert value(samples, "adaptrain_steps_committed_total") == len(steps) > steps_before
        assert value(samples, "adaptrain_events_total", kind="restarted") == 1
        assert value(samples, "adaptrain_events_total", kind="joined") == sum(e["kind"] == "joined" for e in events) > 3
        assert sum(v for (name, _), v in samples.items() if name == "adaptrain_events_total") == len(events)
        assert value(samples, "adaptrain_step") == steps[-1]
        assert status["state"] == "training", status

        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        assert job.wait_workers(60) == {"w1": 0, "w2": 0, "w3": -9}


def _status_until(job: LocalJob, done: Any, timeout_s: float, what: str) -> dict[str, Any]:
    """Poll `ctl status` until `done(status)`; every answer must be one the job can truly be in."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status: dict[str, Any] = job.ctl("status")
        if done(status):
            return status
        time.sleep(0.3)
    raise TimeoutError(f"no {what} within {timeout_s} s; the last status: {status.get('reason')}")


@pytest.mark.timeout(300)
def test_after_a_total_loss_status_says_the_job_waits_for_workers(tmp_path: Path) -> None:
    with LocalJob(PACED_JOB, tmp_path, min_workers=2, coordinator_args=["--checkpoint-every", "10"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        written = job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= 10, 180, "a checkpoint")
        for name in ("w1", "w2"):
            job.signal(name, signal.SIGKILL)  # every worker at once: more than the redundancy covers
        job.wait_workers(30)
        lost = job.wait_event(lambda e: e["kind"] == "state_lost", 30, "state_lost")
        resume_from = lost["resume_from"]
        assert resume_from is not None and lost["step"] >= written["step"], lost
        status = job.ctl("status")
        assert status["state"] == "waiting_for_workers" and status["reason"].startswith(
            "waiting for workers: 0 ready, --min-workers 2; then resuming from checkpoint"), status

        job.add_worker("w3")
        waiting = _status_until(job, lambda s: s["state"] != "waiting_for_workers" or " 1 ready" in s["reason"],
                                120, "w3 ready")
        assert waiting["state"] == "waiting_for_workers", waiting
        assert waiting["reason"] == (f"waiting for workers: 1 ready, --min-workers 2; then resuming from checkpoint "
                                     f"{resume_from} (step {waiting['step']})"), waiting
        explained = job.ctl("plan", "--explain")
        assert explained["plan"] is None and explained["explain"]["detail"] == waiting["reason"], explained
        human = ctl(job, "--control", job.control_endpoint, "status")
        assert human.returncode == 0 and f"state: {waiting['reason']}" in human.stdout, human.stdout
        assert "training" not in human.stdout.splitlines()[1]
        plan_text = ctl(job, "--control", job.control_endpoint, "plan", "--explain")
        assert "no ready devices" not in plan_text.stdout and waiting["reason"] in plan_text.stdout, plan_text.stdout

        job.add_worker("w4")
        job.wait_event(lambda e: e["kind"] == "resumed", 120, "resumed")
        training = _status_until(job, lambda s: s["state"] in ("training", "finished"), 60, "training")
        assert training["reason"].startswith(("training: epoch", "finished")), training
        stopped = job.ctl("stop")
        assert set(stopped["workers"]) == {"w3", "w4"}, stopped
        assert job.wait_coordinator(60) == 0, job.tail("coordinator.out")
        said = json.dumps([e for e in job.events() if e["kind"] == "plan"])
        assert "w3" in said and "w4" in said
