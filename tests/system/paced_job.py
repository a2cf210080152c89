# A test job: the examples' MLP with a pause per sample in every forward pass, so that a run lasts
# long enough (about 35 ms a step with three workers) to kill, stop and add workers in the middle
# of it, and a replica's compute time grows with its share as on a real device. Sleeping instead
# of computing keeps the workers from fighting over this machine's two cores. The pause changes
# timing only, never the mathematics.

from __future__ import annotations

import time
from typing import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job

PACE_PER_SAMPLE_S = 0.0015
NUM_STEPS = 400


class Paced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            time.sleep(PACE_PER_SAMPLE_S * x.shape[0])
        return self.net(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 4, generator=g)) + 0.1 * torch.randn(4096, 4, generator=g)
    return TensorDataset(x, y)


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target, reduction="sum")


def job() -> Job:
    return Job(model=Paced, optimizer=adam, dataset=dataset(), loss=sum_mse, global_batch=64,
               num_steps=NUM_STEPS, seed=7, description="paced MLP for fault tests")
