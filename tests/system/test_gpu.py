"""GPU path (NCCL): runs only where torch sees a CUDA device; skipped on CPU-only machines (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from localjob import LocalJob

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.timeout(300)]


def test_cuda_worker_trains_with_nccl(tmp_path: Path) -> None:
    with LocalJob(f"{ROOT / 'examples' / 'mlp.py'}:job", tmp_path) as job:
        job.start()
        job.add_worker("g0", "--device", "cuda:0", "--digest-every", "50")
        assert job.wait_coordinator(240) == 0, job.tail("g0")
        assert sorted(job.steps()) == list(range(1, 201))
        assert job.wait_workers(30) == {"g0": 0}
        joined = [e for e in job.events() if e["kind"] == "joined" and e["worker"] == "g0"]
        assert joined and joined[0]["device"].startswith("cuda"), joined  # calibrated and trained on the GPU
