"""Every process group this worker forms is let go of in a thread of its own, never in the trainer's.

Destroying a gloo or NCCL group waits for the operations still queued on it, and an operation whose
peer died or gave the step up ends only at the group timeout (60 s by default). Whichever thread
drops the last reference to a group runs that destructor: a `group = None` in the step loop, an
exception unwinding the frames that held it, the cyclic collector freeing a structure it sat in.
When that was the trainer's thread, the survivor sat out the whole timeout before forming the next
epoch, and its peers waited for it at the rendezvous: one stall of the timeout after a kill.

So `keep` holds a reference to every group from the moment it is formed. A reaper thread looks
every REAP_S at what it holds and, for each group nobody else refers to any longer (its reference
count is the keeper's own), hands that last reference to a short-lived thread that drops it: the
destructor, and its wait, run there. While the keeper holds a group, no other thread's release and
no collection can destroy it, since it is still reachable. A group in use is never touched.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TypeVar

__all__ = ["keep", "held"]

G = TypeVar("G")

REAP_S = 0.5  # how often the reaper looks for groups nobody uses any more

_lock = threading.Lock()
_held: list[Any] = []
_reaper: threading.Thread | None = None

# sys.getrefcount of a group that only the keeper holds, as the reaper calls it: one reference from
# the `_held` list, one for getrefcount's own argument.
_ONLY_KEEPER = 2


def keep(group: G) -> G:
    """Hold `group` until nobody else refers to it, then let it go in a thread of its own; returns it."""
    global _reaper
    with _lock:
        _held.append(group)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_forever, name="group-reaper", daemon=True)
            _reaper.start()
    return group


def held() -> int:
    """How many groups the keeper holds now (formed and not yet let go)."""
    with _lock:
        return len(_held)


def _reap_forever() -> None:
    event = threading.Event()
    while True:
        event.wait(REAP_S)
        reap()


def reap() -> int:
    """Let go of every group only the keeper refers to, each in a thread of its own; how many."""
    with _lock:
        unused = [i for i in range(len(_held)) if sys.getrefcount(_held[i]) <= _ONLY_KEEPER]
        boxes = [[_held[i]] for i in unused]
        for i in reversed(unused):
            del _held[i]
    for box in boxes:  # the box holds the last reference: the thread that empties it destroys the group
        threading.Thread(target=box.clear, name="group-release", daemon=True).start()
    return len(boxes)
