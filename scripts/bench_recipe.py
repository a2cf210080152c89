"""What a training recipe costs a step: the GPT of examples/gpt.py trained by two real workers, once
as a plain run (constant learning rate, no clipping, no evaluation: `job_long_plain`) and once with
the recipe (warmup + cosine schedule, gradient clipping, an evaluation of 256 held-out samples every
50 steps: `job_long`), side by side in one run (a section of scripts/bench_planner.py).

  step time   the median `step_s` of the step events: forward, backward, all-reduce, clipping,
              the schedule and the optimizer step (the evaluation runs after it, outside step_s).
              Goal: schedule + clipping cost <= 2%.
  wall        seconds per committed step from first to last: the evaluations included.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"


def bench_recipe(workdir: Path, *, steps: int = 300, skip: int = 20) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant, name in (("plain", "job_long_plain"), ("recipe", "job_long")):
        with LocalJob(f"{GPT}:{name}", workdir / f"recipe-{variant}", min_workers=2,
                      coordinator_args=["--planner", "even"]) as job:
            job.start()
            job.add_worker("w1", "--log-every", "0")
            job.add_worker("w2", "--log-every", "0")
            job.wait_step(steps, 600)
            events = job.events()
            try:
                job.ctl("stop")
            except RuntimeError:
                pass
            job.wait_coordinator(30)
        measured = sorted((e for e in events if e["kind"] == "step" and skip < e["step"] <= steps),
                          key=lambda e: e["step"])
        wall = (measured[-1]["ts"] - measured[0]["ts"]) / (len(measured) - 1)
        out[variant] = {"median_step_s": statistics.median(e["step_s"] for e in measured), "wall_per_step_s": wall,
                        "evals": sum(e["kind"] == "eval" for e in events), "steps": len(measured)}
    plain, recipe = out["plain"], out["recipe"]
    out["step_overhead"] = recipe["median_step_s"] / plain["median_step_s"] - 1
    out["wall_overhead"] = recipe["wall_per_step_s"] / plain["wall_per_step_s"] - 1
    return out
