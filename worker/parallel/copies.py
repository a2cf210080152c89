"""The redundancy of a sharded or pipeline layout, on one member: the ring of copies (`plan.reshard.copy_ring`).

Each member keeps a copy of its *source*'s slices (parameters and optimizer state; in a pipeline,
its source's stage) and has its own slices copied by its *keeper*. The copies stay current without moving the state: after the step's
backward, every member sends its gradient slices to its keeper (`exchange`: one buffer per dtype,
the send and the receive posted before either is waited for), or, where the step's reduce-scatters
ran as all-reduces (gloo), the keeper takes them from what it kept of those (`take`); after the
step's update the keeper applies the same update to its copy (`update`, with the job's own optimizer:
`worker.parallel.update`). Until the update is applied, the gradients stay on the copy's pieces:
a step that some members applied before a failure is rolled forward with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plan.layout import Layout
from plan.placement import ranges_of
from plan.reshard import TensorShape, copy_ring
from worker.parallel.slices import PARAM, LocalState, Piece
from worker.parallel.update import GRAD, apply_update

if TYPE_CHECKING:
    from worker.parallel.fsdp import KeptShard

GRAD_TAG = 64  # p2p tags of the gradient slices a member sends to the keeper of its copy
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
    inbox: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

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
            copy.pieces[t.name] = [Piece(lo, hi, {k: local.fresh(t.name, k, lo, hi) for k in local.keys[t.name]})
                                   for lo, hi in ranges_of(layout, src, t) if hi > lo]
        return Copies(keeper, source, copy)

    def exchange(self, named_grads: Iterable[tuple[torch.Tensor, torch.Tensor | None]], members: Sequence[str],
                 pg: Any, wait: Wait, device: torch.device) -> None:
        """Send this member's gradient slices (`(local parameter shard, its gradient or None)` in
        parameter order) to its keeper; receive the source's onto the copy's pieces."""
        if self.keeper is None and self.source is None:
            return
        mine: dict[torch.dtype, list[torch.Tensor]] = {}
        for local, grad in named_grads:
            mine.setdefault(local.dtype, []).append(
                grad.reshape(-1) if grad is not None else torch.zeros(local.numel(), dtype=local.dtype, device=local.device))
        dtypes = sorted(mine, key=str)
        reused_out, reused_in = self.outbox, self.inbox
        self.outbox, self.inbox = {}, {}  # (kept again below once every op has completed)
        works: list[tuple[Any, torch.Tensor]] = []
        outbox: dict[torch.dtype, torch.Tensor] = {}
        if self.keeper is not None:
            for d, dtype in enumerate(dtypes):
                size = sum(g.numel() for g in mine[dtype])
                outbox[dtype] = buf = torch.cat(mine[dtype], out=_kept_or_fresh(reused_out, dtype, size, device))
                works.append((pg.send([buf], list(members).index(self.keeper), GRAD_TAG + d), buf))
        inbox: dict[torch.dtype, torch.Tensor] = {}
        copy = self.copy
        if self.source is not None and copy is not None:
            sizes: dict[torch.dtype, int] = {}
            for fqn, pieces in copy.pieces.items():
                dtype = copy.dtype(fqn, PARAM)
                sizes[dtype] = sizes.get(dtype, 0) + sum(q.hi - q.lo for q in pieces)
            for d, dtype in enumerate(dtypes):
                inbox[dtype] = _kept_or_fresh(reused_in, dtype, sizes.get(dtype, 0), device)
                works.append((pg.recv([inbox[dtype]], list(members).index(self.source), GRAD_TAG + d), inbox[dtype]))
        for work, buf in works:
            wait(work, buf)
        self.outbox, self.inbox = outbox, inbox
        if copy is not None:
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
               shapes: Mapping[str, tuple[int, ...]], lr: Callable[[int], float], coefficient: float) -> None:
        """Apply the step's update to the copy, with the gradients `exchange` brought."""
        if self.copy is not None:
            apply_update(optimizer_factory, self.copy, self.copy.pieces, shapes, lr, coefficient)
            self.copy.step += 1

    def pieces(self, pending: bool) -> Mapping[str, list[Piece]]:
        """The copy's pieces for a LocalState; their gradients only while a step is `pending`."""
        if self.copy is None:
            return {}
        if not pending:
            for pieces in self.copy.pieces.values():
                for piece in pieces:
                    piece.data.pop(GRAD, None)
        return self.copy.pieces


def _kept_or_fresh(kept: Mapping[torch.dtype, torch.Tensor], dtype: torch.dtype, numel: int,
                   device: torch.device) -> torch.Tensor:
    """The last exchange's buffer of `dtype` when it has the size asked for, else a fresh one."""
    buf = kept.get(dtype)
    return buf if buf is not None and buf.numel() == numel else torch.empty(numel, dtype=dtype, device=device)
