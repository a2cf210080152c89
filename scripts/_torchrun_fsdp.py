"""The torchrun + FSDP2 baseline of scripts/bench_parallel.py: plain `fully_shard` over gloo training
an adaptrain job, the way a user would write it by hand.

Run under torchrun, e.g.
  torchrun --standalone --nproc-per-node=3 scripts/_torchrun_fsdp.py --job examples/gpt.py:job_10m --events run.jsonl

The model, optimizer, loss, data and sampler are the job's own (`worker.job.load_job`, step k's batch
is `sample_ids(seed, k, ...)`, rank r computes the contiguous slice `share_slice(shares, r)` with the
batch split as evenly as it goes). Each child of the model that holds parameters is a `fully_shard`
unit, then the root, as adaptrain shards the GPT example. FSDP2 averages gradients over ranks, so
each rank backpropagates `loss_sum * world / global_batch`: the full global batch's gradient.

--events gets one JSON object a line (rank 0 only): step{step,loss,world,ts}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="PATH.py:NAME, as for the coordinator")
    p.add_argument("--events", required=True, help="JSON-lines file to append events to")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the job's)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from worker.job import load_job, resolve_job_ref, sample_ids, share_slice

    torch.set_num_threads(a.threads)
    src = resolve_job_ref(a.job)
    job = load_job(src.source, src.name, filename=src.ref)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(job.seed)
    model = job.model()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    optimizer = job.optimizer(model.parameters())
    G = job.global_batch
    shares = [G // world + (1 if r < G % world else 0) for r in range(world)]
    steps = a.steps or job.num_steps
    fd = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if rank == 0 else -1
    for step in range(steps):
        ids = sample_ids(job.seed, step, len(job.dataset), G)[share_slice(shares, rank)]
        inputs, targets = job.dataset[ids]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(model(inputs), targets)
        (loss * (world / G)).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if rank == 0:
            os.write(fd, (json.dumps({"ts": time.time(), "kind": "step", "step": step + 1,
                                      "loss": float(loss.detach()) / max(1, len(ids)), "world": world}) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
