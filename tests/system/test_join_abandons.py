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
        assert "abandoned at step 5" in job.tail("w1", 10_000), "w1 gave its paused step up instead of waiting out the pause"
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        old_epoch = joined["epoch"] - 1
        for name in ("w1", "w2"):  # each member gave a step of the old epoch up
            log = (job.state_dir / f"{name}.log").read_text()
            assert f"epoch {old_epoch} abandoned at step 5" in log, log[-3000:]
        _assert_exact(job.events(), reference)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["fsdp=1", "dp=1"], ids=["replicated", "sharded"])
def test_a_join_that_missed_the_vote_abandons_the_step_after_it(tmp_path: Path, layout: str) -> None:
    """w1 waits at its switch vote in step 6 until the join's delta reaches it (--pause-at vote@6);
    w2, waiting for w1 in the step's all-reduce, voted before the delta came. Step 6 looked over
    when w3 came, so the plan went out planned (for the step boundary); the members commit step 6
    without the switch, and instead of running all of step 7 in the old epoch while w3 waits, they
    give it up when the coordinator sends the delta again, aborting (`abandon` event: with
    --join-wait-max 0 any wait is too long). The new group does step 7; every step exact."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2,
                  coordinator_args=["--layout", layout, "--join-wait-max", "0"]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", "vote@6")
        job.add_worker("w2")
        _wait_for_log(job, "w1", "pausing at the vote of step 6")
        job.add_worker("w3")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and "w3" in (e["layout"] or {}).get("members", []),
                                120, "w3 planned in")
        assert joined["abandons_step"] is False, joined["detail"]
        missed = job.wait_event(lambda e: e["kind"] == "abandon", 60, "the next step abandoned")
        assert (missed["epoch"], missed["step"]) == (joined["epoch"], 7), missed
        assert "step 6 was committed without the switch" in missed["detail"], missed
        first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == joined["epoch"], 120, "a step with w3")
        assert first["step"] == 7, "step 7 was given up in the old epoch and done in the new one"
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        old_epoch = joined["epoch"] - 1
        events = job.events()
        # (no member committed step 7 in the old epoch: each gave it up, or got the delta before it began)
        assert [e["step"] for e in events if e["kind"] == "step" and e["epoch"] == old_epoch][-1] == 6
        _assert_exact(events, reference)


# Four paced blocks (a ModuleList of one class: each its own FSDP2 unit), 8 ms of forward a sample
# each: a step is mostly compute outside any collective, where an abort lands with no wait to notice it.
PACED_BLOCKS = '''
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset
from worker.job import Job


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if x.device.type != "meta":
            time.sleep(0.008 * x.shape[0])  # (per sample: a share's compute, as on a real device)
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def job() -> Job:
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 2, generator=g))
    return Job(model=Net, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3), dataset=data,
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=16,
               num_steps=400, seed=5, description="paced blocks (the join tests)")
'''


@pytest.mark.timeout(300)
def test_a_sharded_join_gives_up_a_step_that_is_only_computing(tmp_path: Path) -> None:
    """No member waits in a collective when the delta lands (all alive, all computing): the step
    in flight is given up at its next FSDP2 gather or reduce-scatter, not finished and committed in
    the old epoch. A step whose backward had begun when the delta landed (its last ~20 ms here) may
    rightly commit; one that commits later was in its forward, with gathers still ahead: without
    the abandon points it commits, at any time in the ~0.3 s the step has left."""
    source = tmp_path / "blocks.py"
    source.write_text(PACED_BLOCKS)
    with LocalJob(f"{source}:job", tmp_path / "run", min_workers=2,
                  coordinator_args=["--layout", "dp=1", "--join-abandons", "always"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        for k, name in enumerate(("w3", "w4", "w5")):
            job.wait_step(max(job.steps(), default=0) + 2, 120)
            job.add_worker(name)
            joined = job.wait_event(lambda e: e["kind"] == "plan" and name in (e["layout"] or {}).get("members", []),
                                    120, f"{name} planned in")
            assert joined["abandons_step"] is True, (joined["detail"], joined)
            first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == joined["epoch"], 120, "a step")
            old = [e for e in job.events() if e["kind"] == "step" and e["epoch"] < joined["epoch"]]
            # The step whose collectives were completing as the plan went out may still commit; a
            # whole step more of the old epoch after it is a join that waited, not one that gave up.
            before = max((e["step"] for e in old if e["ts"] <= joined["ts"]), default=0)
            late = [e["step"] for e in old if e["step"] > before + 1]
            assert not late, f"{name}'s join: step {late} finished in the old epoch, not given up"
            assert first["step"] == max(e["step"] for e in old) + 1  # (nothing lost, nothing done twice)
            if k < 2:
                job.ctl("drain", name)
                job.workers[name].wait(timeout=120)
        job.ctl("stop")
        job.wait_coordinator(60)
