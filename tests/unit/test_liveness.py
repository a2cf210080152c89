"""The liveness checks (scripts/liveness.py) on hand-written event logs: each rule flags what breaks it
and passes what keeps it."""

from __future__ import annotations

from typing import Any

from liveness import STALL_MARK, problems


def ev(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "ts": ts, **fields}


def plan(ts: float, epoch: int, members: list[str], reason: str = "join") -> dict[str, Any]:
    return ev("plan", ts, epoch=epoch, reason=reason, layout={"members": members})


def steps(first: int, last: int, epoch: int, ts: float, step_s: float = 0.1) -> list[dict[str, Any]]:
    return [ev("step", ts + (s - first) * step_s, step=s, epoch=epoch, step_s=step_s) for s in range(first, last + 1)]


BEFORE = [ev("joined", 0.0, worker="a"), ev("joined", 0.1, worker="b"), plan(1.0, 1, ["a", "b"]),
          *steps(1, 10, 1, 2.0), ev("failed", 3.05, worker="b", detected_by="disconnect")]
HEALTHY = [*BEFORE, plan(3.06, 2, ["a"], "failure"), *steps(11, 40, 2, 3.3)]


def test_a_healthy_run_has_no_problem() -> None:
    assert problems(HEALTHY, {"a": "[a] epoch 2 (failure): formed in 12 ms"}) == []


def test_a_recovery_past_the_bound_is_a_stall() -> None:
    slow = [*BEFORE, plan(3.06, 2, ["a"], "failure"), *steps(11, 40, 2, 63.0)]
    [p] = problems(slow)
    assert "trained again only" in p and "b failed" in p


def test_a_failure_no_plan_follows_is_a_frozen_planner() -> None:
    assert any("no plan followed" in p for p in problems([*BEFORE, *steps(11, 12, 1, 3.1)]))


def test_a_join_never_planned_is_flagged_and_a_standby_with_a_reason_is_not() -> None:
    run = [*HEALTHY, ev("joined", 6.0, worker="c"), *steps(41, 80, 2, 6.5)]
    assert any("c joined" in p for p in problems(run))
    assert problems([*run, ev("standby", 7.0, worker="c", why="too slow to pay for its part")]) == []
    assert problems([*run, plan(7.0, 3, ["a", "c"]), *steps(81, 82, 3, 8.0)]) == []


def test_a_straggler_needs_a_plan_or_a_kept_event() -> None:
    run = [*HEALTHY, ev("straggler", 6.0, worker="a", speed=1.0), *steps(41, 80, 2, 6.5)]
    assert any("straggler" in p for p in problems(run))
    kept = [*HEALTHY, ev("straggler", 6.0, worker="a", speed=1.0), ev("kept", 6.2, reason="straggler", detail="x"),
            *steps(41, 80, 2, 6.5)]
    assert problems(kept) == []


def test_a_step_committed_twice_is_flagged_unless_a_resume_redoes_it() -> None:
    doubled = [*HEALTHY, *steps(40, 41, 2, 7.0)]
    assert problems(doubled) == ["step 40 was committed 2 times"]
    redone = [*HEALTHY, ev("resumed", 6.9, step=39, path="ckpt", epoch=3, redone=1), *steps(40, 41, 3, 7.0)]
    assert problems(redone) == []


def test_a_worker_that_sat_out_a_timeout_is_flagged() -> None:
    log = f"[a] epoch 2: its entry took 59.97 s, {STALL_MARK} (60 s)"
    assert problems(HEALTHY, {"a": log}) == [f"a stalled: {log}"]


def test_a_total_loss_is_not_held_to_the_survivors_bound() -> None:
    run = [*BEFORE, ev("failed", 3.06, worker="a", detected_by="disconnect"),
           ev("joined", 10.0, worker="c"), ev("state_lost", 20.0, step=10), plan(20.1, 2, ["c"], "join"),
           ev("resumed", 25.0, step=10, path="ckpt", epoch=2, redone=0), *steps(11, 40, 2, 25.5)]
    assert problems(run) == []


def test_a_member_of_the_running_plan_put_on_standby_is_flagged() -> None:
    benched = [*HEALTHY, ev("standby", 7.0, worker="a", why="too slow to pay for its part of the communication")]
    [p] = problems(benched)
    assert "a was put on standby" in p
    left_out = [*HEALTHY, ev("joined", 7.0, worker="c"), ev("standby", 7.1, worker="c", why="too slow")]
    assert problems(left_out) == []
