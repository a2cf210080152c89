"""The worker's control agent: a thread that owns the worker's one socket to the coordinator.

It keeps heartbeating while the training thread computes (torch releases the GIL in its kernels),
sends what the trainer queues (step reports, acks, leaves), and keeps what the coordinator says in
the protocol's worker side (`transport.worker_side.WorkerSide`, under a lock) that the trainer
reads between (and during) collectives: plan deltas, aborted epochs, `Stop`, fencing (the trainer
drops its state), save and checkpoint requests. The conversation's rules (re-joining when fenced,
registering again with a restarted coordinator and sending it the step reports it has not logged,
retrying a busy join) are the worker side's; this module is its I/O.

The socket is a DEALER with CURVE keys (unless the coordinator runs --insecure). The coordinator
binds the worker's name to this connection at Join, so the agent keeps one socket for its life.
The agent watches its socket's handshakes: a coordinator that refuses its key, wants keys it does
not have, or runs without keys it was given is a `FatalError` with a sentence saying which; so is an
answer from the coordinator's control socket (a ControlReply: --join was given the `control=`
address). The monitor also reports TCP connections, so a join that times out says whether nothing
could be reached there or something answered that is not a coordinator's workers socket. An
`ERR_BUSY` answer to a Join (too many workers joining at once) is retried a moment later.

The loop sleeps in one poll of the socket, its handshake monitor and a pipe the trainer's sends
write to, until one of them has something or a heartbeat is due (never a fixed short tick).

Every send is non-blocking, with what zmq cannot take yet kept in order for the next turn of the loop:
a DEALER whose only connection was refused at the handshake (a protocol error: zmq does not
reconnect) has no pipe, and a blocking send waits forever: on a loaded machine the refusal can land
before the first Join is sent, and a thread blocked in `send` would never read the refusal it is
there to report.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from transport import MAX_FRAME_BYTES, Join, Leave, Message, PlanDelta, Ready, Welcome, encode
from transport.endpoints import no_answer
from transport.security import HANDSHAKE_EVENTS, ClientKeys, handshake_failure, harden_client, no_detail_failure
from transport.worker_side import WorkerSide
from worker.calibrate import Calibration

POLL_S = 0.01  # while zmq cannot take what is unsent (a full pipe, a closing flush): look again this often
IDLE_S = 0.25  # otherwise the loop wakes on a frame, a handshake event, the trainer's send, or a heartbeat due
NO_DETAIL_GRACE_S = 3.0  # handshakes failing without detail (and none succeeding) for this long: give up
GOODBYE_S = 2.0  # how long a leaving worker waits for the coordinator to answer its Leave


class FatalError(RuntimeError):
    """The coordinator refused this worker for good (name taken, protocol mismatch)."""


class Agent:
    def __init__(self, endpoint: str, name: str, calibration: Calibration, *, slowdown: float = 1.0,
                 keys: ClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self._handshaken = False  # a handshake with the coordinator succeeded at least once
        self._connected = False  # a TCP connection to the endpoint was made at least once (what a timeout says)
        self._failing_since: float | None = None  # first failed handshake before any success
        self._gone_since: float | None = None  # the connection to the coordinator dropped (monotonic), until back
        self.name = name
        self.calibration = calibration
        c = calibration
        # What the coordinator said, and the rules of the conversation (under `_cond`).
        self._side = WorkerSide(join_template=Join(name=name, host=c.host, pid=os.getpid(), device=c.device,
                                                   flops=c.flops, memory_bytes=c.memory_bytes, threads=c.threads,
                                                   cores=c.cores),
                                endpoint=endpoint, slowdown=slowdown)
        self.on_interrupt: Callable[[], None] | None = None  # called when work may be superseded
        self._cond = threading.Condition()
        self._outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._unsent: deque[bytes] = deque()  # encoded, in order: zmq could not take them yet (agent thread only)
        self._closing = threading.Event()
        self._close_by = 0.0  # monotonic: stop trying to flush the unsent after this (set by close)
        # The trainer's sends wake the loop through this pipe, so the loop sleeps until something
        # happens instead of waking every few ms: a 10 ms poll loop takes CPU (several percent of a
        # sharded worker's samples where workers share cores) and the GIL from the training thread.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="adaptrain-agent", daemon=True)

    # --- trainer-facing API (thread-safe) ----------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._side.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:  # (set by the trainer: what heartbeats and joins report)
        self._side.epoch = value

    @property
    def step(self) -> int:
        return self._side.step

    @step.setter
    def step(self, value: int) -> None:
        self._side.step = value

    @property
    def slowdown(self) -> float:
        """The test knob: compute is stretched by this factor (`Slowdown`)."""
        return self._side.slowdown

    def start(self) -> None:
        self._thread.start()

    def send(self, msg: Message) -> None:
        self._outbox.put(msg)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # the pipe is full (the loop is awake already), or the loop has ended
            pass

    def say_goodbye(self, msg: Leave, wait_s: float = GOODBYE_S) -> bool:
        """Send the final `Leave`: from now on no heartbeats, and fencing no longer re-joins (the
        coordinator has let this worker go; it must not be planned in again). Then wait up to
        `wait_s` for the coordinator's answer (its Stop): exiting at once races the Leave, since
        the coordinator's socket monitor may report the closed connection before its reader has
        taken the Leave, and a worker that finished or was told to stop would be logged as failed.
        A Stop that came before the Leave is not that answer. False: no answer in time."""
        with self._cond:
            self._side.leaving()
        self.send(msg)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._side.goodbye_answered:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def mark_ready(self) -> None:
        """The job is loaded and the model built: the coordinator may plan with this worker."""
        self._side.ready = True
        self.send(Ready(name=self.name))

    def wait_welcome(self, timeout_s: float) -> Welcome:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._side.welcome is None:
                self._raise_fatal()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(no_answer(self.endpoint, timeout_s, who="worker", connected=self._connected))
                self._cond.wait(min(left, 0.1))
            return self._side.welcome

    def superseded(self, epoch: int) -> bool:
        """Whether work of `epoch` must be abandoned now (`WorkerSide.superseded`)."""
        return self._side.superseded(epoch)

    def pending_planned(self, epoch: int) -> PlanDelta | None:
        """The planned delta waiting for the step boundary, if one newer than `epoch` arrived."""
        with self._cond:
            return self._side.pending_planned(epoch)

    def next_delta(self, epoch: int, timeout_s: float) -> PlanDelta | None:
        """Block until a delta newer than `epoch` (the newest one), a stop or fencing."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_fatal()
                newest = self._side.newest_after(epoch)
                if newest is not None:
                    return newest
                left = deadline - time.monotonic()
                if self._side.stop is not None or self._side.fenced or left <= 0:
                    return None
                self._cond.wait(min(left, 0.1))

    def coordinator_gone_for(self) -> float:
        """Seconds since the connection to the coordinator dropped and was not made again (0: connected)."""
        since = self._gone_since
        return 0.0 if since is None else time.monotonic() - since

    def save_waiting(self) -> bool:
        """Whether a `ctl save` waits for a step boundary (not taken)."""
        return bool(self._side.saves)

    def checkpoint_waiting(self) -> bool:
        """Whether a checkpoint was asked for and waits for a step boundary (not taken)."""
        return self._side.checkpoints > 0

    def take_checkpoint(self) -> None:
        """Every checkpoint asked for so far is written at this step boundary."""
        with self._cond:
            self._side.checkpoints = 0

    def take_save(self) -> str | None:
        """The oldest `ctl save` path waiting for a step boundary, if any (taken)."""
        with self._cond:
            return self._side.saves.pop(0) if self._side.saves else None

    def stop_reason(self) -> str | None:
        return self._side.stop

    def take_fenced(self) -> bool:
        """True once after the coordinator fenced this worker out (the agent is joining again)."""
        with self._cond:
            fenced, self._side.fenced = self._side.fenced, False
            return fenced

    def close(self, linger_s: float = 1.0) -> None:
        """Flush what is queued (up to `linger_s`) and stop the thread."""
        self._close_by = time.monotonic() + linger_s
        self._closing.set()
        self._wake()
        self._thread.join(timeout=linger_s + 1.0)

    # --- the thread ----------------------------------------------------------------------------

    def _raise_fatal(self) -> None:
        if self._side.fatal is not None:
            raise FatalError(self._side.fatal)

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        harden_client(sock, max_bytes=MAX_FRAME_BYTES + 4096, keys=self.keys)
        monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        try:
            self._loop(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            os.close(self._wake_r)  # (the write end stays: a late send must not fail)

    def _watch_handshakes(self, monitor: zmq.Socket[bytes]) -> None:
        """Turn a handshake the coordinator refused into a fatal error that says why. A failure
        without detail (the coordinator closed the connection mid-handshake, which is how a refusal
        can look under load) is fatal too when no handshake has succeeded for NO_DETAIL_GRACE_S."""
        why: str | None = None
        while monitor.poll(0):
            event = recv_monitor_message(monitor)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_CONNECTED:
                self._connected, self._gone_since = True, None
                continue
            if kind == zmq.EVENT_DISCONNECTED:
                self._gone_since = self._gone_since or time.monotonic()
                continue
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken, self._failing_since, self._gone_since = True, None, None
                continue
            why = why or handshake_failure(kind, value, self.keys, who="worker", endpoint=self.endpoint)
            if not self._handshaken and self._failing_since is None:
                self._failing_since = time.monotonic()
        if why is None and self._failing_since is not None and time.monotonic() - self._failing_since > NO_DETAIL_GRACE_S:
            why = no_detail_failure(self.keys)
        if why is not None:
            with self._cond:
                self._side.fatal = why
                self._cond.notify_all()

    def _send(self, sock: zmq.Socket[bytes], msg: Message) -> None:
        """Send `msg` after anything still unsent, never blocking (see the module comment)."""
        self._unsent.append(encode(msg))
        self._flush(sock)

    def _flush(self, sock: zmq.Socket[bytes]) -> bool:
        """Hand zmq what it takes of the unsent messages, in order; True when none is left."""
        while self._unsent:
            try:
                sock.send(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._unsent.popleft()
        return True

    def _loop(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        with self._cond:
            join = self._side.join(time.monotonic())
        self._send(sock, join)
        next_beat = time.monotonic()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            self._drain_wakes()
            self._watch_handshakes(monitor)
            side = self._side
            if side.fatal is not None and side.welcome is None:
                return  # refused at the door: nothing to flush
            with self._cond:
                again = side.join_due(time.monotonic())
            if again is not None:
                self._send(sock, again)
            closing = self._closing.is_set()
            while True:
                try:
                    queued = self._outbox.get_nowait()
                except queue.Empty:
                    break
                with self._cond:
                    side.sent(queued)
                self._unsent.append(encode(queued))
            flushed = self._flush(sock)
            if closing:
                if flushed or time.monotonic() >= self._close_by:
                    return
                sock.poll(int(POLL_S * 1000), zmq.POLLOUT)  # a final Leave still waits for zmq
                continue
            welcome = side.welcome
            if welcome is not None and not side.gone and flushed and time.monotonic() >= next_beat:
                # No heartbeat queues behind a backlog: a stale one says nothing the next will not.
                self._send(sock, side.heartbeat())
                next_beat = time.monotonic() + welcome.heartbeat_s
            # Sleep until a frame, a handshake event or a send from the trainer, or until the next
            # heartbeat or join retry is due; briefly while zmq holds back what is unsent.
            wake_at = [time.monotonic() + (IDLE_S if flushed and not self._unsent else POLL_S)]
            if welcome is not None and not side.gone:
                wake_at.append(next_beat)
            if side.retry_join_at is not None:
                wake_at.append(side.retry_join_at)
            timeout_ms = max(0, int((min(wake_at) - time.monotonic()) * 1000) + 1)
            poller.poll(timeout_ms)
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # drain after every wake: the FD is edge-triggered
                self._handle(sock, sock.recv())

    def _drain_wakes(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _handle(self, sock: zmq.Socket[bytes], frame: bytes) -> None:
        with self._cond:
            replies = self._side.receive_frame(frame, time.monotonic())
            logs = self._side.take_logs()
            self._cond.notify_all()
        for msg in replies:
            self._send(sock, msg)
        for line in logs:
            self._log(line)
        if self.on_interrupt is not None:  # (work may be superseded now: the trainer's wait looks again)
            self.on_interrupt()

    def _log(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)
