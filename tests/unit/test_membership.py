"""Membership as a pure state machine: `apply(state, event, config, now=...)` with a hand-moved clock.

No sockets, no sleeps. `Sim` keeps the state and the time; each test drives events and asserts on
the effects (who gets which message, what is logged) and on the resulting state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from coordinator import membership as m
from coordinator import steps
from coordinator.cli import parse_args
from coordinator.state import JOIN_WAIT_MAX_S
from plan import Graph
from plan.graph import Layer
from plan.layout import parse_pin
from transport import (ERR_NAME_TAKEN, ERR_STALE_EPOCH, Abort, Ack, Checkpointed, CheckpointNow, Error, Join, PlanDelta,
                       ResumeFailed, StateLost, StepReport, Stop)

GLOBAL_BATCH = 64
LEASE_S = 1.0


def _config(**kw: Any) -> m.Config:
    return m.Config(**{"global_batch": GLOBAL_BATCH, "num_steps": 100, "lease_s": LEASE_S, "min_workers": 1,
                       **kw})


def _join_msg(name: str, flops: float = 1e9) -> Join:
    return Join(name=name, host="host-" + name, pid=1000 + len(name), device="cpu", flops=flops,
                memory_bytes=2**30, threads=1)


@dataclass
class Sim:
    config: m.Config = field(default_factory=_config)
    state: m.State = field(default_factory=m.State)
    now: float = 100.0

    def __call__(self, event: m.Event) -> list[m.Effect]:
        """Apply `event`, and its follow-ups right after their effects (as the daemon does)."""
        self.state, effects = m.apply(self.state, event, self.config, now=self.now)
        out: list[m.Effect] = []
        for effect in effects:
            out.append(effect)
            if isinstance(effect, m.FollowUp):
                out += self(effect.event)
        return out

    def join(self, name: str, *, ready: bool = True) -> list[m.Effect]:
        effects = self(m.Joined(_join_msg(name)))
        if ready:
            effects += self(m.MadeReady(name))
        return effects

    def ack(self, name: str, epoch: int | None = None, step: int = 0) -> list[m.Effect]:
        epoch = self.state.epoch if epoch is None else epoch
        return self(m.Acked(Ack(name=name, epoch=epoch, step=step, reshard_bytes=0, reshard_s=0.0)))

    def ack_all(self) -> list[m.Effect]:
        assert self.state.plan is not None
        effects: list[m.Effect] = []
        for name in self.state.plan.members:
            effects += self.ack(name)
        assert not self.state.pending
        return effects

    def running(self, *names: str) -> None:
        """A job training under epoch 1 with `names`, every member acknowledged (the first plan
        waits for all of them: min_workers is raised while they join)."""
        config, self.config = self.config, replace(self.config, min_workers=len(names))
        for name in names:
            self.join(name)
        self.config = config
        self.ack_all()
        assert self.state.epoch == 1 and self.state.plan is not None
        assert list(self.state.plan.members) == list(names)


def deltas(effects: list[m.Effect]) -> dict[str, PlanDelta]:
    out = {e.to: e.msg for e in effects if isinstance(e, m.Send) and isinstance(e.msg, PlanDelta)}
    assert len({(d.epoch, tuple(d.members), tuple(d.shares)) for d in out.values()}) <= 1, \
        "every recipient gets the same delta"
    return out


def the_delta(effects: list[m.Effect]) -> PlanDelta:
    ds = deltas(effects)
    assert ds, f"no PlanDelta in {effects}"
    return next(iter(ds.values()))


def sent(effects: list[m.Effect], kind: type) -> dict[str, Any]:
    return {e.to: e.msg for e in effects if isinstance(e, m.Send) and isinstance(e.msg, kind)}


def logs(effects: list[m.Effect], kind: str) -> list[dict[str, Any]]:
    return [e.fields for e in effects if isinstance(e, m.Log) and e.kind == kind]


def finished(effects: list[m.Effect]) -> list[m.Finished]:
    return [e for e in effects if isinstance(e, m.Finished)]


def report(name: str, step: int, epoch: int = 1) -> m.StepDone:
    return m.StepDone(StepReport(name=name, epoch=epoch, step=step, loss=1.0, samples=32,
                                 global_batch=GLOBAL_BATCH, compute_s=0.01, comm_s=0.005, step_s=0.02,
                                 digest=""))


# --- the first plan ------------------------------------------------------------------------------


def test_first_plan_waits_for_min_workers_and_only_for_ready_ones() -> None:
    sim = Sim(config=_config(min_workers=2))
    effects = sim.join("a")
    assert [e for e in effects if isinstance(e, m.Welcome)] == [m.Welcome("a")]
    assert logs(effects, "joined") == [{"worker": "a", "host": "host-a", "device": "cpu"}]
    assert not deltas(effects) and sim.state.epoch == 0

    assert not deltas(sim.join("b", ready=False)), "b has not sent Ready: still one eligible worker"
    assert not deltas(sim.join("c", ready=False))
    assert sim.state.plan is None

    effects = sim(m.MadeReady("b"))
    ds = deltas(effects)
    assert set(ds) == {"a", "b"}, "c joined but is not ready: it is neither planned nor told"
    d = ds["a"]
    assert d.epoch == 1 and d.members == ["a", "b"] and not d.abort
    assert sum(d.shares) == GLOBAL_BATCH == d.global_batch
    assert [e.epoch for e in effects if isinstance(e, m.Planned)] == [1]
    assert sim.state.pending


# --- planned changes -----------------------------------------------------------------------------


def test_join_during_training_sends_a_planned_delta_to_old_and_new_members() -> None:
    sim = Sim()
    sim.running("a", "b")
    effects = sim.join("c")
    ds = deltas(effects)
    assert set(ds) == {"a", "b", "c"}
    d = ds["c"]
    assert d.epoch == 2 and not d.abort and d.reason == "join"
    assert sorted(d.members) == ["a", "b", "c"] and d.members[:2] == ["a", "b"], "old ranks kept"
    assert sum(d.shares) == GLOBAL_BATCH and all(s > 0 for s in d.shares)
    assert not sent(effects, Abort), "a join aborts nothing"
    assert sim.state.running == {"a", "b"}, "the old group runs until the switch"


def test_second_join_waits_until_every_member_acknowledged_the_first() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim.join("c")
    assert sim.state.epoch == 2

    effects = sim.join("d")
    assert not deltas(effects), "a planned change is in flight: the next one waits"
    assert sim.state.replan_wanted == "join" and sim.state.epoch == 2

    assert not deltas(sim.ack("a")) and not deltas(sim.ack("b"))
    effects = sim.ack("c")
    d = the_delta(effects)
    assert d.epoch == 3 and "d" in d.members and not d.abort
    assert set(deltas(effects)) == {"a", "b", "c", "d"}
    assert sum(d.shares) == GLOBAL_BATCH
    assert logs(effects, "reshard") and logs(effects, "reshard")[0]["epoch"] == 2
    assert sim.state.replan_wanted is None


def test_stale_epoch_ack_does_not_complete_the_current_epoch() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim.join("c")
    assert sim.state.epoch == 2
    sim.join("d")  # deferred until epoch 2 is acknowledged
    sim.ack("c", epoch=2)
    effects = sim.ack("a", epoch=1) + sim.ack("b", epoch=1)  # late acks of the previous epoch
    assert sim.state.pending and sim.state.acked == {"c"}
    assert not logs(effects, "reshard") and not deltas(effects), "epoch 2 is not complete"
    effects = sim.ack("a", epoch=2) + sim.ack("b", epoch=2)
    assert [f["epoch"] for f in logs(effects, "reshard")] == [2]
    assert the_delta(effects).epoch == 3, "epoch 2 complete: the deferred join goes out"


def test_a_drain_past_its_deadline_falls_back_to_the_redundancy() -> None:
    """b is drained but never completes the switch (stuck handing its state over): at the drain
    deadline it is let go as failed (a `drain_deadline` event, a Stop, an abort and a failure
    re-plan), so the others take its part from the copies; a drain that completed in time, whose
    worker is only slow to exit, is no deadline miss."""
    sim = Sim()
    sim.config = replace(sim.config, drain_deadline_s=5.0, lease_s=1e9)
    sim.running("a", "b", "c")
    sim(m.DrainRequested("b"))
    sim.now += 4.0
    assert not logs(sim(m.Tick()), "drain_deadline"), "not yet"
    sim.now += 2.0
    effects = sim(m.Tick())
    assert logs(effects, "drain_deadline") == [{"worker": "b", "reason": "drained", "seconds": 6.0}]
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "drain_deadline"}]
    assert [s.msg for s in effects if isinstance(s, m.Send) and s.to == "b" and isinstance(s.msg, Stop)]
    assert sent(effects, Abort) and the_delta(effects).members == ["a", "c"] and the_delta(effects).reason == "failure"
    assert "b" not in sim.state.workers

    sim = Sim()
    sim.config = replace(sim.config, drain_deadline_s=5.0, lease_s=1e9)
    sim.running("a", "b", "c")
    sim(m.DrainRequested("b"))
    sim.ack_all()  # the switch happened: b only has to exit
    sim.now += 10.0
    effects = sim(m.Tick())
    assert not logs(effects, "drain_deadline") and not sent(effects, Abort)


def test_drain_plans_the_member_out_and_its_leave_aborts_nothing() -> None:
    sim = Sim()
    sim.running("a", "b", "c")
    effects = sim(m.DrainRequested("b"))
    ds = deltas(effects)
    assert set(ds) == {"a", "b", "c"}, "b is told too: it leaves at the switch"
    d = ds["b"]
    assert d.members == ["a", "c"] and not d.abort and d.epoch == 2
    assert sum(d.shares) == GLOBAL_BATCH
    assert sim.state.workers["b"].leaving == "drained"
    assert not sent(effects, Abort)

    effects = sim(m.Left("b", "drained"))  # it reached the switch before the others acked
    assert logs(effects, "left") == [{"worker": "b", "reason": "drained"}]
    assert not sent(effects, Abort) and not deltas(effects)
    assert "b" not in sim.state.workers
    effects = sim.ack_all()
    assert not sent(effects, Abort) and not deltas(effects)
    assert sim.state.epoch == 2


def test_preemption_notice_is_a_planned_change() -> None:
    sim = Sim()
    sim.running("a", "b")
    effects = sim(m.Left("b", "preempted"))
    d = the_delta(effects)
    assert d.members == ["a"] and d.shares == [GLOBAL_BATCH] and not d.abort
    assert not sent(effects, Abort) and "b" in sim.state.workers
    effects = sim(m.Left("b", "preempted"))  # again, at the switch
    assert logs(effects, "left") == [{"worker": "b", "reason": "preempted"}]
    assert not sent(effects, Abort) and "b" not in sim.state.workers


# --- failures ------------------------------------------------------------------------------------


def test_lease_expiry_fails_the_silent_worker_and_aborts_the_survivors() -> None:
    sim = Sim()
    sim.running("a", "b", "c")
    sim.now += LEASE_S / 2
    assert sim(m.Tick()) == [], "nobody is late yet"
    sim(m.Seen("a", 1, 5))
    sim(m.Seen("c", 1, 5))
    sim.now += LEASE_S * 0.75  # b has been silent for 1.25 leases, a and c for 0.75
    effects = sim(m.Tick())
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "lease"}]
    assert set(sent(effects, Abort)) == {"a", "c"}
    assert all(a.epoch == 1 for a in sent(effects, Abort).values())
    ds = deltas(effects)
    assert set(ds) == {"a", "c"}
    d = ds["a"]
    assert d.abort and d.epoch == 2 and d.members == ["a", "c"] and sum(d.shares) == GLOBAL_BATCH
    assert "b" not in sim.state.workers
    assert sim(m.Tick()) == [], "a failure is reported once"


def test_disconnect_fails_the_worker_and_aborts_the_survivors() -> None:
    sim = Sim()
    sim.running("a", "b", "c")
    effects = sim(m.Lost("c", "disconnect"))
    assert logs(effects, "failed") == [{"worker": "c", "detected_by": "disconnect"}]
    assert set(sent(effects, Abort)) == {"a", "b"}
    d = the_delta(effects)
    assert d.abort and d.members == ["a", "b"] and set(deltas(effects)) == {"a", "b"}
    assert "c" not in sim.state.workers and "c" not in sim.state.cluster.devices


def test_failure_supersedes_a_pending_planned_change() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim.join("c")  # epoch 2 pending
    effects = sim(m.Lost("a", "disconnect"))
    d = the_delta(effects)
    assert d.abort and d.epoch == 3 and d.members == ["b", "c"]
    assert set(sent(effects, Abort)) == {"b", "c"}


def test_failure_of_a_previous_plan_member_during_a_pending_switch_still_aborts() -> None:
    sim = Sim()
    sim.running("a", "b", "c")
    sim(m.DrainRequested("b"))  # epoch 2 = [a, c], pending; epoch 1's group (with b) still runs
    assert sim.state.pending and "b" in sim.state.running
    effects = sim(m.Lost("b", "disconnect"))
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "disconnect"}]
    assert set(sent(effects, Abort)) == {"a", "c"}, "a and c may be stuck in epoch 1's collective with b"
    d = the_delta(effects)
    assert d.abort and d.epoch == 3 and d.members == ["a", "c"]


def test_a_standby_worker_failing_aborts_nothing() -> None:
    sim = Sim()
    sim.running("a")
    sim.join("b", ready=False)
    effects = sim(m.Lost("b", "disconnect"))
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "disconnect"}]
    assert not sent(effects, Abort) and not deltas(effects)
    assert sim.state.epoch == 1


# --- fencing and rejoin --------------------------------------------------------------------------


@pytest.mark.parametrize("event", [
    m.Seen("ghost", 1, 3),
    report("ghost", 4),
    m.Acked(Ack(name="ghost", epoch=1, step=3, reshard_bytes=0, reshard_s=0.0)),
    m.MadeReady("ghost"),
], ids=["heartbeat", "step-report", "ack", "ready"])
def test_messages_from_a_non_member_are_fenced(event: m.Event) -> None:
    sim = Sim()
    sim.running("a", "b")
    sim(m.Lost("b", "lease"))  # b is fenced now; "ghost" was never here
    before = sim.state
    for ev in (event, _renamed(event, "b")):
        effects = sim(ev)
        name = "b" if ev is not event else "ghost"
        errors = sent(effects, Error)
        assert set(errors) == {name} and errors[name].code == ERR_STALE_EPOCH
        assert sim.state == before, "a fenced worker changes nothing"


def _renamed(event: m.Event, name: str) -> m.Event:
    match event:
        case m.Seen(_, epoch, step):
            return m.Seen(name, epoch, step)
        case m.StepDone(r):
            return report(name, r.step)
        case m.Acked(a):
            return m.Acked(Ack(name=name, epoch=a.epoch, step=a.step, reshard_bytes=0, reshard_s=0.0))
        case m.MadeReady(_):
            return m.MadeReady(name)
    raise AssertionError(event)


def test_fenced_worker_that_joins_again_is_in_the_next_plan() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim.now += LEASE_S * 2
    sim(m.Seen("a", 1, 10))
    effects = sim(m.Tick())  # b was stopped (SIGSTOP): its lease ran out
    assert logs(effects, "failed") == [{"worker": "b", "detected_by": "lease"}]
    assert the_delta(effects).members == ["a"]
    assert sent(sim(m.Seen("b", 1, 10)), Error)["b"].code == ERR_STALE_EPOCH  # b resumes: fenced

    effects = sim.join("b")
    assert m.Welcome("b") in effects
    sim.ack("a")  # a formed epoch 2 alone; the deferred join goes out now
    d = sim.state.plan
    assert d is not None and sim.state.epoch == 3 and set(d.members) == {"a", "b"}
    assert sum(d.shares) == GLOBAL_BATCH


def test_name_taken() -> None:
    sim = Sim()
    sim.running("a")
    before = sim.state
    effects = sim(m.Joined(Join(name="a", host="elsewhere", pid=4242, device="cpu", flops=1e9,
                                memory_bytes=1, threads=1)))
    errors = sent(effects, Error)
    assert set(errors) == {"a"} and errors["a"].code == ERR_NAME_TAKEN
    assert not any(isinstance(e, m.Welcome) for e in effects)
    assert sim.state == before and sim.state.workers["a"].host == "host-a"


# --- the end -------------------------------------------------------------------------------------


def test_all_workers_leaving_finished_after_the_last_step_finishes_the_job() -> None:
    sim = Sim(config=_config(num_steps=3))
    sim.running("a", "b")
    for step in (1, 2, 3):
        for name in ("a", "b"):
            effects = sim(report(name, step))
    assert sim.state.finished and sim.state.last_step == 3
    assert [f["step"] for f in logs(sim(report("a", 3)), "step")] == [], "a step is logged once"
    effects = sim(m.Left("a", "finished"))
    assert logs(effects, "left") == [{"worker": "a", "reason": "finished"}]
    assert not sent(effects, Abort) and not finished(effects), "b is still there"
    effects = sim(m.Left("b", "finished"))
    assert finished(effects) == [m.Finished("finished")]
    assert not sent(effects, Abort) and not deltas(effects)


def test_step_reports_are_logged_once_per_step() -> None:
    sim = Sim()
    sim.running("a", "b")
    assert [f["step"] for f in logs(sim(report("a", 1)), "step")] == [1]
    assert logs(sim(report("b", 1)), "step") == []
    assert sim.state.workers["b"].step == 1 and not sim.state.finished


def test_stop_tells_everyone_and_finishes_when_they_have_left() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim.join("c", ready=False)
    effects = sim(m.StopRequested("stopped by ctl"))
    stops = sent(effects, Stop)
    assert set(stops) == {"a", "b", "c"} and stops["a"].reason == "stopped by ctl"
    assert not finished(effects) and sim.state.stopping
    effects = sim(m.Left("a", "stopped"))
    assert logs(effects, "left") == [{"worker": "a", "reason": "stopped"}] and not finished(effects)
    assert not deltas(effects), "no re-plan while stopping"
    effects = sim(m.Lost("c", "disconnect"))
    assert not finished(effects)
    assert not logs(effects, "failed"), "exiting after Stop is not a failure"
    effects = sim(m.Lost("b", "disconnect"))
    assert not logs(effects, "failed") and not sent(effects, Abort)
    assert finished(effects) == [m.Finished("stopped")]
    assert not sim.state.workers
    effects = sim(m.Joined(_join_msg("late")))
    assert set(sent(effects, Stop)) == {"late"}, "a worker joining a stopped job is told to stop"


def test_a_lone_worker_that_crashes_and_rejoins_is_planned_again() -> None:
    """A one-worker job whose worker is restarted (same name) must train again."""
    sim = Sim()
    sim.running("a")
    effects = sim(m.Lost("a", "disconnect"))
    assert logs(effects, "failed") and not sim.state.workers
    effects = sim.join("a")
    d = the_delta(effects)
    assert d.members == ["a"] and d.epoch == 2 and sum(d.shares) == GLOBAL_BATCH


def test_draining_the_only_member_does_not_lose_the_job() -> None:
    sim = Sim()
    sim.running("a")
    for step in (1, 2, 3):
        sim(report("a", step))
    sim(m.DrainRequested("a"))
    assert sim.state.last_step == 3, "a still holds the training state"
    effects = sim.join("b")
    assert "a" in deltas(effects), "a is told about the next epoch: it cannot train on alone"
    handoff = the_delta(effects)
    assert handoff.members == ["b", "a"] and handoff.shares == [GLOBAL_BATCH, 0], \
        "a stays one epoch with no samples, to hand its state to b inside the new group"
    effects = sim.ack("b") + sim.ack("a")
    final = the_delta(effects)
    assert final.members == ["b"] and final.epoch == handoff.epoch + 1 and not final.abort
    assert "a" in deltas(effects), "a learns it is planned out, and leaves at the switch"


def test_a_member_that_lost_the_plan_gets_it_again() -> None:
    """A member still heartbeating an older epoch a lease after the plan went out is sent the
    plan again (a fenced worker re-joining can drop it); before a lease has passed, it is not."""
    sim = Sim()
    sim.running("a", "b")
    effects = sim.join("c")
    delta = the_delta(effects)
    sim(m.Acked(Ack(name="a", epoch=delta.epoch, step=0, reshard_bytes=0, reshard_s=0.0)))
    assert not sent(sim(m.Seen("c", 0, 0)), PlanDelta), "too early to resend"
    sim.now += sim.config.lease_s + 0.1
    resent = sent(sim(m.Seen("c", 0, 0)), PlanDelta)
    assert resent == {"c": delta}
    assert not sent(sim(m.Seen("a", delta.epoch, 0)), PlanDelta), "a member that acked is left alone"
    assert not sent(sim(m.Seen("c", 0, 0)), PlanDelta), "at most once a lease"


def test_drained_worker_is_stopped_once_the_new_epoch_is_in_place() -> None:
    sim = Sim()
    sim.running("a", "b")
    effects = sim(m.DrainRequested("b"))
    delta = the_delta(effects)
    assert delta.members == ["a"] and "b" in deltas(effects)
    assert not sent(effects, Stop), "b must first switch with everyone at the step boundary"
    effects = sim.ack("a")
    assert sent(effects, Stop) == {"b": Stop(reason="drained")}
    effects = sim(m.Left("b", "drained"))
    assert logs(effects, "left") == [{"worker": "b", "reason": "drained"}] and not sent(effects, Abort)


# --- with the model's graph: the cost model and the MILP decide ------------------------------------

GRAPH = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=400_000, activation_bytes=1000),),
              optimizer_state_bytes=800_000)
STATIC = 1_600_000  # parameters + gradients + optimizer state


def planned(effects: list[m.Effect]) -> list[m.Planned]:
    return [e for e in effects if isinstance(e, m.Planned)]


def timed(name: str, step: int, epoch: int, samples: int, compute_s: float) -> m.StepDone:
    return m.StepDone(StepReport(name=name, epoch=epoch, step=step, loss=1.0, samples=samples,
                                 global_batch=GLOBAL_BATCH, compute_s=compute_s, comm_s=0.001,
                                 step_s=compute_s + 0.002, digest=""))


def graph_sim(*names: str, memory: dict[str, int] | None = None) -> Sim:
    sim = Sim()
    sim(m.GraphReceived(GRAPH))
    for name in names:
        msg = replace(_join_msg(name), memory_bytes=(memory or {}).get(name, 2**30))
        sim(m.Joined(msg))
    return sim


def planned_sim(*names: str, **config: Any) -> Sim:
    """`graph_sim` with every one of `names` ready and the first plan (of all of them) acknowledged."""
    sim = graph_sim(*names)
    sim.config = replace(sim.config, min_workers=len(names), **config)
    for name in names:
        sim(m.MadeReady(name))
    sim.ack_all()
    return sim


def train(sim: Sim, steps: int, compute: dict[str, float]) -> list[m.Effect]:
    """`steps` steps of the current plan, each member taking compute[name] s per sample."""
    effects: list[m.Effect] = []
    plan = sim.state.plan
    assert plan is not None
    for _ in range(steps):
        step = sim.state.last_step + 1
        for name, share in zip(plan.members, plan.shares):
            effects += sim(timed(name, step, sim.state.epoch, share, share * compute[name]))
    return effects


def test_straggler_is_found_from_step_times_and_its_share_drops() -> None:
    sim = graph_sim("a", "b", "c")
    sim.config = replace(sim.config, min_workers=3)
    for name in ("a", "b", "c"):
        sim(m.MadeReady(name))
    sim.ack_all()
    first = sim.state.plan
    assert first is not None and sim.state.result is not None and sim.state.result.status == "heuristic"
    effects = train(sim, 12, {"a": 0.01, "b": 0.01, "c": 0.01})  # measured: no change worth a new epoch
    assert not deltas(effects) and sim.state.epoch == 1
    effects = train(sim, 6, {"a": 0.01, "b": 0.03, "c": 0.01})  # b three times slower
    assert [f["worker"] for f in logs(effects, "straggler")] == ["b"]
    [p] = planned(effects)
    assert p.reason == "straggler" and p.result.status == "optimal"
    d = the_delta(effects)
    shares = dict(zip(d.members, d.shares))
    assert not d.abort and d.members == list(first.members)
    assert shares["b"] < GLOBAL_BATCH / 3 / 2 and sum(d.shares) == GLOBAL_BATCH
    sim.ack_all()
    train(sim, 6, {"a": 0.01, "b": 0.03, "c": 0.01})  # the new epoch settles and measures its baseline
    effects = train(sim, 6, {"a": 0.01, "b": 0.01, "c": 0.01})
    assert [f["worker"] for f in logs(effects, "recovered")] == ["b"]
    assert dict(zip(the_delta(effects).members, the_delta(effects).shares))["b"] >= 20


def test_members_recovering_one_after_another_are_planned_at_their_true_speed() -> None:
    """Three workers of one host stretched 8x are set back to full speed a few steps apart: the
    first is found `recovered` and takes most of the batch; in that epoch the other two are 8x
    faster than planned. Their device change is no layout effect: the fits' own layout kind learns
    no efficiency (it once learned 0.25 from those two, the median of three, and every speed went
    wrong: one member was given the whole batch), and each device ends fitted at its true speed
    with the batch shared evenly."""
    sim = Sim(config=_config(num_steps=400, min_workers=3))
    sim.state = replace(sim.state, layout=parse_pin("fsdp=1"))
    sim(m.GraphReceived(GRAPH))
    names = ("w9", "w11", "w12")
    for name in names:
        sim(m.Joined(Join(name=name, host="h", pid=1, device="cpu", flops=1e9, memory_bytes=2**30, threads=1,
                          cores=2)))
    for name in names:
        sim(m.MadeReady(name))
    sim.ack_all()
    fast_from = {"w9": 60, "w11": 62, "w12": 63}
    recovered: list[str] = []
    for step in range(1, 160):
        sim.now += 0.1
        plan, epoch = sim.state.plan, sim.state.epoch
        assert plan is not None
        effects: list[m.Effect] = []
        for name, share in zip(plan.members, plan.shares):  # 0.8 ms + 12 ms a sample at 8x, 1.5 ms at 1x
            per_sample = 0.0015 if step >= fast_from[name] else 0.012
            effects += sim(timed(name, step, epoch, share, 0.0008 + share * per_sample))
        recovered += [f["worker"] for f in logs(effects, "recovered")]
        if sim.state.pending:
            sim.ack_all()
    assert sorted(recovered) == sorted(names)  # each found, one at a time
    cluster, plan = sim.state.cluster, sim.state.plan
    assert cluster.efficiency_of("dp") == 1.0 and cluster.unit_kind == "dp"
    for name in names:
        assert cluster.speeds()[name] == pytest.approx(1 / 0.0015, rel=0.05), (name, cluster.devices[name])
    assert plan is not None and set(plan.members) == set(names) and max(plan.shares) - min(plan.shares) <= 3


def test_a_slow_joiner_is_left_on_standby_without_a_new_epoch() -> None:
    sim = planned_sim("a", "b")
    train(sim, 6, {"a": 0.001, "b": 0.001})
    epoch = sim.state.epoch
    sim(m.Joined(_join_msg("snail", flops=1e3)))  # calibrated a million times slower
    effects = sim(m.MadeReady("snail"))
    assert not deltas(effects) and sim.state.epoch == epoch
    assert sim.state.result is not None and "snail" in sim.state.result.standby


def test_a_survivor_with_memory_for_few_samples_trains_the_whole_batch_in_micro_batches() -> None:
    sim = graph_sim("big", "small", memory={"small": STATIC + 10 * 1000})  # small holds 10 samples at once
    sim.config = replace(sim.config, min_workers=2)
    sim(m.MadeReady("big"))
    sim(m.MadeReady("small"))
    sim.ack_all()
    train(sim, 6, {"big": 0.001, "small": 0.001})
    assert sim.state.last_step == 6
    d = the_delta(sim(m.Lost("big", "disconnect")))
    assert d.members == ["small"] and d.shares == [sim.config.global_batch]
    assert d.micro_batch == [10], "memory bounds the micro-batch, not the share"
    assert sim.state.holders == ["small"] and sim.state.last_step == 6, "the state is not lost"


def test_standby_workers_are_stopped_when_the_job_is_over() -> None:
    sim = graph_sim("a", "b")
    sim.config = replace(sim.config, min_workers=2, num_steps=20)
    sim(m.MadeReady("a"))
    sim(m.MadeReady("b"))
    sim.ack_all()
    train(sim, 6, {"a": 0.001, "b": 0.001})
    sim(m.Joined(_join_msg("snail", flops=1e3)))
    sim(m.MadeReady("snail"))
    assert sim.state.result is not None and "snail" in sim.state.result.standby
    effects = train(sim, 14, {"a": 0.001, "b": 0.001})
    assert sim.state.finished
    assert set(sent(effects, Stop)) == {"snail"}, "members leave by themselves; the standby is told"
    # Its connection closing before its Leave is read (two sockets, no order between them) is it
    # going as told, not a failure.
    gone = sim(m.Lost("snail", "disconnect"))
    assert [(e.kind, e.fields) for e in gone if isinstance(e, m.Log)] == [("left", {"worker": "snail",
                                                                                    "reason": "stopped"})]


# --- durable checkpoints (#12) -------------------------------------------------------------------


def _written(sim: Sim, step: int, *, error: str = "") -> list[m.Effect]:
    return sim(m.CheckpointWritten(Checkpointed(name="a", step=step, path=f"/ck/step-{step}", seconds=0.5,
                                                bytes=1000, error=error)))


def test_every_holder_lost_resumes_the_next_workers_from_the_newest_checkpoint() -> None:
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a", "b")
    assert logs(_written(sim, 10), "checkpoint") == [{"step": 10, "path": "/ck/step-10", "seconds": 0.5,
                                                      "bytes": 1000, "worker": "a"}]
    _written(sim, 20)
    assert logs(_written(sim, 30, error="OSError: disk full"), "checkpoint_failed")[0]["step"] == 30
    assert [c.step for c in sim.state.checkpoints] == [10, 20], "a failed write is not a checkpoint"
    sim(report("a", 27))
    sim(m.Lost("a", "disconnect"))
    effects = sim(m.Lost("b", "disconnect"))
    lost = logs(effects, "state_lost")
    assert lost and lost[0]["resume_from"] == "/ck/step-20" and lost[0]["redo"] == 7, lost
    assert sim.state.resume is not None and sim.state.last_step == 20
    sim.config = replace(sim.config, min_workers=2)
    effects = sim.join("c") + sim.join("d")
    d = the_delta(effects)
    assert d.resume_path == "/ck/step-20" and d.resume_step == 20 and d.senders == []
    effects = sim.ack_all()
    assert logs(effects, "resumed") == [{"step": 20, "path": "/ck/step-20", "epoch": sim.state.epoch,
                                         "redone": 7}]
    assert sim.state.resume is None
    sim(report("c", 21, epoch=sim.state.epoch))
    assert the_delta(sim.join("e")).resume_path == "", "once resumed, plans move state as usual"


def test_a_damaged_checkpoint_falls_back_to_the_one_before_said_once() -> None:
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a")
    _written(sim, 10)
    _written(sim, 20)
    sim(m.Lost("a", "disconnect"))
    sim.join("b")
    sim.join("c")
    bad = m.ResumeFailedReported(ResumeFailed(name="b", epoch=sim.state.epoch, path="/ck/step-20",
                                              detail="/ck/step-20/__0_0.distcp: sha256 differs"))
    effects = sim(bad)
    assert logs(effects, "checkpoint_corrupt")[0]["path"] == "/ck/step-20"
    assert set(sent(effects, Abort)) == {"b", "c"}
    assert the_delta(effects).resume_path == "/ck/step-10"
    assert sim(replace(bad, msg=replace(bad.msg, name="c"))) == [], "said by every member: taken once"


def test_a_lost_slice_with_a_checkpoint_resumes_instead_of_stopping() -> None:
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a", "b", "c")
    _written(sim, 10)
    effects = sim(m.StateLostReported(StateLost(name="c", epoch=1, detail="no member holds w[0:4] of step 12")))
    assert logs(effects, "state_lost")[0]["resume_from"] == "/ck/step-10"
    assert not sim.state.stopping and the_delta(effects).resume_path == "/ck/step-10"
    assert not sent(effects, Stop)


def test_ctl_checkpoint_asks_every_member() -> None:
    sim = Sim(config=_config(checkpoint_dir="/ck"))
    sim.running("a", "b")
    effects = sim(m.CheckpointRequested("ctl checkpoint"))
    assert set(sent(effects, CheckpointNow)) == {"a", "b"}
    sim.config = _config()
    assert sim(m.CheckpointRequested("ctl checkpoint")) == [], "no --checkpoint-dir: nothing to ask"


def test_a_coordinator_stall_fails_nobody_for_the_heartbeats_it_did_not_read() -> None:
    sim = Sim()
    sim.running("a", "b")
    sim(m.Tick())
    sim.now += LEASE_S * 3  # the coordinator did not run: its ticks and the heartbeats queued
    assert logs(sim(m.Tick()), "failed") == [], "its own stall is nobody's failure"
    for _ in range(30):  # the queued heartbeats are read, a's keep coming; b's never do
        sim(m.Seen("a", 1, 5))
        sim.now += 0.05
        failed = logs(sim(m.Tick()), "failed")
        if failed:
            break
    assert failed == [{"worker": "b", "detected_by": "lease"}]


def _sharded_sim() -> Sim:
    """A job pinned to `--layout dp=1` (every member a shard: FSDP over all of them), with a graph,
    trained by "a" alone (a whole replica: one member), which is then drained while "b" and "c"
    are ready to take over (made ready together: one re-plan)."""
    sim = Sim(state=m.State(layout=parse_pin("dp=1")))
    sim(m.GraphReceived(GRAPH))
    sim.running("a")
    sim(report("a", 1))
    sim.join("b", ready=False)
    sim.join("c", ready=False)
    sim.state = replace(sim.state, workers={n: replace(w, ready=True) for n, w in sim.state.workers.items()})
    return sim


def test_a_whole_replica_hands_its_state_to_a_sharded_plan_as_a_sender() -> None:
    """The only holder (one member: a whole replica) is drained and two newcomers are planned as
    shards: it hands the state over as a sender, never as a member with no samples (which would
    make the pinned all-shards layout a replicated one)."""
    sim = _sharded_sim()
    effects = sim(m.DrainRequested("a"))
    d = the_delta(effects)
    assert d.members == ["b", "c"] and d.layout.dp_replicate == 1 and d.layout.dp_shard == 2, d
    assert d.senders == ["a"] and "a" in deltas(effects), "the sender is told, or the members wait for it"


def test_a_sender_outside_the_last_plan_is_still_told_and_nudged() -> None:
    """A holder that handed off in an epoch that never completed stays a sender of the next one,
    though it is in neither the last plan nor the new one: it must get that delta (the chaos suite
    hung on this: the members waited at the rendezvous for a rank nobody told), and again if it
    still heartbeats an older epoch a lease later."""
    sim = _sharded_sim()
    sim.join("d", ready=False)
    sim.state = replace(sim.state, workers={n: replace(w, ready=True) for n, w in sim.state.workers.items()})
    sim(m.DrainRequested("a"))
    assert sim.state.plan is not None and sim.state.plan.members == ("b", "c", "d")
    sim.ack("b")  # the switch is not complete everywhere: c and d never acknowledge
    effects = sim(m.Lost("c", "disconnect"))
    d = the_delta(effects)
    assert "a" in d.senders and "a" not in d.members and "a" in deltas(effects), d
    sim.now += LEASE_S * 1.5
    effects = sim(m.Seen("a", epoch=d.epoch - 1, step=1))
    assert "a" in deltas(effects), "a sender that lost the delta is sent it again"


def _joining_mid_step(elapsed_s: float, *, policy: str = "auto", host: str | None = None,
                      cores: int = 0, wait_max: float | None = None) -> tuple[Sim, list[m.Effect]]:
    """a and b train (0.3 s steps, measured); c becomes ready `elapsed_s` into the step in flight.
    `host`: all three on that host with `cores` cores, whose compute slows in proportion to the
    threads per core beyond one (γ = 1, as learned from measurements), else each on its own host."""
    sim = graph_sim()
    sim.config = replace(sim.config, min_workers=2, join_abandons=policy, join_wait_max_s=wait_max)
    for name in ("a", "b", "c"):
        msg = _join_msg(name)
        sim(m.Joined(replace(msg, host=host, cores=cores) if host else msg))
    sim(m.MadeReady("a"))
    sim(m.MadeReady("b"))
    sim.ack_all()
    train(sim, 8, {"a": 0.01, "b": 0.01})
    if host:
        sim.state = replace(sim.state, cluster=replace(sim.state.cluster, gamma={host: 1.0}))
    sim.now += elapsed_s
    return sim, sim(m.MadeReady("c"))


def test_a_join_early_in_a_step_abandons_it_when_the_new_plan_pays_for_that() -> None:
    # Two equal members and a third like them: the step is 2/3 as long, so abandoning pays while
    # less than a third of the step has run (80% of that, for the prediction's error).
    sim, effects = _joining_mid_step(0.02)
    [p] = planned(effects)
    d = the_delta(effects)
    assert d.reason == "join" and d.members == ["a", "b", "c"]
    assert d.abort and p.abandons_step, "the members give the step in flight up at once"
    assert "abandon the step in flight: 0.02 s of ~0.32 s run" in p.result.reason
    assert not sent(effects, Abort), "nobody failed: the delta itself supersedes the old epoch"


def test_a_join_late_in_a_step_waits_for_its_boundary() -> None:
    sim, effects = _joining_mid_step(0.2)  # 2/3 of the step has run: finishing it is worth more
    [p] = planned(effects)
    d = the_delta(effects)
    assert d.members == ["a", "b", "c"] and not d.abort and not p.abandons_step
    assert "abandon" not in p.result.reason


def test_a_join_that_makes_the_step_no_faster_never_abandons_it() -> None:
    # All on one host with two cores, two members already busy on them: a third adds no compute.
    sim, effects = _joining_mid_step(0.01, host="box", cores=2)
    [p] = planned(effects)
    d = the_delta(effects)
    assert "c" in d.members and not d.abort, p.result.reason


@pytest.mark.parametrize(("wait_max", "abandons"), [(0.05, True), (0.2, False)])
def test_join_wait_max_bounds_how_long_a_join_waits_for_the_boundary(wait_max: float, abandons: bool) -> None:
    # 0.2 s into a ~0.32 s step: past where abandoning pays (test above); ~0.12 s of it is left.
    sim, effects = _joining_mid_step(0.2, wait_max=wait_max)
    [p] = planned(effects)
    d = the_delta(effects)
    assert d.members == ["a", "b", "c"] and d.abort is abandons and p.abandons_step is abandons, p.result.reason
    assert ("--join-wait-max" in p.result.reason) is abandons, p.result.reason


def test_join_wait_max_abandons_even_where_a_newcomer_makes_the_step_no_faster() -> None:
    # Where the cost model says a join never pays for the members' lost work (same host, cores busy),
    # the bound still holds: the newcomer is taken in at once rather than after most of a step.
    sim, effects = _joining_mid_step(0.01, host="box", cores=2, wait_max=0.05)
    [p] = planned(effects)
    d = the_delta(effects)
    assert "c" in d.members and d.abort and p.abandons_step, p.result.reason
    assert "would keep the newcomer waiting longer than --join-wait-max 0.05 s" in p.result.reason


def test_the_first_step_of_an_epoch_counts_from_the_epochs_formation() -> None:
    # c joins late in a step and waits for its boundary; the members finish the step, report it and
    # take 0.4 s to form the new epoch (the entry). d becomes ready 0.05 s into that epoch's first
    # step: most of the step is left, so --join-wait-max 0.05 abandons it. Timed from the last step's
    # report instead, the step would look overdue, be taken to end at once, and d would wait for it
    # (measured: 1.2 s joins after a drain's switch, the bench's default run).
    sim, effects = _joining_mid_step(0.2)
    assert not the_delta(effects).abort
    plan = sim.state.plan
    assert plan is not None and sim.state.epoch == 2
    sim.now += 0.12
    for name in ("a", "b"):
        sim(timed(name, 9, 1, 16, 0.3))
    sim.now += 0.4
    sim.ack_all()
    sim.config = replace(sim.config, join_wait_max_s=0.05)
    sim.now += 0.05
    effects = sim.join("d")
    [p] = planned(effects)
    assert "d" in the_delta(effects).members
    assert the_delta(effects).abort and p.abandons_step, p.result.reason
    assert "--join-wait-max 0.05 s" in p.result.reason, p.result.reason


def _step_of(sim: Sim, name: str, step: int, epoch: int, *, switching: bool) -> list[m.Effect]:
    return sim(m.StepDone(StepReport(name=name, epoch=epoch, step=step, loss=1.0, samples=32,
                                     global_batch=GLOBAL_BATCH, compute_s=0.3, comm_s=0.001, step_s=0.3,
                                     digest="", switching=switching)))


@pytest.mark.parametrize(("wait_max", "policy", "abandons"),
                         [(0.05, "auto", True), (None, "auto", True), (None, "never", False)])
def test_a_join_that_misses_the_members_vote_abandons_the_next_step(wait_max: float | None, policy: str,
                                                                    abandons: bool) -> None:
    # c comes 0.35 s into a ~0.32 s step: the step looks over, so the join waits for its boundary.
    # The step ends, but the delta reached a member after its vote: the members commit it without
    # switching and begin a whole step more of the old epoch. Weighed at that step's start, the
    # join rule abandons it (the new plan is faster; with --join-wait-max, the whole step is also
    # longer than the bound): the delta goes out again, aborting. Measured before: a join 1.35 s
    # into a 1.4 s step waited 1.39 s.
    sim, effects = _joining_mid_step(0.35, wait_max=wait_max, policy=policy)
    first = the_delta(effects)
    assert first.members == ["a", "b", "c"] and not first.abort, planned(effects)[0].result.reason
    sim.now += 0.02
    effects = _step_of(sim, "a", 9, 1, switching=False)
    again = deltas(effects)
    assert bool(again) is abandons, effects
    if abandons:
        assert set(again) == {"a", "b", "c"} and all(d.abort and d.epoch == first.epoch for d in again.values())
        assert sim.state.delta is not None and sim.state.delta.abort, "a member that lost it is sent the aborting one"
        [ev] = logs(effects, "abandon")
        assert ev["epoch"] == first.epoch and ev["step"] == 10, ev
        assert "step 9 was committed without the switch" in ev["detail"], ev
    assert not deltas(_step_of(sim, "b", 9, 1, switching=False)), "decided once a step"


def test_a_join_whose_vote_the_members_made_is_not_abandoned() -> None:
    sim, effects = _joining_mid_step(0.35, wait_max=0.05)
    assert not the_delta(effects).abort
    sim.now += 0.02
    for name in ("a", "b"):  # they voted in step 9 and switch right after it
        assert not deltas(_step_of(sim, name, 9, 1, switching=True))
    assert sim.state.delta is not None and not sim.state.delta.abort


@pytest.mark.parametrize(("policy", "elapsed", "abandons"), [("never", 0.001, False), ("always", 0.2, True)])
def test_join_abandons_policy_overrides_the_cost_model(policy: str, elapsed: float, abandons: bool) -> None:
    sim, effects = _joining_mid_step(elapsed, policy=policy)
    [p] = planned(effects)
    assert the_delta(effects).abort is abandons and p.abandons_step is abandons


def test_join_wait_max_flag_is_checked_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--bind", "tcp://127.0.0.1:0", "--job", "x.py:job", "--insecure"]
    assert parse_args(base)[0].join_wait_max_s == JOIN_WAIT_MAX_S == 0.5  # the default bounds a join's wait
    assert parse_args([*base, "--join-wait-max", "1.5"])[0].join_wait_max_s == 1.5
    assert parse_args([*base, "--join-wait-max", "none"])[0].join_wait_max_s is None  # no bound
    for policy in ("never", "always"):  # the bound is auto's: the others have none
        assert parse_args([*base, "--join-abandons", policy])[0].join_wait_max_s is None
    for bad, said in ((["--join-wait-max", "-1"], "must be seconds >= 0"),
                      (["--join-wait-max", "nan"], "must be seconds >= 0"),
                      (["--join-wait-max", "soon"], "seconds or none, got 'soon'"),
                      (["--join-wait-max", "none", "--join-abandons", "never"], "always waits for the step boundary"),
                      (["--join-wait-max", "0.5", "--join-abandons", "never"], "always waits for the step boundary"),
                      (["--join-wait-max", "0.5", "--join-abandons", "always"], "always abandons the step in flight")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*base, *bad])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and said in err and "Traceback" not in err, err


def test_join_wait_max_reaches_the_planners_config(tmp_path: Any) -> None:
    """--join-wait-max goes from the command line through the daemon into the config `replan` reads."""
    from coordinator.daemon import Core
    from coordinator.events import EventLog
    from coordinator.jobinfo import JobInfo

    cfg, _ = parse_args(["--bind", "tcp://127.0.0.1:0", "--job", "x.py:job", "--insecure", "--state-dir", str(tmp_path),
                         "--join-wait-max", "0.25"])
    info = JobInfo(ref="x.py:job", path="x.py", name="job", source="", sha256="0" * 64, global_batch=8,
                   num_steps=100, seed=0, num_params=10, description="")
    log = EventLog(tmp_path / "events.jsonl")
    core = Core(cfg, info, None, None, log, run_id="1")  # type: ignore[arg-type]  (no socket used)
    assert (core.config.join_abandons, core.config.join_wait_max_s) == ("auto", 0.25)
    log.close()


# --- liveness: no plan stays pending ------------------------------------------------------------


def test_a_plan_one_member_never_acknowledges_does_not_block_re_planning() -> None:
    """A member stuck entering an epoch (it heartbeats, so no lease expires) is declared failed once
    the plan's acknowledgements are overdue; the others get a new plan, and a straggler after it is
    handled (a plan or a `kept`), as it would be with no stuck epoch before."""
    sim = graph_sim("a", "b", "c", "d")
    sim.config = replace(sim.config, min_workers=4, ack_timeout_s=5.0)
    for name in ("a", "b", "c", "d"):
        sim(m.MadeReady(name))
    sim.ack_all()
    train(sim, 12, {n: 0.01 for n in "abcd"})
    d = the_delta(sim(m.Lost("d", "disconnect")))
    assert d.abort and sorted(d.members) == ["a", "b", "c"]
    sim.ack("a")
    sim.ack("b")  # c never does: it heartbeats the epoch it left, is sent the delta again, and stays stuck
    before: list[m.Effect] = []
    for _ in range(40):
        sim.now += 0.25
        effects: list[m.Effect] = []
        for name, epoch in (("a", d.epoch), ("b", d.epoch), ("c", d.epoch - 1)):
            effects += sim(m.Seen(name, epoch=epoch, step=12))
        effects += sim(m.Tick())
        if logs(effects, "failed"):
            break
        before += effects
    assert [(f["worker"], f["detected_by"]) for f in logs(effects, "failed")] == [("c", "ack_timeout")], effects
    assert sim.now - 100.0 >= sim.config.ack_timeout_s, "not before its bound"
    nudged = [e for e in before if isinstance(e, m.Send) and e.to == "c" and isinstance(e.msg, PlanDelta)]
    assert nudged, "the stuck member was sent the delta again before it was given up"
    again = the_delta([e for e in effects if not (isinstance(e, m.Send) and e.to == "c")])
    assert again.epoch == d.epoch + 1 and sorted(again.members) == ["a", "b"] and again.abort
    sim.ack_all()
    train(sim, 8, {"a": 0.01, "b": 0.01})
    effects = train(sim, 8, {"a": 0.01, "b": 0.04})  # b four times slower, lasting
    assert [f["worker"] for f in logs(effects, "straggler")] == ["b"]
    assert planned(effects) or logs(effects, "kept"), "a straggler gets a plan or a kept event"


def test_a_plan_acknowledged_in_time_is_never_declared_failed() -> None:
    sim = graph_sim("a", "b", "c")
    sim.config = replace(sim.config, min_workers=3, ack_timeout_s=5.0)
    for name in ("a", "b", "c"):
        sim(m.MadeReady(name))
    sim.ack_all()
    train(sim, 6, {n: 0.01 for n in "abc"})
    sim(m.Lost("c", "disconnect"))
    sim.ack("a")
    effects: list[m.Effect] = []
    for _ in range(16):  # b acknowledges after 4 s of the 5 s bound
        sim.now += 0.25
        effects += sim(m.Seen("a", epoch=sim.state.epoch, step=6)) + sim(m.Seen("b", epoch=1, step=6)) + sim(m.Tick())
    effects += sim.ack("b")
    for _ in range(40):
        sim.now += 0.25
        effects += sim(m.Seen("a", epoch=sim.state.epoch, step=6)) + sim(m.Seen("b", epoch=sim.state.epoch, step=6))
        effects += sim(m.Tick())
    assert not logs(effects, "failed") and not sim.state.pending


def test_the_migration_fit_never_learns_from_a_failures_entry() -> None:
    """A failure's epoch entry holds the fault's aftermath (a survivor released late from an abandoned
    collective took 60 s here): what moving state costs is learned from planned switches only."""
    sim = graph_sim("a", "b", "c")
    sim.config = replace(sim.config, min_workers=3)
    for name in ("a", "b", "c"):
        sim(m.MadeReady(name))
    sim.ack_all()
    before = sim.state.cluster.migration
    d = the_delta(sim(m.Lost("c", "disconnect")))
    for name, seconds in (("a", 0.01), ("b", 60.0)):
        sim(m.Acked(Ack(name=name, epoch=d.epoch, step=0, reshard_bytes=1000, reshard_s=seconds)))
    assert not sim.state.pending and sim.state.cluster.migration == before


def test_a_worker_still_loading_the_job_is_not_failed_for_a_stalled_heartbeat() -> None:
    """Joined, not ready yet (importing its libraries): its heartbeats may stall behind a native
    import for seconds. It holds nothing and is in no plan, so only LOADING_LEASE_S fails it; once
    ready, the lease is the usual one."""
    sim = Sim()
    sim.join("a")
    sim.ack_all()
    sim.join("b", ready=False)

    def wait(seconds: float) -> list[m.Effect]:  # a heartbeats, b is silent; the coordinator ticks
        effects: list[m.Effect] = []
        for _ in range(int(seconds / 0.25)):
            sim.now += 0.25
            effects += sim(m.Seen("a", epoch=sim.state.epoch, step=0)) + sim(m.Tick())
        return effects

    assert not logs(wait(LEASE_S * 5), "failed") and "b" in sim.state.workers
    failed = logs(wait(m.LOADING_LEASE_S), "failed")
    assert [(f["worker"], f["detected_by"]) for f in failed] == [("b", "lease")]


def test_a_straggler_whose_best_plan_is_the_running_one_gets_a_kept_event() -> None:
    """A re-plan for a speed change that finds the same members and shares makes no epoch, and still
    answers the change: a `kept` event says the running plan is the best for the measured speeds.
    (Two samples a step between two workers: a 1.5x slower one still takes its one sample.)"""
    sim = planned_sim("a", "b", global_batch=2)
    assert sim.state.plan is not None and list(sim.state.plan.shares) == [1, 1]
    train(sim, 12, {"a": 0.01, "b": 0.01})
    epoch = sim.state.epoch
    effects = train(sim, 8, {"a": 0.01, "b": 0.015})
    assert [f["worker"] for f in logs(effects, "straggler")] == ["b"]
    assert not deltas(effects) and sim.state.epoch == epoch
    [kept] = logs(effects, "kept")
    assert kept["reason"] == "straggler" and "the one running" in kept["detail"], kept
    assert not logs(effects, "standby"), "a member of the running plan is never put on standby"


def test_an_epochs_entry_steps_teach_no_fit() -> None:
    """The first SETTLE steps of an epoch hold its entry (a survivor released from the abandoned step,
    the reshard): a step stretched so changes neither a member's speed nor its per-step overhead."""
    sim = planned_sim("a", "b")
    train(sim, 12, {"a": 0.01, "b": 0.01})
    before = sim.state.cluster.devices["a"]
    sim(m.Lost("b", "disconnect"))  # a new epoch of one
    sim.ack_all()
    step = sim.state.last_step + 1
    for k in range(steps.SETTLE):
        sim(m.StepDone(StepReport(name="a", epoch=sim.state.epoch, step=step + k, loss=1.0, samples=GLOBAL_BATCH,
                                  global_batch=GLOBAL_BATCH, compute_s=5.0, comm_s=0.0, step_s=60.0, digest="")))
    after = sim.state.cluster.devices["a"]
    assert (after.samples_per_s, after.overhead_s, after.compute_window) == \
        (before.samples_per_s, before.overhead_s, before.compute_window)
