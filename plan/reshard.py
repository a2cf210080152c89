"""Live reshard by slice intersection: who sends which element range of which tensor to whom, so that
every member of a new epoch holds exactly what its layout gives it. Pure, torch-free.

State is described as *holdings*: member -> tensor -> element ranges [lo, hi) of the flattened
tensor. `holdings(layout, tensors, copies)` gives what a layout puts where (its slices, plus the
redundancy copies); the survivors' holdings before a change are those of the old epoch minus the
members that are gone. `plan_reshard(before, after, ...)` then lists the transfers:

* what a destination needs is its holdings after, minus what it holds already: nothing is sent to a
  member that has it (a survivor keeps its overlap; a replica keeps its whole state);
* a needed range is cut at every holder's boundaries, and each piece comes from one member that
  holds it: each needed byte is sent once per destination;
* sources are balanced: a piece goes to the holder that has sent the fewest bytes so far, and a large
  piece that several holders have is split between them, so a newcomer pulls from every replica;
* a piece that no survivor holds is *missing*: the caller stops the job naming it, never trains on
  made-up state.

Transfers are sorted (destination, tensor, lo), so every member derives the same list and the
same order of point-to-point ops. Adjacent pieces from one source are merged into one transfer,
and a run of equally long, equally spaced ones (a row-wise split's rows) into one strided transfer.

The companion tensors of a parameter (its gradient is not moved; its optimizer state, e.g. Adam's
two moments, has the parameter's shape) move with it: a transfer of parameter P's range also
carries that range of each of P's state tensors, and `element_bytes` counts them all.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import permutations

from plan.layout import Layout
from plan.placement import TensorShape as TensorShape  # (where the reshard's callers have always found it)
from plan.placement import ranges_of

Range = tuple[int, int]
Holdings = dict[str, dict[str, list[Range]]]  # member -> tensor -> ranges (sorted, disjoint)
SPLIT_MIN = 1 << 16  # elements: a piece at least twice this long is split between its holders


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """Elements [lo, hi) of the flattened `tensor` from `src` to `dst`; with `count` > 1, a strided
    run of such ranges: [lo + i·stride, hi + i·stride) for i < count (a box cut along a later dim, a
    row-wise tensor-parallel weight, moves as one transfer, not one per row)."""

    dst: str
    tensor: str
    lo: int
    hi: int
    src: str
    count: int = 1
    stride: int = 0

    @property
    def elements(self) -> int:
        return (self.hi - self.lo) * self.count

    @property
    def end(self) -> int:
        """Where its last range ends."""
        return self.hi + (self.count - 1) * self.stride

    def ranges(self) -> list[Range]:
        return [(self.lo + i * self.stride, self.hi + i * self.stride) for i in range(self.count)]


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    transfers: tuple[Transfer, ...]
    missing: tuple[tuple[str, int, int], ...]  # (tensor, lo, hi) that no survivor holds
    sent: Mapping[str, int] = field(default_factory=dict)  # source -> elements it sends

    def bytes_moved(self, element_bytes: Mapping[str, int]) -> int:
        """Bytes of every transfer, with `element_bytes[tensor]` per element (state included)."""
        return sum(t.elements * element_bytes[t.tensor] for t in self.transfers)

    def largest_sender(self, element_bytes: Mapping[str, int]) -> int:
        per: dict[str, int] = defaultdict(int)
        for t in self.transfers:
            per[t.src] += t.elements * element_bytes[t.tensor]
        return max(per.values(), default=0)

    def for_member(self, name: str) -> tuple[list[Transfer], list[Transfer]]:
        """(what `name` sends, what it receives), in the plan's order."""
        return ([t for t in self.transfers if t.src == name], [t for t in self.transfers if t.dst == name])

    def describe_missing(self) -> str:
        parts = [f"{tensor}[{lo}:{hi}]" for tensor, lo, hi in self.missing[:8]]
        more = f" and {len(self.missing) - 8} more ranges" if len(self.missing) > 8 else ""
        return ", ".join(parts) + more


# --- what a layout puts where -------------------------------------------------------------------------


