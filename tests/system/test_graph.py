"""The first worker captures the model's graph and uploads it; `ctl graph` shows it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from localjob import LocalJob

JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'paced.py'}:job"

pytestmark = pytest.mark.timeout(120)


def test_ctl_graph_shows_the_uploaded_graph(tmp_path: Path) -> None:
    with LocalJob(JOB, tmp_path) as job:
        job.start()
        job.add_worker("w1")
        job.wait_step(5, 60)
        deadline = time.monotonic() + 20
        while True:
            try:
                graph = job.ctl("graph")
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "no graph was uploaded"
                time.sleep(0.2)
        # examples/paced.py: Linear(32,64) GELU Linear(64,64) GELU Linear(64,4), float32
        params = (32 * 64 + 64) + (64 * 64 + 64) + (64 * 4 + 4)
        assert graph["param_bytes"] == 4 * params
        assert sum(layer["param_bytes"] for layer in graph["layers"]) == 4 * params
        forward = 2 * (32 * 64 + 64 * 64 + 64 * 4)
        # forward + backward per sample; the first layer's backward needs no input gradient
        assert 2 * forward < graph["flops"] <= 3 * forward * 1.01
        job.ctl("stop")
        assert job.wait_coordinator(30) == 0
