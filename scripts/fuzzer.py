"""A seeded fuzzer for the coordinator's sockets: what it sends, and what the coordinator should count.

Used by tests/system/test_fuzz.py (during a real training run) and scripts/bench_control.py (inputs
absorbed per second, and what absorbing them costs a training step). Every input is one of the
kinds below, made by `random.Random(seed)`, so a failure reproduces from its seed. Each kind says
which refusal reason (coordinator.guard.REASONS) the coordinator must count for it, so a run can
check that the counters account for every input.

Message-level inputs go over one long-lived DEALER per socket that holds a key of that socket's
role (the worst case: a buggy or hostile insider; an outsider never gets past the handshake):

  random       valid zmq, random payload bytes                        -> decode
  junk         valid msgpack that is not a message (random structures) -> decode
  fields       a message kind with a field missing, extra, of the wrong type or out of range -> decode
  huge         msgpack headers declaring gigabyte strings, arrays, maps -> decode
  truncated    a valid message cut short                               -> decode
  version      a valid message of another protocol version             -> version
  frames       2 to 20 frames where one is expected                    -> frames
  oversize     a frame just over the codec's size limit                -> decode
  role         a valid message of a kind this socket does not take     -> role
  replay       old-epoch Heartbeat / StepReport / Ack under a live worker's name -> name
  impersonate  Leave / Ready / Join under a live worker's name          -> name
  stale        Heartbeat / StepReport under a name that never joined   -> stale
  store        store requests outside the rendezvous namespace or malformed -> store
  command      control requests that are unknown or malformed (control socket) -> request

Connection-level inputs, one new TCP connection each, closed after its outcome:

  raw-tcp      random bytes with no zmq greeting                      -> handshake
  greeting     a ZMTP 3.0 NULL greeting, then random bytes            -> handshake
  no-key       a zmq DEALER without CURVE                             -> handshake
  wrong-key    a zmq DEALER with a key the coordinator does not know   -> auth
  wrong-role   a DEALER with the other socket's role key (ctl on workers, worker on control) -> auth
  over-limit   a frame over the socket's zmq message size: the coordinator drops the connection
               (libzmq closes it; nothing reaches the coordinator's code, so nothing is counted)
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

import transport as t
from transport import MAX_FRAME_BYTES, PROTOCOL_VERSION, encode
from transport.security import ROLE_CTL, ROLE_WORKER, ClientKeys, load_client_keys

MAX_CONTROL_BYTES = 64 * 1024  # coordinator.daemon's limit (ctl requests)

WORKER_KINDS = {"random": "decode", "junk": "decode", "fields": "decode", "huge": "decode", "truncated": "decode",
                "version": "version", "frames": "frames", "role": "role", "replay": "name", "impersonate": "name",
                "stale": "stale", "store": "store"}
CONTROL_KINDS = {"random": "decode", "junk": "decode", "fields": "decode", "huge": "decode", "truncated": "decode",
                 "version": "version", "frames": "frames", "role": "role", "command": "request"}
CONNECTION_KINDS = {"raw-tcp": "handshake", "greeting": "handshake", "no-key": "handshake", "wrong-key": "auth",
                    "wrong-role": "auth"}


@dataclass(slots=True)
class FuzzReport:
    sent: Counter[str] = field(default_factory=Counter)  # inputs by kind
    expected: Counter[str] = field(default_factory=Counter)  # refusals the coordinator should count, by reason
    dropped: int = 0  # over-limit connections the coordinator closed (not counted by it)
    seconds: float = 0.0

    def add(self, other: FuzzReport) -> None:
        self.sent.update(other.sent)
        self.expected.update(other.expected)
        self.dropped += other.dropped
        self.seconds += other.seconds

    @property
    def total(self) -> int:
        return sum(self.sent.values())


# --- message-level inputs ------------------------------------------------------------------------


def _message_samples(live: list[str]) -> list[t.Message]:
    name = live[0] if live else "w1"
    return [
        t.Join(name=name, host="h", pid=1, device="cpu", flops=1e9, memory_bytes=1 << 30, threads=1),
        t.Heartbeat(name=name, epoch=1, step=3),
        t.StepReport(name=name, epoch=1, step=3, loss=1.0, samples=4, global_batch=8, compute_s=0.1,
                     comm_s=0.01, step_s=0.2, digest=""),
        t.Ack(name=name, epoch=1, step=3, reshard_bytes=0, reshard_s=0.0),
        t.Leave(name=name, reason="finished"),
        t.StoreRequest(req_id=1, op="check", keys=["epoch1/x"], values=[], amount=0, timeout_s=1.0),
        t.ControlRequest(command="status", args=[]),
    ]


_ROLE_SAMPLES: list[t.Message] = [
    t.Welcome(name="w1", run_id="r", job_ref="j", job_name="job", job_source="", job_sha256="0" * 64,
              heartbeat_s=0.2, lease_s=1.0, want_graph=False),
    t.PlanDelta(epoch=1, reason="x", layout=t.MeshLayout(dp_replicate=1, dp_shard=1, pp=1, tp=1, members=["w1"],
                                                    shares=[8]), global_batch=8, abort=False),
    t.Abort(epoch=1, reason="x"), t.Stop(reason="x"), t.Slowdown(factor=2.0),
    t.Error(code="x", message="y"), t.StoreReply(req_id=1, ok=True, values=[], number=0, error=""),
    t.ControlReply(ok=True, data={}, error=""),
]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(7 if depth < 3 else 4)
    if choice == 0:
        return rng.randrange(-2**63, 2**63)
    if choice == 1:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if choice == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(20)))
    if choice == 3:
        return rng.randbytes(rng.randrange(20))
    if choice == 4:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(5))]
    if choice == 5:  # a map that looks a little like a frame
        m: dict[Any, Any] = {rng.choice(["kind", "name", "x", 7]): _junk(rng, depth + 1) for _ in range(3)}
        return m
    return None


def _fields(rng: random.Random, live: list[str]) -> bytes:
    """A valid frame of a real kind, then one thing wrong with it."""
    msg = rng.choice(_message_samples(live))
    frame = msgpack.unpackb(encode(msg), raw=False)
    names = [k for k in frame if k not in ("v", "kind")]
    how = rng.randrange(4)
    if how == 0 and names:
        del frame[rng.choice(names)]
    elif how == 1:
        frame[f"extra{rng.randrange(100)}"] = _junk(rng)
    elif how == 2 and names:
        key = rng.choice(names)
        frame[key] = 12345 if isinstance(frame[key], str) else "not-a-number"
    elif "name" in frame:
        frame["name"] = rng.choice(["", "has space", "x" * 200, "../etc", "\x00"])
    else:
        frame["v"] = PROTOCOL_VERSION  # keep it a real kind; make the kind unknown instead
        frame["kind"] = f"NoSuchKind{rng.randrange(1000)}"
    return bytes(msgpack.packb(frame, use_bin_type=True))


_HUGE = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xf0", b"\xdd\x7f\xff\xff\xff", b"\xdf\x7f\xff\xff\xff",
         b"\xc9\xff\xff\xff\xff\x01", b"\xd9\xff"]


def worker_input(kind: str, rng: random.Random, live: list[str]) -> list[bytes]:
    """The frames of one input of `kind` for the workers socket (`live`: names of live workers)."""
    if kind == "random":
        return [rng.randbytes(rng.randrange(1, 2000))]
    if kind == "junk":
        return [bytes(msgpack.packb(_junk(rng), use_bin_type=True))]
    if kind == "fields":
        return [_fields(rng, live)]
    if kind == "huge":
        prefix = bytes(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "Join"}, use_bin_type=True))[:-1]
        return [rng.choice([b"", b"\x82\xa1v\x02\xa4kind"]) + rng.choice(_HUGE) + rng.randbytes(rng.randrange(8))
                if rng.random() < 0.8 else prefix + rng.choice(_HUGE)]
    if kind == "truncated":
        whole = encode(rng.choice(_message_samples(live)))
        return [whole[:rng.randrange(1, len(whole))]]
    if kind == "version":
        frame = msgpack.unpackb(encode(rng.choice(_message_samples(live))), raw=False)
        frame["v"] = rng.choice([0, 1, PROTOCOL_VERSION + 1, 99, -1, "2", 2.0])
        return [bytes(msgpack.packb(frame, use_bin_type=True))]
    if kind == "frames":
        return [rng.randbytes(rng.randrange(0, 50)) for _ in range(rng.randrange(2, 21))]
    if kind == "oversize":
        return [b"\x00" * (MAX_FRAME_BYTES + rng.randrange(1, 4000))]
    if kind == "role":
        return [encode(rng.choice(_ROLE_SAMPLES + [t.ControlRequest(command="stop", args=[])]))]
    if kind == "replay":
        name, epoch, step = rng.choice(live), rng.randrange(0, 3), rng.randrange(0, 100)
        replays: list[t.Message] = [
            t.Heartbeat(name=name, epoch=epoch, step=step),
            t.StepReport(name=name, epoch=epoch, step=step, loss=rng.random(), samples=4, global_batch=64,
                         compute_s=0.01, comm_s=0.01, step_s=0.03, digest=""),
            t.Ack(name=name, epoch=epoch, step=step, reshard_bytes=0, reshard_s=0.0)]
        return [encode(rng.choice(replays))]
    if kind == "impersonate":
        name = rng.choice(live)
        claims: list[t.Message] = [
            t.Leave(name=name, reason="drained"), t.Ready(name=name),
            t.Join(name=name, host="evil", pid=1, device="cpu", flops=1e12, memory_bytes=1 << 40, threads=1),
            t.GraphUpload(name=name, graph={"layers": []})]
        return [encode(rng.choice(claims))]
    if kind == "stale":
        ghost = f"ghost-{rng.randrange(10**6)}"
        ghosts: list[t.Message] = [
            t.Heartbeat(name=ghost, epoch=rng.randrange(5), step=1),
            t.StepReport(name=ghost, epoch=1, step=1, loss=0.0, samples=1, global_batch=1, compute_s=0.0,
                         comm_s=0.0, step_s=0.0, digest=""),
            t.Ack(name=ghost, epoch=1, step=0, reshard_bytes=0, reshard_s=0.0)]
        return [encode(rng.choice(ghosts))]
    if kind == "store":
        op = rng.choice(["set", "get", "add", "wait", "frobnicate", "delete", "compare_set"])
        keys = rng.choice([[], ["unscoped"], [f"epoch{10**9}/k"], ["epoch1/" + "k" * 600],
                           [f"epoch1/{i}" for i in range(70)]])
        return [encode(t.StoreRequest(req_id=rng.randrange(1 << 30), op=op, keys=keys, values=[b"v"],
                                      amount=1, timeout_s=rng.choice([0.0, 1e9, float("inf")])))]
    raise ValueError(f"unknown worker input kind {kind!r}")


def control_input(kind: str, rng: random.Random) -> list[bytes]:
    if kind == "command":
        command = rng.choice(["", "statuss", "STOP", "drain", "slowdown", "events", "plan", "graph", "status",
                              "stop", "rm -rf /", "x" * 100])
        args: dict[str, list[str]] = {
            "drain": [f"nobody-{rng.randrange(1000)}"], "slowdown": ["nobody", "2"], "events": ["not-a-number"],
            "plan": ["bogus"], "graph": ["extra"], "status": ["extra"], "stop": ["now", "please"]}
        return [encode(t.ControlRequest(command=command, args=args.get(command, [])))]
    if kind == "oversize":
        return [b"\x00" * (MAX_CONTROL_BYTES + rng.randrange(1, 4000))]
    if kind == "role":
        return [encode(rng.choice(_ROLE_SAMPLES + _message_samples(["w1"])[:-1]))]
    return worker_input(kind, rng, ["w1"])


# --- sending -------------------------------------------------------------------------------------


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: ClientKeys | None) -> zmq.Socket[bytes]:
    """A DEALER connected to `endpoint`, with CURVE `keys` if given (no other hardening: it is the
    coordinator's limits that are under test)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.connect(endpoint)
    return sock


def _drain(sock: zmq.Socket[bytes]) -> int:
    n = 0
    while sock.poll(0):
        sock.recv_multipart()
        n += 1
    return n


def send_messages(endpoint: str, keys: ClientKeys | None, inputs: list[tuple[str, list[bytes]]],
                  kinds: dict[str, str], *, rate_per_s: float | None = None) -> FuzzReport:
    """Send every (kind, frames) over one DEALER; the refusals they should cause, by reason."""
    report = FuzzReport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, endpoint, keys)
    t0 = time.perf_counter()
    try:
        for i, (kind, frames) in enumerate(inputs):
            sock.send_multipart(frames)
            report.sent[kind] += 1
            report.expected[kinds.get(kind, "decode")] += 1
            _drain(sock)
            if rate_per_s is not None:
                ahead = (i + 1) / rate_per_s - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        # Keep the connection (and reading its answers) until the coordinator has caught up: a
        # closing zmq socket stops reading, and what it had not yet sent would be lost with it.
        quiet_since, deadline = time.monotonic(), time.monotonic() + 120
        while time.monotonic() - quiet_since < 1.0 and time.monotonic() < deadline:
            if sock.poll(50):
                _drain(sock)
                quiet_since = time.monotonic()
    finally:
        report.seconds = time.perf_counter() - t0
        sock.close(linger=0)
        ctx.term()
    return report


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


