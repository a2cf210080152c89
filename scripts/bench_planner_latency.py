"""Event -> plan-delta latency of the real coordinator with N simulated devices (default 16).

The coordinator is the real one (`LocalJob`: a `coordinator` process on loopback, job
examples/mlp.py:job, `--min-workers N`). The devices are simulated inside this process: each is a
zmq DEALER whose routing id is its name, in its own thread, speaking the real protocol through
`transport.encode`/`decode`: Join (heterogeneous calibrated FLOP/s, 8 GiB, device "cpu") ->
Welcome -> GraphUpload (a synthetic graph, when `want_graph`) -> Ready -> a heartbeat every
`Welcome.heartbeat_s` carrying the epoch it last acknowledged. Every PlanDelta that includes it is
answered at once with `Ack(step=<steps reported so far>, reshard_bytes=0, reshard_s=0.0)`: no torch,
no group is formed.
Each thread stamps every message with `time.monotonic()` the moment it is read off the socket.

After the first plan is in place, the members report `--warmup-steps` steps as if they had trained at
their calibrated speed (so the planner has measured speeds and solves its MILP; without any step
measured it only splits the batch by calibrated FLOP/s, status "heuristic"). Then each trial does:

1. failure: one member (rotating through the speed classes) closes its socket; the coordinator's
   socket monitor sees the disconnect and re-plans with `abort=True`. Timed from just before the
   close (stamped in the victim's own thread) to the first and to the last survivor's PlanDelta.
2. join: a fresh device of the victim's class joins and sends Ready (the cluster is back at N).
   Timed from just before Ready is sent to the PlanDelta that includes it. The planner may leave
   it on standby (a new plan must beat the current one by plan.planner.MIN_GAIN): then no delta
   comes, the trial says "standby" (checked with the control endpoint's `plan`), and it does not
   count in the latency.

Between events the benchmark waits for the coordinator's `reshard` event of the current epoch
(every member acknowledged), so each event meets an idle coordinator. Every wait has a deadline; a
trial that misses one is recorded as timed out and the run goes on. The coordinator's own side
(`plan` events: epoch, reason, solve_s, status) is read from STATE_DIR/events.jsonl.

    .venv/bin/python scripts/bench_planner_latency.py [--devices 16] [--trials 20] [--quick]

From another script (scripts/ is not a package):

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_planner_latency import bench_event_to_delta
    result = bench_event_to_delta(devices=16, trials=20)  # result["summary"]["rows"], raw trials, events
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, read_jsonl, close_on_sigterm  # noqa: E402

from transport import (  # noqa: E402
    Abort,
    Ack,
    CodecError,
    ControlReply,
    ControlRequest,
    Error,
    GraphUpload,
    Join,
    Message,
    PlanDelta,
    Ready,
    StepReport,
    Stop,
    Welcome,
    decode,
    encode,
)
from transport.worker_side import WorkerSide  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOB_REF = f"{ROOT / 'examples' / 'mlp.py'}:job"
GOAL_S = 0.050  # p50 event -> delta
FLOP_CLASSES = (1e9, 2e9, 4e9, 8e9)  # calibrated FLOP/s of the four device classes
MEMORY_BYTES = 8 << 30
MAX_POLL_S = 0.05  # a device thread looks at its kill/stop flags and outbox at least this often
INTRA_ALPHA_S, INTRA_BETA_S_PER_BYTE = 1e-4, 1e-9  # the warm-up's all-reduce (plan.cluster's intra-host prior)
OVERHEAD_S = 0.001  # the warm-up's per-step time outside compute and the all-reduce

EPILOG = f"""\
rows of the table (milliseconds; p50/p95/max over the trials that completed):
  failure -> first survivor   victim's socket closed (stamped just before close()) -> the first
                              survivor reads the new PlanDelta (abort=True)
  failure -> all survivors    the same, until the last survivor has it (the group can re-form)
  failure -> Abort (first)    the same, to the first survivor's Abort message (sent before the plan)
  failure -> failed logged    close -> the coordinator's `failed` event (wall clock; detection)
  failure solve_s             the coordinator's `plan` event of the failure epoch: time of the
                              membership transition that made the plan (planner included)
  join Ready -> own delta     the joiner sends Ready -> it reads the PlanDelta that includes it
                              (trials where the planner took it in; the rest are "standby")
  join Ready -> all members   the same, until every member of that plan has it
  join solve_s                the `plan` event of the join epoch
