"""Entering an epoch: bringing every member to one consistent step, in either of two ways.

Replicated to replicated (`reconcile`, the fast path): the model stays where it is. The members
all-reduce their step counters; the lowest rank with the most steps sends its whole state (model,
optimizer, step: `worker.state`, a skeleton and one flat buffer per dtype) to every rank that is
behind, new or stale, so all continue from one step: no step is lost or applied twice.

Any epoch with sharded state on either side (`enter`): who holds what, and the reshard into the new
layout. Every member states what it holds (its step, the element ranges of every parameter it has
and the structure of its whole-state part, or nothing: a newcomer, a fenced worker), in two
all-gathers over the epoch's raw group (sizes, then the padded descriptions). The holders are the
members at the highest step (one that fell a step behind, or was fenced, holds nothing current).
From that, every member derives the same transfer list (`plan.reshard.plan_reshard`: the new
layout's slices, each needed byte once, sources balanced), and runs its part of it
(`worker.parallel.slices.execute`). State that no holder has is `StateLost`: the worker tells the
coordinator, which stops the job naming it; nothing trains on made-up state. The usual planned
change is foreseen before the group forms (`foresee`: every member of the layout being left still
holds its slices), so that the packing and cutting of the transfers is done while it forms; what
the descriptions say decides, and `slices.execute` uses that work only where it is this plan's.

Why all-gather rather than the coordinator's word: after an abandoned epoch the members may hold
different layouts (a failure can strike mid-reshard, when some members assembled their new slices
and others still hold the old ones); what each one says it holds is the only ground truth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from plan.layout import Layout
from plan.reshard import Holdings, ReshardPlan, TensorShape, copy_ring, holdings, plan_reshard, row_lengths, union
from worker import state
from worker.parallel import slices
from worker.parallel.slices import LocalState

Wait = Callable[[Any, torch.Tensor | None], None]


class StateLost(RuntimeError):
    """Slices of the training state that no member holds any more (named in the message)."""


def describe(tensors: Sequence[TensorShape], local: LocalState | None,
             packed: state.Packed | None = None) -> torch.Tensor:
    """int64 [step, pending, n, the n bytes of the whole-state skeleton packed 8 to a word, then per
    tensor (in `tensors` order): n, lo1, hi1, ..., lo_n, hi_n]; step -1: nothing; pending 1: the
    gradients of step + 1 are held, not applied. `packed`: `local`'s `slices.pack_whole`, when
    already made."""
    if local is None:
        return torch.tensor([-1, 0, 0], dtype=torch.int64)
    whole = bytes((packed if packed is not None else slices.pack_whole(local)).skeleton.numpy())
    words = torch.frombuffer(bytearray(whole + bytes(-len(whole) % 8)), dtype=torch.int64)
    out = [local.step, int(local.pending), len(whole)]
    held = local.holdings()
    for t in tensors:
        ranges = held.get(t.name, [])
        out.append(len(ranges))
        for lo, hi in ranges:
            out += [lo, hi]
    return torch.cat([torch.tensor(out[:3], dtype=torch.int64), words, torch.tensor(out[3:], dtype=torch.int64)])


def read(tensors: Sequence[TensorShape], data: list[int]) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    step = data[0]
    if step < 0:
        return step, {}
    out: dict[str, list[tuple[int, int]]] = {}
    at = 3 + -(-data[2] // 8)
    for t in tensors:
        n = data[at]
        at += 1
        ranges = [(data[at + 2 * i], data[at + 2 * i + 1]) for i in range(n)]
        at += 2 * n
        if ranges:
            out[t.name] = ranges
    return step, out


def skeleton(data: list[int]) -> bytes:
    """The whole-state skeleton a description carries (b"" for a member with nothing)."""
    n = data[2]
    return torch.tensor(data[3:3 + -(-n // 8)], dtype=torch.int64).numpy().tobytes()[:n]


def exchange(pg: Any, rank: int, world: int, mine: torch.Tensor, wait: Wait) -> list[list[int]]:
    """Every member's description (see `describe`), by rank."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    wait(pg.allgather([sizes], [size]), None)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.int64)
    padded[:mine.numel()] = mine
    out = [torch.zeros(longest, dtype=torch.int64) for _ in range(world)]
    wait(pg.allgather([out], [padded]), None)
    return [o[:int(s.item())].tolist() for o, s in zip(out, sizes)]


def plan_entry(layout: Layout, tensors: Sequence[TensorShape], described: list[list[int]],
               ranks: Sequence[str]) -> tuple[int, list[str], Holdings, ReshardPlan]:
    """(step to continue from, holders, the new layout's holdings with its copies, the transfers);
    StateLost when some slice is held by nobody."""
    states = [read(tensors, d) for d in described]
    best = max(step for step, _ in states)
    holders = [ranks[r] for r, (step, _) in enumerate(states) if step == best and best >= 0]
    # (each member's ranges merged where they touch, as `holdings` has them: its own slices and the
    # copy it keeps are separate pieces, a row-wise split's a piece per row, yet one range to plan)
    before: Holdings = {ranks[r]: {t: union(ranges) for t, ranges in held.items()}
                        for r, (step, held) in enumerate(states) if ranks[r] in holders}
    after = holdings(layout, tensors, copy_ring(layout))  # (a layout that needs no copies has no ring)
    plan = _planned(before, after, tensors)
    if plan.missing:
        raise StateLost(f"no member holds {plan.describe_missing()} of step {best}")
    return best, holders, after, plan


