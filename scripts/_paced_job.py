# A benchmark job whose compute time is proportional to the samples a replica trains: a small MLP
# plus a pause of PACE_PER_SAMPLE_S per sample in every forward pass. It stands for a device of a
# known, steady speed: sleeping instead of computing keeps several workers on this 2-core machine
# from fighting over the cores, so each worker's speed is its own (as on separate machines) and
# `--slowdown` is the only thing that changes it. The pause changes timing, never the mathematics.
# bench_planner.py stops its runs with `ctl stop`, so NUM_STEPS is only an upper bound.

from __future__ import annotations

import time
from typing import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job

PACE_PER_SAMPLE_S = 0.001
GLOBAL_BATCH = 120
NUM_STEPS = 100_000


class Paced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            time.sleep(PACE_PER_SAMPLE_S * x.shape[0])
        return self.net(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(8192, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 4, generator=g)) + 0.1 * torch.randn(8192, 4, generator=g)
    return TensorDataset(x, y)


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target, reduction="sum")


def job() -> Job:
    return Job(model=Paced, optimizer=adam, dataset=dataset(), loss=sum_mse, global_batch=GLOBAL_BATCH,
               num_steps=NUM_STEPS, seed=3, description="MLP paced per sample (planner benchmark)")
