"""coordinator.phase: the one answer `ctl status` and `ctl plan --explain` give to "what is the job
doing, and why", through every state a total loss and a resume pass (pure: membership driven by
hand, no sockets)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from test_journal import _journaled
from test_membership import Sim, _config, deltas, report

from coordinator import membership as m
from coordinator.control import ControlView, answer_control
from coordinator.ctl import format_explain, format_plan, format_status
from coordinator.journal import recover
from coordinator.phase import PHASES, phase
from plan import PlanResult
from transport import Checkpointed, ControlRequest


def _ask(sim: Sim, command: str, *args: str) -> dict[str, object]:
    view = ControlView(state=sim.state, job_ref="job.py:job", num_steps=sim.config.num_steps, global_batch=64,
                       uptime_s=1.0, min_workers=sim.config.min_workers)
    reply, events = answer_control(view, ControlRequest(command=command, args=list(args)), now=sim.now)
    assert reply.ok and events == [], reply.error
    return reply.data


def _said(sim: Sim) -> tuple[str, str, str, str]:
    """(state, reason) of `status`, and what `plan --explain` says, as JSON and for people."""
    status, plan = _ask(sim, "status"), _ask(sim, "plan", "explain")
    explained = plan["explain"]
    assert isinstance(explained, dict)
    assert status["state"] == plan["state"] == explained["state"] in PHASES, (status, plan)
    assert f"\nstate: {status['reason']}  (" in format_status(status)
    return str(status["state"]), str(status["reason"]), str(explained["detail"]), format_plan(plan)


def test_a_total_loss_under_min_workers_2_waits_for_workers_then_resumes() -> None:
    sim = Sim(config=_config(checkpoint_dir="/ck", min_workers=2))
    sim.running("a", "b")
    assert _said(sim)[0] == "training"
    sim(m.CheckpointWritten(Checkpointed(name="a", step=10, path="/ck/step-10", seconds=0.1, bytes=10, error="")))
    sim(report("a", 13))
    sim(m.Lost("a", "disconnect"))
    sim(m.Lost("b", "disconnect"))  # every worker gone: the epoch stays, nothing trains
    lost_at = sim.state.epoch
    assert sim.state.plan is None and sim.state.resume is not None
    assert sim.state.result is not None and "no ready devices" in sim.state.result.reason  # (the planner's last word)
    state, reason, _, _ = _said(sim)
    assert state == "waiting_for_workers"
    assert reason == "waiting for workers: 0 ready, --min-workers 2; then resuming from checkpoint /ck/step-10 (step 10)"

    assert not deltas(sim.join("c")), "one ready worker: --min-workers 2 holds the plan back"
    state, reason, detail, plan_text = _said(sim)
    assert state == "waiting_for_workers" and reason.startswith("waiting for workers: 1 ready, --min-workers 2;")
    assert detail == reason, "plan --explain gives the same reason, not the planner's stale 'no ready devices'"
    assert plan_text == f"no plan (epoch {lost_at}): {reason}"
    assert "training" not in format_status(_ask(sim, "status")).split("\n")[1]

    sim.join("d", ready=False)
    assert _said(sim)[1].startswith("waiting for workers: 1 ready, 1 loading, --min-workers 2")
    d = next(iter(deltas(sim(m.MadeReady("d"))).values()))
    assert d.resume_path == "/ck/step-10"
    state, reason, _, _ = _said(sim)
    assert state == "resuming" and reason == (f"resuming from checkpoint /ck/step-10 (step 10): epoch {lost_at + 1} "
                                              "waits for c, d to load it")
    sim.ack("c")
    assert _said(sim)[1].endswith("waits for d to load it")
    sim.ack("d")
    state, reason, detail, _ = _said(sim)
    assert (state, reason) == ("training", f"training: epoch {lost_at + 1}, 2 member(s)") and "no ready devices" not in detail


def test_a_total_loss_without_a_checkpoint_says_training_starts_over() -> None:
    sim = Sim(config=_config(min_workers=2))
    sim.running("a", "b")
    sim(report("a", 5))
    sim(m.Lost("a", "disconnect"))
    sim(m.Lost("b", "lease"))
    sim.join("c")
    state, reason, _, _ = _said(sim)
    assert state == "waiting_for_workers" and reason == ("waiting for workers: 1 ready, --min-workers 2; the training "
                                                         "state was lost with no checkpoint: training starts over "
                                                         "from step 0")


def test_switching_stopping_and_finished() -> None:
    sim = Sim()
    assert _said(sim)[:2] == ("waiting_for_workers", "waiting for workers: 0 ready, --min-workers 1")
    sim.running("a", "b")
    sim.join("c")
    state, reason, _, _ = _said(sim)
    assert state == "switching" and reason == "switching to epoch 2: waiting for a, b, c to acknowledge it"
    sim.ack_all()
    sim(report("a", sim.config.num_steps, epoch=2))
    assert _said(sim)[:2] == ("finished", "finished: the last step (100) is committed")
    sim = Sim()
    sim.running("a")
    sim(m.StopRequested("stopped by ctl"))
    assert _said(sim)[0] == "stopping"


def test_a_restarted_coordinator_says_it_waits_for_the_journaled_members(tmp_path: Path) -> None:
    _, values = _journaled(tmp_path)
    sim = Sim(config=_config(checkpoint_dir="/ck"), state=recover(values, now=100.0))
    state, reason, _, _ = _said(sim)
    assert state == "recovering" and "waiting for a, b to register again" in reason


def test_survivors_that_no_plan_fits_wait_for_a_device_that_fits() -> None:
    sim = Sim()
    sim.running("a", "b")
    nothing = PlanResult(plan=None, status="infeasible", reason="a needs 3.0 GiB, has 1.0 GiB")
    sim.state = replace(sim.state, plan=None, running=frozenset({"a"}), acked=frozenset(), result=nothing)
    p = phase(sim.state, min_workers=5)  # survivors are not held back by --min-workers
    assert p.name == "waiting_for_fit" and p.reason == ("waiting for a device that fits: a keep(s) the training state "
                                                        "(a needs 3.0 GiB, has 1.0 GiB)")
    assert _said(sim)[:3] == (p.name, p.reason, p.reason)
    assert format_explain(_ask(sim, "plan", "explain")) == f"no plan: {phase(sim.state).reason}"
