"""What one member holds of the training state between epochs, as slices of flattened tensors, and the
execution of a reshard plan (`plan.reshard`) over point-to-point ops in the new epoch's group.

`LocalState` is the layout-free form of a member's state: for every parameter (by fully qualified
name), the element ranges it holds of the flattened parameter and of every optimizer-state tensor
shaped like it (Adam's two moments: the *companions*), plus what every holder has whole: the step,
the optimizer's other per-parameter state (Adam's `step`), its hyper-parameters, and the module's
buffers. An executor (`worker.parallel.replicated`, `worker.parallel.fsdp`) is built from a
LocalState and gives one back (`extract`), so any layout can follow any other.

`execute` runs the transfers of one member. A large message is one companion of one transfer, sent
from a view of what is held and received in place into the new state's fresh buffers (no copy to
pack or to assemble); the small ones travel packed, one message a peer and dtype. The transfer list
is sorted the same everywhere, so both sides number a pair's messages alike. All sends and receives
are posted before any is waited for (no ordering deadlock), and each wait goes through the caller's
abortable `wait`. A member that holds nothing (a newcomer) also receives the whole-state part's
tensors from the lowest-ranked holder, in the same round; their structure (`skeleton`) reached it
before, in the description all-gather.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plan.reshard import Range, ReshardPlan, Transfer, subtract
from worker import state as packing
from worker.comm import AllOf

PARAM = "param"  # the companion key of the parameter itself
META_TAG, DATA_TAG = 1, 1 << 16  # p2p tags: the whole-state part's tensors, then the data
# Messages smaller than this travel packed (one a peer and dtype): each message has a fixed cost in
# gloo and in Python (posting a 10M GPT join's 232 took 3-24 ms), and 150 of those 232 are under 2 KB
# (biases, norms); packed, the join is ~85 messages and the copying a few hundred KB.
PACK_BELOW = 64 * 1024


@dataclass(slots=True)
class Piece:
    """Elements [lo, hi) of one flattened parameter: the parameter's and each companion's."""

    lo: int
    hi: int
    data: dict[str, torch.Tensor]  # companion key -> 1-D tensor of hi - lo elements


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

    def holdings(self) -> dict[str, list[Range]]:
        return {fqn: [(p.lo, p.hi) for p in pieces] for fqn, pieces in self.pieces.items() if pieces}

    def read(self, fqn: str, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of companion `key` of `fqn`, from the pieces that cover them."""
        parts = []
        at = lo
        for p in self.pieces.get(fqn, []):
            if p.hi <= at or p.lo >= hi:
                continue
            if p.lo > at:
                break
            end = min(p.hi, hi)
            parts.append(p.data[key][at - p.lo:end - p.lo])
            at = end
            if at == hi:
                break
        if at != hi:
            raise KeyError(f"{fqn}[{lo}:{hi}] ({key}) is not held here (held: {[(p.lo, p.hi) for p in self.pieces.get(fqn, [])]})")
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def whole(self) -> dict[str, Any]:
        """The part every holder has whole (what a newcomer receives first)."""
        return {"step": self.step, "keys": {k: list(v) for k, v in self.keys.items()}, "dtypes": self.dtypes,
                "scalars": self.scalars, "hyper": self.hyper, "buffers": self.buffers}

    @staticmethod
    def from_whole(whole: Mapping[str, Any]) -> LocalState:
        return LocalState(step=int(whole["step"]), keys={k: tuple(v) for k, v in whole["keys"].items()},
                          dtypes=dict(whole["dtypes"]), scalars=dict(whole["scalars"]), hyper=list(whole["hyper"]),
                          buffers=dict(whole["buffers"]))

    def dtype(self, fqn: str, key: str) -> torch.dtype:
        return getattr(torch, self.dtypes[fqn][key])  # type: ignore[no-any-return]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pieces in self.pieces.values() for p in pieces
                   for t in p.data.values())


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


# --- executing a reshard ---------------------------------------------------------------------------------


def skeleton(local: LocalState) -> bytes:
    """The whole-state part's structure (keys, dtypes, hyper-parameters, tensor shapes), what a
    member without state needs before it can receive anything; its tensors follow in `execute`."""
    return bytes(packing.pack(local.whole(), torch.device("cpu")).skeleton.numpy())


