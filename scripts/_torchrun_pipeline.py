"""The torchrun + `torch.distributed.pipelining` baseline of scripts/bench_pipeline.py: torch's own
pipeline schedule over gloo training an adaptrain job, the way a user would write it by hand.

Run under torchrun, one process per stage, e.g.
  torchrun --standalone --nproc-per-node=3 scripts/_torchrun_pipeline.py --job examples/gpt.py:job \
      --events run.jsonl --cuts 0,1|2,3|4,5 --microbatches 4

The model, optimizer, loss, data and sampler are the job's own (`worker.job.load_job`, step k's batch
is `sample_ids(seed, k, ...)`, every stage sees the whole global batch, as in adaptrain's pipeline).
Rank r holds the units of the r-th group of `--cuts` (children of the GPT's nn.Sequential, '0'..'5';
default: as even a split as the unit count allows) as one `PipelineStage`, and `Schedule1F1B` (or
`--schedule gpipe`) runs `--microbatches` micro-batches, which must divide the global batch:
torch's stage pre-allocates its receive buffers from the first micro-batch, so unequal micro-batches
fail (pytorch#126600), unlike adaptrain's own 1F1B (worker/parallel/pipeline.py). The loss of a
micro-batch is its summed loss divided by the global batch and the schedule does not rescale the
gradients (`scale_grads=False`), so the summed gradients are the full batch's, as adaptrain's. The
recipe (clipping by the global gradient norm, gathered over the stages with one all-reduce of the
squared norms; the learning-rate schedule) is applied as adaptrain applies it.

`--slowdown RANK:FACTOR` stretches that rank's compute as adaptrain's `--slowdown` does a pipeline
stage's: the schedule gives no hook between a stage's computations and its sends, so the stage's
compute in a step is taken as the CPU time its thread spent in the step's schedule (waiting for a
neighbour takes none: the forwards, backwards and the issuing of sends), and that rank sleeps
(FACTOR - 1) x that time after the schedule, before the optimizer step: its neighbours wait for it
at the next step's boundaries, as for a slow device (and as adaptrain's stage sleeps).

`--slow-cgroup RANK:PATH` makes that rank a slow device instead: it moves itself into the CPU
cgroup at PATH (scripts/slowcpu.py, a fraction of a core) before it builds anything, as the
benchmark starts adaptrain's slow worker in it.

`--schedule adaptrain` runs adaptrain's own 1F1B (worker/parallel/pipeline.py: `one_f_one_b`) in
place of torch's, over the same group with plain waits (`work.wait()`): the schedule alone, without
the coordinator, the ring of copies or the abortable waits, so that the benchmark can tell the
schedule's cost apart from the rest of the system's. Its micro-batches are `--microbatches`
contiguous slices of the batch (need not divide it).

Measured on torch 2.13 (CPU, gloo, loopback): `Schedule1F1B` and `ScheduleGPipe` run; the batched p2p
hang of pytorch#132644 was not met at these sizes (if a run hangs, the driver's timeout reports it).

--events gets one JSON object a line (rank 0 only; "ts" unix seconds): start{step,ts} when the group
is up, then step{step,ts,world} after each optimizer step; the last rank writes loss{step,loss}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any


def parse_cuts(text: str, units: int, stages: int) -> list[list[int]]:
    """'0,1|2,3|4,5' -> [[0, 1], [2, 3], [4, 5]]; '' -> units split as evenly as they go."""
    if not text:
        base, extra = divmod(units, stages)
        sizes = [base + (1 if s < extra else 0) for s in range(stages)]
        starts = [sum(sizes[:s]) for s in range(stages)]
        return [list(range(a, a + n)) for a, n in zip(starts, sizes)]
    cuts = [[int(u) for u in part.split(",")] for part in text.split("|")]
    if len(cuts) != stages or [u for c in cuts for u in c] != list(range(units)):
        raise ValueError(f"--cuts {text!r}: want {stages} groups covering units 0..{units - 1} in order")
    return cuts


def clip_and_schedule(job: Any, params: list[Any], optimizer: Any, base_lrs: list[float], step: int) -> float:
    """The recipe across stages: the global gradient norm (each stage's squared norm all-reduced),
    the clip, the learning rate of the schedule. Returns the norm."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    squares = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if job.grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, job.grad_clip, torch.tensor(norm))
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = base * job.lr_multiplier(step)
    return norm


def adaptrain_schedule(job: Any, module: Any, rank: int, world: int, microbatches: int) -> Any:
    """`step(inputs, targets) -> the summed loss (last stage; 0 elsewhere)`: adaptrain's 1F1B over the
    default group, each wait a plain `work.wait()`, `microbatches` contiguous slices of the batch."""
    import torch
    import torch.distributed as dist

    from plan.pipeline import micro_batches
    from worker.parallel.pipeline import StageStep, one_f_one_b

    pg = dist.distributed_c10d._get_default_group()
    sizes = micro_batches(job.global_batch, microbatches)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return one_f_one_b(StageStep(
            module=module, stage=rank, stages=world, prev_rank=rank - 1 if rank > 0 else None,
            next_rank=rank + 1 if rank < world - 1 else None, send=lambda x, dst, tag: pg.send([x], dst, tag),
            recv=lambda x, src, tag: pg.recv([x], src, tag), wait=lambda work, buf: work.wait(), sizes=sizes,
            device=torch.device("cpu"), inputs=torch.split(inputs, list(sizes)) if rank == 0 else (),
            targets=torch.split(targets, list(sizes)) if rank == world - 1 else (), loss=job.loss,
            global_batch=job.global_batch))

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="PATH.py:NAME, as for the coordinator")
    p.add_argument("--events", required=True, help="JSON-lines file to append events to")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the job's)")
    p.add_argument("--cuts", default="", help="units per stage, e.g. '0,1,2|3,4,5' (default: even)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches a step (torch's schedules: must divide the global batch)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe", "adaptrain"), default="1f1b",
                   help="torch's Schedule1F1B or ScheduleGPipe, or adaptrain's own 1F1B (see above)")
    p.add_argument("--slowdown", default="", metavar="RANK:FACTOR", help="stretch that rank's compute")
    p.add_argument("--slow-cgroup", default="", metavar="RANK:PATH", help="that rank runs in the CPU cgroup PATH")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.slow_cgroup and int(a.slow_cgroup.split(":", 1)[0]) == rank:
        with open(os.path.join(a.slow_cgroup.split(":", 1)[1], "cgroup.procs"), "w") as f:
            f.write(f"{os.getpid()}\n")

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from worker import sequence
    from worker.job import load_job, resolve_job_ref, sample_ids

    torch.set_num_threads(a.threads)
    src = resolve_job_ref(a.job)
    job = load_job(src.source, src.name, filename=src.ref)
    G = job.global_batch
    if G % a.microbatches and a.schedule != "adaptrain":
        raise SystemExit(f"--microbatches {a.microbatches} must divide the global batch {G} "
                         "(torch's pipelining fails on unequal micro-batches)")
    slow_rank, factor = (int(a.slowdown.split(":")[0]), float(a.slowdown.split(":")[1])) if a.slowdown else (-1, 1.0)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(job.seed)
    model = sequence.build(job)  # (the job's sequence where it gives one, as the worker trains)
    children = list(model.children())
    cuts = parse_cuts(a.cuts, len(children), world)
    module = nn.Sequential(*[children[u] for u in cuts[rank]])
    first, last = rank == 0, rank == world - 1

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return job.loss(out, target) / G

    if a.schedule == "adaptrain":
        ours = adaptrain_schedule(job, module, rank, world, a.microbatches)
    else:
        schedule_cls = Schedule1F1B if a.schedule == "1f1b" else ScheduleGPipe
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        schedule = schedule_cls(stage, a.microbatches, loss_fn=loss_fn, scale_grads=False)
    optimizer = job.optimizer(module.parameters())
    params, base_lrs = list(module.parameters()), [float(g["lr"]) for g in optimizer.param_groups]
    slowed = rank == slow_rank and factor > 1.0
    fd = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if rank in (0, world - 1) else -1

    def write(event: dict[str, Any]) -> None:
        os.write(fd, (json.dumps({"ts": time.time(), **event}) + "\n").encode())

    dist.barrier()
    if rank == 0:
        write({"kind": "start", "step": 0, "cuts": cuts, "microbatches": a.microbatches})
    for step in range(a.steps or job.num_steps):
        inputs, targets = job.dataset[sample_ids(job.seed, step, len(job.dataset), G)]
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        cpu0 = time.thread_time()
        if a.schedule == "adaptrain":
            summed = ours(inputs, targets)
            if last:
                losses.append(summed / G)
        elif first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        if slowed:  # (see the top comment)
            time.sleep((factor - 1.0) * (time.thread_time() - cpu0))
        clip_and_schedule(job, params, optimizer, base_lrs, step)
        optimizer.step()
        if rank == 0:
            write({"kind": "step", "step": step + 1, "world": world})
        if last:
            write({"kind": "loss", "step": step + 1, "loss": float(sum(float(x.detach()) for x in losses))})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
