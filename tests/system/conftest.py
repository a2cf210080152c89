"""Shared by the system tests: the undisturbed run of the paced job that disturbed runs are compared
with (one per session: every run of the job gives the same losses, however it is split)."""

from __future__ import annotations

from pathlib import Path

import pytest
from localjob import LocalJob

PACED_JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'paced.py'}:job"


def _paced_steps() -> int:
    from worker.job import load_job

    path, function = PACED_JOB.rsplit(":", 1)
    return load_job(Path(path).read_text(), function, filename=path).num_steps


NUM_STEPS = _paced_steps()  # the paced job's steps (every paced test checks each one was committed once)


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Loss of every step of the paced job, three workers, nothing happening."""
    with LocalJob(PACED_JOB, tmp_path_factory.mktemp("undisturbed"), min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        assert job.wait_coordinator(180) == 0, job.tail("coordinator.out")
        return job.losses()
