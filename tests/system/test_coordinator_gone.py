"""A worker whose coordinator is gone for good does not wait forever: it trains on while its plan lasts,
and once it needs a plan (a peer died under its step) and the coordinator has been unreachable for
--coordinator-timeout seconds, it exits with status 2 and says why. Real processes, SIGKILLs."""

from __future__ import annotations

import signal
from pathlib import Path

from localjob import LocalJob

JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gpt.py'}:job_long"


def test_a_worker_gives_up_once_the_coordinator_is_gone_and_it_needs_a_plan(tmp_path: Path) -> None:
    with LocalJob(JOB, tmp_path, min_workers=2) as job:
        job.start()
        job.add_worker("w1", "--coordinator-timeout", "3")
        job.add_worker("w2", "--coordinator-timeout", "3")
        job.wait_step(5, 180)
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGKILL)
        job.wait_coordinator(30)
        job.workers["w2"].send_signal(signal.SIGKILL)  # w1's step fails: it needs a plan nobody can make
        assert job.workers["w1"].wait(timeout=120) == 2
        log = job.tail("w1")
        assert "unreachable for" in log and "--coordinator-timeout 3" in log, log
