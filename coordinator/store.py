"""The rendezvous key-value store that torch.distributed uses to form each epoch's group.

The coordinator serves it (it is the one process that outlives any worker), so a group can form
after any worker dies. This module is the store's state with no I/O: `handle` answers a request
at once or parks it (`get`/`wait` on keys that do not exist yet); `poke` answers parked requests
that a write made answerable; `expire` fails parked requests past their deadline. Time is passed in.

Keys are namespaced by torch's PrefixStore as "epoch{E}/..."; `forget_epochs_before` drops the keys
of old epochs so the store does not grow with every re-plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transport import StoreReply, StoreRequest

_EPOCH_KEY = re.compile(r"^epoch(\d+)/")


@dataclass(slots=True)
class _Parked:
    client: bytes
    request: StoreRequest
    deadline: float


@dataclass(slots=True)
class RendezvousStore:
    data: dict[str, bytes] = field(default_factory=dict)
    parked: list[_Parked] = field(default_factory=list)

    def handle(self, client: bytes, req: StoreRequest, *, now: float) -> StoreReply | None:
        """Apply `req`; the reply, or None when it is parked until its keys exist."""
        op, keys = req.op, req.keys
        if op in ("get", "wait"):
            if all(k in self.data for k in keys):
                return self._answer_wait(req)
            self.parked.append(_Parked(client, req, now + max(req.timeout_s, 0.0)))
            return None
        if op == "set":
            self._need(req, keys=1, values=1)
            self.data[keys[0]] = req.values[0]
            return _ok(req)
        if op == "add":
            self._need(req, keys=1, values=0)
            value = int(self.data.get(keys[0], b"0")) + req.amount
            self.data[keys[0]] = str(value).encode()
            return _ok(req, number=value)
        if op == "compare_set":
            self._need(req, keys=1, values=2)
            expected, desired = req.values
            current = self.data.get(keys[0])
            if (current is None and expected == b"") or current == expected:
                self.data[keys[0]] = desired
                current = desired
            return _ok(req, values=[current if current is not None else expected])
        if op == "check":
            return _ok(req, number=int(all(k in self.data for k in keys)))
        if op == "num_keys":
            return _ok(req, number=len(self.data))
        if op == "delete":
            self._need(req, keys=1, values=0)
            return _ok(req, number=int(self.data.pop(keys[0], None) is not None))
        raise ValueError(f"unknown store operation {op!r}")

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
        self.parked = [p for p in self.parked if not any(old(k) for k in p.request.keys)]

    def _answer_wait(self, req: StoreRequest) -> StoreReply:
        values = [self.data[k] for k in req.keys] if req.op == "get" else []
        return _ok(req, values=values)

    @staticmethod
    def _need(req: StoreRequest, *, keys: int, values: int) -> None:
        if len(req.keys) != keys or len(req.values) != values:
            raise ValueError(f"store {req.op} takes {keys} key(s) and {values} value(s)")


def _ok(req: StoreRequest, *, values: list[bytes] | None = None, number: int = 0) -> StoreReply:
    return StoreReply(req_id=req.req_id, ok=True, values=values or [], number=number, error="")