goal: p50 event -> delta <= {GOAL_S * 1e3:.0f} ms at 16 devices (failure: first and all; join).
Devices: {len(FLOP_CLASSES)} classes of {', '.join(f'{f / 1e9:g}' for f in FLOP_CLASSES)} GFLOP/s, 8 GiB, "cpu", host
"sim" (or --devices-per-host K: hosts sim-host-0, sim-host-1, ...). Synthetic graph: 6 layers,
10 MB of parameters, 0.9 GFLOP per sample (forward + backward). The coordinator runs with
LocalJob's lease and heartbeat unless --lease / --heartbeat say otherwise.
"""


def synthetic_graph() -> dict[str, Any]:
    """A `plan.graph.Graph.to_dict()`: 6 layers, 10 MB of parameters, 3e8 forward FLOPs per sample."""
    params = (1_000_000, 2_000_000, 2_000_000, 2_000_000, 2_000_000, 1_000_000)
    layers = [{"name": f"layer{i}", "kind": "embed" if i == 0 else ("head" if i == 5 else "block"),
               "forward_flops": 5e7, "backward_flops": 1e8, "param_bytes": p,
               "activation_bytes": 256 * 1024, "boundary_bytes": 16 * 1024}
              for i, p in enumerate(params)]
    return {"layers": layers, "optimizer_state_bytes": 2 * sum(params)}


# --- simulated devices ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    t: float  # time.monotonic() when read off the socket
    kind: str
    epoch: int = 0
    abort: bool = False
    members: tuple[str, ...] = ()
    reason: str = ""
    shares: tuple[int, ...] = ()
    global_batch: int = 0


class Hub:
    """What every device thread received, under one condition the benchmark waits on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()

    def wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.05))
            return True


