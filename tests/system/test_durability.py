"""Durability (issue #12), the parts built so far, with real coordinator processes:

- one coordinator per state directory: a second one started on the state dir of a live coordinator
  refuses to start (exit 2, naming the holder), without a traceback; once the first is SIGKILLed
  (the OS drops its lock), a new one starts there.

(Preemption in a sharded layout and the drain deadline are tested in test_sharded.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MLP_JOB = f"{ROOT / 'examples' / 'mlp.py'}:job"


def _start(state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                             "--insecure", "--state-dir", str(state)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ready"):
            return line
    raise AssertionError(f"the coordinator ended without a ready line (exit {proc.wait()})")


@pytest.mark.timeout(300)
def test_a_second_coordinator_on_a_live_state_dir_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = _start(state)
    try:
        _ready(first)
        second = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                                 "--insecure", "--state-dir", str(state)], capture_output=True, text=True,
                                timeout=150, cwd=ROOT)
        assert second.returncode == 2, second.stderr
        assert f"{state} is in use by a live coordinator (pid {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and "ready" not in second.stdout
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        with _start(state) as third:
            try:
                assert _ready(third)
            finally:
                third.send_signal(signal.SIGTERM)
                third.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=30)
