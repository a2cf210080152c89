"""The control handler is a pure function: (view, request) -> (reply, events). No sockets, no clock,
nothing applied: the daemon applies the events it returns."""

from __future__ import annotations

from dataclasses import replace

from coordinator import membership as m
from coordinator.control import ControlView, answer_control
from transport import ControlRequest, Join


def _view(**kw: object) -> ControlView:
    state = m.State()
    state, _ = m.apply(state, m.Joined(Join(name="w1", host="h", pid=1, device="cpu", flops=1e9,
                                            memory_bytes=2**30, threads=1)),
                       m.Config(global_batch=8, num_steps=10), now=100.0)
    base = ControlView(state=state, job_ref="examples/mlp.py:job", num_steps=10, global_batch=8, uptime_s=3.0,
                       events=[{"kind": "joined", "worker": "w1"}, {"kind": "step", "step": 1}],
                       refused={"decode": 4, "auth": 1}, secure=True)
    return replace(base, **kw)  # type: ignore[arg-type]


def ask(view: ControlView, command: str, *args: str) -> tuple[bool, dict[str, object], str, list[m.Event]]:
    reply, events = answer_control(view, ControlRequest(command=command, args=list(args)), now=101.5)
    return reply.ok, reply.data, reply.error, events


def test_status_reads_state_refusals_and_the_clock_passed_in() -> None:
    ok, data, _, events = ask(_view(), "status")
    assert ok and events == []
    assert data["refused"] == {"decode": 4, "auth": 1} and data["refused_total"] == 5 and data["secure"] is True
    [w] = data["workers"]  # type: ignore[misc]
    assert w["name"] == "w1" and w["last_seen_s"] == 1.5 and w["role"] == "standby"


def test_steering_commands_return_events_instead_of_applying_them() -> None:
    view = _view()
    ok, data, _, events = ask(view, "drain", "w1")
    assert ok and data == {"draining": "w1"} and events == [m.DrainRequested("w1")]
    ok, _, _, events = ask(view, "slowdown", "w1", "3")
    assert ok and events == [m.SlowdownRequested("w1", 3.0)]
    ok, _, _, events = ask(view, "stop")
    assert ok and events == [m.StopRequested("stopped by ctl")]
    assert not view.state.stopping and "w1" in view.state.workers, "the view itself is untouched"


def test_events_pages_from_an_index() -> None:
    ok, data, _, _ = ask(_view(), "events", "1")
    assert ok and data == {"events": [{"kind": "step", "step": 1}], "next": 2}


def test_bad_commands_are_refused_with_what_would_work_and_no_events() -> None:
    view = _view()
    for command, args, needle in [("frobnicate", [], "commands: status"), ("drain", ["nobody"], "workers: w1"),
                                  ("slowdown", ["w1", "0.5"], "between 1"), ("events", ["x"], "event index"),
                                  ("stop", ["now"], "no argument"), ("status", ["x"], "no argument"),
                                  ("plan", ["bogus"], "explain")]:
        ok, data, error, events = ask(view, command, *args)
        assert not ok and data == {} and events == [] and needle in error, (command, error)