class SimDevice(threading.Thread):
    """One simulated worker: its socket lives and dies in this thread. It speaks the protocol through
    the worker's own side of it (`WorkerSide`: joins, heartbeats, fencing, re-registering), and does
    what a worker does on top at once: Ready after the welcome, an Ack for every plan it is in."""

    def __init__(self, hub: Hub, endpoint: str, name: str, host: str, flops: float) -> None:
        super().__init__(name=f"sim-{name}", daemon=True)
        self.hub, self.endpoint, self.dev_name, self.host, self.flops = hub, endpoint, name, host, flops
        self.got: list[Received] = []  # guarded by hub.cond
        self.t_ready: float | None = None  # monotonic, just before Ready was sent
        self.t_close: float | None = None  # monotonic, just before the socket was closed
        self.t_close_wall: float | None = None
        self.uploaded_graph = False
        self.side = WorkerSide(join_template=Join(name=name, host=host, pid=os.getpid(), device="cpu", flops=flops,
                                                  memory_bytes=MEMORY_BYTES, threads=1), endpoint=endpoint)
        self.outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # sent by the thread, in order
        self.failure: str | None = None
        self._kill_flag = threading.Event()
        self._stop_flag = threading.Event()

    # --- benchmark side ------------------------------------------------------------------------

    def kill(self) -> None:
        """Close the socket (abruptly, linger 0), as a crashed process's kernel would."""
        self._kill_flag.set()

    def stop(self) -> None:
        self._stop_flag.set()

    def deltas(self, after_epoch: int = 0) -> list[Received]:
        with self.hub.cond:
            return [r for r in self.got if r.kind == "PlanDelta" and r.epoch > after_epoch]

    def first(self, kind: str, after_epoch: int, *, member: bool = False, since: float = -math.inf) -> Received | None:
        with self.hub.cond:
            for r in self.got:
                if (r.kind == kind and r.epoch > after_epoch and r.t >= since
                        and (not member or self.dev_name in r.members)):
                    return r
            return None

    # --- the thread ----------------------------------------------------------------------------

    def run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.dev_name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            self._loop(sock)
        except Exception as e:  # a broken device must show up in the report, not kill the run
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            if not sock.closed:
                sock.close(linger=0)
            with self.hub.cond:
                self.hub.cond.notify_all()

    @property
    def acked_epoch(self) -> int:
        return self.side.epoch

    @property
    def step(self) -> int:  # steps "applied": the warm-up's step reports
        return self.side.step

    def _loop(self, sock: zmq.Socket[bytes]) -> None:
        sock.send(encode(self.side.join(time.monotonic())))
        heartbeat_s: float | None = None
        next_beat = 0.0
        while not self._stop_flag.is_set():
            if self._kill_flag.is_set():
                self.t_close_wall = time.time()
                self.t_close = time.monotonic()
                sock.close(linger=0)
                return
            while True:
                try:
                    msg = self.outbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, StepReport):
                    self.side.step = max(self.side.step, msg.step)
                self.side.sent(msg)
                sock.send(encode(msg))
            now = time.monotonic()
            if heartbeat_s is not None and now >= next_beat:
                sock.send(encode(self.side.heartbeat()))
                next_beat = now + heartbeat_s
            wait_s = MAX_POLL_S if heartbeat_s is None else min(MAX_POLL_S, max(0.0, next_beat - now))
            if not sock.poll(int(wait_s * 1000) + 1):
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                t = time.monotonic()
                hb = self._handle(sock, frame, t)
                if hb is not None:
                    heartbeat_s, next_beat = hb, time.monotonic() + hb

    def _handle(self, sock: zmq.Socket[bytes], frame: bytes, t: float) -> float | None:
        try:
            msg = decode(frame)
        except CodecError as e:
            self._note(Received(t, "undecodable", reason=str(e)))
            return None
        heartbeat_s = None
        for reply in self.side.receive(msg, t):  # (a re-join when fenced, reports for a restarted coordinator)
            sock.send(encode(reply))
        match msg:
            case Welcome():
                if msg.want_graph:
                    sock.send(encode(GraphUpload(name=self.dev_name, graph=synthetic_graph())))
                    self.uploaded_graph = True
                self.t_ready = time.monotonic()
                sock.send(encode(Ready(name=self.dev_name)))
                heartbeat_s = msg.heartbeat_s
                self._note(Received(t, "Welcome"))
            case PlanDelta():
                if self.dev_name in msg.members:  # answer first: the coordinator waits on it
                    sock.send(encode(Ack(name=self.dev_name, epoch=msg.epoch, step=self.step, reshard_bytes=0,
                                         reshard_s=0.0)))
                    self.side.epoch = msg.epoch
                self._note(Received(t, "PlanDelta", msg.epoch, msg.abort, tuple(msg.members), msg.reason,
                                    tuple(msg.shares), msg.global_batch))
            case Abort():
                self._note(Received(t, "Abort", msg.epoch, reason=msg.reason))
            case Stop():
                self._note(Received(t, "Stop", reason=msg.reason))
                self._stop_flag.set()
            case Error():
                self._note(Received(t, "Error", reason=f"{msg.code}: {msg.message}"))
            case _:
                self._note(Received(t, type(msg).__name__))
        return heartbeat_s

    def _note(self, r: Received) -> None:
        with self.hub.cond:
            self.got.append(r)
            self.hub.cond.notify_all()


# --- the benchmark -------------------------------------------------------------------------------