_NULL_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00"
                  + b"\x00" * 31)


def send_connections(endpoint: str, keys_dir: Path | None, kinds: list[str], rng: random.Random, *,
                     own_role: str, timeout_s: float = 5.0) -> FuzzReport:
    """One new connection per input (see the module docstring), each closed once it has failed."""
    report = FuzzReport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    t0 = time.perf_counter()
    try:
        for kind in kinds:
            report.sent[kind] += 1
            if kind in ("raw-tcp", "greeting"):
                with socket.create_connection(_host_port(endpoint), timeout=timeout_s) as s:
                    payload = rng.randbytes(rng.randrange(1, 1024))
                    s.sendall(_NULL_GREETING + payload if kind == "greeting" else payload)
                    try:  # the coordinator closes the connection; wait for that, then go
                        while s.recv(4096):
                            pass
                    except OSError:
                        pass
                report.expected["handshake"] += 1
                continue
            if kind == "over-limit":
                keys = load_client_keys(keys_dir, own_role) if keys_dir is not None else None
                limit = MAX_CONTROL_BYTES if own_role == ROLE_CTL else MAX_FRAME_BYTES
                if _dealer_outcome(ctx, endpoint, keys, b"\x00" * (limit + 8192), timeout_s) == "disconnected":
                    report.dropped += 1
                continue
            keys = None
            if kind == "wrong-key":
                public, secret = zmq.curve_keypair()
                server = load_client_keys(keys_dir, own_role).server_public if keys_dir else public
                keys = ClientKeys(server_public=server, public=public, secret=secret, path=Path("random"))
            elif kind == "wrong-role" and keys_dir is not None:
                keys = load_client_keys(keys_dir, ROLE_CTL if own_role == ROLE_WORKER else ROLE_WORKER)
            outcome = _dealer_outcome(ctx, endpoint, keys, b"hello", timeout_s)
            if outcome == "failed":
                report.expected[CONNECTION_KINDS[kind]] += 1
    finally:
        report.seconds = time.perf_counter() - t0
        ctx.term()
    return report


