"""The abortable group (worker/abortable.py) under torch's own FSDP2, one process a member on real gloo:
the same gradients as over the plain group, and a forward blocked in FSDP2's all-gather on a peer
that stopped is released by `abort()` (Superseded), not by the peer's death or a timeout."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from released import run_until_aborted
from worker.abortable import AbortableGroup
from worker.comm import Superseded
from worker.parallel import mesh as meshes

pytestmark = pytest.mark.process

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _member(rank: int, tmp: str, wrapped: bool) -> None:
    """One member; it leaves as the worker does (`worker.cli._exit`), without running the
    interpreter's teardown: gloo's threads torn down beside live groups abort the process
    ("terminate called without an active exception") about one exit in six."""
    _run(rank, tmp, wrapped)
    os._exit(0)  # (an exception above exits non-zero through torch.multiprocessing, as before)


def _run(rank: int, tmp: str, wrapped: bool) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(f"{tmp}/store-{wrapped}", 2)
    backend = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120))
    group = AbortableGroup(backend) if wrapped else None
    pg = meshes.register(backend, store, rank, 2, 1, CPU, pg=group)
    mesh = meshes.mesh_of(pg, CPU, 1)
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    torch.save(grads, f"{tmp}/grads-{wrapped}-{rank}")
    if not wrapped:
        return
    released = Path(f"{tmp}/released")
    if rank == 1:  # a peer that stops taking part: it waits until the other was released
        while not released.exists():
            time.sleep(0.05)
        return
    assert group is not None
    run_until_aborted(lambda: model(x).pow(2).sum().backward(), group.abort, "a member failed", released)


def test_fsdp2_over_the_abortable_group_is_exact_and_an_abort_releases_its_forward(tmp_path: Path) -> None:
    for wrapped in (False, True):
        mp.start_processes(_member, args=(str(tmp_path), wrapped), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        plain, wrapped = (torch.load(tmp_path / f"grads-{w}-{rank}") for w in (False, True))
        for name in plain:
            torch.testing.assert_close(wrapped[name], plain[name], rtol=0, atol=0, msg=name)
    assert (tmp_path / "released").read_text() == "superseded: a member failed"


@pytest.mark.gloo
def test_an_aborted_group_refuses_new_work_and_says_why() -> None:
    store = dist.HashStore()
    group = AbortableGroup(dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30)))
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert group.errored() is None
    group.abort("the epoch was superseded")
    with pytest.raises(Superseded, match="superseded"):
        group.allreduce([t]).wait()
    assert group.errored() == "the epoch was superseded"
    helpers = [t for t in threading.enumerate() if t.name == "abortable-group"]
    group.close()
    for t in helpers:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in helpers), "a closed group's helper thread ends"


def test_an_abort_racing_an_ops_end_finishes_it_once() -> None:
    # The op's end (helper thread) and an abort (this thread) both finish a work; finishing its
    # future twice raised in the helper thread. Many rounds make the race likely on any machine.
    store = dist.HashStore()
    for _ in range(300):
        group = AbortableGroup(dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30)))
        work = group.allreduce([torch.ones(3)])
        group.abort("the epoch was superseded")
        try:
            work.wait()
        except Superseded:
            pass
        assert work.get_future().done()
        group.close()