def _control(endpoint: str, command: str, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """One control request (ctl's protocol, without starting ctl); None when no answer came."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(ControlRequest(command=command)))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = decode(sock.recv())
        return reply.data if isinstance(reply, ControlReply) and reply.ok else None
    finally:
        sock.close(linger=0)


class _Run:
    def __init__(self, job: LocalJob, hub: Hub, per_host: int, timeout_s: float) -> None:
        self.job, self.hub, self.per_host, self.timeout_s = job, hub, per_host, timeout_s
        self.devices: dict[str, SimDevice] = {}
        self.epoch = 0
        self.members: tuple[str, ...] = ()

    def add(self, name: str, flops: float, host: str) -> SimDevice:
        d = SimDevice(self.hub, self.job.workers_endpoint, name, host, flops)
        self.devices[name] = d
        d.start()
        return d

    def host_of(self, index: int) -> str:
        return "sim" if self.per_host <= 0 else f"sim-host-{index // self.per_host}"

    def alive(self) -> list[SimDevice]:
        return [d for d in self.devices.values() if d.t_close is None and d.is_alive()]

    def latest_delta(self) -> Received | None:
        best: Received | None = None
        for d in self.alive():
            for r in d.deltas(self.epoch):
                if best is None or r.epoch > best.epoch:
                    best = r
        return best

    def settled(self, epoch: int, timeout_s: float) -> bool:
        """Wait for the coordinator's `reshard` event of `epoch`: every member acknowledged it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(e["kind"] == "reshard" and e.get("epoch") == epoch for e in self.job.events()):
                return True
            if self.job.coordinator is not None and self.job.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited: {self.job.tail('coordinator.out')}")
            time.sleep(0.01)
        return False


def _warm_up(run: _Run, steps: int, settle_s: float) -> dict[str, Any]:
    """Every member of the current plan reports `steps` steps, as if trained at exactly its calibrated
    speed (compute_s = share x FLOPs per sample / FLOP/s) with a ring all-reduce at the cluster's
    intra-host prior: then the cluster object holds measured speeds and the planner runs its MILP
    (before any measurement it only splits by calibrated FLOP/s, status "heuristic")."""
    delta = next((r for d in run.alive() for r in d.deltas(run.epoch - 1) if r.epoch == run.epoch), None)
    if delta is None or steps <= 0:
        return {"steps": 0}
    graph = synthetic_graph()
    flops_per_sample = sum(layer["forward_flops"] + layer["backward_flops"] for layer in graph["layers"])
    params = sum(layer["param_bytes"] for layer in graph["layers"])
    ranks = len(delta.members)
    comm_s = INTRA_ALPHA_S * 2 * (ranks - 1) + 2 * (ranks - 1) / ranks * params * INTRA_BETA_S_PER_BYTE
    compute = {n: share * flops_per_sample / run.devices[n].flops for n, share in zip(delta.members, delta.shares)}
    step_s = max(compute.values()) + comm_s + OVERHEAD_S
    for step in range(1, steps + 1):
        for n, share in zip(delta.members, delta.shares):
            run.devices[n].outbox.put(StepReport(
                name=n, epoch=delta.epoch, step=step, loss=1.0, samples=share, global_batch=delta.global_batch,
                compute_s=compute[n], comm_s=comm_s, step_s=step_s, digest=""))
    run.job.wait_event(lambda e: e["kind"] == "step" and e["step"] >= steps, run.timeout_s, f"warm-up step {steps}")
    time.sleep(settle_s)  # a step report may re-plan (a speed far from the calibration): let it land
    latest = run.latest_delta()
    if latest is not None and latest.epoch > run.epoch:
        run.epoch, run.members = latest.epoch, latest.members
        if not run.settled(latest.epoch, run.timeout_s):
            raise TimeoutError(f"the plan after the warm-up (epoch {latest.epoch}) was not acknowledged")
        time.sleep(settle_s)
    return {"steps": steps, "step_s": step_s, "comm_s": comm_s, "epoch_after": run.epoch}


def _failure_trial(run: _Run, k: int, settle_s: float) -> dict[str, Any]:
    old_epoch, members = run.epoch, run.members
    wanted = FLOP_CLASSES[k % len(FLOP_CLASSES)]
    candidates = [n for n in members if n in run.devices and run.devices[n].t_close is None]
    victim_name = next((n for n in candidates if run.devices[n].flops == wanted), candidates[0])
    victim = run.devices[victim_name]
    survivors = [run.devices[n] for n in candidates if n != victim_name]
    out: dict[str, Any] = {"trial": k, "victim": victim_name, "victim_flops": victim.flops, "old_epoch": old_epoch,
                           "old_members": len(members)}
    victim.kill()
    if not run.hub.wait_until(lambda: victim.t_close is not None or not victim.is_alive(), 5.0):
        return {**out, "timed_out": "victim did not close its socket"}
    t0 = victim.t_close
    if t0 is None or victim.t_close_wall is None:
        return {**out, "timed_out": f"the victim's thread had stopped: {victim.failure}"}
    out["t_close_wall"] = victim.t_close_wall

    def all_have() -> bool:
        return all(s.first("PlanDelta", old_epoch, since=t0) is not None for s in survivors)

    ok = run.hub.wait_until(all_have, run.timeout_s)
    got = {s.dev_name: s.first("PlanDelta", old_epoch, since=t0) for s in survivors}
    aborts = [r.t - t0 for s in survivors if (r := s.first("Abort", old_epoch - 1, since=t0)) is not None]
    arrived = {n: r for n, r in got.items() if r is not None}
    out["survivor_delta_s"] = {n: r.t - t0 for n, r in arrived.items()}
    out["abort_msg_s"] = sorted(aborts)
    if not ok:
        missing = sorted(set(got) - set(arrived))
        return {**out, "timed_out": f"no PlanDelta within {run.timeout_s} s at {len(missing)} survivor(s): "
                                    f"{', '.join(missing[:5])}"}
    deltas = sorted(arrived.values(), key=lambda r: r.t)
    epochs = {r.epoch for r in deltas}
    new = max(deltas, key=lambda r: r.epoch)
    out.update(first_s=deltas[0].t - t0, all_s=deltas[-1].t - t0, new_epoch=new.epoch, reason=new.reason,
               abort_flag=all(r.abort for r in deltas), epochs_seen=sorted(epochs), new_members=len(new.members),
               first_abort_msg_s=min(aborts) if aborts else None)
    run.epoch, run.members = new.epoch, new.members
    out["settled"] = run.settled(new.epoch, run.timeout_s)
    time.sleep(settle_s)
    return out


def _join_trial(run: _Run, k: int, victim: SimDevice, standby_wait_s: float, settle_s: float) -> dict[str, Any]:
    name = f"j{k:03d}"
    before = run.epoch
    joiner = run.add(name, victim.flops, victim.host)
    out: dict[str, Any] = {"trial": k, "joiner": name, "flops": victim.flops, "old_epoch": before}
    if not run.hub.wait_until(lambda: joiner.t_ready is not None or not joiner.is_alive(), run.timeout_s):
        return {**out, "timed_out": "no Welcome"}
    t0 = joiner.t_ready
    if t0 is None:
        return {**out, "timed_out": f"the joiner stopped: {joiner.failure or joiner.got}"}
    planned = run.hub.wait_until(lambda: joiner.first("PlanDelta", before, member=True) is not None, standby_wait_s)
    if not planned:
        plan = _control(run.job.control_endpoint, "plan")
        members = plan.get("members") if plan else None
        standby = isinstance(members, list) and name not in members
        other = run.latest_delta()
        return {**out, "planned": False, "standby": standby, "plan_epoch": plan.get("epoch") if plan else None,
                "other_delta": other.epoch if other is not None and other.epoch > before else None}
    delta = joiner.first("PlanDelta", before, member=True)
    assert delta is not None
    peers = [run.devices[n] for n in delta.members if n in run.devices]
    ok = run.hub.wait_until(lambda: all(p.first("PlanDelta", delta.epoch - 1) is not None for p in peers), run.timeout_s)
    times = [r.t - t0 for p in peers if (r := p.first("PlanDelta", delta.epoch - 1)) is not None]
    out.update(planned=True, own_s=delta.t - t0, all_s=max(times) if ok else None, new_epoch=delta.epoch,
               abort_flag=delta.abort, reason=delta.reason, new_members=len(delta.members))
    run.epoch, run.members = delta.epoch, delta.members
    out["settled"] = run.settled(delta.epoch, run.timeout_s)
    time.sleep(settle_s)
    return out


def bench_event_to_delta(devices: int = 16, trials: int = 20, out_dir: Path | None = None, *,
                         lease_s: float | None = None, heartbeat_s: float | None = None, per_host: int = 0,
                         settle_s: float = 0.3, timeout_s: float = 10.0, standby_wait_s: float = 3.0,
                         startup_timeout_s: float = 60.0, warmup_steps: int = 4) -> dict[str, Any]:
    """Run the benchmark; returns settings, raw numbers per trial, the coordinator's plan events and a
    summary. With `out_dir` the coordinator's state dir (events.jsonl, logs) stays under it."""
    if devices < 2:
        raise ValueError("--devices must be at least 2 (a failure needs a survivor)")
    if out_dir is not None:
        state_dir = Path(out_dir) / "planner-latency-state"
        shutil.rmtree(state_dir, ignore_errors=True)
        scratch: Path | None = None
    else:
        scratch = Path(tempfile.mkdtemp(prefix="bench-planner-"))
        state_dir = scratch / "state"
    kwargs: dict[str, Any] = {}
    if lease_s is not None:
        kwargs["lease_s"] = lease_s
    if heartbeat_s is not None:
        kwargs["heartbeat_s"] = heartbeat_s
    # Simulated devices speak the protocol without keys: this measures the planner, not CURVE.
    job = LocalJob(JOB_REF, state_dir, min_workers=devices, insecure=True, **kwargs)
    hub = Hub()
    run = _Run(job, hub, per_host, timeout_s)
    result: dict[str, Any] = {
        "settings": {"devices": devices, "trials": trials, "job": JOB_REF, "lease_s": job.lease_s,
                     "heartbeat_s": job.heartbeat_s, "devices_per_host": per_host, "flop_classes": FLOP_CLASSES,
                     "memory_bytes": MEMORY_BYTES, "graph": synthetic_graph(), "settle_s": settle_s,
                     "timeout_s": timeout_s, "standby_wait_s": standby_wait_s, "goal_p50_s": GOAL_S,
                     "warmup_steps": warmup_steps,
                     "state_dir": str(state_dir) if scratch is None else None},
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "commit": _commit()},
        "failures": [], "joins": [],
    }
    try:
        job.start()
        t_start = time.monotonic()
        for i in range(devices):
            run.add(f"s{i:03d}", FLOP_CLASSES[i % len(FLOP_CLASSES)], run.host_of(i))
        first_ok = hub.wait_until(lambda: run.latest_delta() is not None, startup_timeout_s)
        first = run.latest_delta()
        if not first_ok or first is None:
            raise TimeoutError(f"no first plan within {startup_timeout_s} s: {job.tail('coordinator.out')}")
        result["first_plan"] = {"s": first.t - t_start, "epoch": first.epoch, "members": len(first.members)}
        run.epoch, run.members = first.epoch, first.members
        if not run.settled(first.epoch, timeout_s):
            raise TimeoutError(f"the first plan (epoch {first.epoch}) was not acknowledged within {timeout_s} s")
        time.sleep(settle_s)
        result["warm_up"] = _warm_up(run, warmup_steps, settle_s)
        for k in range(trials):
            f = _failure_trial(run, k, settle_s)
            result["failures"].append(f)
            _progress(f"failure {k}", f)
            if "timed_out" in f:
                run.epoch = max(run.epoch, f.get("new_epoch", run.epoch))
                latest = run.latest_delta()
                if latest is not None:
                    run.epoch, run.members = latest.epoch, latest.members
            j = _join_trial(run, k, run.devices[f["victim"]], standby_wait_s, settle_s)
            result["joins"].append(j)
            _progress(f"join {k}", j)
    finally:
        job.close()  # first: devices closing their sockets would otherwise be more failures to plan for
        for dev in run.devices.values():
            dev.stop()
        for dev in run.devices.values():
            dev.join(timeout=2.0)
        result["events"] = read_jsonl(state_dir / "events.jsonl")
        result["device_anomalies"] = _anomalies(run)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["summary"] = summarize(result)
    return result


