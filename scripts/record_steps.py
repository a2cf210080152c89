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
from localjob import LocalJob, read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("kind", "ts", "name", "epoch", "step", "samples", "global_batch", "compute_s", "comm_s", "step_s")


def record(schedule: str, workdir: Path) -> list[dict[str, Any]]:
    job_ref = f"{ROOT / 'examples' / ('paced.py' if schedule == 'slow' else 'gpt.py')}:job"
    last = {"quiet": 150, "demo": 300, "slow": 250}[schedule]
    actions = {"demo": [(60, "kill", "w2"), (100, "join", "w4"), (200, "slowdown", "w3")],
               "slow": [(100, "slowdown", "w2")], "quiet": []}[schedule]
    with LocalJob(job_ref, workdir, min_workers=3) as job:
        job.start()

        def add(name: str) -> None:
            job.add_worker(name, "--log-every", "0", "--trace-steps", str(workdir / f"{name}.steps.jsonl"))

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
        out = [{k: e[k] for k in e if k != "ts"} | {"ts": e["ts"]} for e in job.events() if e["kind"] != "step"]
        for trace in workdir.glob("*.steps.jsonl"):
            out += [{"kind": "report", **{k: r[k] for k in KEEP if k in r}} for r in read_jsonl(trace)]
    out = [r for r in out if r["kind"] != "report" or r["step"] <= last]
    return sorted(out, key=lambda r: r["ts"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="record_steps.py", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("schedule", choices=("quiet", "demo", "slow"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    records = record(a.schedule, Path(tempfile.mkdtemp(prefix=f"record-{a.schedule}-")))
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
