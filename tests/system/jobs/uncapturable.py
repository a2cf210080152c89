# A job whose model graph capture cannot take apart, for the tests of the coarse graph: its forward
# reads a value of its input (so it cannot run on meta tensors), and its blocks draw their scales
# from a one-shot generator the forward creates (so a block cannot be run alone again: the generator
# is spent, and a generator cannot be copied). It trains like any model; only the planner's view of
# it is coarse (the whole model as one unit).

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker import Job

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scales: Iterator[float]) -> torch.Tensor:
        return x + next(scales) * torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        scales = (1.0 / (i + 1) for i in range(len(self.blocks)))
        for block in self.blocks:
            x = block(x, scales=scales)
        return self.head(x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, WIDTH, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(512, 4, generator=g))


def job() -> Job:
    return Job(model=Net, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), dataset=dataset(),
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=24, num_steps=12)