def copy_ring(layout: Layout, hosts: Mapping[str, str] | None = None) -> dict[str, str]:
    """Redundancy for a layout whose members hold unlike state: keeper -> the member whose slices
    (and stage) it also keeps.

    Where every slice already lives on two members (dp_replicate >= 2, or one whole replica per
    member: nothing sharded, staged or split by tensor) there is no ring. Otherwise no two members hold the same
    thing, and the members form one ring in which each keeps a copy of the previous member's part,
    ordered so that a neighbour is on another host where there is one (members taken round-robin
    across hosts): a pipeline stage's state is kept by a member of another stage. One member alone
    has nobody to keep its copy."""
    if layout.dp_replicate > 1 or layout.whole_replicas or layout.world < 2:
        return {}
    hosts = hosts or {}
    by_host: dict[str, list[str]] = defaultdict(list)
    for n in layout.members:
        by_host[hosts.get(n, n)].append(n)
    order: list[str] = []
    queues = sorted(by_host.values(), key=len, reverse=True)
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return {order[(i + 1) % len(order)]: n for i, n in enumerate(order)}


def holdings(layout: Layout, tensors: Sequence[TensorShape], copies: Mapping[str, str] | None = None) -> Holdings:
    """member -> tensor -> ranges: each member's slices under `layout`, plus those of the member it
    keeps a copy of (`copies`: keeper -> source)."""
    out: Holdings = {}
    # (what a rank holds follows from its stage and shard coordinates alone: computed once per pair,
    # the lists shared read-only; a thousand replicas of a pipeline's stages are seven computations)
    by_coords: dict[tuple[int, int, int], dict[str, list[Range]]] = {}
    for rank, name in enumerate(layout.members):
        pp, _, shard, tp = layout.coords(rank)
        held = by_coords.get((pp, shard, tp))
        if held is None:
            held = by_coords[(pp, shard, tp)] = {t.name: ranges for t in tensors if (ranges := ranges_of(layout, rank, t))}
        out[name] = dict(held)
    own = {name: dict(held) for name, held in out.items()}  # copies are of a member's own slices only
    for keeper, source in (copies or {}).items():
        mine = out.setdefault(keeper, {})
        for tensor, ranges in own.get(source, {}).items():
            mine[tensor] = union([*mine.get(tensor, []), *ranges])
    return out


