"""The lifecycle of an epoch's groups on one worker: formed when the epoch is entered, registered
with c10d when its layout is sharded, forgotten when the next sharded executor is built or the
state is dropped.

`form` builds the epoch's raw group over every rank of the delta: its members, then the senders (the
leaving holders of sharded state that only take part in the reshard). Once the reshard is done the
members train in a group of their own (`without_senders`, the store's "train/" part), so a
sender's exit can never stall a step.

`mesh` (and `tp_mesh`, for tensor parallelism) turns the epoch's group into the DeviceMesh FSDP2 (DTensor) wants (`worker.parallel.mesh`): the whole
group registered as the default group, and for HSDP this member's replica and shard sub-groups,
formed with the epoch's timeout and registered too (FSDP2 shards over the shard group; the
replica group carries the all-reduce that keeps the replicas equal). Every group it registers is an
`AbortableGroup` (`worker.abortable`) that gives a wait up once the epoch is superseded, so what
torch issues on them without a hook of ours (the state-dict gathers of a save, DTensor's
collectives) cannot hold a survivor for the group timeout either. Every group it registers is recorded as it is
registered (in the caller's list), so that one formed before a failure part way is still forgotten
(`forget`); their backends are left alone (a hung op on them ends at its own timeout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plan.layout import Layout
from transport import PlanDelta
from worker import comm
from worker.abortable import AbortableGroup
from worker.parallel import mesh as meshes
from worker.store import CoordinatorStore


@dataclass(slots=True)
class Group:
    """An epoch's group as this worker sees it: its raw backend, this worker's rank in it, and the
    plan's members (by rank), shares, layout and micro-batches."""

    epoch: int
    pg: Any  # dist.ProcessGroupGloo or ProcessGroupNCCL
    store: CoordinatorStore  # kept alive as long as the group that was formed through it
    rank: int
    members: list[str]
    shares: list[int]
    layout: Layout
    micro: list[int] = dataclasses.field(default_factory=list)  # per member: samples per pass (0: the whole share)

    def __post_init__(self) -> None:
        if len(self.micro) != len(self.shares):
            self.micro = [0] * len(self.shares)


def form(store: CoordinatorStore, delta: PlanDelta, ranks: list[str], rank: int, device: torch.device, *,
         timeout_s: float, superseded: Callable[[], bool]) -> Group:
    """The epoch's group over `ranks` (the delta's members, then its senders), this worker at `rank`."""
    pg = comm.form_group(store, delta.epoch, rank, len(ranks), device, timeout_s=timeout_s, superseded=superseded)
    layout = Layout.from_dict(dataclasses.asdict(delta.layout))
    return Group(epoch=delta.epoch, pg=pg, store=store, rank=rank, members=ranks,
                 shares=list(delta.shares), layout=layout, micro=list(delta.micro_batch))


def without_senders(g: Group, delta: PlanDelta, device: torch.device, *, timeout_s: float,
                    superseded: Callable[[], bool]) -> Group:
    """The senders are done: the members' own group, formed through the same store ("train/")."""
    pg = comm.form_group(g.store, delta.epoch, g.rank, len(delta.members), device,
                         timeout_s=timeout_s, superseded=superseded, part="train/")
    return Group(epoch=delta.epoch, pg=pg, store=g.store, rank=g.rank, members=list(delta.members),
                 shares=list(delta.shares), layout=g.layout, micro=list(delta.micro_batch))


SPLIT_NAMES = {"dp_shard": "shard", "tp": "tp"}  # a split sub-group's name, by mesh dim


@dataclass(slots=True)
class ShardMesh:
    """Where a sharded or split executor runs: the 1-D mesh FSDP2 shards over (the whole group, or
    this member's shard group) or tensor parallelism splits over; with FSDP x tp, `tp` too (the two
    dims of one 2-D mesh); and with replicas, this member's replica group, over which its shards or
    slices are all-reduced."""

    mesh: DeviceMesh
    replicate: dist.ProcessGroup | None = None
    tp: DeviceMesh | None = None  # FSDP x tp: the mesh's tp dim (`mesh` is its dp_shard dim)


def mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], *, timeout_s: float,
         superseded: Callable[[], bool]) -> ShardMesh:
    """The mesh of a sharded layout over the epoch's group: 1-D over the members, or for HSDP and a
    sharded pipeline stage 1-D over this member's shard group (with HSDP's replica group beside it).
    Appends every group it registers to `registered` (the whole group first), as it registers it."""
    return _split_mesh(g, device, registered, [("dp_shard", g.layout.shard_group(g.rank))], timeout_s, superseded)


