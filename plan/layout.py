"""A plan's layout: how the members of an epoch split the model and the batch. Pure, torch-free.

A `Layout` has four degrees, validated in the manner of torchtitan's `ParallelDims`:

* `dp_replicate`: replicas that each hold (their part of) the whole state and train on their own
  slice of the global batch; gradients are summed across them.
* `dp_shard`: members that split every tensor of a unit along its first dimension (FSDP2's
  `Shard(0)`), gather it for compute and reduce-scatter its gradients. Each also trains on its own
  slice of the batch.
* `pp`: pipeline stages. `stages` names the graph units of each stage, in pipeline order (empty
  when pp = 1); a rank of stage s holds only those units' tensors (`plan.placement`).
* `tp`: tensor-parallel ranks (the model's Linears split between them).

Every degree is >= 1 and their product is the number of members. Members are in rank order, and a
rank's coordinates on the mesh `(pp, dp_replicate, dp_shard, tp)` are row-major (tp fastest), as in
torchtitan. `shares` gives every member the samples it computes of each global batch; members that
differ only in their pp or tp coordinate compute on the same samples, so their shares are equal.
The global batch is the sum of one share per data-parallel coordinate.

A tensor of `numel` elements with a first dimension of `rows` lies on the shard axis the way FSDP2
puts it there (`torch.chunk` on dim 0): shard i of n holds rows [i·c, (i+1)·c) clipped to `rows`,
c = ceil(rows / n), so the last shards may be short or empty. `slice_of` gives that as an element
range of the flattened tensor; `plan.placement` gives every rank's part of every tensor as a box,
stages included, which is what `plan.reshard` moves.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from plan.graph import Graph, Partial, Placement, Replicate, Shard, TensorSpec
from plan.placement import Box

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # mesh order, outermost first
PIN_KEYS = {"dp": "dp_replicate", "fsdp": "dp_shard", "pp": "pp", "tp": "tp"}  # --layout names


class LayoutError(ValueError):
    """A layout that cannot run, with the reason."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    members: tuple[str, ...]
    shares: tuple[int, ...]
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    stages: tuple[tuple[str, ...], ...] = ()  # graph units per pipeline stage, in order (() when pp = 1)

    def __post_init__(self) -> None:
        degrees = self.degrees
        for dim, n in zip(DIMS, degrees):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise LayoutError(f"layout degree {dim} must be an integer >= 1, got {n!r}")
        if math.prod(degrees) != len(self.members):
            product = " x ".join(f"{dim}={n}" for dim, n in zip(DIMS, degrees) if n > 1) or "1"
            raise LayoutError(f"layout degrees {product} make {math.prod(degrees)} ranks, "
                              f"but the plan has {len(self.members)} members")
        if self.pp == 1 and self.stages:
            raise LayoutError(f"layout: stages {[list(s) for s in self.stages]} without a pipeline (pp=1)")
        if self.pp > 1:
            if len(self.stages) != self.pp or not all(self.stages):
                raise LayoutError(f"layout: pp={self.pp} needs {self.pp} stages of at least one unit each, got "
                                  f"{[list(s) for s in self.stages]}")
            units = [u for stage in self.stages for u in stage]
            if len(set(units)) != len(units):
                raise LayoutError(f"layout: a unit is in two stages: {[list(s) for s in self.stages]}")
        if len(set(self.members)) != len(self.members):
            raise LayoutError(f"layout members must be unique, got {list(self.members)}")
        if len(self.shares) != len(self.members):
            raise LayoutError(f"layout: {len(self.shares)} shares for {len(self.members)} members")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.shares):
            raise LayoutError(f"layout shares must be integers >= 0, got {list(self.shares)}")
        first_of: dict[int, int] = {}  # data-parallel slot -> its first rank (ranks ascend)
        for rank, share in enumerate(self.shares):
            first = first_of.setdefault(self.dp_index(rank), rank)
            if share != self.shares[first]:
                raise LayoutError(f"layout: {self.members[rank]} shares a data-parallel slot with "
                                  f"{self.members[first]} but has share {share}, not {self.shares[first]}")

    @staticmethod
    def replicated(members: tuple[str, ...] | list[str], shares: tuple[int, ...] | list[int]) -> Layout:
        """Plain data parallel: every member a replica."""
        return Layout(members=tuple(members), shares=tuple(shares), dp_replicate=len(members))

    # --- the mesh -----------------------------------------------------------------------------------

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def dp(self) -> int:
        """Data-parallel slots: replicas × shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.dp_shard > 1

    @property
    def whole_replicas(self) -> bool:
        """Every member holds the whole training state (nothing sharded, staged or split by tensor):
        any one of them can hand it all to a newcomer or write a checkpoint alone. Otherwise a member
        that leaves may take the only copy of its part with it."""
        return self.pp == self.dp_shard == self.tp == 1

    @property
    def global_batch(self) -> int:
        return sum(self.shares[self.dp_ranks(i)[0]] for i in range(self.dp))

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) of `rank`."""
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} out of range for {self.world} members")
        out = []
        for n in reversed(self.degrees):
            rank, c = divmod(rank, n)
            out.append(c)
        pp, rep, shard, tp = reversed(out)
        return pp, rep, shard, tp

    def rank_of(self, pp: int, rep: int, shard: int, tp: int) -> int:
        rank = 0
        for c, n in zip((pp, rep, shard, tp), self.degrees):
            rank = rank * n + c
        return rank

    def dp_index(self, rank: int) -> int:
        """The data-parallel slot of `rank` (replica-major): which slice of the batch it computes."""
        _, rep, shard, _ = self.coords(rank)
        return rep * self.dp_shard + shard

    def dp_ranks(self, index: int) -> list[int]:
        """The ranks of data-parallel slot `index` (every pp stage and tp rank of it)."""
        rep, shard = divmod(index, self.dp_shard)
        return [self.rank_of(p, rep, shard, t) for p in range(self.pp) for t in range(self.tp)]

    def shard_group(self, rank: int) -> list[int]:
        """The ranks that split `rank`'s tensors between them (its dp_shard axis), in shard order."""
        pp, rep, _, tp = self.coords(rank)
        return [self.rank_of(pp, rep, s, tp) for s in range(self.dp_shard)]

    def tp_group(self, rank: int) -> list[int]:
        """The ranks that split `rank`'s tensor-parallel modules between them (its tp axis), in tp order."""
        pp, rep, shard, _ = self.coords(rank)
        return [self.rank_of(pp, rep, shard, t) for t in range(self.tp)]

    def replicate_group(self, rank: int) -> list[int]:
        """The ranks that hold the same shard as `rank` (its dp_replicate axis)."""
        pp, _, shard, tp = self.coords(rank)
        return [self.rank_of(pp, r, shard, tp) for r in range(self.dp_replicate)]

    def batch_slice(self, rank: int) -> tuple[int, int]:
        """[start, stop) of each global batch that `rank` computes on (contiguous, in slot order)."""
        index = self.dp_index(rank)
        start = sum(self.shares[self.dp_ranks(i)[0]] for i in range(index))
        return start, start + self.shares[rank]

    def slice_of(self, rank: int, rows: int, numel: int) -> tuple[int, int]:
        """The element range [lo, hi) of a flattened tensor (`rows` along dim 0, `numel` in all)
        that `rank` holds: the whole tensor unless it is sharded, then FSDP2's chunk of dim 0."""
        if not self.sharded or rows == 0:
            return 0, numel
        _, _, shard, _ = self.coords(rank)
        box = Box.whole((rows, numel // rows)).chunk(0, shard, self.dp_shard)
        lo = box.offsets[0] * (numel // rows)
        return lo, lo + box.numel

    # --- the wire -----------------------------------------------------------------------------------

    def describe(self) -> str:
        """e.g. "dp_replicate=2 x dp_shard=2" (degrees above 1), or "1 member"."""
        parts = [f"{dim}={n}" for dim, n in zip(DIMS, self.degrees) if n > 1]
        return " x ".join(parts) if parts else "1 member"

    def to_dict(self) -> dict[str, Any]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "pp": self.pp, "tp": self.tp,
                "members": list(self.members), "shares": list(self.shares),
                "stages": [list(stage) for stage in self.stages]}

    @staticmethod
    def from_dict(data: Any) -> Layout:
        """Rebuild a layout from `to_dict`'s form; LayoutError names what is wrong."""
        if not isinstance(data, dict):
            raise LayoutError(f"layout: expected an object, got {type(data).__name__}")
        unknown = set(data) - {*DIMS, "members", "shares", "stages"}
        if unknown:
            raise LayoutError(f"layout: unknown fields {sorted(unknown)}")
        members, shares = data.get("members"), data.get("shares")
        if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
            raise LayoutError("layout: 'members' must be a list of names")
        if not isinstance(shares, list):
            raise LayoutError("layout: 'shares' must be a list of integers")
        stages = data.get("stages") or []
        if not isinstance(stages, list) or not all(isinstance(s, list) and all(isinstance(u, str) for u in s)
                                                   for s in stages):
            raise LayoutError("layout: 'stages' must be a list of lists of unit names")
        return Layout(members=tuple(members), shares=tuple(shares), stages=tuple(tuple(s) for s in stages),
                      **{dim: data.get(dim, 1) for dim in DIMS})


# --- distributed attributes ---------------------------------------------------------------------------


def describe(spec: TensorSpec) -> str:
    """A placement in DTensor's notation: "[Replicate(), Shard(0)] on (4, 2)"."""
    names = [f"Shard({p.dim})" if isinstance(p, Shard) else f"{type(p).__name__}()" for p in spec.placements]
    return f"[{', '.join(names)}] on {spec.mesh_shape}"


def placements(graph: Graph, layout: Layout) -> dict[str, dict[str, TensorSpec]]:
    """The distributed attributes of every layer's tensors under `layout`, on the data-parallel mesh:
    `(dp_replicate,)` when nothing is sharded, else `(dp_replicate, dp_shard)`. Parameters and
    optimizer state are replicated across replicas and `Shard(0)` across shards; gradients are
    partial sums across replicas (all-reduced) and reduce-scattered to `Shard(0)` across shards;
    activations are split along the batch on every axis."""
    if layout.pp != 1 or layout.tp != 1:
        raise LayoutError(f"pipeline and tensor parallel layouts are not planned yet (pp={layout.pp}, tp={layout.tp})")
    if layout.sharded:
        mesh: tuple[int, ...] = (layout.dp_replicate, layout.dp_shard)
        state: tuple[Placement, ...] = (Replicate(), Shard(0))
        grads: tuple[Placement, ...] = (Partial(), Shard(0))
    else:
        mesh, state, grads = (layout.dp_replicate,), (Replicate(),), (Partial(),)
    batch = tuple(Shard(0) for _ in mesh)
    return {layer.name: {"params": TensorSpec(mesh, state), "grads": TensorSpec(mesh, grads),
                         "optimizer_state": TensorSpec(mesh, state), "activations": TensorSpec(mesh, batch)}
            for layer in graph.layers}


# --- pinned degrees (coordinator --layout) ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutPin:
    """Degrees the operator fixed (`--layout dp=R,fsdp=S`, `--layout pp=P` or `pp=P,dp=R`); None:
    the planner chooses. A pipeline pin (pp > 1) fixes the data-parallel degrees it leaves out at 1
    (`pp=2,dp=2,fsdp=2`: two replicas of pipelines whose stages are sharded over two)."""

    dp_replicate: int | None = None
    dp_shard: int | None = None
    pp: int | None = None
    tp: int | None = None

    @property
    def members(self) -> int | None:
        """The member count the pin implies when both data-parallel degrees are fixed (None: the
        planner chooses it): `pp=P` alone means exactly P members. An unpinned tp counts as 1 here
        (the planner may still choose tp: the count is then the plan's)."""
        pp, replicas, shards, tp = self._wanted()
        if replicas is None or shards is None:
            return None
        return replicas * shards * (pp or 1) * (tp or 1)

    def admits(self, layout: Layout) -> bool:
        return all(want is None or want == got for want, got in zip(self._wanted(), layout.degrees))

    def _wanted(self) -> tuple[int | None, int | None, int | None, int | None]:
        """(pp, dp_replicate, dp_shard, tp) as pinned, a pipeline's omitted data-parallel degrees as 1."""
        implied = 1 if (self.pp or 1) > 1 else None
        unsharded = 1 if (self.pp or 1) > 1 or (self.tp or 1) > 1 else None  # (tp shards only where fsdp is pinned)
        return (self.pp, implied if self.dp_replicate is None else self.dp_replicate,
                unsharded if self.dp_shard is None else self.dp_shard, self.tp)

    def describe(self) -> str:
        names = {v: k for k, v in PIN_KEYS.items()}
        return ",".join(f"{names[dim]}={getattr(self, dim)}" for dim in DIMS if getattr(self, dim) is not None)


def parse_pin(text: str, *, source: str = "--layout") -> LayoutPin:
    """`dp=2,fsdp=2` or `pp=2` -> LayoutPin; LayoutError with the reason for anything else. `source`
    names where the text came from in the message (`--layout`, or ctl's `layout` command)."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"([a-z]+)=(\d+)", part)
        if m is None or m.group(1) not in PIN_KEYS:
            raise LayoutError(f"{source}: {part[:40]!r} is not NAME=N with NAME one of {', '.join(PIN_KEYS)} "
                              f"(e.g. {source} dp=2,fsdp=2)")
        dim, n = PIN_KEYS[m.group(1)], int(m.group(2))
        if dim in values:
            raise LayoutError(f"{source}: {m.group(1)} given twice")
        if n < 1:
            raise LayoutError(f"{source}: {m.group(1)} must be >= 1, got {n}")
        values[dim] = n
    return LayoutPin(**values)