def _progress(what: str, r: dict[str, Any]) -> None:
    if "timed_out" in r:
        text = f"TIMED OUT: {r['timed_out']}"
    elif "first_s" in r:
        text = f"first {r['first_s'] * 1e3:.1f} ms, all {r['all_s'] * 1e3:.1f} ms, epoch {r['new_epoch']}"
    elif r.get("planned"):
        text = f"own delta {r['own_s'] * 1e3:.1f} ms, epoch {r['new_epoch']}"
    else:
        text = f"not planned in (standby={r.get('standby')})"
    print(f"  {what}: {text}", file=sys.stderr, flush=True)


def _anomalies(run: _Run) -> list[str]:
    out = []
    for d in run.devices.values():
        if d.failure:
            out.append(f"{d.dev_name}: thread failed: {d.failure}")
        with run.hub.cond:
            for r in d.got:
                if r.kind in ("Error", "undecodable") or (r.kind == "Stop" and not d._stop_flag.is_set()):
                    out.append(f"{d.dev_name}: {r.kind} {r.reason}")
    return out


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "") if out.returncode == 0 else None


# --- report --------------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "max": None}
    s = sorted(values)
    return {"n": len(s), "p50": statistics.median(s), "p95": s[max(0, math.ceil(0.95 * len(s)) - 1)], "max": s[-1]}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    plans = {e["epoch"]: e for e in result["events"] if e["kind"] == "plan"}
    failed = [e for e in result["events"] if e["kind"] == "failed"]
    fails = [f for f in result["failures"] if "first_s" in f]
    joins = [j for j in result["joins"] if j.get("planned")]
    detect = []
    for f in fails:
        ev = next((e for e in failed if e["worker"] == f["victim"]), None)
        if ev is not None:
            detect.append(ev["ts"] - f["t_close_wall"])
    rows = {
        "failure -> first survivor": _stats([f["first_s"] for f in fails]),
        "failure -> all survivors": _stats([f["all_s"] for f in fails]),
        "failure -> Abort (first)": _stats([f["first_abort_msg_s"] for f in fails if f["first_abort_msg_s"] is not None]),
        "failure -> failed logged": _stats(detect),
        "failure solve_s": _stats([plans[f["new_epoch"]]["solve_s"] for f in fails if f["new_epoch"] in plans]),
        "join Ready -> own delta": _stats([j["own_s"] for j in joins]),
        "join Ready -> all members": _stats([j["all_s"] for j in joins if j.get("all_s") is not None]),
        "join solve_s": _stats([plans[j["new_epoch"]]["solve_s"] for j in joins if j["new_epoch"] in plans]),
    }
    goals = ("failure -> first survivor", "failure -> all survivors", "join Ready -> own delta")
    for name in goals:
        p50 = rows[name]["p50"]
        rows[name]["goal"] = f"p50 <= {GOAL_S * 1e3:.0f} ms"
        rows[name]["meets_goal"] = None if p50 is None else p50 <= GOAL_S
    statuses: dict[str, int] = {}
    for e in plans.values():
        statuses[str(e.get("status"))] = statuses.get(str(e.get("status")), 0) + 1
    return {
        "rows": rows,
        "failure_trials": len(result["failures"]), "failure_timeouts": sum("timed_out" in f for f in result["failures"]),
        "failure_not_abort": sum(1 for f in fails if not f["abort_flag"]),
        "join_trials": len(result["joins"]), "joins_planned_in": len(joins),
        "joins_standby": sum(1 for j in result["joins"] if j.get("planned") is False and j.get("standby")),
        "join_timeouts": sum("timed_out" in j for j in result["joins"]),
        "joins_planned_by_flops": {f"{c / 1e9:g}e9": [sum(1 for j in joins if j["flops"] == c),
                                                      sum(1 for j in result["joins"] if j.get("flops") == c)]
                                   for c in FLOP_CLASSES},
        "plan_statuses": statuses,
    }


