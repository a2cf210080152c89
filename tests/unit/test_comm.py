"""comm.Waiter: a collective whose peer never comes is given up at once on an abort, and the
helper thread left in it does not serve (or block) later waits."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from worker import comm


def groups(world: int, prefix: str) -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    pgs: list[dist.ProcessGroup | None] = [None] * world

    def build(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world,  # type: ignore[attr-defined]
                                          timedelta(seconds=30))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [pg for pg in pgs if pg is not None]


def test_abandoned_collective_is_released_by_an_interrupt() -> None:
    pg0, _pg1 = groups(2, "a/")
    waiter = comm.Waiter(torch.device("cpu"))
    aborted = threading.Event()
    buf = torch.ones(4)
    work = pg0.allreduce([buf])  # rank 1 never joins in: gloo would block for its 30 s timeout

    def abort_soon() -> None:
        time.sleep(0.1)
        aborted.set()
        waiter.interrupt()

    threading.Thread(target=abort_soon).start()
    with pytest.raises(comm.Superseded):
        waiter.wait(pg0, work, superseded=aborted.is_set, buf=buf)
    assert not work.is_completed(), "released by the abort while the op still hangs, not by its timeout"

    # The next wait is served by a fresh helper while the old one is still stuck.
    a, b = groups(2, "b/")
    x, y = torch.ones(3), torch.full((3,), 2.0)
    wa, wb = a.allreduce([x]), b.allreduce([y])
    waiter.wait(a, wa, superseded=lambda: False)
    waiter.wait(b, wb, superseded=lambda: False)
    assert torch.equal(x, torch.full((3,), 3.0))
