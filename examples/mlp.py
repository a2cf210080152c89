# A small MLP regression job: the fastest real job, for demos and system tests.
#
# The data is synthetic but deterministic: inputs from a seeded generator, targets from a fixed
# random "teacher" network plus noise, so every machine builds the same dataset without files.
# A step (global batch 64) takes well under a millisecond of compute on one CPU thread.
#
# Run it: coordinator --bind tcp://127.0.0.1:5555 --job examples/mlp.py:job

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker import Job

NUM_SAMPLES = 4096
NUM_INPUTS = 32
HIDDEN = 64
NUM_OUTPUTS = 4
NOISE = 0.1


def make_dataset(seed: int = 1234) -> TensorDataset:
    """Inputs x ~ N(0, 1); targets y = teacher(x) + noise, all from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, NUM_INPUTS, generator=g)
    w1 = torch.randn(NUM_INPUTS, HIDDEN, generator=g) / NUM_INPUTS**0.5
    w2 = torch.randn(HIDDEN, NUM_OUTPUTS, generator=g) / HIDDEN**0.5
    y = torch.tanh(x @ w1) @ w2 + NOISE * torch.randn(NUM_SAMPLES, NUM_OUTPUTS, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    # An nn.Sequential: every layer takes one tensor and returns one, so it splits into
    # pipeline stages anywhere.
    return nn.Sequential(
        nn.Linear(NUM_INPUTS, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, NUM_OUTPUTS),
    )


def sum_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Squared error summed over samples and output dimensions (the worker divides by the
    global batch)."""
    return nn.functional.mse_loss(outputs, targets, reduction="sum")


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def job() -> Job:
    return Job(
        model=make_model,
        optimizer=adam,
        dataset=make_dataset(),
        loss=sum_mse,
        global_batch=64,
        num_steps=200,
        seed=0,
        description="MLP regression on a synthetic teacher, 4096 samples",
    )
