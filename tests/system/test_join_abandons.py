"""A join that abandons the members' step in flight (`coordinator --join-abandons`), with the real
coordinator and workers on loopback, in both layouts.

A member paused in the forward of step 6 (`--pause-at`), the other waiting for it in the step's
collectives: both give the step in flight up the moment the delta that takes the newcomer in
arrives, instead of finishing it and voting the switch at its boundary; the new group does step 6
again. Nothing is lost: every step once, and every step's loss,
learning rate and gradient norm equal the single-process recipe's within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from localjob import LocalJob
from test_recipe import JOB
from test_sharded import _assert_exact, _wait_for_log, single_process


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["fsdp=1", "dp=1"], ids=["replicated", "sharded"])
def test_a_join_that_abandons_the_step_in_flight_loses_nothing(tmp_path: Path, layout: str) -> None:
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2,
                  coordinator_args=["--layout", layout, "--join-abandons", "always"]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", "forward@6")  # (the delta lands inside step 6: w1 sleeps in it,
        job.add_worker("w2")  # w2 waits for w1 in the step's collectives)
        _wait_for_log(job, "w1", "pausing at forward of step 6")
        job.add_worker("w3")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and "w3" in (e["layout"] or {}).get("members", []),
                                120, "w3 planned in")
        assert joined["reason"] == "join" and joined["abandons_step"] is True, joined
        assert "abandon the step in flight" in joined["detail"]
        first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == joined["epoch"], 120, "a step with w3")
        assert first["step"] == 6, "step 6 was given up in the old epoch and done in the new one"
        assert first["ts"] - joined["ts"] < 50, "the members did not sit out the 60 s pause"
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, {n: job.tail(n) for n in exits}
        assert job.wait_coordinator(30) == 0
        old_epoch = joined["epoch"] - 1
        for name in ("w1", "w2"):  # each member gave a step of the old epoch up
            log = (job.state_dir / f"{name}.log").read_text()
            assert f"epoch {old_epoch} abandoned at step 5" in log, log[-3000:]
        _assert_exact(job.events(), reference)
