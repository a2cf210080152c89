"""A native crash leaves its Python stacks in the log.

A segfault in torch, gloo or zmq kills a process without a Python traceback; users (and CI) would
see only an exit status of -11. Worker and coordinator enable `faulthandler` at start, so the log
says what every thread was doing. Real processes, a real SIGSEGV.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from localjob import LocalJob  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

JOB = f"{SCRIPTS.parent / 'examples' / 'mlp.py'}:job"


@pytest.mark.timeout(120)
def test_a_segfault_in_a_worker_or_the_coordinator_leaves_every_threads_stack_in_its_log(tmp_path: Path) -> None:
    with LocalJob(JOB, tmp_path, min_workers=1) as job:
        job.start()
        job.add_worker("w1")
        job.wait_step(2, 60)
        job.signal("w1", signal.SIGSEGV)
        exits = job.wait_workers(30)
        assert exits == {"w1": -signal.SIGSEGV}, job.tails(exits)
        log = (tmp_path / "w1.log").read_text(errors="replace")
        assert "Fatal Python error: Segmentation fault" in log, log[-3000:]
        assert 'File "' in log and "worker/" in log, log[-3000:]  # the Python frames, ours among them
        assert "Thread 0x" in log, log[-3000:]  # every thread's (the agent's too), not only the current one

        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGSEGV)
        assert job.wait_coordinator(30) == -signal.SIGSEGV
        log = (tmp_path / "coordinator.log").read_text(errors="replace")
        assert "Fatal Python error: Segmentation fault" in log, log[-3000:]
        assert "coordinator/" in log or "trio/" in log, log[-3000:]
