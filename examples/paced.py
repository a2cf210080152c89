# A job for trying adaptrain's planner on one machine: a small MLP whose forward pass also pauses
# a fixed time per sample, so each worker behaves like a device of steady speed (its compute time
# grows with its share of the batch) while the pause itself uses no CPU: several workers on a
# laptop do not slow each other down, as separate machines would not. Give one `--slowdown 3`
# (or `ctl.py slowdown NAME 3` while it runs) and watch the planner find it and move its share.
# The pause changes timing only, never the mathematics.
#
#   job       global batch 64, 250 steps, 1.5 ms a sample (the fault tests: ~35 ms a step on 3 workers)
#   long_job  global batch 240, 100,000 steps, 1 ms a sample (benchmarks; stop it with ctl stop)
#
# Run it: coordinator --bind tcp://127.0.0.1:5555 --job examples/paced.py:job

from __future__ import annotations

import functools
import time
from typing import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker import Job


class Paced(nn.Module):
    def __init__(self, pace_per_sample_s: float) -> None:
        super().__init__()
        self.pace_per_sample_s = pace_per_sample_s
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":  # graph capture runs on meta tensors: no pause there
            time.sleep(self.pace_per_sample_s * x.shape[0])
        return self.net(x)


def dataset(size: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(size, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 4, generator=g)) + 0.1 * torch.randn(size, 4, generator=g)
    return TensorDataset(x, y)


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target, reduction="sum")


def job() -> Job:
    return Job(model=functools.partial(Paced, 0.0015), optimizer=adam, dataset=dataset(), loss=sum_mse,
               global_batch=64, num_steps=250, seed=7, description="paced MLP (fault tests)")


def long_job() -> Job:
    return Job(model=functools.partial(Paced, 0.001), optimizer=adam, dataset=dataset(8192), loss=sum_mse,
               global_batch=240, num_steps=100_000, seed=3, description="paced MLP (planner benchmark)")
