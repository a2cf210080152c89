"""The coordinator daemon: trio tasks around the pure membership core.

Tasks and who owns what:

* `_pump_workers` waits on the workers ROUTER (the only task that does), decodes frames and
  forwards them; a frame that cannot be handled (wrong frame count, undecodable, another protocol
  version, a kind or key role this socket does not take) is refused right there: counted, logged at
  a bounded rate, answered with `Error`, and it never reaches state. At most FRAMES_IN_FLIGHT
  frames wait for the core, so a flood backs up into zmq's per-peer queues, not into memory.
* `_pump_monitor` follows each socket's connections (coordinator.guard.ConnectionLedger: refused
  handshakes are counted) and turns a worker connection's disconnect into a `Lost` event
  (milliseconds after a worker process dies: the kernel closes its sockets).
* `_pump_control` does the same for ctl's requests.
* `_ticker` sends a `Tick` every `tick_s` (lease expiry, store deadlines).
* the main loop of `serve` is the one task that owns the state: it applies events with
  `membership.apply`, runs the rendezvous store, and executes effects (sends are synchronous and never
  wait; see transport.trio_zmq).

Names are bound to connections: a worker's Join binds its NAME to the ROUTER routing id of the
connection it came on (zmq assigns it; a peer cannot choose a bound one), and every later message
under that name must come on that connection (coordinator.guard.check_agent_message). The binding
ends when membership forgets the worker. With per-worker keys, the key's name must match too.

Metrics (coordinator.metrics) are fed from the same effects that write the event log, plus each
refusal, in the core task; with `metrics_port` set, prometheus_client serves them from its own
thread, and the ready line ends with `metrics=http://HOST:PORT/metrics`.

The coordinator is not on the training step's critical path: workers all-reduce among themselves
and only report steps here.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import trio
import zmq

from coordinator import membership as m
from coordinator.checkpoints import scan
from coordinator.journal import Journal, JournalDamaged, check_job, devices_of, recover, restart_layout, snapshot
from coordinator.control import ControlView, answer_control
from coordinator.events import EventLog
from coordinator.guard import LEDGER_EVENTS, ConnectionLedger, Refusals, check_agent_message
from coordinator.jobinfo import JobInfo, facts
from coordinator.metrics import Metrics, MetricsServer, serve_metrics
from coordinator.state import JOIN_WAIT_MAX_S, pin_text
from coordinator.store import RendezvousStore
from plan.graph import Graph
from plan.layout import LayoutPin
from transport import (
    ERR_BAD_REQUEST,
    ERR_BUSY,
    ERR_DECODE,
    ERR_NAME_TAKEN,
    ERR_PROTOCOL,
    ERR_REJOIN,
    ERR_STALE_EPOCH,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Checkpointed,
    CodecError,
    ControlReply,
    ControlRequest,
    Error,
    EvalReport,
    GraphUpload,
    Heartbeat,
    Join,
    Leave,
    Message,
    Ready,
    ResumeFailed,
    Saved,
    StateLost,
    StepReport,
    StoreRequest,
    Received,
    TrioSocket,
    Welcome,
    decode,
    encode,
)
from transport.security import (
    DOMAIN_CONTROL,
    DOMAIN_WORKERS,
    Gatekeeper,
    ServerKeys,
    harden_server,
    may_control,
    may_work,
)

AGENT_MESSAGES = (Join, Ready, GraphUpload, Heartbeat, StepReport, Ack, Leave, Saved, EvalReport, StateLost,
                  Checkpointed, ResumeFailed)
FRAMES_IN_FLIGHT = 1024  # decoded frames waiting for the core, at most
JOURNAL_SAY_EVERY_S = 10.0  # a journal that cannot be written (a full disk) is said at most this often
JOURNAL_DEVICES_EVERY_S = 5.0  # the members' measured speeds are journaled at most this often (and when they change)
MAX_CONTROL_BYTES = 64 * 1024  # a control request is a command and a few words
_ERROR_CODES = {"name": ERR_NAME_TAKEN, "stale": ERR_STALE_EPOCH, "busy": ERR_BUSY, "version": ERR_PROTOCOL,
                "decode": ERR_DECODE, "frames": ERR_DECODE}


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    bind: str
    control: str
    state_dir: Path
    keys: ServerKeys | None  # None: --insecure (no CURVE; every peer may connect)
    min_workers: int = 1
    max_workers: int | None = None
    max_joining: int = 64  # workers joined but not ready yet; more Joins are told to retry
    lease_s: float = 1.5
    heartbeat_s: float = 0.25
    tick_s: float = 0.05
    stop_grace_s: float = 10.0
    drain_deadline_s: float = 25.0  # --drain-deadline
    ack_timeout_s: float = 20.0  # --ack-timeout
    checkpoint_dir: Path | None = None  # --checkpoint-dir (None: no durable checkpoints)
    checkpoint_every: int = 0  # --checkpoint-every (0: only on `ctl checkpoint` and SIGTERM)
    checkpoint_keep: int = 3  # --checkpoint-keep
    recovery_grace_s: float = 10.0  # --recovery-grace
    join_abandons: str = "auto"  # --join-abandons
    join_wait_max_s: float | None = JOIN_WAIT_MAX_S  # --join-wait-max (None: no bound)
    quiet: bool = False
    planner: str = "milp"
    solve_time_limit_s: float = 0.5
    solver: str = "auto"
    horizon_steps: int = 200
    stability: str = "calm"
    layout: LayoutPin | None = None  # --layout: the pin at the start (`ctl layout` changes it: `State.layout`)
    metrics_port: int | None = None  # None: no metrics endpoint; 0: a free port
    metrics_host: str = "127.0.0.1"


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
    user_id: str


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
                 log: EventLog, run_id: str, *, journal: Journal | None = None,
                 journaled: dict[str, Any] | None = None, endpoints: dict[str, str] | None = None,
                 metrics: Metrics | None = None) -> None:
        self.cfg, self.job, self.workers, self.control, self.log = cfg, job, workers, control, log
        self._job_facts = facts(job)  # (one object: the journal writes it once)
        self.run_id = run_id
        self.config = m.Config(global_batch=job.global_batch, num_steps=job.num_steps, lease_s=cfg.lease_s,
                               min_workers=cfg.min_workers, max_workers=cfg.max_workers, planner=cfg.planner,
                               solve_time_limit_s=cfg.solve_time_limit_s, horizon_steps=cfg.horizon_steps,
                               stability=cfg.stability,
                               solver=cfg.solver, drain_deadline_s=cfg.drain_deadline_s, ack_timeout_s=cfg.ack_timeout_s,
                               checkpoint_dir=str(cfg.checkpoint_dir or ""), checkpoint_keep=cfg.checkpoint_keep,
                               recovery_grace_s=cfg.recovery_grace_s, join_abandons=cfg.join_abandons,
                               join_wait_max_s=cfg.join_wait_max_s, tp_degrees=job.tp_degrees)
        self.state = m.State(layout=cfg.layout)  # (the pin's first value: `ctl layout` changes it)
        self.journal, self.endpoints = journal, endpoints or {}
        self._graph_dict: tuple[Graph, dict[str, Any]] | None = None  # the graph as journaled, encoded once
        self._journaled: tuple[Any, ...] | None = None  # the state's journaled fields when last written
        self._devices: tuple[tuple[str, ...], float, dict[str, Any]] | None = None  # (members, when, devices_of)
        self._journal_said_at = -JOURNAL_SAY_EVERY_S  # when a failed journal write was last said
        # Metrics summarise the whole job: the daemon seeds them from the log it opened (`serve`).
        self.metrics = metrics if metrics is not None else Metrics()
        relaid: str | None = None  # the journaled layout pin this coordinator's --layout replaced
        if journaled is not None:
            self.state = recover(journaled, now=time.monotonic(), flag=cfg.layout)
            relaid = restart_layout(journaled, cfg.layout)[1]
        elif cfg.checkpoint_dir is not None:
            self._find_checkpoints(cfg.checkpoint_dir)
        self._say_replayed()
        if journaled is not None or log.replayed.events or log.replayed.bad:
            # Every start on a state dir that has a history is marked in the log, journal or not.
            expected = sorted(self.state.recovering)
            fields = {"epoch": self.state.epoch, "step": self.state.last_step, "expecting": expected,
                      "journal": str(journal.path) if journal and journaled is not None else None,
                      "events": log.replayed.events, "skipped_lines": log.replayed.bad,
                      "layout": pin_text(self.state.layout)}
            self.log.write("restarted", **fields)
            self.metrics.observe("restarted", fields)
            if relaid is not None:
                self._relaid(relaid)
            if journaled is not None:
                self.say(f"restarted from the journal: epoch {self.state.epoch}, step {self.state.last_step}; "
                         f"waiting for {', '.join(expected) or 'no member'} to register again")
        self.store = RendezvousStore()
        self.refusals = Refusals()
        self.bindings: dict[str, bytes] = {}  # live worker name -> routing id of its connection
        self.fd_owner: dict[int, str] = {}  # connection fd -> worker name (agent sockets only)
        self.worker_fd: dict[str, int] = {}
        self.done = trio.Event()
        self.finish_reason = ""
        self.started = time.monotonic()

    def _say_replayed(self) -> None:
        """What was read of the log a previous coordinator of this state dir wrote."""
        r = self.log.replayed
        if not r.events and not r.bad:
            return
        self.say(f"the event log {self.log.path} has {r.events} events of this job; the new ones are appended")
        for bad in r.first_bad:
            self.say(f"warning: {self.log.path} line {bad.number}: {bad.why}; skipped", err=True)
        if r.bad > len(r.first_bad):
            self.say(f"warning: {self.log.path}: {r.bad - len(r.first_bad)} more bad lines skipped", err=True)

    def _find_checkpoints(self, directory: Path) -> None:
        """Checkpoints of this job already on disk (a job started again after everything was lost):
        the first plan resumes from the newest complete one."""
        found, skipped = scan(directory, self.job.sha256)
        for line in skipped:
            self.say(f"checkpoint passed over: {line}", err=True)
        if found:
            newest = found[-1]
            self.state = replace(self.state, checkpoints=tuple(found), resume=newest, last_step=newest.step,
                                 lost_at=newest.step)
            self.say(f"resuming from checkpoint {newest.path} (step {newest.step}; {len(found)} found). To start "
                     "over instead, give another --state-dir or --checkpoint-dir")

    def _relaid(self, journaled: str) -> None:
        """This coordinator's --layout replaced the pin the journal held (`journal.restart_layout`):
        said, and the plan is re-planned under it once it is back."""
        fields = {"layout": pin_text(self.state.layout), "previous": journaled, "source": "command line"}
        self.log.write("layout", **fields)
        self.metrics.observe("layout", fields)
        self.say(f"--layout {fields['layout']} replaces the layout pin {journaled} of the journal (the command "
                 "line at a restart is the operator's latest word)")

    # --- inbox -------------------------------------------------------------------------------

    def handle(self, item: Inbox) -> None:
        match item:
            case _FromWorker(identity, msg, fd, user_id):
                self._from_worker(identity, msg, fd, user_id)
            case _FromControl(identity, request):
                view = ControlView(state=self.state, job_ref=self.job.ref, num_steps=self.job.num_steps,
                                   global_batch=self.job.global_batch, uptime_s=time.monotonic() - self.started,
                                   events=self.log.events, refused=self.refusals.snapshot(),
                                   secure=self.cfg.keys is not None, writable=writable_dir,
                                   checkpoint_dir=str(self.cfg.checkpoint_dir or ""), min_workers=self.cfg.min_workers,
                                   max_workers=self.cfg.max_workers, tp_refuses=self.job.refuses)
                reply, events = answer_control(view, request, now=time.monotonic())
                if not reply.ok:
                    self.refuse("request", f"control {request.command[:40]!r}: {reply.error}")
                self.control.send([identity, encode(reply)])
                for event in events:
                    self.apply(event)
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
                    for line in self.refusals.flush(now=time.monotonic()):
                        self.say(line, err=True)

    def _from_worker(self, identity: bytes, msg: Message, fd: int, user_id: str) -> None:
        if isinstance(msg, StoreRequest):
            self._store(identity, msg)
            return
        if not isinstance(msg, AGENT_MESSAGES):
            self.refuse("role", f"workers do not send {type(msg).__name__}", reply_to=(self.workers, identity))
            return
        refused = check_agent_message(self.state, self.bindings, identity, user_id, msg,
                                      max_joining=self.cfg.max_joining)
        if refused is not None and refused.reason == "stale" and msg.name in self.state.recovering:
            # A member of the journaled plan, still training: it registers again, keeping its state.
            self.workers.send([identity, encode(Error(code=ERR_REJOIN, message="the coordinator restarted: "
                                                      "register again and keep training"))])
            return
        if refused is not None:
            text = refused.text
            if refused.reason == "stale":
                text = f"{msg.name!r} is not a member of the current epoch; join again"
            elif refused.reason == "busy":
                text = f"{refused.text}: try again shortly"
            self.refuse(refused.reason, refused.text, reply_to=(self.workers, identity), reply_text=text)
            return
        self.fd_owner[fd] = msg.name
        self.worker_fd[msg.name] = fd
        match msg:
            case Join():
                self.bindings[msg.name] = identity
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
            case Leave(name=name, reason=reason, error=error, where=where):
                self.apply(m.Left(name, reason, error, where))
            case Saved():
                self.apply(m.ModelSaved(msg))
            case EvalReport():
                self.apply(m.Evaluated(msg))
            case StateLost():
                self.apply(m.StateLostReported(msg))
            case Checkpointed():
                self.apply(m.CheckpointWritten(msg))
            case ResumeFailed():
                self.apply(m.ResumeFailedReported(msg))

    @property
    def graph(self) -> Graph | None:
        return self.state.graph

    def _graph(self, identity: bytes, name: str, data: dict[str, Any]) -> None:
        if self.state.graph is not None:
            return  # the first upload wins: every worker runs the same job
        try:
            g = Graph.from_dict(data)
        except (ValueError, TypeError, KeyError) as e:
            self.refuse("decode", f"bad graph from {name}: {e!r}"[:300], reply_to=(self.workers, identity))
            return
        self.apply(m.GraphReceived(g))
        self.say(f"graph from {name}: {len(g.layers)} layers, {g.param_bytes / 1e6:.1f} MB of parameters, "
                 f"{g.train_flops / 1e6:.1f} MFLOP per sample")

    def _store(self, identity: bytes, req: StoreRequest) -> None:
        try:
            reply = self.store.handle(identity, req, now=time.monotonic(), epoch=self.state.epoch)
        except ValueError as e:
            self.refuse("store", str(e), reply_to=(self.workers, identity))
            return
        if reply is not None:
            self.workers.send([identity, encode(reply)])
        for client, answer in self.store.poke():
            self.workers.send([client, encode(answer)])

    def refuse(self, reason: str, text: str, *, reply_to: tuple[TrioSocket, bytes] | None = None,
               reply_text: str | None = None) -> None:
        """Count and (at a bounded rate) log one refused input; answer the peer where it can be told."""
        self.metrics.refused(reason)
        for line in self.refusals.refuse(reason, text, now=time.monotonic()):
            self.say(line, err=True)
        if reply_to is not None:
            sock, identity = reply_to
            code = _ERROR_CODES.get(reason, ERR_BAD_REQUEST)
            sock.send([identity, encode(Error(code=code, message=(reply_text or text)[:1000]))])

    # --- effects -----------------------------------------------------------------------------

    def apply(self, event: m.Event) -> None:
        t0 = time.perf_counter()
        state, effects = m.apply(self.state, event, self.config, now=time.monotonic())
        elapsed = time.perf_counter() - t0
        if state.epoch != self.state.epoch:
            self.store.forget_epochs_before(state.epoch - 1)
        self.state = state
        # Write-ahead: the journal holds the new state before anyone hears of it. Otherwise a
        # coordinator killed in between could restart from an older state than the one its events
        # and messages announced (found in CI: a `checkpoint` event logged, the coordinator killed,
        # and its successor not knowing that checkpoint; or a plan's epoch sent twice, different).
        if self.journal is not None:
            self._journal()
        for effect in effects:
            self._execute(effect, elapsed)
        if len(self.bindings) > len(self.state.workers):  # every worker is bound: one was forgotten
            for name in [n for n in self.bindings if n not in self.state.workers]:
                del self.bindings[name]  # the name is free again

    def _journal(self) -> None:
        """Write what changed to the journal (one small transaction; the graph is encoded once)."""
        assert self.journal is not None
        st = self.state
        # What `snapshot` reads; an event that changed none of it (a tick, a heartbeat) writes nothing.
        read = (st.epoch, st.delta, st.plan, st.acked, st.cluster, st.last_step, st.finished, st.checkpoints,
                st.resume, st.lost_at, st.graph, st.layout)
        if self._journaled is not None and all(a is b for a, b in zip(read, self._journaled)):
            return
        graph = self.state.graph
        if graph is not None and (self._graph_dict is None or self._graph_dict[0] is not graph):
            self._graph_dict = (graph, graph.to_dict())
        # The members' measured speeds change with every step; encoding them is most of a step's
        # journal write, so they are written when the members change and at most every few seconds
        # otherwise (a restarted coordinator plans with speeds that old, and measures again).
        members, now = tuple(st.plan.members) if st.plan is not None else (), time.monotonic()
        if self._devices is None or self._devices[0] != members or now - self._devices[1] >= JOURNAL_DEVICES_EVERY_S:
            self._devices = (members, now, devices_of(st))
        try:
            self.journal.save(snapshot(self.state, self.endpoints, self._graph_dict[1] if self._graph_dict else None,
                                       job=self._job_facts, flag=self.cfg.layout, devices=self._devices[2]))
            self._journaled = read  # (a failed write is tried again at the next event)
        except Exception as e:  # noqa: BLE001 (a full disk must not stop training: said, retried next event)
            now = time.monotonic()
            if now - self._journal_said_at >= JOURNAL_SAY_EVERY_S:
                self._journal_said_at = now
                self.say(f"could not write the journal {self.journal.path}: {e} (tried again at every change; "
                         "a coordinator restarted meanwhile would resume from the last state written)", err=True)

    def _send(self, to: str, msg: Message) -> bool:
        identity = self.bindings.get(to)
        return identity is not None and self.workers.send([identity, encode(msg)])

    def _execute(self, effect: m.Effect, elapsed_s: float) -> None:
        match effect:
            case m.Send(to, msg):
                if not self._send(to, msg):
                    self.say(f"could not deliver {type(msg).__name__} to {to} (not connected)", err=True)
            case m.Welcome(to):
                job = self.job
                self._send(to, Welcome(
                    name=to, run_id=self.run_id, job_ref=job.ref, job_name=job.name, job_source=job.source,
                    job_sha256=job.sha256, heartbeat_s=self.cfg.heartbeat_s, lease_s=self.cfg.lease_s,
                    want_graph=self.graph is None, final_dir=str((self.cfg.state_dir / "final").resolve()),
                    checkpoint_dir=str(self.cfg.checkpoint_dir.resolve()) if self.cfg.checkpoint_dir else "",
                    checkpoint_every=self.cfg.checkpoint_every, checkpoint_keep=self.cfg.checkpoint_keep,
                    last_step=self.state.last_step))
            case m.Log(kind, fields):
                self.log.write(kind, **fields)
                self.metrics.observe(kind, fields)
                self._echo(kind, fields)
            case m.Planned(result, epoch, reason, abandons_step):
                plan = result.plan
                runner = result.runner_up
                planned: dict[str, Any] = {
                    "epoch": epoch, "reason": reason, "status": result.status, "detail": result.reason,
                    "abandons_step": abandons_step,
                    "predicted_step_s": plan.predicted_step_s if plan else None,
                    "solve_s": round(elapsed_s, 6), "mode": plan.mode if plan else "sync",
                    "layout": plan.layout.to_dict() if plan else None,
                    "micro_batch": list(plan.micro) if plan and plan.micro else None,
                    "standby": list(result.standby), "moved_bytes": result.moved_bytes,
                    "runner_up": ({"description": runner.description,
                                   "predicted_step_s": runner.plan.predicted_step_s} if runner else None),
                }
                self.log.write("plan", **planned)
                self.metrics.observe("plan", planned)
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


def writable_dir(path: str) -> str:
    """`path` made absolute, when the coordinator's user could create or write that directory (the
    workers run on loopback or see the same filesystem at the same path); ValueError naming the
    path otherwise. Workers report their own failure too (`save_failed`)."""
    target = Path(path).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot save to {target}: it exists and is not a directory")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot save to {target}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot save to {target}: {existing} is not writable")
    return str(target)


def _admit(core: Core, sock: TrioSocket, received: Received, *, socket_name: str, allowed: Callable[[str], bool],
           max_bytes: int) -> Message | None:
    """The message in `received`, or None after refusing it (frames, key role, decoding)."""
    reply_to = (sock, received.frames[0])
    if len(received.frames) != 2 or received.dropped:
        n = len(received.frames) + received.dropped
        core.refuse("frames", f"a message of {n} frames on the {socket_name} socket (one is expected after "
                              "the routing id)", reply_to=reply_to)
        return None
    if not allowed(received.user_id):
        core.refuse("role", f"a {received.user_id!r} key on the {socket_name} socket")
        return None
    try:
        return decode(received.frames[1], max_bytes=max_bytes)
    except CodecError as e:
        core.refuse("version" if e.code == ERR_PROTOCOL else "decode", f"{socket_name}: {e}", reply_to=reply_to)
        return None


async def _pump_workers(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox], core: Core,
                        in_flight: trio.Semaphore) -> None:
    while True:
        received = await sock.receive_from()
        msg = _admit(core, sock, received, socket_name="workers", allowed=may_work, max_bytes=MAX_FRAME_BYTES)
        if msg is None:
            continue
        await in_flight.acquire()  # released by the core once handled
        await inbox.send(_FromWorker(received.frames[0], msg, received.fd, received.user_id))


async def _pump_control(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox], core: Core,
                        in_flight: trio.Semaphore) -> None:
    while True:
        received = await sock.receive_from()
        msg = _admit(core, sock, received, socket_name="control", allowed=may_control, max_bytes=MAX_CONTROL_BYTES)
        if msg is None:
            continue
        identity = received.frames[0]
        if not isinstance(msg, ControlRequest):
            core.refuse("role", f"control socket got {type(msg).__name__}")
            sock.send([identity, encode(ControlReply(ok=False, data={},
                                                     error=f"expected ControlRequest, got {type(msg).__name__}"))])
            continue
        await in_flight.acquire()
        await inbox.send(_FromControl(identity, msg))


async def _pump_monitor(sock: TrioSocket, inbox: trio.MemorySendChannel[Inbox], core: Core, *,
                        workers: bool) -> None:
    ledger = ConnectionLedger()
    with sock.monitor(LEDGER_EVENTS) as monitor:
        async for event in monitor:
            refused = ledger.observe(event.event, event.value)
            if refused is not None:
                core.refuse(*refused)
            if workers and event.event == zmq.EVENT_DISCONNECTED:
                await inbox.send(_Disconnected(event.value))


async def _ticker(inbox: trio.MemorySendChannel[Inbox], tick_s: float) -> None:
    while True:
        await trio.sleep(tick_s)
        await inbox.send(_Event(m.Tick()))


async def _signals(inbox: trio.MemorySendChannel[Inbox], core: Core, grace_s: float) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            state = core.state
            if core.cfg.checkpoint_dir is not None and state.plan is not None and not state.finished:
                core.say(f"got {name}: a checkpoint at the next step boundary, then stopping the workers")
                seen = len(core.log.events)
                await inbox.send(_Event(m.CheckpointRequested(f"the coordinator got {name}")))
                with trio.move_on_after(grace_s):
                    while not any(e.get("kind") in ("checkpoint", "checkpoint_failed")
                                  for e in core.log.events[seen:]):
                        await trio.sleep(0.05)
            core.say(f"got {name}: stopping the workers and exiting")
            await inbox.send(_Event(m.StopRequested("the coordinator is shutting down")))
            with trio.move_on_after(grace_s):
                await core.done.wait()
            core.finish_reason = core.finish_reason or "stopped"
            core.done.set()
            return


def open_log(path: Path) -> tuple[EventLog, Metrics]:
    """The job's event log, and metrics seeded from the events already in it (those of the
    coordinators before this one on the state dir): a counter covers the whole job, not the time
    since the latest restart. (Refusals are not events: their counters start at 0.)"""
    metrics = Metrics()
    replay = metrics.replay()
    log = EventLog(path, fold=replay)
    replay.finish()
    return log, metrics


def _open_journal(path: Path, log: EventLog, metrics: Metrics) -> tuple[Journal, dict[str, Any] | None]:
    """The journal and what it holds (None: a fresh one). A damaged one is moved aside, said in the
    log with what was lost, and a fresh one started: the job goes on from the checkpoints on disk."""
    journal = Journal(path)
    try:
        return journal, journal.load()
    except JournalDamaged as e:
        journal.close()
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(f"{path}{suffix}")
            if part.exists():
                part.rename(Path(f"{aside}{suffix}"))
        print(f"[coordinator] the journal is damaged ({e}); moved to {aside}. Membership and plans are lost: "
              "the job resumes from the newest checkpoint with the workers that join", file=sys.stderr, flush=True)
        said = log.write("journal_damaged", path=str(path), moved_to=str(aside), detail=str(e)[:500],
                         lost="membership, plans and the step counter; the newest checkpoint is resumed")
        metrics.observe("journal_damaged", said)
        journal = Journal(path)
        return journal, journal.load()


def _same_port(endpoint: str, before: str | None) -> str:
    """`endpoint`, or where the previous coordinator of this state dir listened when `endpoint`
    asks for any port (tcp://HOST:0): the workers reconnect to that address by themselves."""
    if before and endpoint.startswith("tcp://") and endpoint.endswith(":0") and before.startswith("tcp://"):
        return f"{endpoint[:-2]}:{before.rsplit(':', 1)[1]}"
    return endpoint


def _bind(sock: TrioSocket, endpoint: str) -> str:
    try:
        sock.socket.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot listen on {endpoint}: {e}") from None
    return sock.socket.getsockopt_string(zmq.LAST_ENDPOINT)


async def serve(cfg: CoordinatorConfig, job: JobInfo, *,
                task_status: trio.TaskStatus[Endpoints] = trio.TASK_STATUS_IGNORED) -> str:
    """Run the coordinator until the job is over; returns why it ended."""
    log, metrics = open_log(cfg.state_dir / "events.jsonl")
    journal, journaled = _open_journal(cfg.state_dir / "journal.sqlite", log, metrics)
    if journaled is not None:
        try:
            check_job(journaled, journal.path, job.ref, job.sha256)
        except OSError:
            journal.close()
            log.close()
            raise
    gatekeeper = Gatekeeper(zmq.Context.instance(), cfg.keys)
    gatekeeper.start()
    workers = TrioSocket.create(zmq.ROUTER)
    workers.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    harden_server(workers.socket, max_bytes=MAX_FRAME_BYTES + 4096, domain=DOMAIN_WORKERS, keys=cfg.keys)
    control = TrioSocket.create(zmq.ROUTER)
    harden_server(control.socket, max_bytes=MAX_CONTROL_BYTES + 4096, domain=DOMAIN_CONTROL, keys=cfg.keys)
    metrics_server: MetricsServer | None = None
    try:
        before = (journaled or {}).get("endpoints") or {}
        endpoints = Endpoints(workers=_bind(workers, _same_port(cfg.bind, before.get("workers"))),
                              control=_bind(control, _same_port(cfg.control, before.get("control"))))
        core = Core(cfg, job, workers, control, log, run_id=f"{int(time.time())}", journal=journal,
                    journaled=journaled, endpoints={"workers": endpoints.workers, "control": endpoints.control},
                    metrics=metrics)
        core.apply(m.Tick())  # (journals the fresh state at once)
        if cfg.metrics_port is not None:
            metrics_server = serve_metrics(core.metrics, cfg.metrics_host, cfg.metrics_port)
        send, receive = trio.open_memory_channel[Inbox](math.inf)  # frames are bounded by `in_flight`
        in_flight = trio.Semaphore(FRAMES_IN_FLIGHT)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump_workers, workers, send, core, in_flight)
            nursery.start_soon(_pump_control, control, send, core, in_flight)
            nursery.start_soon(lambda: _pump_monitor(workers, send, core, workers=True))
            nursery.start_soon(lambda: _pump_monitor(control, send, core, workers=False))
            nursery.start_soon(_ticker, send, cfg.tick_s)
            nursery.start_soon(_signals, send, core, cfg.stop_grace_s)
            task_status.started(endpoints)
            security = "keys=curve" if cfg.keys is not None else "keys=none(insecure)"
            served = f" metrics={metrics_server.url}" if metrics_server is not None else ""
            print(f"ready workers={endpoints.workers} control={endpoints.control} "
                  f"state_dir={cfg.state_dir} job={job.ref} {security} protocol={PROTOCOL_VERSION}{served}",
                  flush=True)
            if cfg.keys is None:
                core.say("WARNING: --insecure: no CURVE keys; anyone who can reach these ports can join, "
                         "read events and stop the job. Use only on a trusted network.", err=True)
            async with receive:
                while not core.done.is_set():
                    with trio.move_on_after(cfg.tick_s):
                        item = await receive.receive()
                        try:
                            core.handle(item)
                        finally:
                            if isinstance(item, (_FromWorker, _FromControl)):
                                in_flight.release()
                nursery.cancel_scope.cancel()  # before the inbox closes under the pumps
        core.say(f"done: {core.finish_reason} (last step {core.state.last_step}/{job.num_steps})")
        return core.finish_reason
    finally:
        log.close()
        journal.close()
        with trio.CancelScope(shield=True):
            workers.close(linger_s=0.5)
            control.close(linger_s=0.5)
            gatekeeper.stop()
            if metrics_server is not None:
                metrics_server.close()
