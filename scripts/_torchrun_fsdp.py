"""The torchrun + FSDP2 baseline of scripts/bench_parallel.py: plain `fully_shard` over gloo training
an adaptrain job, the way a user would write it by hand.

Run under torchrun, e.g.
  torchrun --standalone --nproc-per-node=3 scripts/_torchrun_fsdp.py --job examples/gpt.py:job_10m --events run.jsonl

The model, optimizer, loss, data and sampler are the job's own (`worker.job.load_job`, step k's batch
is `sample_ids(seed, k, ...)`, rank r computes the contiguous slice `share_slice(shares, r)` with the
batch split as evenly as it goes). Each child of the model that holds parameters is a `fully_shard`
unit, then the root, as adaptrain shards the GPT example. FSDP2 averages gradients over ranks, so
each rank backpropagates `loss_sum * world / global_batch`: the full global batch's gradient. The
job's recipe (clipping by the global gradient norm, the learning-rate schedule) is applied as in
the DDP baseline (`_torchrun_job.apply_recipe`).

--events gets one JSON object a line (rank 0 only): step{step,loss,world,ts}, and start{step,ts} when a
process group is up and the state is loaded.

--checkpoint DIR --checkpoint-every N: what a torchrun elastic user does so that a restart (after
a worker dies, torchrun stops every worker and starts them all again) does not start over: every
N steps a `torch.distributed.checkpoint` (DCP) save of the sharded model and optimizer to
DIR/step-N (written to a temporary name, renamed by rank 0 when all ranks are done), and at start
the newest one is loaded.
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
    p.add_argument("--checkpoint", default="", help="directory of DCP checkpoints (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from _torchrun_job import apply_recipe  # (this script's directory: the DDP baseline beside it)
    from worker import sequence
    from worker.job import load_job, resolve_job_ref, sample_ids, share_slice

    torch.set_num_threads(a.threads)
    src = resolve_job_ref(a.job)
    job = load_job(src.source, src.name, filename=src.ref)
    # Each restart's group on its own key prefix: torchrun keeps one store across restarts, and a
    # restarted gloo group that reads the previous round's addresses cannot connect (pytorch#167288).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,  # type: ignore[attr-defined]
                          os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
                          timedelta(seconds=60))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank,  # type: ignore[attr-defined]
                            world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(job.seed)
    model = sequence.build(job)  # (the job's sequence where it gives one, as the worker trains)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    optimizer = job.optimizer(model.parameters())
    params, base_lrs = list(model.parameters()), [float(g["lr"]) for g in optimizer.param_groups]
    G = job.global_batch
    shares = [G // world + (1 if r < G % world else 0) for r in range(world)]
    steps = a.steps or job.num_steps
    fd = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if rank == 0 else -1
    begin = 0
    saved = sorted((d for d in os.listdir(a.checkpoint) if d.startswith("step-") and d[5:].isdigit()),
                   key=lambda d: int(d[5:])) if a.checkpoint and os.path.isdir(a.checkpoint) else []
    if saved:  # a restart: continue from the newest checkpoint
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp_load({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(a.checkpoint, saved[-1]))
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        begin = int(saved[-1][5:])
    if rank == 0:
        os.write(fd, (json.dumps({"ts": time.time(), "kind": "start", "step": begin}) + "\n").encode())
    for step in range(begin, steps):
        ids = sample_ids(job.seed, step, len(job.dataset), G)[share_slice(shares, rank)]
        inputs, targets = job.dataset[ids]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(model(inputs), targets)
        (loss * (world / G)).backward()  # type: ignore[no-untyped-call]
        apply_recipe(job, params, optimizer, base_lrs, step)
        optimizer.step()
        if rank == 0:
            os.write(fd, (json.dumps({"ts": time.time(), "kind": "step", "step": step + 1,
                                      "loss": float(loss.detach()) / max(1, len(ids)), "world": world}) + "\n").encode())
        if a.checkpoint and (step + 1) % a.checkpoint_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            path = os.path.join(a.checkpoint, f"step-{step + 1}")
            dcp_save({"model": model_state, "optim": optim_state}, checkpoint_id=path + ".tmp")
            dist.barrier()
            if rank == 0:
                os.rename(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
