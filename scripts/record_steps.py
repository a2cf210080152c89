"""Record real step-time series on this machine, for the planner's replay tests.

Runs a real job (coordinator + workers on loopback, workers with `--trace-steps`) through a
schedule and writes one JSON line per record, in time order:

  {"kind": "report", "name", "epoch", "step", "samples", "compute_s", "comm_s", "step_s", ...}
  {"kind": "joined" | "failed" | "left" | "slowdown" | "plan" ..., ...}   the coordinator's events

Schedules:
  quiet  three workers of examples/gpt.py:job, 150 steps, nothing happens (the noise of three
         workers sharing the machine's cores)
  demo   the demo's schedule on examples/gpt.py:job: SIGKILL w2 at step 60, w4 joins at 100,
         `ctl slowdown w3 3` at 200, 300 steps
  slow   three workers of examples/paced.py:job (steady, independent speeds), `ctl slowdown w2 3`
         at step 100, 250 steps

    python scripts/record_steps.py quiet --out tests/data/steps-gpt-quiet.jsonl

A replay (tests/unit/test_calm.py) feeds these through the pure planner, so what it asserts does not
depend on how busy the machine running the tests is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, read_jsonl, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("kind", "ts", "name", "epoch", "step", "samples", "global_batch", "compute_s", "comm_s", "step_s")


SCHEDULES = {  # name: (job, last step, [(at step, action, worker)])
    "quiet": ("gpt.py:job", 150, []),
    "demo": ("gpt.py:job", 300, [(60, "kill", "w2"), (100, "join", "w4"), (200, "slowdown", "w3")]),
    "slow": ("paced.py:job", 250, [(100, "slowdown", "w2")]),
}
REAL_EVENTS = {"quiet": 1, "demo": 4, "slow": 2}  # the first join of the three workers counts as one


def run_schedule(schedule: str, workdir: Path, *, coordinator_args: list[str] | None = None,
                 trace: bool = True) -> list[dict[str, Any]]:
    """Run `schedule` for real; the coordinator's events (and, with `trace`, every step report)."""
    job_name, last, plan = SCHEDULES[schedule]
    actions = list(plan)
    with LocalJob(f"{ROOT / 'examples' / job_name}", workdir, min_workers=3,
                  coordinator_args=coordinator_args) as job:
        job.start()

        def add(name: str) -> None:
            extra = ["--trace-steps", str(workdir / f"{name}.steps.jsonl")] if trace else []
            job.add_worker(name, "--log-every", "0", *extra)

        for name in ("w1", "w2", "w3"):
            add(name)
        while True:
            steps = job.steps()
            done = max(steps, default=0)
            while actions and done >= actions[0][0]:
                _, what, who = actions.pop(0)
                if what == "kill":
                    job.kill(who)
                elif what == "join":
                    add(who)
                else:
                    job.ctl("slowdown", who, "3")
            if done >= last:
                break
            if job.coordinator is not None and job.coordinator.poll() is not None:
                break
            time.sleep(0.1)
        if job.coordinator is not None and job.coordinator.poll() is None:
            try:
                job.ctl("stop")
            except RuntimeError:
                pass  # it finished by itself meanwhile
            job.wait_coordinator(30)
        out = job.events()
        for path in workdir.glob("*.steps.jsonl"):
            out += [{"kind": "report", **{k: r[k] for k in KEEP if k in r}} for r in read_jsonl(path)]
    out = [r for r in out if r["kind"] not in ("report", "step") or r["step"] <= last]
    return sorted(out, key=lambda r: r["ts"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="record_steps.py", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("schedule", choices=("quiet", "demo", "slow"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    records = [r for r in run_schedule(a.schedule, Path(tempfile.mkdtemp(prefix=f"record-{a.schedule}-")))
               if r["kind"] != "step"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    reports = sum(r["kind"] == "report" for r in records)
    plans = sum(r["kind"] == "plan" for r in records)
    print(f"wrote {a.out}: {reports} step reports, {len(records) - reports} events ({plans} plans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
