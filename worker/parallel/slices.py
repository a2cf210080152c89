"""What one member holds of the training state between epochs, as slices of flattened tensors, and the
execution of a reshard plan (`plan.reshard`) over point-to-point ops in the new epoch's group.

`LocalState` is the layout-free form of a member's state: for every parameter (by fully qualified
name), the element ranges it holds of the flattened parameter and of every optimizer-state tensor
shaped like it (Adam's two moments: the *companions*), plus what every holder has whole: the step,
the optimizer's other per-parameter state (Adam's `step`), its hyper-parameters, and the module's
buffers. An executor (`worker.parallel.replicated`, `worker.parallel.fsdp`) is built from a
LocalState and gives one back (`extract`), so any layout can follow any other.

`execute` runs the transfers of one member. A pair's items (each companion's range of each
transfer) travel in messages of about `MESSAGE` bytes, small items packed by the sender, a large
one sent from a view of what is held. What a member receives from one peer in one dtype lands in one
fresh buffer (an *arena*), every message where its elements belong, and the new state's pieces are
views of the arenas and of what it held: no piece allocated, nothing unpacked, nothing copied. The
transfer list is sorted the same everywhere, so both sides cut and number a pair's messages alike.
All receives, then all sends are posted before any is waited for (no ordering deadlock), and each
wait goes through the caller's abortable `wait`; a member that sent waits for a note from each peer
it sent to that everything arrived (none builds its executor beside a peer still receiving). A member that holds nothing (a newcomer) also
receives the whole-state part's tensors from the lowest-ranked holder, in the same round; their
structure (`skeleton`) reached it before, in the description all-gather.

Most of a reshard is known before the group forms, and done while it forms (forming waits on the
store and on TCP handshakes, leaving the cores idle): every member foresees the plan from the layout
being left and the new one (`worker.epoch.foresee`). A holder packs what it will send
(`pack_sends`, an `Outgoing`) and, when it receives nothing (a join's holders), makes its new
state's pieces. A member that holds nothing faults in a `Pool` and cuts its arenas, messages and new
pieces from it (`expect`, an `Incoming`), with the keys and dtypes its graph recorded per tensor.
`execute` takes what was made ahead only where the plan it runs gives that member exactly those
transfers (and keys, dtypes, step); else it does the work itself. The newcomer then receives and
unpacks the whole-state part while the data is on the wire.

Why ahead and why the notes: packing, cutting and faulting pages in inside the reshard run on the
same cores as the wire; done while the group forms they cost the transfer nothing. What is left is
mostly loopback TCP: on 2 cores the newcomer's reads take most of its CPU in a join, each sender's
writes most of theirs. A sender that, done first, built its FSDP2 executor at once would stall the
newcomer's last messages on shared cores, so it waits for the newcomer's note that everything
arrived (docs/benchmarks.md has the figures, beside raw gloo p2p).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import islice, zip_longest
from typing import Any

import torch

from plan.graph import TensorInfo
from plan.reshard import Range, ReshardPlan, Transfer
from worker import state as packing
from worker.comm import AllOf

PARAM = "param"  # the companion key of the parameter itself
META_TAG, DATA_TAG = 1, 1 << 16  # p2p tags: the whole-state part's tensors, then the data
DONE_TAG = DATA_TAG - 1  # a receiver's note to each peer it received from: everything arrived
# Bytes a message: smaller items (a companion's range of one transfer) are packed into messages of
# about this size. Each message has a fixed cost in gloo and in Python, and gloo's loopback rate
# peaks at 20-50 messages of 1-2 MB (43 MB from two senders: 2.3 GB/s as 2 messages, 3.1 as 150,
# 3.7-3.8 as 20-50).
MESSAGE = 1 << 20
Item = tuple[Transfer, str]  # one companion of one transfer


@dataclass(slots=True)
class Piece:
    """Elements [lo, hi) of one flattened parameter: the parameter's and each companion's."""

    lo: int
    hi: int
    data: dict[str, torch.Tensor]  # companion key -> 1-D tensor of hi - lo elements


def _start(piece: Piece) -> int:
    return piece.lo


def pieces_over(ranges: Iterable[Range], data: Mapping[str, torch.Tensor]) -> list[Piece]:
    """A member's local flat tensors `data` (companion key -> its elements of one tensor, in the
    order of `ranges`) as one piece per range, each a view of its part."""
    out: list[Piece] = []
    at = 0
    for lo, hi in ranges:
        if hi > lo:
            out.append(Piece(lo, hi, {k: v[at:at + hi - lo] for k, v in data.items()}))
            at += hi - lo
    return out


@dataclass(slots=True)
class LocalState:
    step: int
    keys: dict[str, tuple[str, ...]]  # fqn -> companion keys, PARAM first (the same on every member)
    dtypes: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn -> companion key -> torch dtype name
    pieces: dict[str, list[Piece]] = field(default_factory=dict)  # fqn -> held pieces, sorted, disjoint
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)  # fqn -> optimizer state not shaped like it
    hyper: list[dict[str, Any]] = field(default_factory=list)  # optimizer param_groups without "params"
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # module buffers (whole)
    pending: bool = False  # pieces carry the gradients of step `step` + 1, not applied here yet
    coefficient: float = 1.0  # the clipping coefficient of the last step applied (for a roll forward)

    def add(self, more: Mapping[str, list[Piece]]) -> None:
        """Hold `more` pieces too (a copy of another member's slices, what was held before a reshard);
        overlaps are allowed, every reader takes each element once."""
        for fqn, pieces in more.items():
            self.pieces[fqn] = sorted([*self.pieces.get(fqn, []), *pieces], key=lambda q: q.lo)

    def adopt(self, other: LocalState, pieces: Mapping[str, list[Piece]] | None = None) -> None:
        """Hold `other`'s pieces too (or only `pieces` of them), with the keys, dtypes and optimizer
        scalars of the tensors this state did not know (a pipeline stage's copy of another stage)."""
        more = other.pieces if pieces is None else pieces
        for fqn, held in more.items():
            if held and fqn not in self.keys:
                self.keys[fqn], self.dtypes[fqn] = other.keys[fqn], other.dtypes[fqn]
                self.scalars.setdefault(fqn, other.scalars.get(fqn, {}))
        self.add(more)

    def holdings(self) -> dict[str, list[Range]]:
        return {fqn: [(p.lo, p.hi) for p in pieces] for fqn, pieces in self.pieces.items() if pieces}

    def read(self, fqn: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of companion `key` of `fqn`: a view when one piece covers them."""
        parts = self._parts(fqn, key, lo, hi)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def copy_to(self, fqn: str, key: str, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Copy elements [lo, hi) of companion `key` of `fqn` into `out` (flat, hi - lo elements),
        piece by piece (no intermediate tensor when several pieces hold them); returns `out`."""
        return _copy_parts(self._parts(fqn, key, lo, hi), out)

    def fill(self, fqn: str, key: str, ranges: Sequence[Range], out: torch.Tensor) -> torch.Tensor:
        """`out` (flat: a member's local elements of `fqn`, in the order of `ranges`, as
        `plan.placement.ranges_of` gives them) filled from companion `key`; returns `out`. A box's
        rows (equally long, equally spaced ranges) held in one buffer are copied at once."""
        run = _run_of(ranges)
        if run is not None and (view := self.strided(fqn, key, *run)) is not None:
            out.view(run[3], run[1] - run[0]).copy_(view)
            return out
        parts = [part for lo, hi in ranges if hi > lo for part in self._parts(fqn, key, lo, hi)]
        return _copy_parts(parts, out)

    def read_transfer(self, key: str, t: Transfer) -> torch.Tensor:
        """Companion `key` of what transfer `t` moves (all of its ranges, in order), flat: a view
        when one piece holds a single range, else a copy."""
        if t.count == 1:
            return self.read(t.tensor, key, t.lo, t.hi)
        view = self.strided(t.tensor, key, t.lo, t.hi, t.stride, t.count)
        if view is not None:
            return view.reshape(-1)
        return torch.cat([part for lo, hi in t.ranges() for part in self._parts(t.tensor, key, lo, hi)])

    def strided(self, fqn: str, key: str, lo: int, hi: int, stride: int, count: int) -> torch.Tensor | None:
        """Companion `key` of the ranges [lo + i·stride, hi + i·stride), i < count, as one
        (count, hi - lo) view, where the pieces holding them lie in one buffer equally spaced (a
        box's rows as the executor holds them: `pieces_over` one flat tensor); else None."""
        pieces = self.pieces.get(fqn, [])
        length = hi - lo
        i = bisect_right(pieces, lo, key=_start) - 1
        if i < 0 or length <= 0:
            return None
        first = pieces[i].data[key]
        if first.dim() != 1 or first.stride(0) != 1:
            return None
        if pieces[i].lo <= lo and hi + (count - 1) * stride <= pieces[i].hi:  # (one piece holds them all)
            return first.as_strided((count, length), (stride, 1), first.storage_offset() + lo - pieces[i].lo)
        storage, size = first.untyped_storage().data_ptr(), first.element_size()
        at = first.data_ptr() + (lo - pieces[i].lo) * size
        spacing = None  # (the rows' spacing in the buffer, in bytes)
        checked = -1  # (the last piece whose buffer was checked)
        for r in range(count):
            a = lo + r * stride
            while i < len(pieces) and pieces[i].hi <= a:
                i += 1
            if i == len(pieces) or not pieces[i].lo <= a or a + length > pieces[i].hi:
                return None
            data = pieces[i].data[key]
            if checked != i:
                if data.untyped_storage().data_ptr() != storage or data.stride(0) != 1:
                    return None
                checked = i
            address = data.data_ptr() + (a - pieces[i].lo) * size
            if r == 1:
                spacing = address - at
                if spacing < length * size or spacing % size:
                    return None
            elif r > 1 and address - at != r * (spacing or 0):
                return None
        step = (spacing or length * size) // size
        return first.as_strided((count, length), (step, 1), (at - storage) // size)

    def fresh(self, fqn: str, key: str, lo: int, hi: int, device: torch.device | None = None) -> torch.Tensor:
        """Elements [lo, hi) of companion `key` of `fqn`, copied into a tensor of their own on `device`
        (default: where they are held)."""
        parts = self._parts(fqn, key, lo, hi)
        return _copy_parts(parts, torch.empty(hi - lo, dtype=self.dtype(fqn, key), device=device or parts[0].device))

    def _parts(self, fqn: str, key: str, lo: int, hi: int) -> list[torch.Tensor]:
        parts = []
        at = lo
        pieces = self.pieces.get(fqn, [])
        # (sorted by lo: start at the last piece that starts by `lo`, found by bisection, a row-wise
        # split holding a piece per row; where that one ends before `lo`, an earlier piece may
        # overlap it and cover `lo`: scan from the first)
        first = bisect_right(pieces, lo, key=_start) - 1
        if first < 0 or pieces[first].hi <= lo:
            first = 0
        for p in islice(pieces, first, None):
            if p.hi <= at or p.lo >= hi:
                continue
            if p.lo > at:
                break
            end = min(p.hi, hi)
            parts.append(p.data[key] if p.lo == at and p.hi == end else p.data[key][at - p.lo:end - p.lo])
            at = end
            if at == hi:
                break
        if at != hi:
            raise KeyError(f"{fqn}[{lo}:{hi}] ({key}) is not held here (held: {[(p.lo, p.hi) for p in self.pieces.get(fqn, [])]})")
        return parts

    @staticmethod
    def recorded(tensors: Sequence[TensorInfo]) -> LocalState | None:
        """No pieces, the keys and dtypes a trained member holds for `tensors` as the graph recorded
        them (`TensorInfo.state`): what a member that holds nothing cuts its receives for before it
        learns them; None where the capture could not step the optimizer."""
        if any(t.state is None for t in tensors):
            return None
        return LocalState(step=0, keys={t.fqn: (PARAM, *(k for k, _ in t.state or ())) for t in tensors},
                          dtypes={t.fqn: {PARAM: t.dtype, **dict(t.state or ())} for t in tensors})

    def with_whole(self, whole: LocalState) -> LocalState:
        """These pieces, with `whole`'s step, keys, dtypes and whole-state part."""
        return LocalState(step=whole.step, keys=whole.keys, dtypes=whole.dtypes, pieces=self.pieces,
                          scalars=whole.scalars, hyper=whole.hyper, buffers=whole.buffers)

    def whole(self) -> dict[str, Any]:
        """The part every holder has whole (what a newcomer receives first)."""
        return {"step": self.step, "keys": {k: list(v) for k, v in self.keys.items()}, "dtypes": self.dtypes,
                "scalars": self.scalars, "hyper": self.hyper, "buffers": self.buffers}

    def dtype(self, fqn: str, key: str) -> torch.dtype:
        return _dtype(self.dtypes[fqn][key])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pieces in self.pieces.values() for p in pieces
                   for t in p.data.values())


@cache
def _dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("float32")."""
    return getattr(torch, name)  # type: ignore[no-any-return]


def _copy_parts(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    if len(parts) == 1:
        out.copy_(parts[0])
    elif parts:
        torch.cat(parts, out=out)  # (one call: a row-wise split's pieces are thousands)
    return out


def _run_of(ranges: Sequence[Range]) -> tuple[int, int, int, int] | None:
    """(lo, hi, stride, count) where `ranges` are [lo + i·stride, hi + i·stride), i < count, count > 1."""
    if len(ranges) < 2:
        return None
    (lo, hi), stride = ranges[0], ranges[1][0] - ranges[0][0]
    if stride < hi - lo or hi <= lo:
        return None
    for i, (a, b) in enumerate(ranges):
        if a != lo + i * stride or b - a != hi - lo:
            return None
    return lo, hi, stride, len(ranges)


# --- the state of a whole (replicated) model -------------------------------------------------------------


def from_module(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> LocalState:
    """A LocalState holding every element of a plain (unsharded) model and its optimizer."""
    local = LocalState(step=step, keys={})
    by_param = {id(p): n for n, p in model.named_parameters()}
    opt_state = {by_param[id(p)]: s for p, s in optimizer.state.items() if id(p) in by_param}
    for fqn, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        data = {PARAM: flat}
        scalars: dict[str, Any] = {}
        for key, value in opt_state.get(fqn, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                data[key] = value.detach().reshape(-1)
            else:
                scalars[key] = value
        local.keys[fqn] = tuple(data)
        local.dtypes[fqn] = {k: str(v.dtype).removeprefix("torch.") for k, v in data.items()}
        local.pieces[fqn] = [Piece(0, flat.numel(), data)]
        local.scalars[fqn] = scalars
    local.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    local.buffers = {n: b.detach() for n, b in model.named_buffers()}
    return local


def to_module(local: LocalState, module: torch.nn.Module,
              optimizer_factory: Callable[[Any], torch.optim.Optimizer], device: torch.device) -> torch.optim.Optimizer:
    """The inverse of `from_module`: `module` (built on the meta device) materialised on `device`
    and filled from `local`, which holds every element of its parameters (and its buffers), and its
    optimizer (`optimizer_factory`, the job's) with the hyper-parameters and state `local` carries."""
    module.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in module.named_parameters():
            local.copy_to(fqn, PARAM, 0, p.numel(), p.view(-1))
        for name, buf in module.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    optimizer = optimizer_factory(module.parameters())
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in module.named_parameters():
        state: dict[str, Any] = {key: local.fresh(fqn, key, 0, p.numel(), device).view_as(p)
                                 for key in local.keys.get(fqn, ()) if key != PARAM}
        state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in local.scalars.get(fqn, {}).items()})
        if state:
            optimizer.state[p] = state
    return optimizer


# --- executing a reshard ---------------------------------------------------------------------------------


def pack_whole(local: LocalState) -> packing.Packed:
    """The whole-state part, packed: its skeleton (keys, dtypes, hyper-parameters, tensor shapes:
    what a member without state needs before it can receive anything) travels in the description
    all-gather, its buffers are what the sender sends in `execute`. Packed once per entry and used
    for both: packing walks every parameter's optimizer scalars (milliseconds for a 10M GPT, which
    the sender would otherwise spend again before its first data message)."""
    return packing.pack(local.whole(), torch.device("cpu"))


def execute(plan: ReshardPlan, me: str, ranks: Mapping[str, int], local: LocalState | None,
            needed: Mapping[str, Sequence[Range]], holders: Sequence[str], pg: Any,
            wait: Callable[[Any, torch.Tensor | None], None], device: torch.device,
            whole: bytes = b"", sender: str | None = None, pool: Pool | None = None,
            packed_whole: packing.Packed | None = None, outgoing: Outgoing | None = None,
            incoming: Incoming | None = None,
            teach: Callable[[LocalState], None] = lambda local: None) -> tuple[LocalState, int]:
    """Run `me`'s part of `plan`; returns the new LocalState (exactly the ranges `needed`) and the
    bytes received. `holders`: the members whose state is current; `sender` (default: the
    lowest-ranked holder) sends the whole-state part's tensors to the others; `local`: this member's
    state, None if it has none; `whole`: the sender's `skeleton`, which a member without state needs
    (every member learns it in the description all-gather before, so its receives go out with the
    data's); `packed_whole`: the sender's `pack_whole`, when it has it already; `outgoing`: this
    member's data messages packed ahead (`pack_sends`), used when they are this plan's; `incoming`:
    where this member's receives land, made ready ahead (`expect`), used when they are this plan's;
    `teach(local)`: tells this member's state the keys and dtypes of tensors it never held, before
    its receives are cut (`worker.epoch.Structure`: a pipeline stage that moves)."""
    received = 0
    sender = sender or min(holders, key=lambda n: ranks[n])
    works: list[tuple[Any, torch.Tensor]] = []
    meta: dict[str, Any] | None = None  # the whole-state part's structure, for a member without state
    behind: list[str] = []  # the members without state this member sends the whole-state part to
    if local is None or me not in holders:
        if not whole:
            raise ValueError(f"{me} holds no current state and was not given the holders' skeleton")
        meta = packing.read_meta(torch.frombuffer(bytearray(whole), dtype=torch.uint8))
        # What this member held is stale: it keeps nothing of it. Its data receives need only the
        # keys and dtypes (plain data in the skeleton): they go out first, and the whole-state part
        # is received and unpacked after them, while the data is on the wire.
        structure = meta["skeleton"]
        local = LocalState(step=int(structure["step"]), keys={k: tuple(v) for k, v in structure["keys"].items()},
                           dtypes=dict(structure["dtypes"]))
    elif me == sender:
        behind = sorted((n for n in ranks if n not in holders), key=lambda n: ranks[n])
        if behind:
            packed = packed_whole if packed_whole is not None else pack_whole(local)
            for n in behind:
                for tag, buf in enumerate(packed.buffers, start=META_TAG):
                    works.append((pg.send([buf], ranks[n], tag), buf))
    assert local is not None
    teach(local)
    sends, recvs = plan.for_member(me)
    # Receives first: the wire starts for each message as soon as both sides posted it. Taken as
    # made ready ahead (`incoming`, by a member that held nothing, while the group formed) when the
    # plan is the one foreseen, else cut here (`expect`).
    if incoming is not None and incoming.serves(recvs, local):
        incoming.used = True
    else:
        if incoming is not None:
            incoming.give_back(pool)
        incoming = expect(recvs, local, pool, device)
    for turn in zip_longest(*incoming.posts):
        works += [(pg.recv([buf], ranks[peer], tag), buf) for peer, tag, buf in filter(None, turn)]
    received += incoming.received
    if meta is not None:  # the whole-state part: its tensors are views of `bufs`, filled as they arrive
        bufs = packing.empty_buffers(meta, torch.device("cpu"))
        for tag, buf in enumerate(bufs, start=META_TAG):
            works.append((pg.recv([buf], ranks[sender], tag), buf))
        received += len(whole) + sum(b.numel() * b.element_size() for b in bufs)
        # (only the parts that hold tensors are walked: the keys and dtypes are plain data, read above)
        tensors = packing.unpack({**meta, "skeleton": {k: structure[k] for k in ("scalars", "hyper", "buffers")}}, bufs)
        local.scalars, local.hyper, local.buffers = dict(tensors["scalars"]), list(tensors["hyper"]), dict(tensors["buffers"])
    arriving = incoming.land()  # (where each item lands, worked out while the first messages arrive)
    # Both sides cut and number a pair's messages alike, from the plan. Packed ahead (`outgoing`,
    # while the group formed) when the plan is the one foreseen; else each message is packed here and
    # posted at once (the wire carries the last while the next is packed).
    if outgoing is not None and outgoing.serves(sends, local.step):
        outgoing.used = True
        works += [(pg.send([out], ranks[peer], tag), out) for peer, tag, out in outgoing.messages]
    else:
        if outgoing is not None:
            outgoing.messages.clear()  # (another plan: its memory goes before this one's is packed)
        for peer, tag, out in _outgoing(local, sends):
            works.append((pg.send([out], ranks[peer], tag), out))
    # The new state while the data is on the wire: views of what arrives and of what is held.
    made = (incoming.assembled if not local.pieces  # (a member that held nothing)
            else outgoing.assembled if outgoing is not None and outgoing.used and not recvs else None)  # (a holder)
    new = (made.state.with_whole(local) if made is not None and made.serves(needed)
           else _assemble(local, needed, recvs, arriving, device))
    wait(AllOf(works), None)
    # Delivered: a member that received tells each peer it received from, and one that sent waits
    # to hear it from each peer it sent to, rather than build its executor beside a peer still
    # receiving. On a host whose cores they share, that work stalls the newcomer's last messages
    # (a 10M GPT join's receive of 43 MB takes half as long again). A receiver's notes are 4-byte
    # sends: it waits for nothing more.
    received_from = {t.src for t in recvs if t.hi > t.lo} | ({sender} if meta is not None else set())
    sent_to = {t.dst for t in sends if t.hi > t.lo} | set(behind)
    notes: list[tuple[Any, torch.Tensor]] = []
    for peer in sorted(received_from):
        note = torch.ones(1, device=device)
        notes.append((pg.send([note], ranks[peer], DONE_TAG), note))
    for peer in sorted(sent_to):
        note = torch.zeros(1, device=device)
        notes.append((pg.recv([note], ranks[peer], DONE_TAG), note))
    if notes:
        wait(AllOf(notes), None)
    return new, received


@dataclass(slots=True)
class Incoming:
    """Where one member's receives of a reshard land (`expect`): what comes from one peer in one
    dtype lands in one fresh buffer (an *arena*), each message where its elements belong, so the new
    state's pieces are views of it: nothing to allocate a piece, nothing to unpack, and never a write
    into live state (an abandoned receive writes into a buffer nobody keeps).

    A member that holds nothing makes this ready while its group forms, from the plan it foresees
    (`worker.epoch.foresee`) and the keys and dtypes the graph recorded, with the new state's
    pieces (`assembled`); `execute` takes it only when the plan it runs gives this member exactly
    these receives, in these keys and dtypes, and else gives the arenas back to the pool."""

    recvs: tuple[Transfer, ...]
    keys: dict[str, tuple[str, ...]]
    dtypes: dict[str, dict[str, str]]
    posts: list[list[tuple[str, int, torch.Tensor]]]  # per peer, in order: (peer, tag, buffer)
    landing: list[tuple[torch.Tensor, list[Item]]]  # each message's buffer and its items
    received: int  # bytes
    pool_mark: int | None  # the pool's use before the arenas were cut from it (None: no pool)
    arriving: dict[Transfer, dict[str, torch.Tensor]] | None = None  # transfer -> companion -> its view
    assembled: Made | None = None  # the new state (`assemble`)
    used: bool = False  # `execute` took it (the plan was the one foreseen)

    def serves(self, recvs: Sequence[Transfer], local: LocalState) -> bool:
        return tuple(recvs) == self.recvs and local.keys == self.keys and local.dtypes == self.dtypes

    def land(self) -> dict[Transfer, dict[str, torch.Tensor]]:
        """Where each item lands: views of the messages' buffers (one `split` a message: slicing
        item by item cost 7 us an item)."""
        if self.arriving is None:
            self.arriving = defaultdict(dict)
            for buf, items in self.landing:
                for (t, key), view in zip(items, buf.split_with_sizes([t.elements for t, _ in items])):
                    self.arriving[t][key] = view
        return self.arriving

    def assemble(self, needed: Mapping[str, Sequence[Range]], device: torch.device) -> None:
        """The new state of a member that holds nothing: views of the arenas (see `_assemble`)."""
        self.assembled = Made.of(LocalState(step=0, keys=self.keys, dtypes=self.dtypes), needed, list(self.recvs),
                                 self.land(), device)

    def give_back(self, pool: Pool | None) -> None:
        """Not used: its arenas go back to the pool (no receive was posted into them)."""
        if pool is not None and self.pool_mark is not None:
            pool.used = self.pool_mark


def expect(recvs: Sequence[Transfer], local: LocalState, pool: Pool | None, device: torch.device) -> Incoming:
    """Cut the arenas and the messages for `recvs` (see `Incoming`); `local` gives the keys and dtypes.
    The receives are posted taking the peers in turn, a message of each at a time: gloo reads a
    message whose data is already there in the posting call itself, so posting one peer's messages
    all first would keep the others' streams waiting (a 10M GPT join from two holders is about 15%
    faster in turn)."""
    posts: list[list[tuple[str, int, torch.Tensor]]] = []
    landing: list[tuple[torch.Tensor, list[Item]]] = []
    received = 0
    mark = pool.used if pool is not None else None
    for peer, transfers in _by_peer(list(recvs), lambda t: t.src).items():
        messages = [(dtype, items, sum(t.elements for t, _ in items)) for dtype, items in _messages(local, transfers)]
        sizes: dict[torch.dtype, int] = defaultdict(int)
        for dtype, _, count in messages:
            sizes[dtype] += count
        arenas = {dtype: _arena(pool, size, dtype, device) for dtype, size in sizes.items()}
        at: dict[torch.dtype, int] = defaultdict(int)
        posts.append([])
        for tag, (dtype, items, count) in enumerate(messages, start=DATA_TAG):
            buf = arenas[dtype][at[dtype]:at[dtype] + count]
            at[dtype] += count
            posts[-1].append((peer, tag, buf))
            landing.append((buf, items))
            received += buf.numel() * buf.element_size()
    return Incoming(tuple(recvs), dict(local.keys), dict(local.dtypes), posts, landing, received, mark)


@dataclass(slots=True)
class Outgoing:
    """A sender's data messages of one reshard, packed before the reshard starts (`pack_sends`,
    while the new group forms) from the plan the sender foresees. `execute` sends them only when the
    plan it runs gives this member exactly these transfers at this step; else it packs afresh.

    Why ahead: packing is a copy of every small item a sender sends (a 10M GPT join: 21 MB from
    each of two senders), on the same cores as the wire; forming the group leaves those cores idle
    (it waits on the store and on TCP handshakes)."""

    sends: tuple[Transfer, ...]
    step: int
    messages: list[tuple[str, int, torch.Tensor]]  # (peer, tag, what is sent)
    used: bool = False  # `execute` sent them (the plan was the one foreseen)
    assembled: Made | None = None  # the sender's new state, when it receives nothing (`pack_sends`)

    def serves(self, sends: Sequence[Transfer], step: int) -> bool:
        return step == self.step and tuple(sends) == self.sends


def pack_sends(plan: ReshardPlan, me: str, local: LocalState, needed: Mapping[str, Sequence[Range]] | None = None,
               device: torch.device | None = None) -> Outgoing:
    """`me`'s data messages of `plan`, packed from `local` (which must not change before they are
    sent); and, given the ranges it will hold (`needed`) where it receives nothing (a join's
    holders), its new state too: views of what it holds."""
    sends, recvs = plan.for_member(me)
    out = Outgoing(tuple(sends), local.step, list(_outgoing(local, sends)))
    if needed is not None and not recvs and not plan.missing:
        out.assembled = Made.of(local, needed, [], {}, device or torch.device("cpu"))
    return out


@dataclass(frozen=True, slots=True)
class Made:
    """A member's new state made ahead of its reshard (views of arenas, or of what it holds), for
    exactly the ranges `needed`: `execute` takes it where the plan needs the same of this member."""

    state: LocalState
    needed: dict[str, list[Range]]

    @staticmethod
    def of(local: LocalState, needed: Mapping[str, Sequence[Range]], recvs: Sequence[Transfer],
           arriving: Mapping[Transfer, dict[str, torch.Tensor]], device: torch.device) -> Made:
        return Made(_assemble(local, needed, recvs, arriving, device), {k: list(v) for k, v in needed.items()})

    def serves(self, needed: Mapping[str, Sequence[Range]]) -> bool:
        return self.needed == needed


def _outgoing(local: LocalState, sends: Sequence[Transfer]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(peer, tag, message) of each data message `sends` make, in order, one at a time: a message of
    one item is a view of what is held (no packing copy), the others are packed."""
    for peer, transfers in _by_peer(list(sends), lambda t: t.dst).items():
        for tag, (_, items) in enumerate(_messages(local, transfers), start=DATA_TAG):
            yield peer, tag, (local.read_transfer(items[0][1], items[0][0])
                              if len(items) == 1 else torch.cat([local.read_transfer(key, t) for t, key in items]))


ALIGN = 64  # bytes: an arena cut from a pool starts where a fresh allocation would (c10's CPU alignment)


class Pool:
    """Memory a member that holds nothing makes ready for what it will receive before the reshard
    (while it waits for the group to form), so that the transfers land in pages already faulted in.
    A fresh page costs a fault and a zeroing on first write: a 10M GPT join into fresh memory (43 MB,
    10,500 pages) takes several times as long as the wire itself. The arenas are cut from it in
    order; what does not fit is allocated as usual.

    Only a member that holds nothing gets one (`worker.trainer`): its wait for the group is the
    members' step boundary (or, when they abandon their step, 50-90 ms), which hides the touching.
    A member that holds state forms its group at once; touching what it will receive there costs
    more than it saves (a drain's entry gets slower)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.used = 0

    @staticmethod
    def for_slices(ranges: Mapping[str, Sequence[Range]], itemsize: Mapping[str, int], state_factor: float,
                   device: torch.device) -> Pool:
        """A pool for `ranges` of every tensor (fqn -> element ranges): the parameters' bytes
        (`itemsize` per fqn) and the optimizer state's (`state_factor` times those: the graph's
        `optimizer_state_factor`)."""
        param_bytes = sum(itemsize[fqn] * (hi - lo) for fqn, rs in ranges.items() for lo, hi in rs)
        return Pool(round(param_bytes * (1 + state_factor)), device)

    def touch(self) -> None:
        """Fault every page in (a write each; run it off the critical path, e.g. in a thread while
        the group forms: torch releases the GIL while it writes)."""
        self.block.fill_(0)

    def take(self, count: int, dtype: torch.dtype) -> torch.Tensor | None:
        start = -(-self.used // ALIGN) * ALIGN
        end = start + count * dtype.itemsize
        if end > self.block.numel():
            return None
        self.used = end
        return self.block[start:end].view(dtype)


def _arena(pool: Pool | None, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    taken = pool.take(count, dtype) if pool is not None and pool.block.device == device else None
    return taken if taken is not None else torch.empty(count, dtype=dtype, device=device)


def _by_peer(transfers: list[Transfer], peer: Callable[[Transfer], str]) -> dict[str, list[Transfer]]:
    out: dict[str, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[peer(t)].append(t)
    return dict(out)


def _messages(local: LocalState, transfers: list[Transfer]) -> list[tuple[torch.dtype, list[Item]]]:
    """The messages of one pair, in order: for each dtype (in dtype-name order), the pair's items
    (each companion of each transfer, in the plan's order) cut into messages of about `MESSAGE`
    bytes; an item of `MESSAGE` or more is a message of its own."""
    by_dtype: dict[torch.dtype, list[tuple[Item, int]]] = {}
    for t in transfers:
        elements = t.elements
        if elements:
            names = local.dtypes[t.tensor]
            for key in local.keys[t.tensor]:
                by_dtype.setdefault(_dtype(names[key]), []).append(((t, key), elements))
    out: list[tuple[torch.dtype, list[Item]]] = []
    for dtype in sorted(by_dtype, key=str):
        group: list[Item] = []
        size = 0
        for item, elements in by_dtype[dtype]:
            n = elements * dtype.itemsize
            if n >= MESSAGE:
                out.append((dtype, [item]))
                continue
            group.append(item)
            size += n
            if size >= MESSAGE:
                out.append((dtype, group))
                group, size = [], 0
        if group:
            out.append((dtype, group))
    return out


def _assemble(local: LocalState, needed: Mapping[str, Sequence[Range]], recvs: Sequence[Transfer],
              arriving: Mapping[Transfer, dict[str, torch.Tensor]], device: torch.device) -> LocalState:
    """The new state: exactly the `needed` ranges, each as pieces that are views, of the arenas where
    a range arrives and of the held pieces elsewhere (cut where the source changes; nothing copied).
    A tensor's arrivals (a strided transfer's rows each) and held pieces are each disjoint and
    sorted: each range finds its own by bisection (a row-wise tp split needs a range per row, and as
    many arrive: a scan per range was quadratic, seconds for a small model)."""
    out = LocalState(step=local.step, keys=local.keys, dtypes=local.dtypes, scalars=local.scalars, hyper=local.hyper,
                     buffers=local.buffers)
    incoming: dict[str, list[Piece]] = defaultdict(list)
    for t in recvs:
        incoming[t.tensor].extend(_rows(t, arriving[t]))
    for fqn, ranges in needed.items():
        keys = local.keys[fqn]
        here = sorted(incoming.get(fqn, []), key=_start)
        here_lo = [t.lo for t in here]
        held = _disjoint(sorted(local.pieces.get(fqn, []), key=_start))
        held_lo = [h.lo for h in held]
        pieces: list[Piece] = []
        for lo, hi in ranges:
            if hi <= lo:
                continue
            parts: list[Piece] = []
            covered: list[Range] = []
            for t in _overlapping(here, here_lo, lo, hi):
                a, b = max(lo, t.lo), min(hi, t.hi)
                covered.append((a, b))
                parts.append(t if a == t.lo and b == t.hi else _cut(t, a, b, keys))
            for gap_lo, gap_hi in _gaps(lo, hi, covered):  # (what did not arrive comes from what is held)
                for h in _overlapping(held, held_lo, gap_lo, gap_hi):
                    a, b = max(gap_lo, h.lo), min(gap_hi, h.hi)
                    if a == h.lo and b == h.hi and h.data[keys[0]].device == device:  # (a fresh piece: never shared)
                        parts.append(Piece(a, b, {k: h.data[k] for k in keys}))
                    else:
                        parts.append(Piece(a, b, {k: h.data[k][a - h.lo:b - h.lo].to(device) for k in keys}))
            parts.sort(key=_start)
            if sum(p.hi - p.lo for p in parts) != hi - lo:
                raise KeyError(f"{fqn}[{lo}:{hi}] is needed here but neither held nor received "
                               f"(held: {[(p.lo, p.hi) for p in held]}, received: {[(t.lo, t.hi) for t in here]})")
            pieces.extend(parts)
        out.pieces[fqn] = pieces
    return out


def _rows(t: Transfer, data: Mapping[str, torch.Tensor]) -> list[Piece]:
    """What transfer `t` brought (`data`: companion -> its elements, flat), a piece per range."""
    if t.count == 1:
        return [Piece(t.lo, t.hi, dict(data))]
    rows = {k: v.view(t.count, t.hi - t.lo).unbind(0) for k, v in data.items()}  # (one call for every row)
    return [Piece(lo, hi, {k: v[i] for k, v in rows.items()}) for i, (lo, hi) in enumerate(t.ranges())]


def _cut(p: Piece, a: int, b: int, keys: Iterable[str]) -> Piece:
    return Piece(a, b, {k: p.data[k][a - p.lo:b - p.lo] for k in keys})


def _gaps(lo: int, hi: int, covered: Sequence[Range]) -> Iterator[Range]:
    """The parts of [lo, hi) that none of `covered` (sorted, disjoint, inside it) covers."""
    at = lo
    for a, b in covered:
        if a > at:
            yield at, a
        at = max(at, b)
    if at < hi:
        yield at, hi


def _overlapping(spans: Sequence[Any], starts: Sequence[int], lo: int, hi: int) -> Iterator[Any]:
    """Those of `spans` (disjoint, sorted by `.lo`; `starts` their `.lo`s) that overlap [lo, hi)."""
    i = max(bisect_right(starts, lo) - 1, 0)
    while i < len(spans) and spans[i].lo < hi:
        if spans[i].hi > lo:
            yield spans[i]
        i += 1


def _disjoint(pieces: list[Piece]) -> list[Piece]:
    """Sorted pieces with overlaps trimmed (a received piece never overlaps a held one; held pieces
    may overlap when a member kept a copy of a range it also owns)."""
    out: list[Piece] = []
    for p in pieces:
        if out and p.lo < out[-1].hi:
            if p.hi <= out[-1].hi:
                continue
            cut = out[-1].hi - p.lo
            p = Piece(out[-1].hi, p.hi, {k: v[cut:] for k, v in p.data.items()})
        out.append(p)
    return out
