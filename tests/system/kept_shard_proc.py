"""A process of tests/system/test_kept_shard.py: FSDP2 over gloo on a small model whose parameters
shard unevenly (dim 0 of 7 and 2 rows on 3 members: short and empty shards), its reduce-scatters
run by `worker.parallel.fsdp.AbortableReduceScatter` as all-reduces (or natively, to compare),
two micro-batch passes accumulated, and the previous rank's reduced gradient shards kept
(`KeptShard`). It writes its own gradient shards and the kept ones to OUT/RANK-MODE.pt.

usage: python kept_shard_proc.py RANK WORLD OUT MODE   (MODE: all_reduce or native)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from parallel_harness import _store  # noqa: E402
from plan.layout import Layout  # noqa: E402
from worker.parallel.fsdp import AbortableAllGather, AbortableReduceScatter, CommTime, KeptShard  # noqa: E402

PASSES = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2), nn.LayerNorm(2))


def inputs(rank: int, k: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * rank + k))


def main() -> None:
    rank, world, out, mode = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    names = [f"m{i}" for i in range(world)]
    store = _store(out, names, names[rank])
    dist.init_process_group("gloo", store=dist.PrefixStore(mode, store), rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    net = model()
    for unit in (net[0], net[2], net[3]):
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    source = (rank - 1) % world
    kept = KeptShard(source)
    comm = CommTime()
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            module.set_custom_all_gather(AbortableAllGather(lambda work, _buf: work.wait(), comm))
            module.set_custom_reduce_scatter(AbortableReduceScatter(
                lambda work, _buf: work.wait(), comm, by_all_reduce=mode == "all_reduce", kept=kept))
    kept.clear()
    for k in range(PASSES):
        net(inputs(rank, k)).sum().backward()
    layout = Layout(members=tuple(names), shares=(1,) * world, dp_shard=world)
    own, copy = {}, {}
    for fqn, p in net.named_parameters():
        assert isinstance(p.grad, DTensor)
        grad = p.grad.to_local()
        own[fqn] = grad.reshape(-1).clone()
        if mode == "all_reduce":
            lo, hi = layout.slice_of(source, p.shape[0], p.numel())
            copy[fqn] = kept.grad(grad, hi - lo).clone()
    torch.save({"own": own, "copy": copy}, out / f"{rank}-{mode}.pt")
    dist.barrier()  # (rank 0 serves the store: it leaves last)
    os._exit(0)  # (no teardown of gloo's threads: seen to abort a process at exit, after its work was done)


if __name__ == "__main__":
    main()
