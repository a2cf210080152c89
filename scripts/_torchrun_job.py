"""The torchrun baseline of scripts/bench_recovery.py: plain DDP over gloo training an adaptrain job.

Run under torchrun (one process per "node"), e.g.
  torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \
      scripts/_torchrun_job.py --job examples/gpt.py:job --events run.jsonl --ckpt ckpt.pt

The model, optimizer, loss, data set and sampler are the adaptrain job's own (the job file is loaded
with `worker.job.load_job`, the batch of step k is `sample_ids(seed, k, ...)`, rank r computes the
contiguous slice `share_slice(shares, r)` of it with the batch split as evenly as it goes). DDP
averages gradients over ranks, so each rank backpropagates `loss_sum * world / global_batch`: the
gradient is exactly the full global batch's, as in adaptrain; the job's recipe (gradient clipping,
learning-rate schedule) is applied as a torchrun user would (`apply_recipe`), so both train alike.
The job's evaluation runs as often as in adaptrain (`eval_every`, and after the last step): each rank
sums the loss over its contiguous part of the held-out set, the sums are all-reduced (`evaluate`).

With --ckpt, rank 0 saves model + optimizer + step after every step (write to a temporary file,
fsync-free `os.replace`: atomic on one file system) and every process resumes from that file when it
starts, as torchrun's elastic restarts expect. A step is "committed" once its checkpoint is in place
(or, without --ckpt, once the optimizer has applied it).

--events gets one JSON object a line (O_APPEND, one write per line; "ts" unix seconds):
  start{pid,ppid,rank,world,restart}  resumed{step,rank,world}  step{step,loss,world}  (rank 0 only)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any


def apply_recipe(job: Any, params: list[Any], optimizer: Any, base_lrs: list[float], step: int) -> None:
    """What a torchrun user writes for the job's recipe, as adaptrain applies it before each update:
    the gradient clipped to `grad_clip` by its global norm (a sharded gradient's norm gathered, as
    torchtitan does), and every group's learning rate set from the schedule."""
    import torch
    from torch.distributed.tensor import DTensor

    if job.grad_clip is not None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, job.grad_clip, norm)
    multiplier = job.lr_multiplier(step)
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * multiplier


def evaluate(job: Any, model: Any, rank: int, world: int) -> float:
    """The mean held-out loss, as a torchrun user computes it: each rank its contiguous part of the
    set, in chunks of EVAL_CHUNK, the (loss sum, count) pairs all-reduced."""
    import torch
    import torch.distributed as dist

    from worker.evaluate import EVAL_CHUNK
    from worker.job import share_slice

    total = len(job.eval_dataset)
    part = share_slice([total // world + (1 if r < total % world else 0) for r in range(world)], rank)
    sums = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for start in range(part.start, part.stop, EVAL_CHUNK):
            inputs, targets = job.eval_dataset[torch.arange(start, min(start + EVAL_CHUNK, part.stop))]
            sums[0] += job.loss(model(inputs), targets).double()
            sums[1] += len(inputs)
    model.train()
    dist.all_reduce(sums)
    return float(sums[0] / sums[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="PATH.py:NAME, as for the coordinator")
    p.add_argument("--events", required=True, help="JSON-lines file to append events to")
    p.add_argument("--ckpt", help="checkpoint file (rank 0 writes it every step); none: no checkpoints")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the job's)")
    p.add_argument("--timeout", type=float, default=30.0, help="gloo process group timeout, seconds")
    a = p.parse_args()
    fd = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def log(kind: str, **fields: object) -> None:
        os.write(fd, (json.dumps({"ts": time.time(), "kind": kind, **fields}) + "\n").encode())

    log("start", pid=os.getpid(), ppid=os.getppid(), rank=rank, world=world,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from worker import sequence
    from worker.job import load_job, resolve_job_ref, sample_ids, share_slice

    torch.set_num_threads(a.threads)
    src = resolve_job_ref(a.job)
    job = load_job(src.source, src.name, filename=src.ref)
    torch.manual_seed(job.seed)  # as the adaptrain worker does: identical initial parameters
    model = sequence.build(job)  # (the job's sequence where it gives one, as the worker trains)
    optimizer = job.optimizer(model.parameters())
    step = 0
    if a.ckpt and os.path.exists(a.ckpt):
        state = torch.load(a.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    ddp = DistributedDataParallel(model)
    G = job.global_batch
    shares = [G // world + (1 if r < G % world else 0) for r in range(world)]
    params, base_lrs = list(ddp.parameters()), [float(g["lr"]) for g in optimizer.param_groups]
    log("resumed", step=step, rank=rank, world=world)
    last = a.steps or job.num_steps
    while step < last:
        ids = sample_ids(job.seed, step, len(job.dataset), G)[share_slice(shares, rank)]
        inputs, targets = job.dataset[ids]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(ddp(inputs), targets)
        (loss * (world / G)).backward()  # type: ignore[no-untyped-call]  # DDP divides by world
        apply_recipe(job, params, optimizer, base_lrs, step)
        optimizer.step()
        step += 1
        if rank == 0:
            if a.ckpt:
                tmp = f"{a.ckpt}.tmp"
                torch.save({"step": step, "model": model.state_dict(),
                            "optimizer": optimizer.state_dict()}, tmp)
                os.replace(tmp, a.ckpt)
            log("step", step=step, loss=float(loss.detach()) / max(1, len(ids)), world=world)
        if job.eval_every and job.eval_dataset is not None and (step % job.eval_every == 0 or step == job.num_steps):
            held_out = evaluate(job, model, rank, world)
            if rank == 0:
                log("eval", step=step, loss=held_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
