"""The redundancy of a sharded or pipeline layout, on one member: the ring of copies (`plan.reshard.copy_ring`).

Each member keeps a copy of its *source*'s slices (parameters and optimizer state; in a pipeline,
its source's stage) and has its own slices copied by its *keeper*. The copies stay current without moving the state: after the step's
backward, every member sends its gradient slices to its keeper (`exchange`: one buffer per dtype,
the send and the receive posted before either is waited for), or, where the step's reduce-scatters
ran as all-reduces (gloo), the keeper takes them from what it kept of those (`take`); after the
step's update the keeper applies the same update to its copy (`update`, with the job's own optimizer:
`worker.parallel.update`). Until the update is applied, the gradients stay on the copy's pieces:
a step that some members applied before a failure is rolled forward with them.

A pipeline stage hides most of this in its bubble: it posts the receive as its step starts
(`receive`), so the source's gradients arrive while it computes, and defers the copy's update
(`update(defer=True)`) to its next step's first wait for a neighbour, when it would idle anyway
(`flush`). A deferred update is applied before anything reads the copy (`pieces`) and before the
next exchange replaces its gradients; the receive buffers alternate between two, so the one posted
early never holds gradients a deferred update still reads.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plan.layout import Layout
from plan.placement import ranges_of
from plan.reshard import TensorShape, copy_ring
from worker.comm import AllOf
from worker.parallel.slices import PARAM, LocalState, Piece
from worker.parallel.update import GRAD, apply_update

if TYPE_CHECKING:
    from worker.parallel.fsdp import KeptShard

# p2p tags of the gradient slices a member sends to the keeper of its copy, one per dtype: far above
# a pipeline's own tags (2 per micro-batch), since a stage posts its receive before its micro-batches
GRAD_TAG = 1 << 24
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _tag(dtype: torch.dtype) -> int:
    return GRAD_TAG + (DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES) + zlib.crc32(str(dtype).encode()) % 1000)


Wait = Callable[[Any, torch.Tensor | None], None]


@dataclass(slots=True)
class Copies:
    keeper: str | None  # who keeps a copy of this member's slices
    source: str | None  # whose slices this member keeps a copy of
    copy: LocalState | None  # that copy (None without a source)
    # The last exchange's buffers, by dtype, kept only when every one of its ops was waited for to
    # the end: an abandoned op may still write into its buffer, so the next exchange takes fresh ones.
    # (Fresh buffers every step cost the page faults of both directions' bytes.)
    outbox: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    inbox: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # the copy's gradients are views of it
    spare: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # the exchange before last's: free
    # A receive posted early in the step (`receive`): its works and buffers.
    _incoming: tuple[list[tuple[Any, torch.Tensor]], dict[torch.dtype, torch.Tensor]] | None = None
    deferred: Callable[[], None] | None = None  # the last step's update of the copy, not yet applied
    _flushing: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def none() -> Copies:
        return Copies(None, None, None)

    @staticmethod
    def of(layout: Layout, me: str, local: LocalState, tensors: Sequence[TensorShape]) -> Copies:
        """This member's part of the layout's ring, its copy taken from `local` (which the reshard
        made hold both its own slices and its source's)."""
        ring = copy_ring(layout)  # (none where every slice already lives on two members)
        keeper = next((k for k, source in ring.items() if source == me), None)
        source = ring.get(me)
        if source is None:
            return Copies(keeper, None, None)
        src = list(layout.members).index(source)
        copy = LocalState(step=local.step, keys=dict(local.keys), dtypes=dict(local.dtypes), hyper=local.hyper,
                          scalars={f: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sc.items()}
                                   for f, sc in local.scalars.items()})
        for t in tensors:  # (the source's slices, or its stage's tensors whole; nothing of another stage)
            copy.pieces[t.name] = _in_one_buffer(local, t.name, [r for r in ranges_of(layout, src, t) if r[1] > r[0]])
        return Copies(keeper, source, copy)

    def exchange(self, named_grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], members: Sequence[str],
                 pg: Any, wait: Wait, device: torch.device) -> None:
        """Send this member's gradient slices (`(local parameter shard, its gradient or None)` in
        parameter order) to its keeper; receive the source's onto the copy's pieces. The receive is
        posted first where `receive` was not called earlier in the step."""
        self.receive(members, pg, device)
        self.finish(named_grads, members, pg, wait, device)

    def receive(self, members: Sequence[str], pg: Any, device: torch.device) -> None:
        """Post the receive of the source's gradient slices now (a pipeline posts it as its step
        starts, so that what its source sends lands while this member still computes), into a
        buffer no pending update reads: the exchange before last's, when it completed."""
        copy = self.copy
        if self.source is None or copy is None or self._incoming is not None:
            return
        sizes: dict[torch.dtype, int] = {}
        for fqn, pieces in copy.pieces.items():
            dtype = copy.dtype(fqn, PARAM)
            sizes[dtype] = sizes.get(dtype, 0) + sum(q.hi - q.lo for q in pieces)
        # (a buffer taken is kept again in `finish`, once every op on it has completed)
        if self.deferred is None:  # nothing reads the last gradients any more: their buffer
            free, self.inbox = self.inbox, {}
        else:
            free, self.spare = self.spare, {}
        src = list(members).index(self.source)
        inbox = {dtype: _kept_or_fresh(free, dtype, n, device) for dtype, n in sizes.items() if n}  # (what is sent)
        self._incoming = ([(pg.recv([buf], src, _tag(dtype)), buf) for dtype, buf in inbox.items()], inbox)

    def finish(self, named_grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], members: Sequence[str],
               pg: Any, wait: Wait, device: torch.device, *, also: Sequence[tuple[Any, torch.Tensor]] = ()) -> None:
        """The rest of the exchange: the deferred update of the last step applied (its gradients
        are about to be replaced), this member's gradient slices sent, the source's received.
        `also`: other ops of the step (a stage's last sends) waited for in the same wait."""
        if self.keeper is None and self.source is None:
            if also:
                wait(AllOf(list(also)), None)
            return
        self.flush()
        mine: dict[torch.dtype, list[torch.Tensor]] = {}
        for local, grad in named_grads:
            mine.setdefault(local.dtype, []).append(
                grad.reshape(-1) if grad is not None else torch.zeros(local.numel(), dtype=local.dtype, device=local.device))
        reused_out, self.outbox = self.outbox, {}  # (kept again below once every op has completed)
        works: list[tuple[Any, torch.Tensor]] = []
        outbox: dict[torch.dtype, torch.Tensor] = {}
        if self.keeper is not None:
            keeper = list(members).index(self.keeper)
            for dtype in sorted(mine, key=str):
                size = sum(g.numel() for g in mine[dtype])
                if not size:  # (nothing of this dtype to keep: the keeper posts no receive for it)
                    continue
                outbox[dtype] = buf = torch.cat(mine[dtype], out=_kept_or_fresh(reused_out, dtype, size, device))
                works.append((pg.send([buf], keeper, _tag(dtype)), buf))
        self.receive(members, pg, device)  # (where it was not posted earlier in the step)
        incoming, self._incoming = self._incoming, None
        inbox = incoming[1] if incoming is not None else {}
        wait(AllOf([*also, *works, *(incoming[0] if incoming is not None else [])]), None)  # (one hand-off)
        self.outbox = outbox
        copy = self.copy
        if copy is not None:
            self.spare, self.inbox = self.inbox, inbox  # (the last step's gradients were applied: `flush` above)
            at: dict[torch.dtype, int] = {}
            for fqn, pieces in copy.pieces.items():
                dtype = copy.dtype(fqn, PARAM)
                for q in pieces:
                    start = at.get(dtype, 0)
                    q.data[GRAD] = inbox[dtype][start:start + q.hi - q.lo]
                    at[dtype] = start + q.hi - q.lo

    def take(self, named_grads: Iterable[tuple[str, torch.Tensor | None]], kept: KeptShard | None) -> None:
        """The copy's gradients from the source's reduced shards this member kept from the step's
        reduce-scatters run as all-reduces (`worker.parallel.fsdp.KeptShard`; `named_grads`: each
        parameter's name and this member's gradient shard, or None): the exchange's result, with no
        message sent. Nothing to do without a copy (the others take theirs the same way)."""
        copy = self.copy
        if copy is None:
            return
        if kept is None:
            raise RuntimeError("a member that keeps a copy has no reduced shards of its source to take")
        grads = dict(named_grads)
        for fqn, pieces in copy.pieces.items():
            if not pieces:
                continue
            [q] = pieces  # (the source's one slice of the tensor: `Copies.of`)
            grad, numel = grads.get(fqn), q.hi - q.lo
            q.data[GRAD] = (kept.grad(grad, numel) if grad is not None
                            else torch.zeros(numel, dtype=copy.dtype(fqn, PARAM), device=q.data[PARAM].device))

    def update(self, optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
               shapes: Mapping[str, tuple[int, ...]], lr: Callable[[int], float], coefficient: float, *,
               defer: bool = False) -> None:
        """Apply the step's update to the copy, with the gradients `exchange` brought; `defer`: later,
        by `flush` (see the file comment), at the latest before anything reads the copy or the next
        exchange replaces its gradients."""
        copy = self.copy
        if copy is None:
            return

        def apply() -> None:
            apply_update(optimizer_factory, copy, copy.pieces, shapes, lr, coefficient)
            copy.step += 1
        self.deferred = apply
        if not defer:
            self.flush()

    def flush(self) -> float:
        """Apply a deferred update now (nothing without one); the seconds it took. Once, whichever
        thread asks, and a second asker returns only when it is applied (an epoch's entry reads the
        copy in a thread while its group forms)."""
        with self._flushing:
            apply, self.deferred = self.deferred, None
            if apply is None:
                return 0.0
            t0 = time.perf_counter()
            apply()
            return time.perf_counter() - t0

    def pieces(self, pending: bool) -> Mapping[str, list[Piece]]:
        """The copy's pieces for a LocalState (a deferred update applied first); their gradients only
        while a step is `pending`."""
        if self.copy is None:
            return {}
        self.flush()
        if not pending:
            for pieces in self.copy.pieces.values():
                for piece in pieces:
                    piece.data.pop(GRAD, None)
        return self.copy.pieces


def _in_one_buffer(local: LocalState, fqn: str, ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """`fqn`'s `ranges` of `local` as pieces whose tensors are consecutive views of one buffer per
    key (a row-wise tp split has a range per row): the copy's update then steps them as one tensor
    (`worker.parallel.update`), not hundreds."""
    total = sum(hi - lo for lo, hi in ranges)
    buffers = {k: torch.empty(total, dtype=local.dtype(fqn, k), device=local.pieces[fqn][0].data[k].device)
               for k in local.keys[fqn]} if ranges else {}
    pieces, at = [], 0
    for lo, hi in ranges:
        data = {k: local.copy_to(fqn, k, lo, hi, buf[at:at + hi - lo]) for k, buf in buffers.items()}
        pieces.append(Piece(lo, hi, data))
        at += hi - lo
    return pieces


def _kept_or_fresh(kept: Mapping[torch.dtype, torch.Tensor], dtype: torch.dtype, numel: int,
                   device: torch.device) -> torch.Tensor:
    """The last exchange's buffer of `dtype` when it has the size asked for, else a fresh one."""
    buf = kept.get(dtype)
    return buf if buf is not None and buf.numel() == numel else torch.empty(numel, dtype=dtype, device=device)
