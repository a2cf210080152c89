"""The torchrun + tensor-parallel baseline of scripts/bench_parallel.py: torch's `parallelize_module`
over gloo training an adaptrain job with the job's tensor-parallel plan, the way a user writes it.

Run under torchrun, one process per rank, e.g.
  torchrun --standalone --nproc-per-node=4 scripts/_torchrun_tp.py --job examples/gpt.py:job_10m \
      --events run.jsonl --tp 2

The world is a 2-D mesh (dp = world / tp, tp) from `init_device_mesh`; each tp row splits the
model's Linears as the job's `Job.tp_plan` says (`ColwiseParallel` / `RowwiseParallel`, the same
modules adaptrain splits: `worker.tp_plan.tp_styles`) and computes its data-parallel slot's
contiguous share of the global batch (split as evenly as it goes); the gradients are summed over
the dp axis with one all-reduce per dtype of the local tensors (DDP does not take DTensor
parameters). The loss of the slot is its summed loss over the global batch, so the summed
gradients are the full batch's; the recipe (clipping by the global norm: the split tensors' squares
summed over the tp group, the others counted once; the schedule's learning rate) as adaptrain
applies it. The model, optimizer, loss, data and sampler are the job's own.

--events gets one JSON object a line (rank 0 only; "ts" unix seconds): start{step:0} when the mesh
is up, then step{step,loss,world} after each optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="PATH.py:NAME, as for the coordinator")
    p.add_argument("--events", required=True, help="JSON-lines file to append events to")
    p.add_argument("--tp", type=int, required=True, help="the tensor-parallel degree (divides the world)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the job's)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % a.tp:
        raise SystemExit(f"--tp {a.tp} does not divide the world of {world}")

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from worker import sequence
    from worker.job import load_job, resolve_job_ref, sample_ids, share_slice
    from worker.tp_plan import tp_styles

    torch.set_num_threads(a.threads)
    src = resolve_job_ref(a.job)
    job = load_job(src.source, src.name, filename=src.ref)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dp = world // a.tp
    mesh = init_device_mesh("cpu", (dp, a.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(job.seed)
    model = sequence.build(job)
    styles = tp_styles(job, model)
    parallelize_module(model, mesh["tp"], {n: ColwiseParallel() if s == "colwise" else RowwiseParallel()
                                           for n, s in styles.items()})
    optimizer = job.optimizer(model.parameters())
    params, base_lrs = list(model.parameters()), [float(g["lr"]) for g in optimizer.param_groups]
    G = job.global_batch
    slot, tp_rank = divmod(rank, a.tp)
    shares = [G // dp + (1 if r < G % dp else 0) for r in range(dp)]
    fd = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if rank == 0 else -1

    def write(event: dict[str, Any]) -> None:
        os.write(fd, (json.dumps({"ts": time.time(), **event}) + "\n").encode())

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    dist.barrier()
    if rank == 0:
        write({"kind": "start", "step": 0})
    for step in range(a.steps or job.num_steps):
        ids = sample_ids(job.seed, step, len(job.dataset), G)[share_slice(shares, slot)]
        inputs, targets = job.dataset[ids]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(model(inputs), targets)
        (loss / G).backward()  # type: ignore[no-untyped-call]
        grads = [local(q.grad) for q in params if q.grad is not None]
        if dp > 1:
            for dtype in {g.dtype for g in grads}:
                mine = [g for g in grads if g.dtype == dtype]
                flat = torch.cat([g.reshape(-1) for g in mine])
                dist.all_reduce(flat, group=mesh["dp"].get_group())
                at = 0
                for g in mine:
                    g.view(-1).copy_(flat[at:at + g.numel()])
                    at += g.numel()
        squares = torch.zeros(2, dtype=torch.float64)
        for q in params:
            if q.grad is not None and (tp_rank == 0 or isinstance(q, DTensor) and any(pl.is_shard() for pl in q.placements)):
                squares[0] += local(q.grad).double().pow(2).sum()
        squares[1] = float(loss.detach()) if tp_rank == 0 else 0.0
        dist.all_reduce(squares)  # (every slot's loss and every member's squares; replicas count dp times)
        norm = float((squares[0] / dp).sqrt())
        if job.grad_clip is not None:
            coefficient = min(1.0, job.grad_clip / (norm + 1e-6))
            for g in grads:
                g.mul_(coefficient)
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base * job.lr_multiplier(step)
        optimizer.step()
        if rank == 0:
            write({"kind": "step", "step": step + 1, "loss": float(squares[1]) / G, "world": world})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
