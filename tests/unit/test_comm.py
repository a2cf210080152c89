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

pytestmark = pytest.mark.gloo


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


def _short_groups(prefix: str, timeout_s: float) -> list[dist.ProcessGroup]:
    store = dist.HashStore()
    pgs: list[dist.ProcessGroup | None] = [None] * 2

    def build(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2,  # type: ignore[attr-defined]
                                          timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [pg for pg in pgs if pg is not None]


@pytest.mark.parametrize("left_behind", [False, True])
def test_ops_given_up_unwaited_do_not_block_whoever_drops_them(left_behind: bool) -> None:
    """A step given up in its compute (a join that abandons it) has gradient buckets out that its
    peer, which gave up earlier, never joins. Dropping the group then blocks until the op's timeout
    unless `outlive` keeps it in the background."""
    pg0, pg1 = _short_groups(f"outlive-{left_behind}/", 3.0)
    work = pg0.allreduce([torch.ones(1000)])  # rank 1 never joins in
    if left_behind:
        comm.outlive(pg0, [(work, None)])
    del pg0  # (the test keeps the work only to look at it: it does not keep the group alive)
    if left_behind:
        assert not work.is_completed(), "the drop returned at once, the op still pending"
    else:  # (the hazard itself, so that this test shows what it guards against)
        assert work.is_completed(), "the drop waited for the op to end at its timeout"
    del work, pg1
