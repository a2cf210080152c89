"""The rendezvous key-value store that torch.distributed uses to form each epoch's group.

The coordinator serves it (it is the one process that outlives any worker), so a group can form
after any worker dies. This module is the store's state with no I/O: `handle` answers a request
at once or parks it (`get`/`wait` on keys that do not exist yet); `poke` answers parked requests
that a write made answerable; `expire` fails parked requests past their deadline. Time is passed in.

Keys are namespaced by torch's PrefixStore as "epoch{E}/..."; `forget_epochs_before` drops the keys
of old epochs so the store does not grow with every re-plan.

Limits, because any worker-keyed peer can reach it (a refused request raises `ValueError` and
changes nothing): keys must lie in the namespace of an epoch that exists (`epoch{E}/` with E at most
the latest), at most MAX_KEYS keys of MAX_KEY_CHARS characters, values of at most MAX_VALUE_BYTES,
MAX_DATA_BYTES in all; waits last at most MAX_WAIT_S, and each client parks at most
MAX_PARKED_PER_CLIENT requests (MAX_PARKED in all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transport import STORE_OPS, StoreReply, StoreRequest

_EPOCH_KEY = re.compile(r"^epoch(\d+)/")
MAX_KEYS = 100_000
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20
MAX_DATA_BYTES = 64 << 20
MAX_WAIT_S = 600.0
MAX_PARKED_PER_CLIENT = 64
MAX_PARKED = 4096


@dataclass(slots=True)
class _Parked:
    client: bytes
    request: StoreRequest
    deadline: float


@dataclass(slots=True)
class RendezvousStore:
    data: dict[str, bytes] = field(default_factory=dict)
    parked: list[_Parked] = field(default_factory=list)
    data_bytes: int = 0

    def handle(self, client: bytes, req: StoreRequest, *, now: float, epoch: int) -> StoreReply | None:
        """Apply `req` (from a client while `epoch` is the latest); the reply, or None when it is
        parked until its keys exist. ValueError for a request outside the limits."""
        op, keys = req.op, req.keys
        self._check(client, req, epoch)
        if op in ("get", "wait"):
            if all(k in self.data for k in keys):
                return self._answer_wait(req)
            timeout_s = req.timeout_s if req.timeout_s == req.timeout_s else 0.0  # NaN waits not at all
            self.parked.append(_Parked(client, req, now + min(max(timeout_s, 0.0), MAX_WAIT_S)))
            return None
        if op == "set":
            self._need(req, keys=1, values=1)
            self._put(keys[0], req.values[0])
            return _ok(req)
        if op == "add":
            self._need(req, keys=1, values=0)
            try:
                value = int(self.data.get(keys[0], b"0")) + req.amount
            except ValueError:
                raise ValueError(f"store add on {keys[0]!r}, which does not hold a number") from None
            self._put(keys[0], str(value).encode())
            return _ok(req, number=value)
        if op == "compare_set":
            self._need(req, keys=1, values=2)
            expected, desired = req.values
            current = self.data.get(keys[0])
            if (current is None and expected == b"") or current == expected:
                self._put(keys[0], desired)
                current = desired
            return _ok(req, values=[current if current is not None else expected])
        if op == "check":
            return _ok(req, number=int(all(k in self.data for k in keys)))
        if op == "num_keys":
            return _ok(req, number=len(self.data))
        if op == "delete":
            self._need(req, keys=1, values=0)
            gone = self.data.pop(keys[0], None)
            self.data_bytes -= len(keys[0]) + len(gone) if gone is not None else 0
            return _ok(req, number=int(gone is not None))
        raise AssertionError(f"unhandled store operation {op!r}")  # _check knows STORE_OPS

    def poke(self) -> list[tuple[bytes, StoreReply]]:
        """Answers for parked requests whose keys now all exist."""
        ready = [p for p in self.parked if all(k in self.data for k in p.request.keys)]
        self.parked = [p for p in self.parked if p not in ready]
        return [(p.client, self._answer_wait(p.request)) for p in ready]

    def expire(self, *, now: float) -> list[tuple[bytes, StoreReply]]:
        """Failure answers for parked requests past their deadline."""
        late = [p for p in self.parked if p.deadline <= now]
        self.parked = [p for p in self.parked if p.deadline > now]
        def missing(p: _Parked) -> list[str]:
            return [k for k in p.request.keys if k not in self.data]

        return [
            (p.client, StoreReply(req_id=p.request.req_id, ok=False, values=[], number=0,
                                  error=f"timed out waiting for keys {missing(p)}"))
            for p in late
        ]

    def forget_epochs_before(self, epoch: int) -> None:
        def old(key: str) -> bool:
            m = _EPOCH_KEY.match(key)
            return m is not None and int(m.group(1)) < epoch

        self.data = {k: v for k, v in self.data.items() if not old(k)}
        self.data_bytes = sum(len(k) + len(v) for k, v in self.data.items())
        self.parked = [p for p in self.parked if not any(old(k) for k in p.request.keys)]

    def _check(self, client: bytes, req: StoreRequest, epoch: int) -> None:
        if req.op not in STORE_OPS:
            raise ValueError(f"unknown store operation {req.op!r}")
        if not 0 < len(req.keys) <= 64 and req.op != "num_keys":
            raise ValueError(f"store {req.op} with {len(req.keys)} keys (1 to 64 allowed)")
        for key in req.keys:
            m = _EPOCH_KEY.match(key)
            if len(key) > MAX_KEY_CHARS or m is None or int(m.group(1)) > epoch:
                raise ValueError(f"store key {key[:80]!r} is not in the namespace of an existing epoch "
                                 f"(epoch{{E}}/..., E <= {epoch}, at most {MAX_KEY_CHARS} characters)")
        if any(len(v) > MAX_VALUE_BYTES for v in req.values):
            raise ValueError(f"store value over {MAX_VALUE_BYTES} bytes")
        if req.op in ("get", "wait"):
            mine = sum(p.client == client for p in self.parked)
            if mine >= MAX_PARKED_PER_CLIENT or len(self.parked) >= MAX_PARKED:
                raise ValueError(f"too many parked store waits ({mine} from this client, {len(self.parked)} in all)")

    def _put(self, key: str, value: bytes) -> None:
        old = self.data.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key))
        if old is None and len(self.data) >= MAX_KEYS:
            raise ValueError(f"the store holds {MAX_KEYS} keys already")
        if self.data_bytes + grow > MAX_DATA_BYTES:
            raise ValueError(f"the store would hold over {MAX_DATA_BYTES} bytes")
        self.data[key] = value
        self.data_bytes += grow

    def _answer_wait(self, req: StoreRequest) -> StoreReply:
        values = [self.data[k] for k in req.keys] if req.op == "get" else []
        return _ok(req, values=values)

    @staticmethod
    def _need(req: StoreRequest, *, keys: int, values: int) -> None:
        if len(req.keys) != keys or len(req.values) != values:
            raise ValueError(f"store {req.op} takes {keys} key(s) and {values} value(s)")


def _ok(req: StoreRequest, *, values: list[bytes] | None = None, number: int = 0) -> StoreReply:
    return StoreReply(req_id=req.req_id, ok=True, values=values or [], number=number, error="")