def execute(plan: ReshardPlan, me: str, ranks: Mapping[str, int], local: LocalState | None,
            needed: Mapping[str, Sequence[Range]], holders: Sequence[str], pg: Any,
            wait: Callable[[Any, torch.Tensor | None], None], device: torch.device,
            whole: bytes = b"", sender: str | None = None) -> tuple[LocalState, int]:
    """Run `me`'s part of `plan`; returns the new LocalState (exactly the ranges `needed`) and the
    bytes received. `holders`: the members whose state is current; `sender` (default: the
    lowest-ranked holder) sends the whole-state part's tensors to the others; `local`: this member's
    state, None if it has none; `whole`: the sender's `skeleton`, which a member without state needs
    (every member learns it in the description all-gather before, so its receives go out with the
    data's)."""
    received = 0
    sender = sender or min(holders, key=lambda n: ranks[n])
    works: list[tuple[Any, torch.Tensor]] = []
    if local is None or me not in holders:
        if not whole:
            raise ValueError(f"{me} holds no current state and was not given the holders' skeleton")
        meta = packing.read_meta(torch.frombuffer(bytearray(whole), dtype=torch.uint8))
        bufs = packing.empty_buffers(meta, torch.device("cpu"))
        for tag, buf in enumerate(bufs, start=META_TAG):
            works.append((pg.recv([buf], ranks[sender], tag), buf))
        received += len(whole) + sum(b.numel() * b.element_size() for b in bufs)
        # What this member held is stale: it keeps nothing of it. The tensors of the whole-state
        # part are views of `bufs`, filled when their receives complete.
        local = LocalState.from_whole(packing.unpack(meta, bufs))
    elif me == sender:
        behind = sorted((n for n in ranks if n not in holders), key=lambda n: ranks[n])
        if behind:
            packed = packing.pack(local.whole(), torch.device("cpu"))
            for n in behind:
                for tag, buf in enumerate(packed.buffers, start=META_TAG):
                    works.append((pg.send([buf], ranks[n], tag), buf))
    assert local is not None
    sends, recvs = plan.for_member(me)
    incoming = _ranges(recvs)
    new, fresh = _allocate(local, needed, incoming, device)
    # A large message is one companion of one transfer: a view of what is held (sent as it lies, no
    # packing copy) or of where it belongs in the new state (received in place into a fresh buffer,
    # never into live state, so an abandoned receive writes nowhere that matters). The small ones
    # (biases, norms: most of a model's tensors, a sliver of its bytes) travel packed, one message
    # a peer and dtype, unpacked once every receive is done. Both sides number a pair's messages
    # alike, from the plan's order.
    for peer, transfers in _by_peer(sends, lambda t: t.dst).items():
        direct, small = _messages(local, transfers)
        for tag, (t, key) in enumerate(direct, start=DATA_TAG):
            out = local.read(t.tensor, key, t.lo, t.hi)
            works.append((pg.send([out], ranks[peer], tag), out))
        for tag, group in enumerate(small.values(), start=DATA_TAG + len(direct)):
            out = torch.cat([local.read(t.tensor, key, t.lo, t.hi) for t, key in group])
            works.append((pg.send([out], ranks[peer], tag), out))
    unpack: list[tuple[torch.Tensor, list[tuple[Transfer, str]]]] = []
    for peer, transfers in _by_peer(recvs, lambda t: t.src).items():
        direct, small = _messages(local, transfers)
        for tag, (t, key) in enumerate(direct, start=DATA_TAG):
            buf = _view(new, t.tensor, key, t.lo, t.hi)
            works.append((pg.recv([buf], ranks[peer], tag), buf))
            received += buf.numel() * buf.element_size()
        for tag, (dtype, group) in enumerate(small.items(), start=DATA_TAG + len(direct)):
            buf = torch.empty(sum(t.elements for t, _ in group), dtype=dtype, device=device)
            works.append((pg.recv([buf], ranks[peer], tag), buf))
            received += buf.numel() * buf.element_size()
            unpack.append((buf, group))
    wait(AllOf(works), None)
    for buf, group in unpack:  # one foreach copy a message (a copy_ each costs ~5 us, and there are hundreds)
        parts = torch.split(buf, [t.elements for t, _ in group])
        torch._foreach_copy_([_view(new, t.tensor, key, t.lo, t.hi) for t, key in group], list(parts))
    # Local copies last: the peers wait on this member's messages, not on them.
    _fill_held(local, fresh, incoming)
    return new, received