def tp_mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], *, timeout_s: float,
            superseded: Callable[[], bool]) -> ShardMesh:
    """The mesh tensor parallelism splits modules over (this member's tp group: the whole group when
    tp is the only degree) and, with replicas, this member's replica group, over which the split
    tensors' gradients are summed; registered as `mesh` registers FSDP2's."""
    return _split_mesh(g, device, registered, [("tp", g.layout.tp_group(g.rank))], timeout_s, superseded)


def shard_tp_mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], *, timeout_s: float,
                  superseded: Callable[[], bool]) -> ShardMesh:
    """FSDP x tp (and HSDP x tp): the 2-D mesh (dp_shard, tp) of this member's replica, from its
    shard and tp groups (torchtitan's order: tp splits the modules over the inner dim, FSDP2 shards
    the split parameters over the outer one), and its replica group with replicas."""
    return _split_mesh(g, device, registered, [("dp_shard", g.layout.shard_group(g.rank)),
                                               ("tp", g.layout.tp_group(g.rank))], timeout_s, superseded)


def _split_mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup],
                dims: list[tuple[str, list[int]]], timeout_s: float, superseded: Callable[[], bool]) -> ShardMesh:
    """The mesh over `dims` (each a mesh dim's name and this member's group along it, outermost
    first), the whole group registered first as the default; each dim's group, where it is not the
    whole group, and the replica group where there are replicas, formed with the epoch's timeout and
    registered. A 1-D mesh is over its one group; a 2-D one is built from its two groups and the
    grid of whole-group ranks they span (`DeviceMesh.from_group`: `init_device_mesh` would form its
    sub-groups with the 30-minute default timeout, and not abortably)."""
    prefixed = dist.PrefixStore(f"epoch{g.epoch}/", g.store)  # type: ignore[attr-defined]
    whole = meshes.register(g.pg, prefixed, g.rank, len(g.members), g.epoch, device,
                            pg=AbortableGroup(g.pg, superseded=superseded))
    registered.append(whole)
    if len(dims) == 1 and len(dims[0][1]) == len(g.members):  # (FSDP or tp over every member: the whole group)
        return ShardMesh(meshes.mesh_of(whole, device, g.epoch, dims[0][0]))
    axes = [(SPLIT_NAMES[dim], ranks) for dim, ranks in dims]
    if g.layout.dp_replicate > 1:
        axes.insert(0, ("replicate", g.layout.replicate_group(g.rank)))
    subs: dict[str, dist.ProcessGroup] = {}
    names = [f"{part}{ranks[0]}" for part, ranks in axes]  # (each group's store prefix)
    raws = comm.form_groups(g.store, g.epoch, [(ranks.index(g.rank), len(ranks), f"{name}/")
                                               for name, (_, ranks) in zip(names, axes)],
                            device, timeout_s=timeout_s, superseded=superseded)
    for name, raw, (part, ranks) in zip(names, raws, axes):
        sub_store = dist.PrefixStore(f"epoch{g.epoch}/{name}/", g.store)  # type: ignore[attr-defined]
        subs[part] = meshes.register(raw, sub_store, ranks.index(g.rank), len(ranks), g.epoch, device,
                                     part=name, ranks=ranks, pg=AbortableGroup(raw, superseded=superseded))
        registered.append(subs[part])
    replicate = subs.get("replicate")
    if len(dims) == 1:
        dim = dims[0][0]
        return ShardMesh(meshes.mesh_of(subs[SPLIT_NAMES[dim]], device, g.epoch, dim), replicate=replicate)
    pp, rep, _, _ = g.layout.coords(g.rank)
    grid = [[g.layout.rank_of(pp, rep, s, t) for t in range(g.layout.tp)] for s in range(g.layout.dp_shard)]
    both = meshes.grid_of([subs["shard"], subs["tp"]], grid, device, g.epoch, ("dp_shard", "tp"))
    return ShardMesh(both[f"epoch{g.epoch}.dp_shard"], replicate=replicate, tp=both[f"epoch{g.epoch}.tp"])


def forget(registered: list[dist.ProcessGroup]) -> None:
    """Unregister the last sharded epoch's groups (their backends end on their own); a wait still on
    one of them is released, and its helper thread ends with the ops it waits for."""
    for pg in registered:
        meshes.forget(pg)
        if isinstance(pg, AbortableGroup):
            pg.abort("the epoch's groups were let go")
            pg.close()
    registered.clear()
