"""The worker's side of the protocol (transport/worker_side.py), driven by hand: each rule of the
conversation, with the coordinator's messages as the coordinator encodes them."""

from __future__ import annotations

from transport import (ERR_BUSY, ERR_NAME_TAKEN, ERR_REJOIN, ERR_STALE_EPOCH, Abort, CheckpointNow, ControlReply, Error,
                       Join, MeshLayout, PlanDelta, Ready, SaveModel, StepReport, Stop, Welcome, encode)
from transport.worker_side import JOIN_RETRY_S, REJOIN_GRACE_S, WorkerSide


def _side() -> WorkerSide:
    join = Join(name="w1", host="h", pid=1, device="cpu", flops=1e9, memory_bytes=1 << 30, threads=1)
    return WorkerSide(join_template=join, endpoint="tcp://127.0.0.1:5556")


def _welcome(last_step: int = 0) -> Welcome:
    return Welcome(name="w1", run_id="r", job_ref="job.py:job", job_name="job", job_source="", job_sha256="",
                   heartbeat_s=0.2, lease_s=1.0, want_graph=False, last_step=last_step)


def _delta(epoch: int, abort: bool) -> PlanDelta:
    return PlanDelta(epoch=epoch, reason="x", layout=MeshLayout(dp_replicate=1, dp_shard=1, pp=1, tp=1, members=["w1"],
                                                                 shares=[8]), global_batch=8, abort=abort)


def _report(step: int) -> StepReport:
    return StepReport(name="w1", epoch=1, step=step, loss=1.0, samples=8, global_batch=8, compute_s=0.1,
                      comm_s=0.0, step_s=0.1, digest="")


def test_a_join_reports_the_workers_epoch_and_step() -> None:
    side = _side()
    side.epoch, side.step = 3, 40
    join = side.join(now=5.0)
    assert (join.name, join.epoch, join.step) == ("w1", 3, 40) and side.joined_at == 5.0


def test_plans_abort_and_stop_decide_what_is_superseded() -> None:
    side = _side()
    side.receive(_welcome(), now=0.0)
    side.receive(_delta(2, abort=False), now=0.0)
    assert not side.superseded(1) and side.pending_planned(1) == _delta(2, abort=False)
    side.receive(_delta(3, abort=True), now=0.0)
    assert side.superseded(2) and side.pending_planned(1) is None and side.newest_after(1) == _delta(3, abort=True)
    side.receive(Abort(epoch=3, reason="w2 failed"), now=0.0)
    assert side.superseded(3) and not side.superseded(4)
    side.receive(Stop(reason="drained"), now=0.0)
    assert not side.superseded(4), "a planned exit finishes the step it is in"
    side.receive(Stop(reason="the job is over"), now=0.0)
    assert side.superseded(4)


def test_fencing_drops_the_old_plans_and_joins_again_saying_ready() -> None:
    side = _side()
    side.join(now=0.0)
    side.receive(_welcome(), now=0.1)
    side.receive(_delta(2, abort=False), now=0.2)
    side.ready = True
    assert side.receive(Error(code=ERR_STALE_EPOCH, message="not a member"), now=0.5) == [], \
        "within the grace after a Join: an echo of an older heartbeat"
    out = side.receive(Error(code=ERR_STALE_EPOCH, message="not a member"), now=REJOIN_GRACE_S + 1)
    assert [type(m) for m in out] == [Join, Ready] and side.fenced and side.deltas == []
    assert any("fenced out" in line for line in side.take_logs())
    side.leaving()
    side.fenced = False
    assert side.receive(Error(code=ERR_STALE_EPOCH, message="gone"), now=10.0) == [], "a worker that left stays out"


def test_a_restarted_coordinator_gets_the_reports_it_has_not_logged() -> None:
    side = _side()
    side.receive(_welcome(), now=0.0)
    for step in range(1, 6):
        side.sent(_report(step))
    out = side.receive(Error(code=ERR_REJOIN, message="the coordinator restarted"), now=5.0)
    assert [type(m) for m in out] == [Join]
    assert side.receive(Error(code=ERR_REJOIN, message="again"), now=5.5) == [], "one re-registration at a time"
    again = side.receive(_welcome(last_step=3), now=6.0)
    assert again == [_report(4), _report(5)]


def test_a_busy_coordinator_is_asked_again_and_refusals_are_fatal_before_the_welcome() -> None:
    side = _side()
    side.receive(Error(code=ERR_BUSY, message="too many joining"), now=1.0)
    assert side.join_due(1.5) is None and isinstance(side.join_due(1.0 + JOIN_RETRY_S), Join)
    side.receive(Error(code=ERR_NAME_TAKEN, message="a live worker is already named 'w1'"), now=2.0)
    assert side.fatal is not None and "already named" in side.fatal
    other = _side()
    other.receive(ControlReply(ok=True, data={}, error=""), now=0.0)
    assert other.fatal is not None and "control endpoint" in other.fatal


def test_requests_wait_for_the_step_boundary_and_garbage_is_counted_not_fatal() -> None:
    side = _side()
    side.receive(_welcome(), now=0.0)
    side.receive(SaveModel(path="/tmp/m"), now=0.0)
    side.receive(CheckpointNow(reason="asked"), now=0.0)
    assert side.saves == ["/tmp/m"] and side.checkpoints == 1
    assert side.receive_frame(b"\x00garbage", now=0.0) == [] and side.ignored == 1 and side.fatal is None
    assert side.receive_frame(encode(Stop(reason="x")), now=0.0) == [] and side.stop == "x"
