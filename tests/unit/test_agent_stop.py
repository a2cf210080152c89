"""What a coordinator's `Stop` means to the step in flight (`worker.agent.Agent.superseded`).

A drained or preempted worker is let go once every member has switched at the agreed step boundary,
so the step it may still be finishing is one its peers already completed: it must finish it, not
abandon it (found in CI: a drained worker logged "epoch 2 abandoned" when the Stop overtook the
last wait of its final step). Any other stop ends the step at once. The agent's own frame handler
decodes real frames; no thread or socket is needed to ask it."""

from __future__ import annotations

import pytest

from transport.codec import encode
from transport.messages import Abort, Stop
from worker.agent import Agent
from worker.calibrate import Calibration


def _agent() -> Agent:
    calibration = Calibration(flops=1e9, memory_bytes=1 << 30, host="h", device="cpu", threads=1)
    return Agent("tcp://127.0.0.1:1", "w3", calibration)


@pytest.mark.parametrize("reason", ["drained", "preempted"])
def test_a_planned_exit_lets_the_last_step_finish(reason: str) -> None:
    agent = _agent()
    agent._handle(None, encode(Stop(reason=reason)))  # type: ignore[arg-type]
    assert agent.stop_reason() == reason
    assert not agent.superseded(2)


@pytest.mark.parametrize("reason", ["the job is over", "stopped by ctl", "drained: the drain deadline passed"])
def test_any_other_stop_supersedes_the_step(reason: str) -> None:
    agent = _agent()
    assert not agent.superseded(2)
    agent._handle(None, encode(Stop(reason=reason)))  # type: ignore[arg-type]
    assert agent.superseded(2)


def test_an_abort_still_supersedes_a_drained_worker() -> None:
    agent = _agent()
    agent._handle(None, encode(Stop(reason="drained")))  # type: ignore[arg-type]
    agent._handle(None, encode(Abort(epoch=2, reason="failure")))  # type: ignore[arg-type]
    assert agent.superseded(2)


def test_a_leaving_worker_waits_for_the_coordinator_to_answer_its_leave() -> None:
    """A worker that exits right after its final Leave races it: the coordinator's socket monitor
    may see the closed connection before its reader takes the Leave, and logs the worker as failed
    (seen in the demo: a standby worker told "the job is over" logged as "failed (detected by
    disconnect)"). The worker waits for the coordinator's answer; a Stop that came before the Leave
    (the one that made it leave) is not that answer."""
    from transport.messages import Leave

    import threading

    agent = _agent()
    agent._handle(None, encode(Stop(reason="the job is over")))  # type: ignore[arg-type]
    assert not agent.say_goodbye(Leave(name="w3", reason="stopped"), wait_s=0.05), \
        "the Stop before the Leave is not its answer"
    answer = threading.Timer(0.1, lambda: agent._handle(None, encode(Stop(reason="goodbye"))))  # type: ignore[arg-type]
    answer.start()
    assert agent.say_goodbye(Leave(name="w3", reason="stopped"), wait_s=60), "the answer ends the wait"
    answer.join()
