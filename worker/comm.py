"""One epoch's torch.distributed group, and collectives that can be walked away from.

gloo (CPU) or NCCL (GPU) is chosen by the worker's device. Every group is built on a PrefixStore
"epoch{E}/" over the coordinator's store, in a helper thread, and every wait polls a `superseded`
predicate (the agent's abort flag), because a dead or stopped peer can hold a gloo collective for
the whole group timeout (DESIGN.md, measured). A superseded operation is not waited for and not
destroyed (destroying a group with an op in flight blocks until that op's timeout): its group, work
and buffer go to the `Graveyard` and are dropped once the op ends on its own. NCCL groups are
aborted instead (ncclCommAbort frees the GPU from a kernel that would spin forever).

Why not `init_process_group`/`new_group`: they keep one process-wide default group and block in
`destroy_process_group` on a pending op; a group object per epoch is what makes live re-forming
possible.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

POLL_S = 0.0002


class Superseded(Exception):
    """The epoch was abandoned (a failure elsewhere, fencing, or a stop)."""


@dataclass(slots=True)
class Graveyard:
    """Abandoned operations kept alive until they end by themselves."""

    entries: list[tuple[Any, Any, Any]] = field(default_factory=list)

    def bury(self, pg: Any, work: Any, buf: Any) -> None:
        if _is_nccl(pg):
            threading.Thread(target=_abort_nccl, args=(pg,), daemon=True).start()
        self.entries.append((pg, work, buf))

    def sweep(self) -> None:
        self.entries = [e for e in self.entries if not e[1].is_completed()]


def form_group(store: Any, epoch: int, rank: int, world: int, device: torch.device, *,
               timeout_s: float, superseded: Callable[[], bool]) -> Any:
    """Build the epoch's group in a helper thread, so a peer that hangs mid-handshake cannot hold
    the trainer: on `superseded` the thread is left to fail on its own (the store call it is
    blocked in raises once the store sees the abort)."""
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            prefixed = dist.PrefixStore(f"epoch{epoch}/", store)  # type: ignore[attr-defined]
            timeout = timedelta(seconds=timeout_s)
            if device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                box["pg"] = dist.ProcessGroupNCCL(prefixed, rank, world, options)
            else:
                box["pg"] = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        except Exception as e:  # noqa: BLE001 (re-raised below, in the trainer's thread)
            box["error"] = e

    thread = threading.Thread(target=build, name=f"form-epoch{epoch}", daemon=True)
    thread.start()
    while thread.is_alive():
        if superseded():
            raise Superseded
        thread.join(0.002)
    if "error" in box:
        if superseded():
            raise Superseded
        raise RuntimeError(f"could not form the group of epoch {epoch}: {box['error']}") from box["error"]
    return box["pg"]


def wait(pg: Any, work: Any, *, superseded: Callable[[], bool], graveyard: Graveyard, buf: Any = None,
         p2p: bool = False) -> None:
    """Wait for `work`, or give it up (raising Superseded) the moment the epoch is superseded.
    A collective that fails (a peer died under it) is also given up: the coordinator's verdict
    decides what comes next, never a gloo error alone."""
    pollable = _Pollable(work) if p2p else work
    while not pollable.is_completed():
        if superseded():
            graveyard.bury(pg, work, buf)
            raise Superseded
        time.sleep(POLL_S)
    try:
        pollable.wait()
    except RuntimeError as e:
        graveyard.bury(pg, work, buf)
        raise Superseded(f"collective failed: {str(e).splitlines()[0]}") from e


class _Pollable:
    """gloo's send/recv work never reports completion through is_completed(); only wait() ends it.
    So its wait() runs in a helper thread that the trainer can poll (and walk away from: the thread
    then ends with the group's timeout)."""

    def __init__(self, work: Any) -> None:
        self.work = work
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="p2p-wait")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.work.wait()
        except BaseException as e:  # noqa: BLE001 (re-raised by wait() in the trainer's thread)
            self.error = e

    def is_completed(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _is_nccl(pg: Any) -> bool:
    return type(pg).__name__ == "ProcessGroupNCCL"


def _abort_nccl(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 (best effort: the group is being thrown away)
        pass