def foresee(old: Layout, layout: Layout, tensors: Sequence[TensorShape],
            ranks: Sequence[str]) -> tuple[Holdings, ReshardPlan]:
    """The new layout's holdings and the transfers `enter` will run when every member of `old` in
    the new group (`ranks`) still holds its slices of `old` (and its copies), all at one step: the
    usual planned change, which every member foresees before the group forms, a holder to pack what
    it will send meanwhile (`slices.pack_sends`), a member that holds nothing to make its receives
    ready (`slices.expect`). Where the descriptions then say otherwise, `execute` does it afresh."""
    before = {n: h for n, h in holdings(old, tensors, copy_ring(old)).items() if n in ranks}
    after = holdings(layout, tensors, copy_ring(layout))  # (a layout that needs no copies has no ring)
    return after, _planned(before, after, tensors)


_last: list[tuple[Holdings, Holdings, ReshardPlan]] = []  # the last plan made (`_planned`)


def _planned(before: Holdings, after: Holdings, tensors: Sequence[TensorShape]) -> ReshardPlan:
    """`plan_reshard(before, after)`, the last one made reused when asked again for the same
    holdings: the entry's own plan is usually the one `foresee` made while the group formed (a tp
    layout's thousands of per-row transfers take a tenth of a second or more to plan)."""
    if _last and _last[0][0] == before and _last[0][1] == after:
        return _last[0][2]
    plan = plan_reshard(before, after, row_length=row_lengths(tensors))
    _last[:] = [(_copied(before), _copied(after), plan)]  # (copies: a caller may change its own later)
    return plan


def _copied(held: Holdings) -> Holdings:
    return {m: {t: list(ranges) for t, ranges in parts.items()} for m, parts in held.items()}


def enter(layout: Layout, tensors: Sequence[TensorShape], me: str, ranks: Sequence[str], local: LocalState | None,
          pg: Any, wait: Wait, device: torch.device, seed: Callable[[], LocalState],
          roll: Callable[[LocalState, float], None],
          before_transfers: Callable[[ReshardPlan], None] = lambda plan: None,
          pool: slices.Pool | None = None, outgoing: slices.Outgoing | None = None,
          incoming: slices.Incoming | None = None) -> tuple[LocalState, int, ReshardPlan]:
    """Run the reshard into `layout` for member `me` (ranks: the group's members by rank, `layout`'s
    members first); returns the new LocalState, the bytes received and the plan. When nobody holds
    any state (a fresh job, or one whose state was lost and restarts), every member takes the seeded
    state of step 0 (`seed`), which is the same everywhere.

    A step interrupted after every member had its gradients (its copy's too) but before all of them
    applied it: the members that applied it are one step ahead. Those behind roll it forward
    (`roll`, with the clipping coefficient broadcast by the lowest-ranked member ahead), so that all
    continue from the later step; when nobody applied it, the gradients are dropped and the step is
    done again. The new layout's copies (`plan.reshard.copy_ring`) are part of what each member
    needs. `pool`: memory made ready for what this member receives (`slices.Pool`); `outgoing`: what this
    member will send, packed ahead from the plan it foresaw (`foresee`, `slices.pack_sends`);
    `incoming`: where what it receives lands, made ready ahead likewise (`slices.expect`)."""
    rank = list(ranks).index(me)
    packed = slices.pack_whole(local) if local is not None else None  # (described, and sent if this is the root)
    described = exchange(pg, rank, len(ranks), describe(tensors, local, packed), wait)
    if all(d[0] < 0 for d in described):
        local = seed()
        packed = slices.pack_whole(local)
        described = [describe(tensors, local, packed).tolist()] * len(ranks)
    best = max(d[0] for d in described)
    ahead = [r for r, d in enumerate(described) if d[0] == best]
    behind = [r for r, d in enumerate(described) if d[0] == best - 1 and d[1]]
    # The lowest-ranked member at the newest step: it sends the whole-state part to those without
    # state (its skeleton is current; one rolled forward below described the step before).
    root = min(r for r, d in enumerate(described) if d[0] == best)
    if behind and best >= 1:  # someone applied the interrupted step: the others roll it forward
        coefficient = torch.tensor([local.coefficient if local is not None and rank == root else 0.0],
                                   dtype=torch.float64)
        wait(pg.broadcast(coefficient, root), None)
        if rank in behind and local is not None:
            roll(local, float(coefficient.item()))
            packed = None  # (not the root: the root is at the newest step)
            described[rank] = describe(tensors, local).tolist()
        for r in behind:
            described[r] = [best, 0, *described[r][2:]]
    if local is not None:
        _drop_pending(local)
    _, holders, after, plan = plan_entry(layout, tensors, described, ranks)
    mine = local if me in holders else None
    structure = Structure([described[r] for r in ahead])
    before_transfers(plan)  # (the --pause-at reshard knob: a source that dies with the transfers ahead)
    new, received = slices.execute(plan, me, {n: i for i, n in enumerate(ranks)}, mine, after.get(me, {}),
                                   holders, pg, wait, device, whole=skeleton(described[root]), sender=ranks[root],
                                   pool=pool, packed_whole=packed if rank == root else None, outgoing=outgoing,
                                   incoming=incoming, teach=structure.teach)
    structure.complete(new, mine)
    return new, received, plan


