"""`ctl layout SPEC` on a running job, with the real coordinator and workers on loopback: two workers
start replicated (no --layout); the operator moves them to a pipeline (`pp=2`), then to FSDP
(`fsdp=2`), then lifts the pin (`auto`). Each change is a `layout` event and a re-plan with reason
"layout" that the workers enter live, and every step's loss, learning rate and gradient norm equal
the single-process recipe's within 1e-4. A bad SPEC is refused by ctl (exit 1, the reason, no
traceback) and changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from localjob import LocalJob
from test_recipe import JOB, single_process
from test_sharded import _assert_exact

CTL = Path(__file__).resolve().parents[2] / "scripts" / "ctl.py"


def _relaid(job: LocalJob, check: str, after: int) -> dict[str, Any]:
    """The first plan with reason "layout" after event index `after` (waits for it), and a step of its
    epoch. `check` names the layout expected, for the failure message."""
    def found(events: list[dict[str, Any]]) -> dict[str, Any] | None:
        return next((e for e in events[after:] if e["kind"] == "plan" and e["reason"] == "layout"
                     and e.get("layout")), None)

    plan = job.wait_until(found, 120, f"a plan for layout {check}")
    job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 120, f"a step under {check}")
    return plan


@pytest.mark.timeout(400)
def test_a_running_job_moves_from_replicas_to_a_pipeline_to_fsdp_and_back(tmp_path: Path) -> None:
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2) as job:
        job.start()
        job.add_worker("w1", "--slowdown", "3")  # (margin for three changes before step 40)
        job.add_worker("w2", "--slowdown", "3")
        job.wait_step(3, 180)
        assert job.ctl("status")["layout_pin"] == "auto"

        bad = subprocess.run([sys.executable, str(CTL), "--control", job.control_endpoint, "layout", "pp=x"],
                             capture_output=True, text=True, timeout=30, env=job.env())
        assert bad.returncode == 1 and "is not NAME=N" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert job.ctl("status")["layout_pin"] == "auto", "a refused SPEC changes nothing"

        seen = len(job.events())
        assert job.ctl("layout", "pp=2") == {"layout": "pp=2"}
        pipeline = _relaid(job, "pp=2", seen)
        assert pipeline["layout"]["pp"] == 2 and len(pipeline["layout"]["stages"]) == 2, pipeline["layout"]

        seen = len(job.events())
        assert job.ctl("layout", "fsdp=2") == {"layout": "fsdp=2"}
        sharded = _relaid(job, "fsdp=2", seen)
        assert sharded["layout"]["dp_shard"] == 2 and sharded["layout"]["pp"] == 1, sharded["layout"]

        seen = len(job.events())
        assert job.ctl("layout", "auto") == {"layout": "auto"}
        answer = job.wait_until(lambda events: next((e for e in events[seen:] if e["kind"] in ("plan", "kept")
                                                     and e["reason"] == "layout"), None), 60, "the pin lifted")
        assert answer["kind"] == "kept" or answer["status"] != "infeasible", answer  # (the planner's choice either way)

        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        changes = [(e["layout"], e["previous"], e["source"]) for e in events if e["kind"] == "layout"]
        assert changes == [("pp=2", "auto", "ctl"), ("fsdp=2", "pp=2", "ctl"), ("auto", "fsdp=2", "ctl")], changes
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_pipeline_is_sharded_live_and_a_killed_shard_is_replaced_from_its_copy(tmp_path: Path) -> None:
    """Five workers under `--layout pp=2` (two train, three wait); `ctl layout pp=2,fsdp=2` shards
    each stage over two members live (the stage holders keep their part, two newcomers receive the
    other); SIGKILL of a member of a sharded stage: the fifth worker takes its shard from the copy
    its ring neighbour keeps. Every step's loss, learning rate and gradient norm stay the
    single-process recipe's; no step is lost; the survivors train again within the liveness bound."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "pp=2"]) as job:
        job.start()
        for name in ("w1", "w2", "w3", "w4", "w5"):
            job.add_worker(name, "--slowdown", "2")  # (margin for two changes before step 40)
        job.wait_step(3, 180)

        seen = len(job.events())
        assert job.ctl("layout", "pp=2,fsdp=2") == {"layout": "pp=2,fsdp=2"}
        sharded = _relaid(job, "pp=2,fsdp=2", seen)
        layout = sharded["layout"]
        assert (layout["pp"], layout["dp_replicate"], layout["dp_shard"]) == (2, 1, 2), layout
        assert len(layout["members"]) == 4 and len(layout["stages"]) == 2, layout

        victim = layout["members"][1]  # (stage 0's second shard)
        job.kill(victim)
        replaced = job.wait_event(lambda e: e["kind"] == "plan" and e.get("layout") and e["epoch"] > sharded["epoch"]
                                  and victim not in e["layout"]["members"], 120, "a plan without the killed member")
        assert (replaced["layout"]["pp"], replaced["layout"]["dp_shard"]) == (2, 2), replaced["layout"]
        assert len(replaced["layout"]["members"]) == 4, replaced["layout"]

        exits = job.wait_workers(300)
        assert {n: c for n, c in exits.items() if n != victim} == {n: 0 for n in exits if n != victim}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_pipeline_that_loses_a_stage_is_cut_again_into_fewer_stages(tmp_path: Path) -> None:
    """`--layout pp=3` on three workers; SIGKILL of the last stage's holder: the pin cannot be met by
    two, so training waits with the state kept (the dead member's stage in the copy its ring
    neighbour holds); `ctl layout pp=2` cuts the model again into two stages over the survivors,
    each receiving the units it lacks from whoever holds them. Every step's loss, learning rate and
    gradient norm equal the single-process recipe's; no state is lost."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "pp=3"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--slowdown", "2")
        first = job.wait_event(lambda e: e["kind"] == "plan" and e.get("layout"), 180, "a plan")
        assert first["layout"]["pp"] == 3, first["layout"]
        job.wait_step(5, 180)
        victim = first["layout"]["members"][2]
        job.kill(victim)
        waiting = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "the failure's plan")
        assert waiting["layout"] is None and "needs 3 members" in waiting["detail"], waiting
        seen = len(job.events())
        assert job.ctl("layout", "pp=2") == {"layout": "pp=2"}
        cut = _relaid(job, "pp=2", seen)
        assert cut["layout"]["pp"] == 2 and victim not in cut["layout"]["members"], cut["layout"]
        exits = job.wait_workers(300)
        assert {n: c for n, c in exits.items() if n != victim} == {n: 0 for n in exits if n != victim}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)
