"""The planner's stability, real workers on this machine: plan epochs per real event, and the
throughput they reach, for the calm planner (`--stability calm`, the default) against the planner
before it (`--stability legacy`), side by side on the same schedules (scripts/record_steps.py):

  demo   the demo's schedule on examples/gpt.py:job (three workers sharing two cores; SIGKILL w2 at
         step 60, w4 joins at 100, `ctl slowdown w3 3` at 200; 300 steps): 4 real events.
         Goal: epochs <= real events + 1.
  quiet  three GPT workers, 150 steps, nothing happens: 1 real event (the first join).
         Goal: <= 2 plans.

Throughput: global samples/s from the first to the last committed step (a planner that never
re-plans is also calm; this says whether calm costs speed).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_steps import REAL_EVENTS, run_schedule  # noqa: E402


def _summary(events: list[dict[str, Any]], schedule: str) -> dict[str, Any]:
    steps = sorted((e for e in events if e["kind"] == "step"), key=lambda e: e["step"])
    plans = [e for e in events if e["kind"] == "plan" and e.get("layout")]
    wall = steps[-1]["ts"] - steps[0]["ts"] if len(steps) > 1 else 0.0
    samples = sum(e["samples"] for e in steps[1:])
    return {"epochs": len(plans), "real_events": REAL_EVENTS[schedule], "reasons": [p["reason"] for p in plans],
            "kept": sum(e["kind"] == "kept" for e in events),
            "stragglers": sum(e["kind"] == "straggler" for e in events),
            "steps": len(steps), "samples_per_s": samples / wall if wall > 0 else None,
            "median_step_s": statistics.median(e["step_s"] for e in steps) if steps else None}


def bench_stability(workdir: Path, *, schedules: tuple[str, ...] = ("demo", "quiet")) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule in schedules:
        for mode in ("calm", "legacy"):
            events = run_schedule(schedule, workdir / f"stability-{schedule}-{mode}",
                                  coordinator_args=["--stability", mode], trace=False)
            out[f"{schedule}_{mode}"] = _summary(events, schedule)
    return out
