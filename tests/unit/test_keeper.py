"""worker.keeper: a group is held while anyone uses it and let go of in another thread once nobody does."""

from __future__ import annotations

import threading

from worker import keeper


class Group:
    """Stands for a process group: records the thread its destructor runs in."""

    def __init__(self, where: list[str], done: threading.Event) -> None:
        self.where, self.done = where, done

    def __del__(self) -> None:
        self.where.append(threading.current_thread().name)
        self.done.set()


def test_a_group_in_use_is_kept_and_a_dropped_one_is_destroyed_off_this_thread() -> None:
    where: list[str] = []
    done = threading.Event()
    group = keeper.keep(Group(where, done))
    before = keeper.held()
    keeper.reap()
    assert keeper.held() == before and not where, "a group someone holds is never let go"
    del group  # the last reference but the keeper's, dropped on this thread: nothing is destroyed here
    assert not where
    keeper.reap()
    assert done.wait(10)
    assert where and where[0] != threading.current_thread().name, where