def _dealer_outcome(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: ClientKeys | None,
                    payload: bytes, timeout_s: float) -> str:
    """Connect once (no reconnect within the timeout), send `payload`: "failed" (handshake refused),
    "disconnected" (dropped after the handshake), or "open"."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 60_000)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
                                      | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    try:
        sock.connect(endpoint)
        try:  # (queued at once as a rule; once, in a loaded suite, EAGAIN: then up to the timeout. The monitor tells the outcome.)
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            try:
                sock.send(payload)
            except zmq.Again:
                pass
        deadline = time.monotonic() + timeout_s
        handshaken = False
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            event = int(recv_monitor_message(monitor)["event"])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                handshaken = True
            elif event == zmq.EVENT_DISCONNECTED:
                return "disconnected" if handshaken else "failed"
            elif not handshaken:
                return "failed"
        return "open"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


# --- plans ----------------------------------------------------------------------------------------


def plan_messages(rng: random.Random, n: int, kinds: dict[str, str], *, live: list[str],
                  control: bool, oversize: int = 2) -> list[tuple[str, list[bytes]]]:
    """`n` message-level inputs: every kind in turn, then random kinds; `oversize` frames of
    megabytes at most (they cost memory, not variety)."""
    names = [k for k in kinds if k != "oversize"]
    order = names + [rng.choice(names) for _ in range(max(0, n - len(names) - oversize))]
    order += ["oversize"] * oversize
    rng.shuffle(order)
    def make(kind: str) -> list[bytes]:
        return control_input(kind, rng) if control else worker_input(kind, rng, live)

    return [(k, make(k)) for k in order[:n]]


def fuzz_socket(endpoint: str, keys_dir: Path | None, *, seed: int, messages: int, connections: int,
                control: bool, live: list[str], rate_per_s: float | None = None) -> FuzzReport:
    """`messages` message-level and `connections` connection-level inputs against one socket."""
    rng = random.Random(seed)
    role = ROLE_CTL if control else ROLE_WORKER
    keys = load_client_keys(keys_dir, role) if keys_dir is not None else None
    kinds = dict(CONTROL_KINDS if control else WORKER_KINDS)
    kinds["oversize"] = "decode"
    report = send_messages(endpoint, keys, plan_messages(rng, messages, kinds, live=live, control=control),
                           kinds, rate_per_s=rate_per_s)
    conn_kinds = [k for k in CONNECTION_KINDS if keys_dir is not None or k not in ("wrong-key", "wrong-role")]
    plan = [conn_kinds[i % len(conn_kinds)] for i in range(connections)]
    if connections:
        plan[-1] = "over-limit"
    rng.shuffle(plan)
    report.add(send_connections(endpoint, keys_dir, plan, rng, own_role=role))
    return report


def seed_from_env(default: int) -> int:
    """ADAPTRAIN_FUZZ_SEED reproduces a failing run."""
    return int(os.environ.get("ADAPTRAIN_FUZZ_SEED", default))
