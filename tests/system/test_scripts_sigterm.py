"""A script that runs a job on this machine (the demo, every benchmark) leaves nothing behind when it
is sent SIGTERM (a `timeout`, a CI runner's cancel): it exits 143 after closing its job, whose
coordinator and workers are killed and reaped (`localjob.close_on_sigterm`). Without it SIGTERM
ended the script at once and its job's processes, each in a session of its own, trained on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def _children(parent: int) -> set[int]:
    """The live (not zombie) processes whose parent is `parent`."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            out.add(int(pid))
    return out


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(pid)
        except OSError:
            pass
    return out


def test_sigterm_to_the_demo_closes_its_job_and_exits_143(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    err = tmp_path / "demo.err"
    with err.open("wb") as out:
        demo = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py"), "--state-dir", str(state)],
                                stdout=subprocess.DEVNULL, stderr=out, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until the job trains: its coordinator and workers are up
            events = state / "events.jsonl"
            if events.exists() and any(json.loads(line).get("kind") == "step"
                                       for line in events.read_text().splitlines() if line.strip()):
                break
            assert demo.poll() is None, err.read_text()[-2000:]
            time.sleep(0.2)
        else:
            pytest.fail("the demo's job never stepped")
        job = _children(demo.pid)
        assert len(job) >= 4, f"a coordinator and three workers run: {job}"
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(60) == 143
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    left = _alive(job)
    for _ in range(50):  # (killed by the demo before it exits; a moment for /proc to agree)
        if not left:
            break
        time.sleep(0.1)
        left = _alive(job)
    assert left == set(), f"the job's processes outlived the demo: {left}"
