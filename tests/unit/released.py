"""For tests where one process waits on a peer that stopped: run the blocked work, abort its group a
moment later from another thread, and write down how the work ended, for the test to read."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from worker.comm import Superseded

ABORT_AFTER_S = 0.3


def run_until_aborted(work: Callable[[], object], abort: Callable[[str], None], why: str, released: Path) -> NoReturn:
    """`work()`, with `abort(why)` called ABORT_AFTER_S later; "completed" or "superseded: ..." goes to
    `released` (which the stopped peer waits for), and the process ends the way a worker does:
    an abandoned op's thread must not be joined at interpreter exit."""
    threading.Timer(ABORT_AFTER_S, abort, args=(why,)).start()
    try:
        work()
        outcome = "completed"
    except Superseded as e:
        outcome = f"superseded: {e}"
    released.write_text(outcome)
    os._exit(0)