def print_table(result: dict[str, Any]) -> None:
    s, cfg = result["summary"], result["settings"]
    print(f"event -> plan delta, {cfg['devices']} simulated devices, {cfg['trials']} trials "
          f"(lease {cfg['lease_s']} s, heartbeat {cfg['heartbeat_s']} s)")
    print(f"{'metric':<28} {'n':>3} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}  goal")
    for name, row in s["rows"].items():
        cells = [f"{row[k] * 1e3:8.1f}" if row[k] is not None else f"{'-':>8}" for k in ("p50", "p95", "max")]
        goal = row.get("goal", "")
        if row.get("meets_goal") is not None:
            goal += "  ok" if row["meets_goal"] else "  MISSED"
        print(f"{name:<28} {row['n']:>3} {' '.join(cells)}  {goal}")
    by = ", ".join(f"{k} FLOP/s {v[0]}/{v[1]}" for k, v in s["joins_planned_by_flops"].items())
    print(f"failures: {s['failure_trials']} trials, {s['failure_timeouts']} timed out, "
          f"{s['failure_not_abort']} without abort=True")
    print(f"joins: {s['joins_planned_in']}/{s['join_trials']} planned in, {s['joins_standby']} left on standby, "
          f"{s['join_timeouts']} timed out (planned in by class: {by})")
    print(f"plan statuses: {s['plan_statuses']}")
    if result["device_anomalies"]:
        print(f"device anomalies ({len(result['device_anomalies'])}): {'; '.join(result['device_anomalies'][:5])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=16, help="simulated devices (default 16; --min-workers too)")
    p.add_argument("--trials", type=int, default=20, help="failure + join trials (default 20)")
    p.add_argument("--quick", action="store_true", help="5 trials (a smoke run)")
    p.add_argument("--devices-per-host", type=int, default=0, metavar="K",
                   help="K devices per simulated host (default 0: every device on host 'sim')")
    p.add_argument("--lease", type=float, default=None, metavar="S", help="coordinator --lease (LocalJob's default)")
    p.add_argument("--heartbeat", type=float, default=None, metavar="S",
                   help="coordinator --heartbeat (LocalJob's default)")
    p.add_argument("--warmup-steps", type=int, default=4, metavar="N",
                   help="step reports every member sends after the first plan, so that the planner has "
                        "measured speeds and solves its MILP (default 4; 0: none, the planner stays on "
                        "its calibrated-FLOP/s heuristic)")
    p.add_argument("--settle", type=float, default=0.3, metavar="S",
                   help="idle time after each plan lands, before the next event (default 0.3)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="deadline of every wait in a trial")
    p.add_argument("--standby-wait", type=float, default=3.0, metavar="S",
                   help="a joiner with no delta after S seconds is taken to be on standby (default 3)")
    p.add_argument("--out", type=Path, default=Path("bench-out/planner-latency.json"),
                   help="JSON with settings and every raw number (default bench-out/planner-latency.json); "
                        "the coordinator's state dir goes next to it")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    trials = 5 if a.quick else a.trials
    if trials < 1:
        p.error("--trials must be at least 1")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = bench_event_to_delta(a.devices, trials, a.out.parent, lease_s=a.lease, heartbeat_s=a.heartbeat,
                                  per_host=a.devices_per_host, settle_s=a.settle, timeout_s=a.timeout,
                                  standby_wait_s=a.standby_wait, warmup_steps=a.warmup_steps)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print_table(result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
