"""A replicated step's compute is given up the moment its epoch is superseded (`worker.step`'s
abandon points): at the next unit's forward, or at the next gradient's arrival in the backward,
not after the whole backward at the collectives' wait. Real modules and autograd; the agent is a
flag (no coordinator is needed to say "superseded")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from worker.comm import Superseded
from worker.parallel.replicated import GradBuckets
from worker.step import _abandon_points
from worker.trainer import Trainer


class Agent:
    def __init__(self) -> None:
        self.aborted = 0  # every epoch <= this one is superseded

    def superseded(self, epoch: int) -> bool:
        return epoch <= self.aborted


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.ran = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran += 1
        return torch.tanh(self.fc(x))


class Model(nn.Module):  # blocks two modules deep, as graph capture names them
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.body.blocks:
            x = block(x)
        return self.head(x)


def _trainer(model: nn.Module) -> Any:
    t = SimpleNamespace(model=model, agent=Agent(), computing=0, abandon_points=None,
                        units=lambda: ["body.blocks.0", "body.blocks.1", "body.blocks.2", "(root)"])
    t.give_up_if_superseded = lambda *args: Trainer.give_up_if_superseded(t, *args)  # type: ignore[arg-type]
    return t


def test_a_superseded_epoch_gives_the_forward_up_at_the_next_unit() -> None:
    model = Model()
    t = _trainer(model)
    _abandon_points(t)
    t.computing = 1
    model(torch.randn(4, 8))  # not superseded: the whole forward runs
    assert [b.ran for b in model.body.blocks] == [1, 1, 1]
    model.body.blocks[0].register_forward_hook(lambda *_: setattr(t.agent, "aborted", 1))  # the abort arrives
    with pytest.raises(Superseded):
        model(torch.randn(4, 8))
    assert [b.ran for b in model.body.blocks] == [2, 1, 1], "block 1 never ran: given up at its start"


def test_a_superseded_epoch_gives_the_backward_up_at_the_next_gradient() -> None:
    model = Model()
    t = _trainer(model)
    params = list(model.parameters())
    buckets = GradBuckets(params, bucket_bytes=1)  # a bucket per parameter: one launch per gradient
    launched: list[torch.Tensor] = []
    t.computing = 1
    buckets.start(lambda b: launched.append(b) or object(), t.give_up_if_superseded)
    loss = model(torch.randn(4, 8)).sum()
    t.agent.aborted = 1
    with pytest.raises(Superseded):
        loss.backward()  # type: ignore[no-untyped-call]
    assert not launched, "no bucket went out after the abort"


def test_nothing_is_given_up_outside_a_step_or_in_a_live_epoch() -> None:
    model = Model()
    t = _trainer(model)
    _abandon_points(t)
    t.agent.aborted = 1
    model(torch.randn(4, 8))  # computing == 0: an evaluation's forward, say
    t.computing = 2  # a newer epoch than the one superseded
    model(torch.randn(4, 8))
    assert [b.ran for b in model.body.blocks] == [2, 2, 2]


def test_the_hooks_follow_the_replica_and_do_not_keep_the_old_one() -> None:
    old, new = Model(), Model()
    t = _trainer(old)
    _abandon_points(t)
    t.model = new
    _abandon_points(t)
    assert t.abandon_points[0]() is new
    t.agent.aborted, t.computing = 1, 1
    old(torch.randn(4, 8))  # the old replica's hooks are gone
    with pytest.raises(Superseded):
        new(torch.randn(4, 8))
