"""A survivor never sits out a group timeout because of the group it abandoned.

Destroying a gloo group waits for the ops still queued on it, and an op whose peer died or gave the
step up ends only at the group timeout. The trainer abandons an epoch by dropping its references to
the group; if its thread ran the destructor, it would sit out the timeout before it could form the
next epoch (its peers waiting for it at the rendezvous). Real processes and a real SIGKILL
(tests/system/group_release_proc.py): rank 0's wait fails on the dead rank while another of its ops
stays queued, it drops the group, and epoch 2 must train before that op's timeout, on rank 1's clock.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

PROC = Path(__file__).resolve().parent / "group_release_proc.py"
ROOT = Path(__file__).resolve().parents[2]


def test_a_survivor_drops_an_abandoned_group_without_waiting_for_its_pending_ops() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, str(PROC), str(rank), str(server.port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(3)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results = {r["rank"]: r for out in outs[:2] for line in out.splitlines() if line.startswith("{")
               for r in [json.loads(line)]}
    assert procs[2].returncode == -9 and set(results) == {0, 1}, outs
    assert results[0]["sum"] == results[1]["sum"] == 3.0, outs  # epoch 2 trained: 1 + 2
    one = results[1]
    assert one["old_op_timed_out"] is not None, outs[1]
    assert one["new_group_trained"] < one["old_op_timed_out"], (
        "rank 0 sat out the abandoned group's timeout before it formed epoch 2", outs)
