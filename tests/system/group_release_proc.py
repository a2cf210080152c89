"""One rank of tests/system/test_group_release.py (run as a script: real gloo groups, real SIGKILL).

rank 0 and 1 survive, rank 2 dies. In epoch 1 (3 ranks, group timeout GROUP_TIMEOUT_S) rank 0 waits,
as the trainer does, for two ops at once: one with rank 2 (it fails when rank 2 dies) and a
collective that rank 1 never joins (pending until the timeout). Rank 0's wait fails; it drops every
reference to the group, as the trainer does when it abandons the epoch, and forms epoch 2 with rank 1.
Rank 1 likewise has an op pending on rank 0 until the timeout, and says on its own clock whether epoch
2's all-reduce completed before that op timed out: only if nobody sat out the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from worker.comm import AllOf, Superseded, Waiter, form_group

GROUP_TIMEOUT_S = 8.0


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=30))
    cpu = torch.device("cpu")
    pg = form_group(store, 1, rank, 3, cpu, timeout_s=GROUP_TIMEOUT_S, superseded=lambda: False)
    if rank == 2:
        store.set("ready2", b"1")
        store.wait(["go"])
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        store.wait(["ready2", "watching"])
        time.sleep(0.5)  # (issued well after rank 1's watched op: it would end after that op's timeout)
        from_dead, from_one = torch.zeros(4), torch.zeros(4)
        # As in a step: one op that fails when rank 2 dies, one collective queued behind it that
        # rank 1 never joins (a peer that gave the step up): it ends only at the group timeout.
        from_one_root = dist.BroadcastOptions()
        from_one_root.rootRank = 1
        works = AllOf([(pg.recv([from_dead], 2, 0), from_dead), (pg.broadcast([from_one], from_one_root), from_one)])
        store.set("go", b"1")
        try:
            Waiter(cpu).wait(pg, works, superseded=lambda: False)
            raise AssertionError("a wait on a dead peer completed")
        except Superseded:
            pass
        del works, pg  # the trainer's last references to the abandoned group
        print(json.dumps({"rank": 0, "abandoned": True}), flush=True)
    if rank == 1:
        pending = pg.recv([torch.zeros(4)], 0, 0)  # rank 0 never sends: ends at the group timeout
        timed_out: list[float] = []

        def watch() -> None:
            try:
                pending.wait()
            except RuntimeError:
                pass
            timed_out.append(time.monotonic())
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        store.set("watching", b"1")
    new = form_group(store, 2, rank, 2, cpu, timeout_s=GROUP_TIMEOUT_S, superseded=lambda: False)
    total = torch.ones(1) * (rank + 1)
    new.allreduce([total]).wait()
    done = time.monotonic()
    if rank == 1:
        watcher.join(GROUP_TIMEOUT_S * 3)
        print(json.dumps({"rank": 1, "sum": float(total), "new_group_trained": done,
                          "old_op_timed_out": timed_out[0] if timed_out else None}), flush=True)
    else:
        print(json.dumps({"rank": 0, "sum": float(total)}), flush=True)
        time.sleep(GROUP_TIMEOUT_S + 2)  # (rank 1 must see its op time out, not rank 0 leave)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
