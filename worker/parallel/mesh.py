"""An epoch's group as torch's higher layers want it: a registered c10d ProcessGroup and a DeviceMesh.

FSDP2 (`fully_shard`) and DTensor accept only a *registered* ProcessGroup, one that c10d's global
maps know, and resolve group ranks through the default group. The epoch's raw gloo/NCCL backend
(`worker.comm.form_group`, built per epoch so that it can be abandoned) is therefore wrapped the way
`distributed_c10d._new_process_group_helper` wraps a backend, registered under the epoch's name,
and made the default group for as long as the epoch lasts (every epoch's group spans all of its
members, so it is the world while it lives). This leans on private c10d functions: they are all in
this module, and `forget` undoes exactly what `register` did, without touching the backend (whose
pending op may be hung on a stopped peer: destroying it would block until that op's timeout).
FSDP2 over such a group matches single-process training to about 1e-7 relative loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from worker import keeper

__all__ = ["forget", "grid_of", "mesh_of", "register"]


def register(backend: Any, store: Any, rank: int, world: int, epoch: int, device: torch.device, *,
             part: str = "", ranks: list[int] | None = None, pg: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """Wrap a raw backend of the epoch as a registered ProcessGroup. The epoch's whole group (no
    `part`) becomes the default group; a sub-group (`part` names it, `ranks` its members' ranks in
    the whole group, in its own rank order) is only registered, as `new_group` would. `pg`: the
    ProcessGroup to register (an `AbortableGroup` around `backend`); by default a plain one."""
    nccl = device.type == "cuda"
    kind = dist.ProcessGroup.BackendType.NCCL if nccl else dist.ProcessGroup.BackendType.GLOO
    pg = pg if pg is not None else dist.ProcessGroup(store, rank, world)
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device.type), kind, backend)
    name = c10d.GroupName(f"adaptrain-epoch{epoch}{'-' + part if part else ''}")
    pg._set_group_name(name)
    members = ranks if ranks is not None else list(range(world))
    c10d._register_pg_in_world(pg, backend_name="nccl" if nccl else "gloo", store=store, group_name=name,
                               backend_config=f"{device.type}:{'nccl' if nccl else 'gloo'}",
                               rank_mapping={global_rank: r for r, global_rank in enumerate(members)})
    if not part:
        c10d._update_default_pg(pg)
    return keeper.keep(pg)  # (destroyed off the trainer's thread, like the backend it wraps)


def mesh_of(pg: dist.ProcessGroup, device: torch.device, epoch: int, dim: str = "dp_shard") -> DeviceMesh:
    """A 1-D mesh over `pg`: the whole group for pure sharding, this member's shard group (its
    replica row) for HSDP, whose replicas are kept equal by an all-reduce FSDP2 leaves to a hook
    (`worker.parallel.fsdp`: FSDP2's own HSDP all-reduce on a 2-D mesh is a blocking call that a
    stopped peer would hold for the whole group timeout).

    The dimension name carries the epoch: DeviceMesh equality ignores the groups (it compares ranks,
    device type and names), and DTensor caches redistribution plans by mesh, so without it a new
    epoch's mesh over the same ranks would be served the old epoch's (unregistered) groups ("Could
    not resolve the process group registered under the name adaptrain-epoch1")."""
    return DeviceMesh.from_group(pg, device.type, mesh_dim_names=(f"epoch{epoch}.{dim}",))


def grid_of(pgs: list[dist.ProcessGroup], grid: list[list[int]], device: torch.device, epoch: int,
            dims: tuple[str, str]) -> DeviceMesh:
    """A 2-D mesh over `grid` (the whole group's ranks, `dims[0]` by `dims[1]`) from this member's
    group along each dim (`pgs`, in the order of `dims`), named with the epoch as `mesh_of` names
    its dim."""
    return DeviceMesh.from_group(pgs, device.type, mesh=torch.tensor(grid, dtype=torch.int),
                                 mesh_dim_names=tuple(f"epoch{epoch}.{d}" for d in dims))


def forget(pg: dist.ProcessGroup | None) -> None:
    """Remove a registered group from c10d's maps (and as the default group), leaving its backend
    alone: a hung op on it ends at its own timeout, and destroying it now would wait for that."""
    if pg is None:
        return
    world = c10d._world
    if world.default_pg is pg:
        c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        table.pop(pg, None)
    for pgs in world.tags_to_pg.values():
        while pg in pgs:
            pgs.remove(pg)
    name = pg.group_name
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # noqa: BLE001 (not registered under that name: nothing to undo)
        pass
