"""The worker side of the rendezvous store: a `torch.distributed.Store` served by the coordinator.

gloo forms each epoch's group through this store (wrapped in a PrefixStore per epoch). Because the
coordinator serves it, a group can form after any worker dies, and because every blocking call
polls `is_aborted`, a worker that is waiting for a peer that will never come is released as soon as
the coordinator says so (an exception inside the gloo constructor, which the trainer catches).

Rules this follows: the C++ side only sees the camelCase names `getNumKeys` and
`deleteKey`; DEALER rather than REQ (REQ wedges after a timeout); one socket per thread, because
gloo may call from its own threads; a socket whose request timed out is discarded, so that a late
reply can never be read as the answer to the next request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
import zmq

from transport import MAX_FRAME_BYTES, CodecError, Error, StoreReply, StoreRequest, decode, encode
from transport.security import ClientKeys, harden_client

POLL_S = 0.02  # how often a blocked call looks at the abort flag


class StoreAborted(RuntimeError):
    """The epoch this store serves was superseded while a call waited."""


class CoordinatorStore(dist.Store):  # type: ignore[misc,name-defined]
    def __init__(self, endpoint: str, *, is_aborted: Callable[[], bool], timeout_s: float,
                 keys: ClientKeys | None = None) -> None:
        super().__init__()
        self._keys = keys
        self._endpoint = endpoint
        self._is_aborted = is_aborted
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._sockets: list[zmq.Socket[bytes]] = []
        self._lock = threading.Lock()

    # --- the torch.distributed.Store interface ---------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._call("set", [key], [bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call("get", [key]).values[0]

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key], amount=amount).number

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", [key], [bytes(expected), bytes(desired)]).values[0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)).number)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else self._timeout_s
        self._call("wait", list(keys), timeout_s=seconds)

    def getNumKeys(self) -> int:  # noqa: N802 (the name C++ looks up)
        return self._call("num_keys", []).number

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return bool(self._call("delete", [key]).number)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()

    # --- one request, one reply ------------------------------------------------------------

    def _socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] | None = getattr(self._local, "sock", None)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            harden_client(sock, max_bytes=MAX_FRAME_BYTES + 4096, keys=self._keys)
            sock.connect(self._endpoint)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def _discard_socket(self) -> None:
        sock = self._local.sock
        self._local.sock = None
        with self._lock:
            self._sockets.remove(sock)
        sock.close(linger=0)

    def _call(self, op: str, keys: list[str], values: list[bytes] | None = None, *,
              amount: int = 0, timeout_s: float | None = None) -> StoreReply:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        req = StoreRequest(req_id=next(self._ids), op=op, keys=keys, values=values or [],
                           amount=amount, timeout_s=timeout_s)
        sock = self._socket()
        deadline = time.monotonic() + timeout_s + 1.0
        unsent: bytes | None = encode(req)
        while True:
            if unsent is not None:  # never block in send: zmq may hold no pipe while it reconnects
                try:
                    sock.send(unsent, zmq.NOBLOCK)
                    unsent = None
                except zmq.Again:
                    pass
            if self._is_aborted():
                self._discard_socket()
                raise StoreAborted(f"store {op} {keys}: the epoch was superseded")
            if time.monotonic() > deadline:
                self._discard_socket()
                raise RuntimeError(f"store {op} {keys}: no answer from the coordinator in {timeout_s:.0f} s")
            if not sock.poll(int(POLL_S * 1000)):
                continue
            try:
                reply = decode(sock.recv())
            except CodecError:
                continue  # not from a coordinator of ours: never let it end the wait early
            if isinstance(reply, Error):  # the coordinator refused the request itself (its limits)
                self._discard_socket()
                raise RuntimeError(f"store {op} {keys}: refused by the coordinator: {reply.message}")
            if not isinstance(reply, StoreReply) or reply.req_id != req.req_id:
                continue  # a stray reply: keep waiting for ours
            if not reply.ok:
                raise RuntimeError(f"store {op} {keys}: {reply.error}")
            return reply
