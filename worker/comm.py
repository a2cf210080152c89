"""One epoch's torch.distributed group, and collectives that can be walked away from.

gloo (CPU) or NCCL (GPU) is chosen by the worker's device. Every group is built on a PrefixStore
"epoch{E}/" over the coordinator's store, in a helper thread, and every wait can be given up the
moment the agent reports an abort (`Waiter`), because a dead or stopped peer can hold a gloo
collective for the whole group timeout (docs/architecture.md, "Failure detection"). A superseded
operation is neither waited for nor destroyed (destroying a group with an op in flight blocks until
that op's timeout): its group, work and buffer stay with the helper thread that waits for it and
are dropped once the op ends on its own. NCCL groups are also aborted (ncclCommAbort frees the GPU
from a kernel that would spin).

Every group is held by `worker.keeper` from the moment it is formed, so that whichever thread drops
the trainer's last reference to it, its destructor (which waits for the ops still queued on it, up
to the group timeout) runs in a thread of its own.

Why not `init_process_group`/`new_group`: they keep one process-wide default group and block in
`destroy_process_group` on a pending op; a group object per epoch is what makes live re-forming
possible.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker import keeper

class Superseded(Exception):
    """The epoch was abandoned (a failure elsewhere, fencing, or a stop)."""


def form_group(store: Any, epoch: int, rank: int, world: int, device: torch.device, *,
               timeout_s: float, superseded: Callable[[], bool], part: str = "") -> Any:
    """Build the epoch's group in a helper thread, so a peer that hangs mid-handshake cannot hold
    the trainer: on `superseded` the thread is left to fail on its own (the store call it is
    blocked in raises once the store sees the abort)."""
    [pg] = form_groups(store, epoch, [(rank, world, part)], device, timeout_s=timeout_s, superseded=superseded)
    return pg


def form_groups(store: Any, epoch: int, groups: list[tuple[int, int, str]], device: torch.device, *,
                timeout_s: float, superseded: Callable[[], bool]) -> list[Any]:
    """Several groups of the epoch (each `(rank, world, part)`: this member's rank in it, its size,
    its store prefix), built at once, each in a helper thread as `form_group` builds one: an
    epoch's sub-groups (a 2-D mesh's, the replicas') rendezvous independently of each other, so
    their handshakes overlap rather than add up."""
    boxes: list[dict[str, Any]] = [{} for _ in groups]

    def build(box: dict[str, Any], rank: int, world: int, part: str) -> None:
        try:
            prefixed = dist.PrefixStore(f"epoch{epoch}/{part}", store)  # type: ignore[attr-defined]
            timeout = timedelta(seconds=timeout_s)
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                box["pg"] = keeper.keep(dist.ProcessGroupNCCL(prefixed, rank, world, options))
            else:
                box["pg"] = keeper.keep(dist.ProcessGroupGloo(prefixed, rank, world, timeout))
        except Exception as e:  # noqa: BLE001 (re-raised below, in the trainer's thread)
            box["error"] = e

    threads = [threading.Thread(target=build, args=(box, *group), name=f"form-epoch{epoch}", daemon=True)
               for box, group in zip(boxes, groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            if superseded():
                raise Superseded
            thread.join(0.002)
    for box in boxes:
        if "error" in box:
            if superseded():
                raise Superseded
            raise RuntimeError(f"could not form the group of epoch {epoch}: {box['error']}") from box["error"]
    return [box["pg"] for box in boxes]


class AllOf:
    """Several works waited for as one (in order), so that a reshard's hundreds of messages cost one
    thread hand-off in `Waiter.wait`, not one each; it keeps their buffers alive meanwhile."""

    def __init__(self, works: list[tuple[Any, Any]]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work, _ in self.works:
            work.wait()
        return True


@dataclass(slots=True)
class _Wait:
    """One wait handed to a helper thread. While the helper is blocked in it, the helper holds
    the group, the work and its buffer: an abandoned op keeps them alive until it ends by itself
    (destroying a group with an op in flight blocks until that op's timeout)."""

    pg: Any
    work: Any
    buf: Any
    done: threading.Event = field(default_factory=threading.Event)
    outcome: BaseException | bool | None = None  # True: completed; an exception: it failed


_Jobs = queue.SimpleQueue[_Wait | None]


class Waiter:
    """Waits for torch work without polling, and can be walked away from.

    A helper thread blocks in `work.wait()` (gloo's send/recv only ever complete through wait(),
    never through is_completed()) and sets an Event; the trainer blocks on that Event, which the
    agent also sets (`interrupt`) when an abort arrives. So a step costs two thread switches, not
    thousands of wake-ups. A helper stuck in an abandoned op is retired: it ends when that op ends
    (at the latest at the group timeout) and a fresh helper serves the next waits.
    """

    SAFETY_NET_S = 0.05  # re-check `superseded` this often even without a wake-up

    def __init__(self, device: torch.device) -> None:
        # NCCL's work.wait() only orders the CUDA stream; the helper must wait for the GPU itself.
        self._sync_cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._waiting: threading.Event | None = None
        self._jobs: _Jobs | None = None

    def interrupt(self) -> None:
        """Wake the trainer's current wait so it re-checks whether its epoch is superseded."""
        with self._lock:
            if self._waiting is not None:
                self._waiting.set()

    def wait(self, pg: Any, work: Any, *, superseded: Callable[[], bool], buf: Any = None) -> None:
        """Wait for `work`, or give it up (raising Superseded) the moment the epoch is superseded.
        A collective that fails (a peer died under it) is also given up: the coordinator's verdict
        decides what comes next, never a gloo error alone."""
        job = _Wait(pg, work, buf)
        with self._lock:
            self._waiting = job.done
        try:
            self._helper().put(job)
            while True:
                job.done.wait(self.SAFETY_NET_S)
                if job.outcome is not None:
                    break
                if superseded():
                    self._retire_helper()
                    if _is_nccl(pg):  # free the GPU from a kernel that would spin forever
                        threading.Thread(target=_abort_nccl, args=(pg,), daemon=True).start()
                    raise Superseded
                job.done.clear()
        finally:
            with self._lock:
                self._waiting = None
        if job.outcome is not True:
            raise Superseded(f"collective failed: {str(job.outcome).splitlines()[0]}")

    def _helper(self) -> _Jobs:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve_waits, args=(self._jobs, self._sync_cuda), daemon=True,
                             name="work-wait").start()
        return self._jobs

    def _retire_helper(self) -> None:
        """The helper is stuck in an abandoned op: it exits once that op ends."""
        assert self._jobs is not None
        self._jobs.put(None)
        self._jobs = None


