"""Buffers in every layout: a BatchNorm model trained by 2 members with uneven shares, replicated and
sharded. Every member ends each step with the same buffers (the share-weighted mean of their updates,
`worker.parallel.buffers`), so the replicas' digests (parameters and buffers) agree, and the
coordinator's evaluation equals an evaluation of the saved model. Without the sync each member keeps
its own share's running statistics, and the two evaluations differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localjob import LocalJob
from worker.job import load_job

BN_JOB = '''\
import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job


def model():
    return nn.Sequential(nn.Linear(6, 24), nn.BatchNorm1d(24), nn.GELU(), nn.Linear(24, 2))


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g) * 3 + 1
    return TensorDataset(x, torch.tanh(x[:, :2]) + 0.05 * torch.randn(n, 2, generator=g))


def job():
    return Job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.02), dataset=data(512, 1),
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=31,
               num_steps=15, seed=4, eval_dataset=data(101, 2), eval_every=5)
'''


def _eval_of_saved(job_path: Path, model_pt: Path) -> float:
    job = load_job(job_path.read_text(), "job", filename=str(job_path))
    model = job.model()
    model.load_state_dict(torch.load(model_pt))
    model.eval()
    with torch.no_grad():
        x, y = job.eval_dataset[torch.arange(len(job.eval_dataset))]
        return float(job.loss(model(x), y)) / len(job.eval_dataset)


@pytest.mark.parametrize("layout", ["dp=2", "dp=1"], ids=["replicated", "sharded"])
def test_batchnorm_buffers_agree_on_every_member_and_in_the_saved_model(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "bn_job.py"
    path.write_text(BN_JOB)
    with LocalJob(f"{path}:job", tmp_path / "job", min_workers=2, coordinator_args=["--layout", layout]) as job:
        job.start()
        for name in ("w1", "w2"):
            job.add_worker(name, "--digest-every", "5")
        assert job.wait_coordinator(180) == 0, job.tail("coordinator.out")
        events = job.events()
        digests = [job.digests(name) for name in ("w1", "w2")]
    plan = next(e for e in events if e["kind"] == "plan")["layout"]
    assert sorted(plan["shares"]) == [15, 16], plan  # uneven shares: their batch statistics differ
    assert (plan["dp_shard"] == 2) == (layout == "dp=1"), plan
    assert sorted(digests[0]) == sorted(digests[1]) == [5, 10, 15], digests
    assert digests[0] == digests[1], "every member holds the same parameters and buffers"
    final = next(e for e in events if e["kind"] == "finished")
    evaluated = {e["step"]: e["loss"] for e in events if e["kind"] == "eval"}
    saved = _eval_of_saved(path, Path(final["path"]) / "model.pt")
    assert abs(evaluated[15] - saved) <= 1e-6 * abs(saved), (evaluated[15], saved)
