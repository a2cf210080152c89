"""Who holds what of every tensor, per rank, as N-D boxes: the one placement model under the reshard,
the copies and the checkpoint. Pure, torch-free.

A tensor's placement on a layout's mesh `(pp, dp_replicate, dp_shard, tp)` is, per mesh axis, one of
three things, as in DTensor (and DCP's chunks, whose offsets and sizes are these boxes):

* *absent*: the pp axis. A tensor belongs to one graph unit, the unit to one pipeline stage
  (`Layout.stages`); ranks of every other stage hold nothing of it.
* *replicated*: the dp_replicate axis, and the tp axis for a tensor tensor parallelism does not
  split (`TensorShape.tp_dim` None: layer norms, embeddings): every coordinate holds the same box.
* *sharded along a dim*: the tp axis cuts a split tensor along its `tp_dim` (a column-wise Linear's
  weight and bias along dim 0, a row-wise one's weight along dim 1: DTensor's `Shard(d)`), and the
  dp_shard axis then cuts dim 0 of what the tp rank holds, the way FSDP2 does (`torch.chunk`: chunk
  i of n holds rows [i·c, (i+1)·c), c = ceil(rows / n), clipped, so the last chunks may be short or
  empty).

So each rank holds at most one box of each tensor. `Box.flat_ranges` turns a box into element
ranges of the row-major flattened tensor, the form the reshard moves: a dim-0 chunk is one range,
a box cut along a later dim (a tensor-parallel `Shard(1)`) is one range per row it spans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plan.graph import ROOT_UNIT

if TYPE_CHECKING:
    from plan.layout import Layout

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class TensorShape:
    """What placement and the reshard need of a tensor: its name, its rows (dim 0; 0 for a scalar),
    its elements, and the graph unit it belongs to (which pipeline stage holds it)."""

    name: str
    rows: int
    numel: int
    unit: str = ROOT_UNIT  # (the graph's: `plan.graph.TensorInfo.unit`)
    tp_dim: int | None = None  # the dim tensor parallelism splits (0 or 1 of `shape`); None: replicated

    @property
    def shape(self) -> tuple[int, ...]:
        """Two dimensions are all a placement needs: rows, and the elements of a row."""
        if self.rows == 0:
            return () if self.numel == 1 else (0,)  # a scalar, or a tensor with no elements
        return (self.rows, self.numel // self.rows)


@dataclass(frozen=True, slots=True)
class Box:
    """An N-D block of a tensor: `sizes[d]` elements from `offsets[d]` along each dim d."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def chunk(self, dim: int, index: int, parts: int) -> Box:
        """Chunk `index` of `parts` of this box along `dim`, as `torch.chunk` cuts it."""
        size = self.sizes[dim]
        step = -(-size // parts)
        lo, hi = min(index * step, size), min((index + 1) * step, size)
        offsets = (*self.offsets[:dim], self.offsets[dim] + lo, *self.offsets[dim + 1:])
        sizes = (*self.sizes[:dim], hi - lo, *self.sizes[dim + 1:])
        return Box(offsets, sizes)

    def flat_ranges(self, shape: Sequence[int]) -> list[Range]:
        """The box as sorted, disjoint element ranges of the row-major flattened tensor of `shape`."""
        if not shape:
            return [(0, 1)]
        if self.numel == 0:
            return []
        if len(shape) == 2:  # (every placement's shape: rows, and a row's elements)
            rows, cols = shape
            (r0, c0), (n, width) = self.offsets, self.sizes
            if width == cols:
                return [(r0 * cols, (r0 + n) * cols)]
            return [(r * cols + c0, r * cols + c0 + width) for r in range(r0, r0 + n)]
        # The innermost dims the box spans whole make one contiguous run with the dim before them.
        j = len(shape) - 1
        while j > 0 and self.offsets[j] == 0 and self.sizes[j] == shape[j]:
            j -= 1
        inner = math.prod(shape[j + 1:])
        run = self.sizes[j] * inner
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        out: list[Range] = []
        for index in _indices(self.offsets[:j], self.sizes[:j]):
            start = sum(i * s for i, s in zip(index, strides)) + self.offsets[j] * strides[j]
            out.append((start, start + run))
        return out


def _indices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of the outer dims of a box, row-major."""
    out: list[tuple[int, ...]] = [()]
    for lo, n in zip(offsets, sizes):
        out = [(*prefix, i) for prefix in out for i in range(lo, lo + n)]
    return out


def unit_of(name: str, units: Sequence[str]) -> str:
    """The graph unit a parameter named `name` belongs to: the longest unit that prefixes it at a
    dot ("blocks.1" holds "blocks.1.fc.weight", not "blocks.10.fc.weight"), else the root unit
    (what graph capture records as `TensorInfo.unit`)."""
    best: str | None = None
    for u in units:
        if (name == u or name.startswith(u + ".")) and (best is None or len(u) > len(best)):
            best = u
    return ROOT_UNIT if best is None else best


def stage_of(layout: Layout, unit: str) -> int:
    """The pipeline stage that holds `unit` (0 without a pipeline). A tensor outside every unit
    goes with the first stage (the model's own parameters, used where the forward begins)."""
    if layout.pp == 1:
        return 0
    for index, stage in enumerate(layout.stages):
        if unit in stage:
            return index
    if unit == ROOT_UNIT:
        return 0
    raise ValueError(f"unit {unit!r} is in no stage of the layout ({layout.describe()})")


def box_of(layout: Layout, rank: int, tensor: TensorShape) -> Box | None:
    """The box of `tensor` that `rank` holds under `layout`; None when its stage holds none of it."""
    pp, _, shard, tp = layout.coords(rank)
    if stage_of(layout, tensor.unit) != pp:
        return None
    box = Box.whole(tensor.shape)
    if layout.tp > 1 and tensor.tp_dim is not None and tensor.shape:
        box = box.chunk(tensor.tp_dim, tp, layout.tp)
    if layout.dp_shard > 1 and tensor.shape:
        box = box.chunk(0, shard, layout.dp_shard)
    return box


def ranges_of(layout: Layout, rank: int, tensor: TensorShape) -> list[Range]:
    """The element ranges of `tensor` (flattened) that `rank` holds: [] when it holds none."""
    box = box_of(layout, rank, tensor)
    return [] if box is None else box.flat_ranges(tensor.shape)