def outlive(pg: Any, works: list[tuple[Any, Any]]) -> None:
    """Ops launched but never handed to a `Waiter` (a step given up in its compute, its gradient
    buckets already going out): a daemon thread holds their group and buffers until they end by
    themselves (a peer that gave the step up earlier never joins them: at the latest the group's
    timeout), so that dropping them never blocks the trainer (see _Wait). NCCL's are aborted."""
    if not works:
        return
    if _is_nccl(pg):
        threading.Thread(target=_abort_nccl, args=(pg,), daemon=True).start()
    threading.Thread(target=_wait_quietly, args=(pg, works), daemon=True, name="abandoned-ops").start()


def _wait_quietly(pg: Any, works: list[tuple[Any, Any]]) -> None:
    for work, _ in works:
        try:
            work.wait()
        except BaseException:  # noqa: BLE001 (an abandoned op: how it ends does not matter)
            pass


def _serve_waits(jobs: _Jobs, sync_cuda: bool) -> None:
    while (job := jobs.get()) is not None:
        try:
            job.work.wait()
            if sync_cuda:
                torch.cuda.synchronize()
            job.outcome = True
        except BaseException as e:  # noqa: BLE001 (reported by Waiter.wait in the trainer's thread)
            job.outcome = e
        job.done.set()
        job = None  # drop the references to the group and buffers (see _Wait)


def _is_nccl(pg: Any) -> bool:
    return type(pg).__name__ == "ProcessGroupNCCL"


def _abort_nccl(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 (best effort: the group is being thrown away)
        pass
