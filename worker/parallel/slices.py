"""What one member holds of the training state between epochs, as slices of flattened tensors, and the
execution of a reshard plan (`plan.reshard`) over point-to-point ops in the new epoch's group.

`LocalState` is the layout-free form of a member's state: for every parameter (by fully qualified
name), the element ranges it holds of the flattened parameter and of every optimizer-state tensor
shaped like it (Adam's two moments: the *companions*), plus what every holder has whole: the step,
the optimizer's other per-parameter state (Adam's `step`), its hyper-parameters, and the module's
buffers. An executor (`worker.parallel.replicated`, `worker.parallel.fsdp`) is built from a
LocalState and gives one back (`extract`), so any layout can follow any other.

`execute` runs the transfers of one member: every pair of members exchanges one flat buffer per
dtype (the transfer list is sorted the same everywhere, so both sides know the buffer's layout), all
sends and receives are posted before any is waited for (no ordering deadlock), and each wait goes
through the caller's abortable `wait`. A member that holds nothing (a newcomer) first receives the
whole-state part from the lowest-ranked holder, as a small `worker.state` skeleton.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plan.reshard import Range, ReshardPlan, Transfer
from worker import state as packing

PARAM = "param"  # the companion key of the parameter itself
META_TAG, DATA_TAG = 1, 8  # p2p tags: the whole-state skeleton (size, bytes), then one per dtype


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


def execute(plan: ReshardPlan, me: str, ranks: Mapping[str, int], local: LocalState | None,
            needed: Mapping[str, Sequence[Range]], holders: Sequence[str], pg: Any,
            wait: Callable[[Any, torch.Tensor | None], None], device: torch.device) -> tuple[LocalState, int]:
    """Run `me`'s part of `plan`; returns the new LocalState (exactly the ranges `needed`) and the
    bytes received. `holders`: the members whose state is current (they send the whole-state part to
    the others, the lowest-ranked one doing it); `local`: this member's state, None if it has none."""
    received = 0
    sender = min(holders, key=lambda n: ranks[n])
    if local is None or me not in holders:
        size = torch.zeros(1, dtype=torch.int64)
        wait(pg.recv([size], ranks[sender], META_TAG), None)
        skeleton = torch.empty(int(size.item()), dtype=torch.uint8)
        wait(pg.recv([skeleton], ranks[sender], META_TAG + 1), None)
        meta = packing.read_meta(skeleton)
        received += int(size.item())
        bufs = packing.empty_buffers(meta, torch.device("cpu"))
        for tag, buf in enumerate(bufs, start=META_TAG + 2):
            wait(pg.recv([buf], ranks[sender], tag), None)
            received += buf.numel() * buf.element_size()
        whole = packing.unpack(meta, bufs)
        local = LocalState.from_whole(whole)  # what this member held is stale: it keeps nothing of it
    elif me == sender:
        behind = sorted((n for n in ranks if n not in holders), key=lambda n: ranks[n])
        if behind:
            packed = packing.pack(local.whole(), torch.device("cpu"))
            size = torch.tensor([packed.skeleton.numel()], dtype=torch.int64)
            for n in behind:
                wait(pg.send([size], ranks[n], META_TAG), None)
                wait(pg.send([packed.skeleton], ranks[n], META_TAG + 1), None)
                for tag, buf in enumerate(packed.buffers, start=META_TAG + 2):
                    wait(pg.send([buf], ranks[n], tag), None)
    assert local is not None
    sends, recvs = plan.for_member(me)
    dtypes = _dtypes(local)
    works: list[tuple[Any, torch.Tensor]] = []
    for peer, transfers in _by_peer(sends, lambda t: t.dst).items():
        for d, buf in enumerate(_pack(local, transfers, dtypes)):
            works.append((pg.send([buf], ranks[peer], DATA_TAG + d), buf))
    inbox: dict[str, list[torch.Tensor]] = {}
    for peer, transfers in _by_peer(recvs, lambda t: t.src).items():
        inbox[peer] = [torch.empty(n, dtype=dt, device=device) for dt, n in zip(dtypes, _sizes(local, transfers, dtypes))]
        for d, buf in enumerate(inbox[peer]):
            if buf.numel():
                works.append((pg.recv([buf], ranks[peer], DATA_TAG + d), buf))
    for work, buf in works:
        wait(work, buf)
    arrived = _unpack(local, recvs, inbox, dtypes)
    received += sum(t.numel() * t.element_size() for bufs in inbox.values() for t in bufs)
    return _assemble(local, needed, arrived, device), received


def _dtypes(local: LocalState) -> list[torch.dtype]:
    """Every companion's dtype, in one order every member derives alike (from the whole-state part)."""
    return sorted({getattr(torch, name) for per in local.dtypes.values() for name in per.values()}, key=str)


def _by_peer(transfers: list[Transfer], peer: Callable[[Transfer], str]) -> dict[str, list[Transfer]]:
    out: dict[str, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[peer(t)].append(t)
    return dict(out)


def _sizes(local: LocalState, transfers: list[Transfer], dtypes: list[torch.dtype]) -> list[int]:
    sizes = [0] * len(dtypes)
    for t in transfers:
        for key in local.keys[t.tensor]:
            sizes[dtypes.index(local.dtype(t.tensor, key))] += t.elements
    return sizes


def _pack(local: LocalState, transfers: list[Transfer], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    parts: list[list[torch.Tensor]] = [[] for _ in dtypes]
    for t in transfers:
        for key in local.keys[t.tensor]:
            chunk = local.read(t.tensor, key, t.lo, t.hi)
            parts[dtypes.index(chunk.dtype)].append(chunk)
    return [torch.cat(p) if p else torch.empty(0, dtype=dt) for p, dt in zip(parts, dtypes)]


def _unpack(local: LocalState, transfers: list[Transfer], inbox: Mapping[str, list[torch.Tensor]],
            dtypes: list[torch.dtype]) -> dict[str, list[Piece]]:
    offsets: dict[tuple[str, int], int] = defaultdict(int)
    out: dict[str, list[Piece]] = defaultdict(list)
    for t in transfers:
        data = {}
        for key in local.keys[t.tensor]:
            d = dtypes.index(local.dtype(t.tensor, key))
            at = offsets[(t.src, d)]
            data[key] = inbox[t.src][d][at:at + t.elements]
            offsets[(t.src, d)] = at + t.elements
        out[t.tensor].append(Piece(t.lo, t.hi, data))
    return out


def _assemble(local: LocalState, needed: Mapping[str, Sequence[Range]], arrived: Mapping[str, list[Piece]],
              device: torch.device) -> LocalState:
    """The new state: exactly the `needed` ranges, from what was held and what arrived."""
    out = LocalState(step=local.step, keys=local.keys, dtypes=local.dtypes, scalars=local.scalars, hyper=local.hyper,
                     buffers=local.buffers)
    for fqn, ranges in needed.items():
        sources = sorted([*local.pieces.get(fqn, []), *arrived.get(fqn, [])], key=lambda p: p.lo)
        both = LocalState(step=0, keys=local.keys, dtypes=local.dtypes, pieces={fqn: _disjoint(sources)})
        out.pieces[fqn] = []
        for lo, hi in ranges:
            if hi <= lo:
                continue
            data = {}
            for key in local.keys[fqn]:
                chunk = both.read(fqn, key, lo, hi)
                data[key] = chunk if chunk.device == device else chunk.to(device)
            out.pieces[fqn].append(Piece(lo, hi, data))
    return out


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
