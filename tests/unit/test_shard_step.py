"""The sharded optimizer step on the shards' local tensors (`worker.parallel.shard_step.LocalStep`)
against the DTensor optimizer's own step: bit for bit, through a changing learning rate, clipped
gradients and a state replaced under it; and the DTensor optimizer (what extract and the state dicts
read) advanced with it. Real FSDP2 on a real one-member gloo group, in this process."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plan.layout import Layout
from worker.parallel import mesh as meshes
from worker.parallel.fsdp import Sharded, apply_fsdp, extract
from worker.parallel.slices import from_module

pytestmark = pytest.mark.gloo

CPU = torch.device("cpu")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 2))


def _two(factory: Any, epoch: int) -> tuple[Sharded, Sharded, Any]:
    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    pg = meshes.register(backend, store, 0, 1, epoch, CPU)
    job = SimpleNamespace(seed=0, model=_model, sequence=None, optimizer=factory)
    torch.manual_seed(0)
    plain = _model()
    layout = Layout(members=("m0",), shares=(4,), dp_shard=1)
    built = [apply_fsdp(job, ["0", "1", "2"], layout, 0, meshes.mesh_of(pg, CPU, epoch),  # type: ignore[arg-type]
                        from_module(0, plain, factory(plain.parameters())), CPU) for _ in range(2)]
    return built[0], built[1], pg


def _steps(dtensor: Sharded, local: Sharded, n: int, *, replace_state_at: int = -1) -> None:
    for i in range(n):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
        for s in (dtensor, local):
            s.optimizer.zero_grad(set_to_none=True)
            s.model(x).pow(2).sum().backward()
            for p in s.params.values():  # clipping scales the local gradient in place
                p.grad.to_local().mul_(0.5)  # type: ignore[union-attr]
            for group in s.optimizer.param_groups:  # a schedule
                group["lr"] = 1e-2 / (i + 1)
        if i == replace_state_at:  # e.g. a checkpoint loaded into the optimizer: new state tensors
            local.optimizer.load_state_dict(local.optimizer.state_dict())
        dtensor.optimizer.step()
        local.stepper.step()


def _same(a: Sharded, b: Sharded) -> None:
    ea, eb = extract(a, a_layout(), 0, 9), extract(b, a_layout(), 0, 9)
    for fqn, pieces in ea.pieces.items():
        for key, value in pieces[0].data.items():
            assert torch.equal(value, eb.pieces[fqn][0].data[key]), (fqn, key)
        assert ea.scalars[fqn] == eb.scalars[fqn], fqn


def a_layout() -> Layout:
    return Layout(members=("m0",), shares=(4,), dp_shard=1)


def test_the_local_step_equals_the_dtensor_step_bit_for_bit() -> None:
    dtensor, local, pg = _two(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 9101)
    try:
        _steps(dtensor, local, 4, replace_state_at=2)
        assert local.stepper._twin is not None  # it did step locally (not the DTensor fallback)
        _same(dtensor, local)
        steps = {float(st["step"]) for st in local.optimizer.state.values()}
        assert steps == {4.0}  # the DTensor optimizer's own state advanced with the twin's steps
    finally:
        meshes.forget(pg)


def test_an_optimizer_that_is_not_known_element_wise_steps_its_dtensors() -> None:
    class Custom(torch.optim.SGD):  # (a subclass may do anything: not trusted to be element-wise)
        pass

    dtensor, local, pg = _two(lambda ps: Custom(ps, lr=1e-2, momentum=0.9), 9102)
    try:
        _steps(dtensor, local, 3)
        assert local.stepper._twin is None
        _same(dtensor, local)
    finally:
        meshes.forget(pg)
