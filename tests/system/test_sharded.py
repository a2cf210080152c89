"""A sharded job end to end, with the real coordinator and workers on loopback: `--layout dp=1`
shards the GPT example's state over every member (FSDP2 on each epoch's group).

- Two members train sharded; a third joins (the reshard brings it only its slices); one is drained
  (it hands its slices over as a sender, then leaves). Every step's loss, learning rate and gradient
  norm equal the single-process recipe's within 1e-4, no step is lost or doubled, every plan says
  it is sharded, and the trained model is written gathered, loadable into the plain model.
- SIGKILL of a member of a sharded job whose slices have no other copy: the job stops with a
  `state_lost` event naming what was lost; it never trains on made-up state.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from localjob import LocalJob
from test_recipe import JOB, NUM_STEPS, _check_the_trained_model, _gap, single_process


def _plans(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["kind"] == "plan" and e.get("layout")]


@pytest.mark.timeout(400)
def test_a_sharded_job_is_exact_through_a_join_and_a_drain(tmp_path: Path) -> None:
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(8, 180)
        job.add_worker("w3")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and len(e["layout"]["members"]) == 3, 120,
                                "w3 planned in")
        job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == joined["epoch"], 60, "a step with w3")
        assert job.ctl("drain", "w1") == {"draining": "w1"}
        drained = job.wait_event(lambda e: e["kind"] == "plan" and "w1" not in e["layout"]["members"]
                                 and e["epoch"] > joined["epoch"], 60, "w1 planned out")
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, {n: job.tail(n) for n in exits}
        assert job.wait_coordinator(30) == 0
        events = job.events()
        steps = {e["step"]: e for e in events if e["kind"] == "step"}
        run = {s: {"loss": e["loss"], "lr": e["lr"], "grad_norm": e["grad_norm"]} for s, e in steps.items()}
        gaps = _gap(run, reference)
        assert max(gaps.values()) <= 1e-4, gaps
        for plan in _plans(job):
            layout = plan["layout"]
            assert (layout["dp_replicate"], layout["dp_shard"]) == (1, len(layout["members"])), layout
        assert drained["layout"]["members"] == ["w2", "w3"]
        reshards = {e["epoch"]: e for e in events if e["kind"] == "reshard"}
        assert reshards[joined["epoch"]]["bytes"] > 0, "the newcomer received its slices"
        assert steps[max(steps)]["epoch"] >= drained["epoch"]
        printed = (tmp_path / "coordinator.out").read_text() if (tmp_path / "coordinator.out").exists() else ""
        _check_the_trained_model(tmp_path, [e for e in events if e["kind"] == "finished"], printed, trained)


@pytest.mark.timeout(300)
def test_a_lost_shard_stops_the_job_naming_it(tmp_path: Path) -> None:
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(5, 180)
        job.kill("w2")
        lost = job.wait_event(lambda e: e["kind"] == "state_lost", 60, "state_lost")
        assert "no member holds" in lost["detail"] and "weight" in lost["detail"], lost
        exits = job.wait_workers(60)
        assert exits["w1"] == 0, job.tail("w1")
        assert job.wait_coordinator(30) is not None
        last = max(job.steps())
        assert last < NUM_STEPS, "nothing trained on after the loss"
        assert "lost" in job.tail("w1", 40)
