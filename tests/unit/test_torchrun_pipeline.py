"""The pipeline benchmark's baselines (scripts/_torchrun_pipeline.py) train the same mathematics:
torch's Schedule1F1B and adaptrain's own 1F1B, each run by torchrun on two stages, give the same
loss at every step (so the benchmark's schedule-alone column compares the runtimes of one
computation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = f"{ROOT / 'examples' / 'gpt.py'}:job_short"
STEPS = 4

pytestmark = [pytest.mark.process, pytest.mark.timeout(300)]


def _losses(tmp_path: Path, schedule: str, microbatches: int) -> list[float]:
    events = tmp_path / f"{schedule}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
           str(ROOT / "scripts" / "_torchrun_pipeline.py"), "--job", JOB, "--events", str(events),
           "--steps", str(STEPS), "--microbatches", str(microbatches), "--schedule", schedule]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    return [r["loss"] for r in sorted((r for r in rows if r["kind"] == "loss"), key=lambda r: r["step"])]


def test_adaptrain_1f1b_under_torchrun_trains_as_torch_1f1b(tmp_path: Path) -> None:
    theirs = _losses(tmp_path, "1f1b", 4)
    ours = _losses(tmp_path, "adaptrain", 4)
    assert len(theirs) == len(ours) == STEPS
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert len(set(theirs)) == STEPS, "the loss moves: the steps trained"