def row_lengths(tensors: Sequence[TensorShape]) -> dict[str, int]:
    """The elements of a row of each tensor tensor parallelism splits by column (`plan_reshard`'s
    `row_length`): a box of one is a range per row."""
    return {t.name: t.numel // t.rows for t in tensors if t.tp_dim == 1 and t.rows > 0}


def survivors(before: Holdings, alive: Iterable[str]) -> Holdings:
    keep = set(alive)
    return {m: h for m, h in before.items() if m in keep}


# --- the transfers ------------------------------------------------------------------------------------


def plan_reshard(before: Holdings, after: Holdings, *, split_min: int = SPLIT_MIN,
                 row_length: Mapping[str, int] | None = None) -> ReshardPlan:
    """The transfers that take the (surviving) holdings `before` to `after` (see the module comment).
    `row_length`: the elements of a row of the tensors that tensor parallelism splits by column
    (a box of such a tensor is one range per row): each is planned by blocks of rows that every
    member holds and needs alike (`_row_blocks`), one row standing for its block, and a block's
    pieces move as strided transfers; planned row by row, a 10M GPT's took a tenth of a second."""
    sent: dict[str, int] = defaultdict(int)
    pieces: list[Transfer] = []
    missing: list[tuple[str, int, int]] = []
    tensors = sorted({t for h in after.values() for t in h})
    for tensor in tensors:
        held = {m: union(h[tensor]) for m, h in sorted(before.items()) if h.get(tensor)}
        needs = {dst: union(h.get(tensor, [])) for dst, h in sorted(after.items())}
        length = (row_length or {}).get(tensor, 0)
        blocks = _row_blocks(held, needs, length) if length > 0 else None
        if blocks is None:
            _plan_ranges(tensor, held, needs, sent, split_min, pieces, missing)
            continue
        for first, end, held_cols, needs_cols in blocks:
            _plan_ranges(tensor, held_cols, needs_cols, sent, split_min, pieces, missing,
                         offset=first * length, count=end - first, stride=length)
    return ReshardPlan(transfers=tuple(_strided(_merge(sorted(pieces)))), missing=tuple(_merge_missing(missing)),
                       sent=dict(sent))


def _plan_ranges(tensor: str, held: Mapping[str, list[Range]], needs: Mapping[str, list[Range]], sent: dict[str, int],
                 split_min: int, pieces: list[Transfer], missing: list[tuple[str, int, int]], *, offset: int = 0,
                 count: int = 1, stride: int = 0) -> None:
    """The pieces (and the missing ranges) of one tensor: each destination's needs less what it
    holds, cut at the holders' boundaries, each piece from a least-loaded holder. With `count` > 1
    the ranges are columns of a block of `count` rows of `stride` elements from element `offset`:
    each piece is a strided transfer of its columns in every row of the block."""
    starts = {m: [a for a, _ in r] for m, r in held.items()}
    covers = [(dst, a, b, holders) for dst, wanted in needs.items() for lo, hi in subtract(wanted, held.get(dst, []))
              for a, b, holders in _cover(lo, hi, held, starts, dst)]
    if count > 1:  # (a block's few large pieces: those with the fewest holders first, then the largest)
        covers.sort(key=lambda c: (len(c[3]), c[1] - c[2], c[0], c[1]))
    last: str | None = None  # (the source of the destination's last piece of this tensor)
    for i, (dst, a, b, holders) in enumerate(covers):
        if i == 0 or covers[i - 1][0] != dst:
            last = None
        if not holders:
            missing.extend((tensor, offset + a + r * stride, offset + b + r * stride) for r in range(count))
            continue
        for src, x, y in _assign(a, b, holders, sent, split_min, last, weight=count):
            if count == 1 or y - x == stride:  # (whole rows: one range)
                pieces.append(Transfer(dst=dst, tensor=tensor, lo=offset + x, hi=offset + x + (y - x) * count, src=src))
            else:
                pieces.append(Transfer(dst=dst, tensor=tensor, lo=offset + x, hi=offset + y, src=src, count=count,
                                       stride=stride))
            last = src


MAX_ROW_BLOCKS = 64  # a tensor's holdings cut into more blocks of rows than this are planned range by range


def _row_blocks(held: Mapping[str, list[Range]], needs: Mapping[str, list[Range]],
                length: int) -> list[tuple[int, int, dict[str, list[Range]], dict[str, list[Range]]]] | None:
    """The tensor's rows (of `length` elements) cut into blocks [first, end) in which every member
    holds (`held`) and needs (`needs`) the same columns in every row: per block, those columns as
    ranges of one row. None where that takes more than MAX_ROW_BLOCKS blocks (no box structure)."""
    rects = {("held", m): _rects(r, length) for m, r in held.items()}
    rects.update({("needs", m): _rects(r, length) for m, r in needs.items()})
    edges = sorted({e for rs in rects.values() for r0, r1, _, _ in rs for e in (r0, r1)})
    if len(edges) > MAX_ROW_BLOCKS + 1:
        return None
    out = []
    for first, end in zip(edges, edges[1:]):
        cols = {key: union((c0, c1) for r0, r1, c0, c1 in rs if r0 <= first and end <= r1) for key, rs in rects.items()}
        out.append((first, end, {m: cols[("held", m)] for m in held if cols[("held", m)]},
                    {m: cols[("needs", m)] for m in needs}))
    return out


def _rects(ranges: list[Range], length: int) -> list[tuple[int, int, int, int]]:
    """Sorted, disjoint element ranges of a tensor of rows of `length` elements as rectangles (first
    row, end row, first column, end column), the rows of equal columns joined."""
    out: list[tuple[int, int, int, int]] = []
    last: dict[tuple[int, int], int] = {}  # (columns) -> index in out of the latest rectangle of them

    def add(r0: int, r1: int, c0: int, c1: int) -> None:
        i = last.get((c0, c1))
        if i is not None and out[i][1] == r0:
            out[i] = (out[i][0], r1, c0, c1)
        else:
            last[(c0, c1)] = len(out)
            out.append((r0, r1, c0, c1))

    for lo, hi in ranges:
        r0, c0 = divmod(lo, length)
        r1, c1 = divmod(hi, length)
        if r0 == r1:
            add(r0, r0 + 1, c0, c1)
            continue
        if c0 > 0:
            add(r0, r0 + 1, c0, length)
            r0 += 1
        if r1 > r0:
            add(r0, r1, 0, length)
        if c1 > 0:
            add(r1, r1 + 1, 0, c1)
    return out


def _cover(lo: int, hi: int, held: Mapping[str, list[Range]], starts: Mapping[str, list[int]],
           skip: str) -> list[tuple[int, int, list[str]]]:
    """[lo, hi) cut at every holder's boundaries (but `skip`'s): (a, b, the members holding all of
    [a, b)). Each holder's ranges are sorted and disjoint (`starts`: their starts), so only those
    that overlap [lo, hi) are looked at: a tensor split one range per row (a row-wise tp weight) has
    hundreds of ranges per holder."""
    near: dict[str, list[Range]] = {}
    for m, ranges in held.items():
        if m == skip:
            continue
        i = max(bisect.bisect_right(starts[m], lo) - 1, 0)
        j = bisect.bisect_left(starts[m], hi, lo=i)
        near[m] = [r for r in ranges[i:j] if r[1] > lo]
    cuts = {lo, hi}
    for ranges in near.values():
        for a, b in ranges:
            cuts.update(x for x in (a, b) if lo < x < hi)
    points = sorted(cuts)
    out: list[tuple[int, int, list[str]]] = [(a, b, []) for a, b in zip(points, points[1:])]
    for m, ranges in near.items():  # (each holder's ranges walked once beside the pieces, both sorted)
        i = 0
        for a, b, holders in out:
            while i < len(ranges) and ranges[i][1] <= a:
                i += 1
            if i < len(ranges) and ranges[i][0] <= a and b <= ranges[i][1]:
                holders.append(m)
    return out


def _assign(a: int, b: int, holders: list[str], sent: dict[str, int], split_min: int,
            last: str | None = None, weight: int = 1) -> list[tuple[str, int, int]]:
    """[a, b) split among the least-loaded holders (by elements sent so far; each element of [a, b)
    stands for `weight`: a column of a block of rows); split among all of them, a part from each. A
    piece too small to split stays with `last`
    (the source of the destination's previous piece) while that one has sent at most `split_min`
    more than the least loaded: a box's rows then come in long runs from one source, strided
    transfers, not alternating row by row between two equal holders."""
    parts = max(1, min(len(holders), b - a, (b - a) * weight // split_min))
    every = sorted(holders, key=lambda m: (sent[m], m)) if parts == len(holders) > 1 else None
    out = []
    for i in range(parts):
        x, y = a + (b - a) * i // parts, a + (b - a) * (i + 1) // parts
        if every is not None:  # (split among all its holders: a part from each)
            sent[every[i]] += (y - x) * weight
            out.append((every[i], x, y))
            continue
        least = min(holders, key=lambda m: (sent[m], m))
        sticky = parts == 1 and weight == 1 and last in holders  # (a block's pieces are strided already)
        src = last if sticky and last is not None and sent[last] <= sent[least] + split_min else least
        sent[src] += (y - x) * weight
        out.append((src, x, y))
    return out


def _merge(pieces: list[Transfer]) -> list[Transfer]:
    """Adjacent pieces of one pair and tensor as one (strided ones of the same rows too)."""
    out: list[Transfer] = []
    for p in pieces:
        last = out[-1] if out else None
        if last is not None and (last.dst, last.tensor, last.src, last.hi, last.count, last.stride) == (
                p.dst, p.tensor, p.src, p.lo, p.count, p.stride):
            merged = replace(last, hi=p.hi)
            if merged.count > 1 and merged.hi - merged.lo == merged.stride:  # (whole rows: one range)
                merged = replace(merged, hi=merged.lo + merged.count * merged.stride, count=1, stride=0)
            out[-1] = merged
        else:
            out.append(p)
    return out


def _strided(transfers: list[Transfer]) -> list[Transfer]:
    """Runs of a pair's transfers of one tensor that are equally long and equally spaced as one
    strided transfer each, sorted as the plan is."""
    runs: dict[tuple[str, str, str], list[Transfer]] = defaultdict(list)
    out: list[Transfer] = []
    for t in transfers:
        if t.count > 1:  # (planned strided: a block of rows)
            out.append(t)
        else:
            runs[(t.dst, t.tensor, t.src)].append(t)
    for pair in runs.values():
        first, count, stride = pair[0], 1, 0
        for t in pair[1:]:
            gap = t.lo - (first.lo + (count - 1) * stride)
            if t.hi - t.lo == first.hi - first.lo and gap > t.hi - t.lo and (count == 1 or gap == stride):
                count, stride = count + 1, gap
                continue
            out.append(replace(first, count=count, stride=stride))
            first, count, stride = t, 1, 0
        out.append(replace(first, count=count, stride=stride))
    return sorted(out)


def _merge_missing(missing: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    out: dict[str, list[Range]] = defaultdict(list)
    for tensor, a, b in missing:
        out[tensor].append((a, b))
    return [(t, a, b) for t in sorted(out) for a, b in union(out[t])]


def union(ranges: Iterable[Range]) -> list[Range]:
    """`ranges` sorted, with overlapping and adjacent ones merged."""
    out: list[Range] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(ranges: Iterable[Range], minus: Iterable[Range]) -> list[Range]:
    """The parts of `ranges` that no range in `minus` covers."""
    minus = sorted(minus)
    ends = list(itertools.accumulate((y for _, y in minus), max))  # (the furthest end so far: skip those before)
    out = []
    for a, b in ranges:
        cur = a
        for x, y in minus[bisect.bisect_right(ends, a):]:
            if x >= b:
                break
            if y <= cur:
                continue
            if x > cur:
                out.append((cur, x))
            cur = max(cur, y)
        if cur < b:
            out.append((cur, b))
    return out


# --- the rank order that moves least --------------------------------------------------------------

ORDER_ROWS = 720_720  # a stand-in tensor: divisible by every shard degree up to 16, so chunks are exact
SEARCH_ALL_UP_TO = 4  # members: every rank order is tried up to this many; beyond, newcomers are inserted


def least_moving_order(before: Layout | None, holders: Iterable[str], members: Sequence[str], *,
                       dp_shard: int, hosts: Mapping[str, str] | None = None,
                       copies: bool = True) -> tuple[list[str], float]:
    """The rank order of `members` for a layout of shard degree `dp_shard` that moves the fewest
    bytes from what `holders` hold under `before` (its slices and its ring of copies), and that
    fraction of the state. FSDP2 gives rank r the r-th chunk of every tensor, so the order decides
    who already holds what: a newcomer placed between two holders takes the parts they give up
    (3 -> 4 members with the ring of copies: half the state moves instead of 7/12; 2 -> 3 without
    copies: a third instead of a half, from both holders at once, and neither receives anything).

    The fraction is that of a stand-in tensor split as every tensor is, through `plan_reshard`.
    Ties keep `members`' order (the planner's: holders in their order, newcomers after), so a change
    that moves the same either way does not reorder. Up to SEARCH_ALL_UP_TO members every order is
    tried; beyond, the holders keep their order and each newcomer goes where it moves least.
    `copies=False`: layouts without the ring of copies (a harness that keeps none)."""
    order = list(members)
    if before is None:
        return order, 0.0
    tensor = [TensorShape("x", ORDER_ROWS, ORDER_ROWS)]
    alive = set(holders)
    held = {m: h for m, h in holdings(before, tensor, copy_ring(before, hosts) if copies else None).items()
            if m in alive}

    def cost(candidate: list[str]) -> float:
        after = Layout(members=tuple(candidate), shares=(1,) * len(candidate),
                       dp_replicate=len(candidate) // dp_shard, dp_shard=dp_shard)
        needed = holdings(after, tensor, copy_ring(after, hosts) if copies else None)
        return plan_reshard(held, needed).bytes_moved({"x": 1}) / ORDER_ROWS

    best, best_cost = order, cost(order)
    if dp_shard <= 1 or len(order) < 2:
        return best, best_cost
    if len(order) <= SEARCH_ALL_UP_TO:
        for candidate in map(list, permutations(order)):
            if (c := cost(candidate)) < best_cost - 1e-12:
                best, best_cost = candidate, c
        return best, best_cost
    placed = [m for m in order if m in alive]
    newcomers = [m for m in order if m not in alive]
    for i, newcomer in enumerate(newcomers):
        options = [placed[:k] + [newcomer] + placed[k:] for k in range(len(placed) + 1)]
        # The least moving, the newcomers not placed yet appended; on a tie, appended (options[-1]).
        placed = min(reversed(options), key=lambda p: cost(p + newcomers[i + 1:]))
    if (c := cost(placed)) < best_cost - 1e-12:
        best, best_cost = placed, c
    return best, best_cost
