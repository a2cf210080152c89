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
    """Where a sharded executor runs: FSDP2's 1-D mesh (the whole group, or for HSDP this member's
    shard group) and, for HSDP, this member's replica group, over which its shards are all-reduced."""

    mesh: DeviceMesh
    replicate: dist.ProcessGroup | None = None


def mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], *, timeout_s: float,
         superseded: Callable[[], bool]) -> ShardMesh:
    """The mesh of a sharded layout over the epoch's group: 1-D over the members, or for HSDP and a
    sharded pipeline stage 1-D over this member's shard group (with HSDP's replica group beside it).
    Appends every group it registers to `registered` (the whole group first), as it registers it."""
    return _split_mesh(g, device, registered, "dp_shard", g.layout.shard_group(g.rank), timeout_s, superseded)


def tp_mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], *, timeout_s: float,
            superseded: Callable[[], bool]) -> ShardMesh:
    """The mesh tensor parallelism splits modules over (this member's tp group: the whole group when
    tp is the only degree) and, with replicas, this member's replica group, over which the split
    tensors' gradients are summed; registered as `mesh` registers FSDP2's."""
    return _split_mesh(g, device, registered, "tp", g.layout.tp_group(g.rank), timeout_s, superseded)


def _split_mesh(g: Group, device: torch.device, registered: list[dist.ProcessGroup], dim: str, split: list[int],
                timeout_s: float, superseded: Callable[[], bool]) -> ShardMesh:
    """A 1-D mesh named `dim` over the ranks `split` (this member's), the whole group registered first
    as the default, the sub-groups (`split` where it is not the whole group, the replica group
    where there are replicas) formed with the epoch's timeout and registered."""
    prefixed = dist.PrefixStore(f"epoch{g.epoch}/", g.store)  # type: ignore[attr-defined]
    whole = meshes.register(g.pg, prefixed, g.rank, len(g.members), g.epoch, device,
                            pg=AbortableGroup(g.pg, superseded=superseded))
    registered.append(whole)
    if len(split) == len(g.members):  # (FSDP or tp over every member: the whole group is the split)
        return ShardMesh(meshes.mesh_of(whole, device, g.epoch, dim))
    subs: dict[str, dist.ProcessGroup] = {}
    axes = [("split", split)]
    if g.layout.dp_replicate > 1:
        axes.insert(0, ("replicate", g.layout.replicate_group(g.rank)))
    for part, ranks in axes:
        name = f"{SPLIT_NAMES[dim] if part == 'split' else part}{ranks[0]}"  # (the group's store prefix)
        raw = comm.form_group(g.store, g.epoch, ranks.index(g.rank), len(ranks), device,
                              timeout_s=timeout_s, superseded=superseded, part=f"{name}/")
        sub_store = dist.PrefixStore(f"epoch{g.epoch}/{name}/", g.store)  # type: ignore[attr-defined]
        subs[part] = meshes.register(raw, sub_store, ranks.index(g.rank), len(ranks), g.epoch, device,
                                     part=name, ranks=ranks, pg=AbortableGroup(raw, superseded=superseded))
        registered.append(subs[part])
    return ShardMesh(meshes.mesh_of(subs["split"], device, g.epoch, dim), replicate=subs.get("replicate"))


def forget(registered: list[dist.ProcessGroup]) -> None:
    """Unregister the last sharded epoch's groups (their backends end on their own); a wait still on
    one of them is released, and its helper thread ends with the ops it waits for."""
    for pg in registered:
        meshes.forget(pg)
        if isinstance(pg, AbortableGroup):
            pg.abort("the epoch's groups were let go")
            pg.close()
    registered.clear()