def _by_peer(transfers: list[Transfer], peer: Callable[[Transfer], str]) -> dict[str, list[Transfer]]:
    out: dict[str, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[peer(t)].append(t)
    return dict(out)


def _messages(local: LocalState, transfers: list[Transfer]
              ) -> tuple[list[tuple[Transfer, str]], dict[torch.dtype, list[tuple[Transfer, str]]]]:
    """The messages of one pair, in the plan's order: each large companion of a transfer on its own,
    and the small ones grouped by dtype (in dtype-name order), each group one packed message."""
    direct: list[tuple[Transfer, str]] = []
    packed: dict[torch.dtype, list[tuple[Transfer, str]]] = {}
    for t in transfers:
        for key in local.keys[t.tensor] if t.elements else ():
            dtype = local.dtype(t.tensor, key)
            if t.elements * dtype.itemsize >= PACK_BELOW:
                direct.append((t, key))
            else:
                packed.setdefault(dtype, []).append((t, key))
    return direct, {d: packed[d] for d in sorted(packed, key=str)}


def _ranges(transfers: Sequence[Transfer]) -> dict[str, list[Range]]:
    out: dict[str, list[Range]] = defaultdict(list)
    for t in transfers:
        out[t.tensor].append((t.lo, t.hi))
    return dict(out)


def _allocate(local: LocalState, needed: Mapping[str, Sequence[Range]], incoming: Mapping[str, list[Range]],
              device: torch.device) -> tuple[LocalState, list[tuple[str, Piece]]]:
    """The new state's pieces, exactly the `needed` ranges, and those of them that are fresh buffers.
    A range that one held piece covers and nothing arrives for is that piece's view (no copy); any
    other is a fresh buffer, filled by the receives and `_fill_held`."""
    out = LocalState(step=local.step, keys=local.keys, dtypes=local.dtypes, scalars=local.scalars, hyper=local.hyper,
                     buffers=local.buffers)
    fresh: list[tuple[str, Piece]] = []
    for fqn, ranges in needed.items():
        out.pieces[fqn] = []
        for lo, hi in ranges:
            if hi <= lo:
                continue
            held = _covering(local.pieces.get(fqn, []), lo, hi)
            if held is not None and not any(a < hi and lo < b for a, b in incoming.get(fqn, [])):
                piece = Piece(lo, hi, {k: v[lo - held.lo:hi - held.lo].to(device) for k, v in held.data.items()})
            else:
                piece = Piece(lo, hi, {k: torch.empty(hi - lo, dtype=local.dtype(fqn, k), device=device)
                                       for k in local.keys[fqn]})
                fresh.append((fqn, piece))
            out.pieces[fqn].append(piece)
    return out, fresh


def _covering(pieces: Sequence[Piece], lo: int, hi: int) -> Piece | None:
    return next((p for p in pieces if p.lo <= lo and hi <= p.hi), None)


def _view(state: LocalState, fqn: str, key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `fqn`'s companion `key` inside the one new piece that holds them."""
    piece = _covering(state.pieces[fqn], lo, hi)
    if piece is None:
        raise KeyError(f"{fqn}[{lo}:{hi}] is received but lies in no needed range")
    return piece.data[key][lo - piece.lo:hi - piece.lo]


def _fill_held(local: LocalState, fresh: list[tuple[str, Piece]], incoming: Mapping[str, list[Range]]) -> None:
    """Copy into the fresh pieces what this member held of them (every part not received)."""
    for fqn, piece in fresh:
        for h in _disjoint(sorted(local.pieces.get(fqn, []), key=lambda p: p.lo)):
            for a, b in subtract([(max(piece.lo, h.lo), min(piece.hi, h.hi))], incoming.get(fqn, [])):
                for key, dst in piece.data.items():
                    dst[a - piece.lo:b - piece.lo].copy_(h.data[key][a - h.lo:b - h.lo])


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
