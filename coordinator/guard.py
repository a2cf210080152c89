"""What the coordinator refuses, and the count of it: pure checks, no sockets, time passed in.

Every input that reaches the coordinator's code passes one of these checks before it may touch
membership, plans or the store; a refused one changes nothing but the `Refusals` counter (and
gets an `Error` reply where the peer can be told). The reasons, as `ctl status` shows them:

  handshake   a connection that never completed the ZMTP/CURVE handshake (raw bytes, a port
              scanner, a peer without keys or speaking another mechanism, one silent too long)
  auth        a CURVE key the coordinator does not know, or of the wrong role for that socket
  frames      a message with the wrong number of frames (a DEALER sends exactly one)
  decode      a frame that is not a valid message (garbage, wrong fields or types, oversize)
  version     a valid frame of another protocol version
  role        a message kind that this socket or this key does not take
  name        a message under another live worker's name, or a Join under a name that is live
  stale       a message from a worker that is not a member (fenced, or never joined): told to join
  epoch       a message claiming an epoch that does not exist yet or that it is not a member of
  busy        a Join while too many workers are still joining (retried by the worker)
  store       a store request outside the rendezvous namespace or over the store's limits
  request     a control command that is unknown or malformed

Logging is bounded: at most `burst` lines per reason every `window_s`; the rest are counted and
summarised in one line when the window ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import zmq

from coordinator.state import State
from transport import Join, Message, StepReport
from transport.security import bound_name

REASONS = ("handshake", "auth", "frames", "decode", "version", "role", "name", "stale", "epoch", "busy", "store",
           "request")


@dataclass(slots=True)
class Refusals:
    window_s: float = 10.0
    burst: int = 5
    counts: Counter[str] = field(default_factory=Counter)
    _window_start: float = 0.0
    _logged: Counter[str] = field(default_factory=Counter)
    _muted: Counter[str] = field(default_factory=Counter)

    def refuse(self, reason: str, text: str, *, now: float) -> list[str]:
        """Count one refusal; the log lines to print now (maybe none)."""
        assert reason in REASONS, reason
        self.counts[reason] += 1
        lines = self.flush(now=now)
        if self._logged[reason] < self.burst:
            self._logged[reason] += 1
            lines.append(f"refused ({reason}): {text}")
        else:
            self._muted[reason] += 1
        return lines

    def flush(self, *, now: float) -> list[str]:
        """At the end of a window: one line per reason whose lines were held back."""
        if now - self._window_start < self.window_s:
            return []
        lines = [f"refused ({reason}): {n} more in the last {self.window_s:g} s (not logged one by one)"
                 for reason, n in sorted(self._muted.items()) if n]
        self._window_start, self._logged, self._muted = now, Counter(), Counter()
        return lines

    def snapshot(self) -> dict[str, int]:
        return {reason: self.counts[reason] for reason in REASONS if self.counts[reason]}

    @property
    def total(self) -> int:
        return sum(self.counts.values())


OUTCOMES = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
MAX_UNATTRIBUTED = 64  # outcomes kept unattributed at most (a flood of overlapping handshakes)


@dataclass(slots=True)
class ConnectionLedger:
    """Follows a socket's connections through its monitor events and says when one ends refused:
    it failed its handshake, or closed before finishing one (raw bytes, no zmq greeting).

    A failed handshake is counted at its event: one event, one refused connection. A connection
    that closed with no outcome at all is the hard case: libzmq's (v1) monitor names the connection
    (its fd) in ACCEPTED and DISCONNECTED but not in the handshake events between them, so when two
    handshakes overlap, which one an outcome belongs to is unknown. Crediting it to the oldest
    waiting connection miscounts: a newer connection's success taken by an older one that later
    fails leaves the newer one "waiting", and its close would be counted as a refusal too.

    So an outcome is kept unattributed, with the connections it may belong to (those open and
    without a known outcome when it came), and it is settled by what follows: a connection that
    closes takes an outcome it may own (the failure just before its close first: libzmq emits a
    failure and the close of that connection back to back), and an outcome left with one
    candidate, or k outcomes sharing the same k candidates, belong to those. A close counts as
    "closed before greeting" only when no outcome may be its own. Each connection has exactly one
    outcome or none, so once the connections involved have closed, the counts are exact."""

    open: dict[int, None] = field(default_factory=dict)  # accepted, open, outcome not known (insertion order)
    unattributed: list[set[int]] = field(default_factory=list)  # per outcome: the connections it may be for
    accepted: int = 0
    handshaken: int = 0
    _just_failed: set[int] | None = None  # the previous event's failure, if that was the previous event

    def observe(self, event: int, value: int) -> tuple[str, str] | None:
        """(reason, text) when this event means a refused connection; None otherwise. `value` is the
        fd for ACCEPTED/DISCONNECTED and the error or status for handshake failures."""
        just_failed, self._just_failed = self._just_failed, None
        if event == zmq.EVENT_ACCEPTED:
            self.accepted += 1
            self.open[value] = None
            return None
        if event == zmq.EVENT_DISCONNECTED:
            return self._closed(value, just_failed)
        if event & OUTCOMES:
            if self.open:
                candidates = set(self.open)
                self.unattributed.append(candidates)
                if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._just_failed = candidates
                self._settle()
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshaken += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "auth", f"a client key that is not admitted here (ZAP status {value})"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return "handshake", f"zmq protocol error {value:#x} (no keys, other keys, or another protocol)"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return "handshake", f"no handshake completed (errno {value}; silent or broken peer)"
        return None

    def _closed(self, fd: int, just_failed: set[int] | None) -> tuple[str, str] | None:
        if fd not in self.open:
            return None  # its outcome is known (or it was accepted before the monitor started)
        del self.open[fd]
        mine = [u for u in self.unattributed if fd in u]  # the outcomes that may be its own
        own = next((u for u in mine if u is just_failed), mine[0] if mine else None)
        self.unattributed = [u for u in self.unattributed if u is not own]
        for u in self.unattributed:
            u.discard(fd)
        self._settle()
        return None if own is not None else ("handshake", "a connection closed before the zmq greeting "
                                                          "(not a zmq peer?)")

    def _settle(self) -> None:
        """Attribute what is certain: k outcomes that may only be for the same k connections are
        theirs (k = 1: an outcome with one candidate). A flood of overlapping handshakes beyond
        MAX_UNATTRIBUTED falls back to crediting the oldest outcome to its oldest candidate."""
        while True:
            self.unattributed = [u for u in self.unattributed if u]  # (its owner closed unseen: dropped)
            if len(self.unattributed) > MAX_UNATTRIBUTED:
                oldest = self.unattributed[0]
                known = {next(fd for fd in self.open if fd in oldest)}
                self.unattributed = self.unattributed[1:]
            else:
                groups = Counter(frozenset(u) for u in self.unattributed)
                full = next((c for c, n in groups.items() if n >= len(c)), None)
                if full is None:
                    return
                known = set(full)
                self.unattributed = [u for u in self.unattributed if frozenset(u) != full]
            for fd in known:
                self.open.pop(fd, None)
            for u in self.unattributed:
                u -= known


LEDGER_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                 | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


# --- messages on the workers socket ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: str  # one of REASONS
    text: str


def check_agent_message(state: State, bindings: dict[str, bytes], identity: bytes, user_id: str, msg: Message, *,
                        max_joining: int) -> Refuse | None:
    """Whether a worker-agent message may reach membership. `bindings` maps each live worker's
    name to the connection (ROUTER routing id) it joined on."""
    name: str = getattr(msg, "name")
    only = bound_name(user_id)
    if only is not None and name != only:
        return Refuse("name", f"a connection with {only!r}'s key sent {type(msg).__name__} as {name!r}")
    owner = bindings.get(name)
    if isinstance(msg, Join):
        if name in state.workers and owner != identity:
            return Refuse("name", f"a live worker is already named {name!r} (on another connection); "
                                  "start this one with another --name")
        joining = sum(not w.ready for w in state.workers.values())
        if name not in state.workers and joining >= max_joining:
            return Refuse("busy", f"Join as {name!r} while {joining} workers are still joining")
        return None
    if owner is None:
        return Refuse("stale", f"{type(msg).__name__} from {name!r}, which is not a member (fenced or never joined)")
    if owner != identity:
        return Refuse("name", f"{type(msg).__name__} claims the name {name!r} of a worker on another connection")
    epoch = getattr(msg, "epoch", None)
    if epoch is not None:
        if epoch > state.epoch:
            return Refuse("epoch", f"{type(msg).__name__} from {name!r} for epoch {epoch}, "
                                   f"but the latest is {state.epoch}")
        if (isinstance(msg, StepReport) and epoch == state.epoch and not state.in_play(name)):
            return Refuse("epoch", f"StepReport from {name!r} for epoch {epoch}, of which it is not a member")
    return None
