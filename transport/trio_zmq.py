"""ZeroMQ sockets under trio: the one place that handles zmq's edge-triggered file descriptor.

A zmq socket is not a kernel socket. `sock.FD` is a signalling descriptor that becomes readable
when the socket's internal mailbox has *commands* for it, and zmq drains it whenever any call on
the socket (`recv`, `send`, reading `zmq.EVENTS`) processes those commands. Three rules follow:

1. Drain after every wake. The FD says "something changed", not "one message arrived": after it
   turns readable, receive until `zmq.Again`; only then is it safe to wait on the FD again.
2. Re-check after every send. A send processes pending commands too, so it can consume the very
   edge that announced an incoming message: the FD goes quiet while a message waits, and a task
   parked on the FD would sleep forever. So `send` wakes the receiving task (it cancels the
   receiver's wait scope) and the receiver tries `recv` again before parking.
3. One task waits on the FD. Two waiters on one descriptor is an error in trio, and a message
   would go to whichever happened to run first. `receive` asserts it has a single caller.

Sends never wait: `send` is synchronous and returns False when zmq cannot take the message now
(high-water mark reached, or a ROUTER_MANDATORY peer that is not connected). For the control plane
a dropped message is a decision for the caller (log it, declare the peer failed), never a hang.
All code here runs in trio's thread, so nothing between a failed `recv` and the wait on the FD
can run a send: the only window is while the receiver is parked, which rule 2 covers.

`SocketMonitor` reads a socket's monitor (a PAIR socket that zmq feeds with connection events)
through the same adapter; the coordinator uses `EVENT_DISCONNECTED` to see a killed worker at once.
Its `value` is the file descriptor of the connection, which `TrioSocket.receive_from` reports
for every message, so a disconnect can be mapped to the peer that sent on that connection.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple, TypeVar

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

_T = TypeVar("_T")
_P = TypeVar("_P", int, str)


class TrioSocket:
    """A zmq socket owned by one trio task: `receive` from that task, `send` from any task."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.socket = sock  # for bind/connect/setsockopt; never recv or send on it directly
        self._receiving = False
        self._wait_scope: trio.CancelScope | None = None

    @classmethod
    def create(cls, socket_type: int, *, linger_s: float = 1.0) -> TrioSocket:
        """A new socket of `socket_type` on the shared context. `linger_s` bounds how long
        unsent messages may delay closing (zmq's default is forever)."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(socket_type)
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        return cls(sock)

    @property
    def closed(self) -> bool:
        return self.socket.closed

    async def receive(self) -> list[bytes]:
        """The next multipart message. Raises trio.ClosedResourceError once the socket is closed."""
        return await self._receive(lambda: self.socket.recv_multipart(zmq.NOBLOCK))

    async def receive_from(self, *, max_frames: int = 8) -> Received:
        """Like `receive`, plus where the message came from: the file descriptor of its connection
        (the `value` of that connection's `EVENT_DISCONNECTED` in `SocketMonitor`; -1 when zmq
        cannot tell) and the ZAP user id its peer authenticated as ("" when none). Frames past
        `max_frames` are read and dropped (`Received.dropped` counts them), so a peer cannot make
        this side hold a message of a million parts."""

        def recv() -> Received:
            frames: list[zmq.Frame] = []
            dropped = 0
            while True:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
                if len(frames) < max_frames:
                    frames.append(frame)
                else:
                    dropped += 1
                if not frame.more:
                    break
            last = frames[-1]
            return Received([f.bytes for f in frames], _property(last, zmq.SRCFD, -1),
                            _property(last, "User-Id", ""), dropped)

        return await self._receive(recv)

    async def _receive(self, recv: Callable[[], _T]) -> _T:
        assert not self._receiving, "another task is already receiving on this socket (rule 3)"
        await trio.lowlevel.checkpoint_if_cancelled()
        self._receiving = True
        try:
            while True:
                if self.socket.closed:
                    raise trio.ClosedResourceError("the zmq socket is closed")
                try:
                    result = recv()
                except zmq.Again:
                    pass
                else:
                    # Yield even when a message was ready, so a busy socket cannot starve other
                    # tasks; shielded, so the message just taken is never lost to a cancellation.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return result
                with trio.CancelScope() as self._wait_scope:  # `send` cancels it (rule 2)
                    await trio.lowlevel.wait_readable(self.socket.FD)
                self._wait_scope = None
        finally:
            self._receiving = False
            self._wait_scope = None

    def send(self, frames: list[bytes]) -> bool:
        """Queue `frames` as one multipart message without waiting. False (and nothing sent)
        when zmq cannot take it now: high-water mark reached, or an unroutable ROUTER_MANDATORY
        peer. Raises trio.ClosedResourceError on a closed socket."""
        if self.socket.closed:
            raise trio.ClosedResourceError("the zmq socket is closed")
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return False
            raise
        finally:
            if self._wait_scope is not None:  # the send may have eaten the receiver's edge
                self._wait_scope.cancel()
        return True

    def monitor(self, events: int = zmq.EVENT_ALL) -> SocketMonitor:
        """Start reporting this socket's connection `events` (a mask of zmq.EVENT_*)."""
        return SocketMonitor(self, events)

    def close(self, linger_s: float | None = None) -> None:
        """Close the socket (idempotent); a task in `receive` gets trio.ClosedResourceError.
        `linger_s` overrides the socket's linger for this close."""
        if self.socket.closed:
            return
        trio.lowlevel.notify_closing(self.socket.FD)
        self.socket.close(linger=None if linger_s is None else int(linger_s * 1000))

    def __enter__(self) -> TrioSocket:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Received(NamedTuple):
    frames: list[bytes]
    fd: int  # the connection it came on (-1: unknown)
    user_id: str  # the ZAP user id of the peer ("" without ZAP)
    dropped: int  # frames past the limit, read and thrown away


def _property(frame: zmq.Frame, name: int | str, default: _P) -> _P:
    """A frame's metadata, or `default`: zmq raises EINVAL for messages that carry none (seen for a
    raw-TCP peer whose bytes libzmq parsed as ZMTP 1.0 frames), and that must never crash a pump."""
    try:
        value = frame.get(name)
    except zmq.ZMQError:
        return default
    return type(default)(value)


class MonitorEvent(NamedTuple):
    event: int  # one zmq.EVENT_* value
    value: int  # for connection events, the connection's file descriptor
    endpoint: str


class SocketMonitor:
    """The connection events of a `TrioSocket`, read by one task: ``async for ev in monitor``
    (ends when the monitor stops), or `receive` one at a time. Close it before the socket."""

    def __init__(self, target: TrioSocket, events: int = zmq.EVENT_ALL) -> None:
        self._target = target
        self._pair = TrioSocket(target.socket.get_monitor_socket(events))
        self._pair.socket.setsockopt(zmq.LINGER, 0)

    async def receive(self) -> MonitorEvent:
        raw = parse_monitor_message(await self._pair.receive())
        return MonitorEvent(int(raw["event"]), int(raw["value"]), raw["endpoint"].decode())

    def __aiter__(self) -> SocketMonitor:
        return self

    async def __anext__(self) -> MonitorEvent:
        event = await self.receive()
        if event.event == zmq.EVENT_MONITOR_STOPPED:
            raise StopAsyncIteration
        return event

    def close(self) -> None:
        if not self._target.closed:
            self._target.socket.disable_monitor()
        self._pair.close()

    def __enter__(self) -> SocketMonitor:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
