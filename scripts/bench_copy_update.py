"""What the redundancy's optimizer step costs a keeper, beside the same step on plain tensors.

A sharded member keeps a copy of its source's slices and applies every step's update to it with
the job's own optimizer (`worker.parallel.update.apply_update`: an optimizer built over views of
the copy's pieces each step). This times that update on a copy of 1/`--share` of every tensor of
the job's model (a member's copy in a `--share`-way sharded layout) against the job's optimizer
`step()` on plain tensors of the same sizes, which is what the owner pays for its own slices: the
difference is the overhead of updating pieces held outside any model. One torch thread, as a
worker by default. Prints a table, writes JSON.

usage: python scripts/bench_copy_update.py [--job examples/gpt.py:job_10m] [--share 3] [--steps 30]
                                           [--out bench-out/copy_update.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(job_ref: str, share: int, steps: int) -> dict[str, Any]:
    import torch

    from worker.job import load_job, resolve_job_ref
    from worker.parallel.slices import PARAM, LocalState, Piece
    from worker.parallel.update import GRAD, apply_update

    torch.set_num_threads(1)
    src = resolve_job_ref(job_ref)
    job = load_job(src.source, src.name, filename=src.ref)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    copy = LocalState(step=0, keys={}, hyper=hyper)
    pieces: dict[str, list[Piece]] = {}
    for n, p in model.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        count = max(rows // share, 1) * (p.numel() // rows)  # whole rows, as a slice is cut
        pieces[n] = [Piece(0, count, {PARAM: torch.randn(count)})]
        copy.keys[n] = (PARAM,)
    elements = sum(q[0].hi for q in pieces.values())

    def timed(step: Any, grads: Any) -> float:
        times = []
        for _ in range(steps):
            grads()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[steps // 5:])  # (the first steps create the state)

    def copy_grads() -> None:
        for ps in pieces.values():
            ps[0].data[GRAD] = torch.randn(ps[0].hi) * 1e-3

    copy_s = timed(lambda: apply_update(job.optimizer, copy, pieces, shapes, lambda i: 1e-4, 0.9), copy_grads)
    plain = [torch.nn.Parameter(torch.randn(q[0].hi)) for q in pieces.values()]
    plain_optimizer = job.optimizer(plain)

    def plain_grads() -> None:
        for p in plain:
            p.grad = torch.randn(p.numel()) * 1e-3

    plain_s = timed(plain_optimizer.step, plain_grads)
    return {"job": job_ref, "share": share, "tensors": len(pieces), "elements": elements, "steps": steps,
            "copy_update_s": copy_s, "plain_step_s": plain_s, "overhead_s": copy_s - plain_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="examples/gpt.py:job_10m", help="PATH:NAME of the job (default: %(default)s)")
    p.add_argument("--share", type=int, default=3, help="the copy holds 1/SHARE of every tensor (default: 3)")
    p.add_argument("--steps", type=int, default=30, help="steps timed, the first fifth not counted (default: 30)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-out" / "copy_update.json")
    a = p.parse_args(argv)
    if a.share < 1 or a.steps < 5:
        p.error("--share must be >= 1 and --steps >= 5")
    r = measure(a.job, a.share, a.steps)
    print(f"bench_copy_update: {r['job']}, a copy of 1/{r['share']} of every tensor ({r['tensors']} tensors, "
          f"{r['elements'] / 1e6:.2f}M elements), one thread, median of {r['steps'] - r['steps'] // 5} steps")
    print(f"  {'the copy (apply_update)':<36} {r['copy_update_s'] * 1e3:8.2f} ms")
    print(f"  {'the optimizer on plain tensors':<36} {r['plain_step_s'] * 1e3:8.2f} ms")
    print(f"  {'overhead of the copy':<36} {r['overhead_s'] * 1e3:8.2f} ms")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
