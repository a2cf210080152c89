"""The coordinator daemon: trio tasks around the pure membership core.

Tasks and who owns what:

* `_pump_workers` waits on the workers ROUTER (the only task that does), decodes frames and
  forwards them; an undecodable frame is answered with `Error` right there and never reaches state.
* `_pump_monitor` turns the socket monitor's disconnects into `Lost` events (milliseconds after a
  worker process dies: the kernel closes its sockets).
* `_pump_control` does the same for ctl's requests.
* `_ticker` sends a `Tick` every `tick_s` (lease expiry, store deadlines).
* `_run_core` is the one task that owns the state: it applies events with
  `membership.apply`, runs the rendezvous store, and executes effects (sends are synchronous and never
  wait; see transport.trio_zmq).

The coordinator is not on the training step's critical path: workers all-reduce among themselves
and only report steps here.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import zmq

from coordinator import membership as m
from coordinator.control import answer_control
from coordinator.events import EventLog
from coordinator.jobinfo import JobInfo
from coordinator.store import RendezvousStore
from plan.graph import Graph
from transport import (
    ERR_BAD_REQUEST,
    Ack,
    CodecError,
    ControlReply,
    ControlRequest,
    Error,
    GraphUpload,
    Heartbeat,
    Join,
    Leave,
    Message,
    Ready,
    StepReport,
    StoreRequest,
    TrioSocket,
    Welcome,
    decode,
    encode,
)

AGENT_MESSAGES = (Join, Ready, GraphUpload, Heartbeat, StepReport, Ack, Leave)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    bind: str
    control: str
    state_dir: Path
    min_workers: int = 1
    max_workers: int | None = None
    lease_s: float = 1.5
    heartbeat_s: float = 0.25
    tick_s: float = 0.05
    stop_grace_s: float = 10.0
    quiet: bool = False
    planner: str = "milp"
    solve_time_limit_s: float = 0.5
    solver: str = "auto"
    horizon_steps: int = 200


@dataclass(frozen=True, slots=True)
class Endpoints:
    workers: str
    control: str


# Items on the core's inbox.
@dataclass(frozen=True, slots=True)
class _FromWorker:
    identity: bytes
    msg: Message
    fd: int


@dataclass(frozen=True, slots=True)
class _FromControl:
    identity: bytes
    request: ControlRequest


@dataclass(frozen=True, slots=True)
class _Disconnected:
    fd: int


@dataclass(frozen=True, slots=True)
class _Event:
    event: m.Event


Inbox = _FromWorker | _FromControl | _Disconnected | _Event


class Core:
    """The state owner: membership, the store, the event log, and the sockets it answers on."""

    def __init__(self, cfg: CoordinatorConfig, job: JobInfo, workers: TrioSocket, control: TrioSocket,
                 log: EventLog, run_id: str) -> None:
        self.cfg, self.job, self.workers, self.control, self.log = cfg, job, workers, control, log
        self.run_id = run_id
        self.config = m.Config(global_batch=job.global_batch, num_steps=job.num_steps, lease_s=cfg.lease_s,
                               min_workers=cfg.min_workers, max_workers=cfg.max_workers, planner=cfg.planner,
                               solve_time_limit_s=cfg.solve_time_limit_s, horizon_steps=cfg.horizon_steps,
                               solver=cfg.solver)
        self.state = m.State()
        self.store = RendezvousStore()
        self.fd_owner: dict[int, str] = {}  # connection fd -> worker name (agent sockets only)
        self.worker_fd: dict[str, int] = {}
        self.done = trio.Event()
        self.finish_reason = ""
        self.started = time.time()

    # --- inbox -------------------------------------------------------------------------------

    def handle(self, item: Inbox) -> None:
        match item:
            case _FromWorker(identity, msg, fd):
                self._from_worker(identity, msg, fd)
            case _FromControl(identity, request):
                self.control.send([identity, encode(answer_control(self, request))])
            case _Disconnected(fd):
                name = self.fd_owner.pop(fd, None)
                if name is not None and self.worker_fd.get(name) == fd:
                    del self.worker_fd[name]
                    self.apply(m.Lost(name, "disconnect"))
            case _Event(event):
                self.apply(event)
                if isinstance(event, m.Tick):
                    for client, late in self.store.expire(now=time.monotonic()):
                        self.workers.send([client, encode(late)])

    def _from_worker(self, identity: bytes, msg: Message, fd: int) -> None:
        if isinstance(msg, StoreRequest):
            self._store(identity, msg)
            return
        if not isinstance(msg, AGENT_MESSAGES):
            self._refuse(identity, f"workers do not send {type(msg).__name__}")
            return
        if msg.name.encode() != identity:
            self._refuse(identity, f"message names {msg.name!r} but came from socket id {identity!r}")
            return
        self.fd_owner[fd] = msg.name
        self.worker_fd[msg.name] = fd
        match msg:
            case Join():
                self.apply(m.Joined(msg))
            case Ready(name=name):
                self.apply(m.MadeReady(name))
            case GraphUpload(name=name, graph=graph):
                self._graph(identity, name, graph)
            case Heartbeat(name=name, epoch=epoch, step=step):
                self.apply(m.Seen(name, epoch, step))
            case StepReport():
                self.apply(m.StepDone(msg))
            case Ack():
                self.apply(m.Acked(msg))
            case Leave(name=name, reason=reason):
                self.apply(m.Left(name, reason))

    @property
    def graph(self) -> Graph | None:
        return self.state.graph

    def _graph(self, identity: bytes, name: str, data: dict[str, Any]) -> None:
        if self.state.graph is not None:
            return  # the first upload wins: every worker runs the same job
        try:
            g = Graph.from_dict(data)
        except ValueError as e:
            self._refuse(identity, f"bad graph from {name}: {e}")
            return
        self.apply(m.GraphReceived(g))
        self.say(f"graph from {name}: {len(g.layers)} layers, {g.param_bytes / 1e6:.1f} MB of parameters, "
                 f"{g.train_flops / 1e6:.1f} MFLOP per sample")

    def _store(self, identity: bytes, req: StoreRequest) -> None:
        try:
            reply = self.store.handle(identity, req, now=time.monotonic())
        except ValueError as e:
            self._refuse(identity, str(e))
            return
        if reply is not None:
            self.workers.send([identity, encode(reply)])
        for client, answer in self.store.poke():
            self.workers.send([client, encode(answer)])

    def _refuse(self, identity: bytes, text: str) -> None:
        self.say(f"refused a frame from {identity!r}: {text}", err=True)
        self.workers.send([identity, encode(Error(code=ERR_BAD_REQUEST, message=text))])

    # --- effects -----------------------------------------------------------------------------

    def apply(self, event: m.Event) -> None:
        t0 = time.perf_counter()
        state, effects = m.apply(self.state, event, self.config, now=time.monotonic())
        elapsed = time.perf_counter() - t0
        if state.epoch != self.state.epoch:
            self.store.forget_epochs_before(state.epoch - 1)
        self.state = state
        for effect in effects:
            self._execute(effect, elapsed)

    def _execute(self, effect: m.Effect, elapsed_s: float) -> None:
        match effect:
            case m.Send(to, msg):
                if not self.workers.send([to.encode(), encode(msg)]):
                    self.say(f"could not deliver {type(msg).__name__} to {to} (not connected)", err=True)
            case m.Welcome(to):
                job = self.job
                self.workers.send([to.encode(), encode(Welcome(
                    name=to, run_id=self.run_id, job_ref=job.ref, job_name=job.name, job_source=job.source,
                    job_sha256=job.sha256, heartbeat_s=self.cfg.heartbeat_s, lease_s=self.cfg.lease_s,
                    want_graph=self.graph is None))])
            case m.Log(kind, fields):
                self.log.write(kind, **fields)
                self._echo(kind, fields)
            case m.Planned(result, epoch, reason):
                plan = result.plan
                runner = result.runner_up
                planned: dict[str, Any] = {
                    "epoch": epoch, "reason": reason, "status": result.status, "detail": result.reason,
                    "predicted_step_s": plan.predicted_step_s if plan else None,
                    "solve_s": round(elapsed_s, 6), "mode": plan.mode if plan else "sync",
                    "layout": ({**plan.layout.to_dict(), "members": list(plan.members),
                                "shares": list(plan.shares)} if plan else None),
                    "standby": list(result.standby), "moved_bytes": result.moved_bytes,
                    "runner_up": ({"description": runner.description,
                                   "predicted_step_s": runner.plan.predicted_step_s} if runner else None),
                }
                self.log.write("plan", **planned)
                self._echo("plan", planned)
            case m.Finished(reason):
                self.finish_reason = reason
                self.done.set()
            case m.FollowUp(event):
                self.apply(event)

    def _echo(self, kind: str, f: dict[str, Any]) -> None:
        if kind == "step":
            if f["step"] % 10 == 0 or f["step"] == self.job.num_steps:
                self.say(f"step {f['step']}/{self.job.num_steps} loss {f['loss']:.4f} epoch {f['epoch']}")
        elif kind == "plan":
            layout = f["layout"]
            who = ", ".join(f"{n}:{s}" for n, s in zip(layout["members"], layout["shares"])) if layout else "-"
            predicted = f["predicted_step_s"]
            step = f", predicted {predicted * 1e3:.1f} ms/step" if isinstance(predicted, float) else ""
            self.say(f"plan epoch {f['epoch']} ({f['reason']}, {f['status']}): {who}{step}")
            if layout is None or f["standby"]:
                self.say(f"  {f['detail']}")
        else:
            detail = " ".join(f"{k}={v}" for k, v in f.items())
            self.say(f"{kind} {detail}")

    def say(self, text: str, *, err: bool = False) -> None:
        if not self.cfg.quiet or err:
            print(f"[coordinator] {text}", file=sys.stderr if err else sys.stdout, flush=True)


# --- tasks ---------------------------------------------------------------------------------------


async def _pump_workers(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox], core: Core) -> None:
    while True:
        frames, fd = await sock.receive_with_fd()
        if len(frames) != 2:
            continue  # not a DEALER frame; nothing to answer to
        identity, frame = frames
        try:
            msg = decode(frame)
        except CodecError as e:
            core.say(f"bad frame from {identity!r}: {e}", err=True)
            sock.send([identity, encode(Error(code=e.code, message=str(e)))])
            continue
        await inbox.send(_FromWorker(identity, msg, fd))


async def _pump_control(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox], core: Core) -> None:
    while True:
        frames = await sock.receive()
        if len(frames) != 2:
            continue
        identity, frame = frames
        try:
            msg = decode(frame)
        except CodecError as e:
            sock.send([identity, encode(Error(code=e.code, message=str(e)))])
            continue
        if not isinstance(msg, ControlRequest):
            sock.send([identity, encode(ControlReply(ok=False, data={},
                                                     error=f"expected ControlRequest, got {type(msg).__name__}"))])
            continue
        await inbox.send(_FromControl(identity, msg))


async def _pump_monitor(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox]) -> None:
    with sock.monitor(zmq.EVENT_DISCONNECTED) as monitor:
        async for event in monitor:
            await inbox.send(_Disconnected(event.value))


async def _ticker(inbox: trio.MemorySendChannel[Inbox], tick_s: float) -> None:
    while True:
        await trio.sleep(tick_s)
        await inbox.send(_Event(m.Tick()))


async def _signals(inbox: trio.MemorySendChannel[Inbox], core: Core, grace_s: float) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            core.say(f"got {signal.Signals(signum).name}: stopping the workers and exiting")
            await inbox.send(_Event(m.StopRequested("the coordinator is shutting down")))
            with trio.move_on_after(grace_s):
                await core.done.wait()
            core.finish_reason = core.finish_reason or "stopped"
            core.done.set()
            return


def _bind(sock: TrioSocket, endpoint: str) -> str:
    try:
        sock.socket.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot listen on {endpoint}: {e}") from None
    return sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)


async def serve(cfg: CoordinatorConfig, job: JobInfo, *,
                task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED) -> str:
    """Run the coordinator until the job is over; returns why it ended."""
    log = EventLog(cfg.state_dir / "events.jsonl")
    workers = TrioSocket.create(zmq.ROUTER)
    workers.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    workers.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    control = TrioSocket.create(zmq.ROUTER)
    try:
        endpoints = Endpoints(workers=_bind(workers, cfg.bind), control=_bind(control, cfg.control))
        core = Core(cfg, job, workers, control, log, run_id=f"{int(time.time())}")
        send, receive = trio.open_memory_channel[Inbox](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump_workers, workers, send, core)
            nursery.start_soon(_pump_control, control, send, core)
            nursery.start_soon(_pump_monitor, workers, send)
            nursery.start_soon(_ticker, send, cfg.tick_s)
            nursery.start_soon(_signals, send, core, cfg.stop_grace_s)
            task_status.started(endpoints)
            print(f"ready workers={endpoints.workers} control={endpoints.control} "
                  f"state_dir={cfg.state_dir} job={job.ref}", flush=True)
            async with receive:
                while not core.done.is_set():
                    with trio.move_on_after(cfg.tick_s):
                        item = await receive.receive()
                        core.handle(item)
                nursery.cancel_scope.cancel()  # before the inbox closes under the pumps
        core.say(f"done: {core.finish_reason} (last step {core.state.last_step}/{job.num_steps})")
        return core.finish_reason
    finally:
        log.close()
        with trio.CancelScope(shield=True):
            workers.close(linger_s=0.5)
            control.close(linger_s=0.5)