class Structure:
    """What the holders at the newest step say of every tensor, merged from their descriptions'
    skeletons: its companion keys, their dtypes, and its optimizer scalars (Adam's step count,
    inline in the skeleton: `worker.state`). `execute` takes the whole-state part from one member
    (the root); where no member holds every tensor (pipeline stages, each with a copy of one
    other), the rest comes from here: a member receiving a stage it never held learns its keys and
    dtypes before its receives are cut, and its scalars after."""

    def __init__(self, ahead: list[list[int]]) -> None:
        self.keys: dict[str, tuple[str, ...]] = {}
        self.dtypes: dict[str, dict[str, str]] = {}
        self.scalars: dict[str, dict[str, Any]] = {}
        for data in ahead:
            whole = state.read_meta(torch.frombuffer(bytearray(skeleton(data)), dtype=torch.uint8))["skeleton"]
            for fqn, keys in whole["keys"].items():
                self.keys.setdefault(fqn, tuple(keys))
                self.dtypes.setdefault(fqn, dict(whole["dtypes"][fqn]))
            for fqn, values in whole["scalars"].items():
                if values and not any(isinstance(v, state.TensorRef) for v in values.values()):
                    self.scalars.setdefault(fqn, values)

    def teach(self, local: LocalState) -> None:
        """`local` learns the keys and dtypes of the tensors it did not know (it holds none of them)."""
        for fqn, keys in self.keys.items():
            if fqn not in local.keys:
                local.keys[fqn], local.dtypes[fqn] = keys, self.dtypes[fqn]

    def complete(self, new: LocalState, mine: LocalState | None) -> None:
        """Every held tensor of `new` gets its optimizer scalars: this member's own where it had
        them, else a holder's."""
        for fqn in new.pieces:
            if new.scalars.get(fqn):
                continue
            known = (mine.scalars.get(fqn) if mine is not None else None) or self.scalars.get(fqn)
            if known:
                new.scalars[fqn] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in known.items()}


def reconcile(pg: Any, rank: int, world: int, step: int, whole: Callable[[], dict[str, Any]], wait: Wait,
              device: torch.device, *, restart: Callable[[], None],
              load: Callable[[dict[str, Any]], None]) -> tuple[int, int]:
    """All-reduce step counters (`step`: this rank's, -1 when it holds nothing current); the lowest
    rank with the most steps sends its state (`whole()`) to every rank that is behind (or new, or
    stale), which `load`s it; when nobody has state, this rank `restart`s from the seed. Returns
    (the bytes this rank received, the bytes it sent: the only sender is the largest)."""
    steps = torch.zeros(world, dtype=torch.float64, device=device)
    steps[rank] = step
    wait(pg.allreduce([steps]), None)
    counts = [int(s) for s in steps.tolist()]
    best = max(counts)
    if best < 0:  # nobody has state: start over from the seed
        restart()
        return 0, 0
    source = counts.index(best)
    behind = [r for r, s in enumerate(counts) if s < best]
    if rank == source and behind:
        packed = state.pack(whole(), device)
        size = torch.tensor([packed.skeleton.numel()], dtype=torch.int64, device=device)
        for r in behind:
            for tag, tensor in enumerate([size, packed.skeleton, *packed.buffers]):
                wait(pg.send([tensor], r, tag), None)
        return 0, state.nbytes(packed) * len(behind)  # the only sender
    if rank in behind:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        wait(pg.recv([size], source, 0), None)
        structure = torch.empty(int(size.item()), dtype=torch.uint8, device=device)  # the packed skeleton
        wait(pg.recv([structure], source, 1), None)
        meta = state.read_meta(structure)
        buffers = state.empty_buffers(meta, device)
        for tag, buf in enumerate(buffers, start=2):
            wait(pg.recv([buf], source, tag), None)
        # Unpack on the CPU: optimizers keep some state (Adam's step) there.
        load(state.unpack(meta, [b.cpu() for b in buffers]))
        return int(size.item()) + sum(b.numel() * b.element_size() for b in buffers), 0
    return 0, 0


def _drop_pending(local: LocalState) -> None:
    """Forget gradients that were not applied (or were just rolled forward)."""
    for pieces in local.pieces.values():
        for piece in pieces:
            piece.data.pop("grad", None)
    local.pending = False
