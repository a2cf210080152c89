"""Durability, measured on this machine with real processes on loopback (issue #12), on the
10M-parameter GPT (examples/gpt.py:job_10m) by default:

  checkpoint   the same job twice, two workers: without checkpoints, and with `--checkpoint-every K`
               (DCP `async_save`: each member stages its part, then writes it in a thread). Global
               samples/s over the same steps (after a warm-up) and the difference; each
               checkpoint's time from its step boundary to complete on disk, its size, and how long
               the step waited for it (the checkpoint group, the state dict and the staging copy:
               the workers' "the step waited" lines).
  total_loss   every worker SIGKILLed at once (more than any redundancy covers), then as many new
               worker processes started: seconds from the kill to the `resumed` event (every member
               loaded the newest checkpoint) and to the first step committed after it, and the
               steps redone (those after the checkpoint). The new processes' start (importing torch,
               building the job) is included: it is what a replaced spot machine costs.
  drain        `ctl drain` of one of three members: seconds from the request to the epoch without
               it in place (its `reshard` event) and steps redone (none: a drain is planned).
  restart      the coordinator SIGKILLed mid-run and started again on the same state dir (its
               journal): seconds from the kill to its ready line (the process start) and to the
               members registered again (`recovered`), the steps the workers committed while it was
               away, and steps redone (none: they never stopped).
Prints a table, writes JSON.

usage: python scripts/bench_faults.py [--job REF] [--every K] [--steps N] [--sections ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("checkpoint", "total_loss", "drain", "restart")
STAGED = re.compile(r"checkpoint of step (\d+): the step waited (\d+) ms")


def _rate(events: list[dict[str, Any]], first: int, last: int, batch: int) -> float:
    ts = {e["step"]: e["ts"] for e in events if e["kind"] == "step"}
    return float(batch * (last - first) / (ts[last] - ts[first]))


def _batch(job_ref: str) -> int:
    from worker.job import load_job, resolve_job_ref

    src = resolve_job_ref(job_ref)
    return load_job(src.source, src.name, filename=src.ref).global_batch


def checkpoint_overhead(job_ref: str, every: int, warmup: int, steps: int, workdir: Path) -> dict[str, Any]:
    batch = _batch(job_ref)
    out: dict[str, Any] = {"every": every, "steps": steps}
    for label, extra in (("none", []), ("async_save", ["--checkpoint-every", str(every)])):
        with LocalJob(job_ref, workdir / label, min_workers=2, coordinator_args=extra) as job:
            job.start()
            job.add_worker("w1")
            job.add_worker("w2")
            job.wait_step(warmup + steps, 1800)
            events = job.events()
            job.ctl("stop")
            job.wait_coordinator(60)
            logs = job.tail("w1", 10_000) + "\n" + job.tail("w2", 10_000)
        out[f"{label}_samples_per_s"] = _rate(events, warmup, warmup + steps, batch)
        if label == "async_save":
            written = [e for e in events if e["kind"] == "checkpoint"]
            staged = [int(ms) / 1e3 for _, ms in STAGED.findall(logs)]
            out["checkpoints"] = len(written)
            out["write_s"] = statistics.median(e["seconds"] for e in written) if written else None
            out["bytes"] = written[-1]["bytes"] if written else 0
            out["staging_s"] = statistics.median(staged) if staged else None
    out["overhead"] = 1 - out["async_save_samples_per_s"] / out["none_samples_per_s"]
    return out


def total_loss(job_ref: str, every: int, workdir: Path) -> dict[str, Any]:
    with LocalJob(job_ref, workdir, min_workers=2, coordinator_args=["--checkpoint-every", str(every)]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= every, 1800, "a checkpoint")
        job.wait_step(max(job.steps()) + 2, 600)  # a few steps past it: those are redone
        reached = max(job.steps())
        t_kill = time.time()
        for name in ("w1", "w2"):
            job.workers[name].send_signal(signal.SIGKILL)
        job.wait_workers(30)
        for name in ("w3", "w4"):
            job.add_worker(name)
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 600, "resumed")
        first = job.wait_event(lambda e: e["kind"] == "step" and e["ts"] > resumed["ts"], 600, "a step after it")
        job.ctl("stop")
        job.wait_coordinator(60)
    return {"kill_to_resumed_s": resumed["ts"] - t_kill, "kill_to_next_step_s": first["ts"] - t_kill,
            "redone": resumed["redone"], "reached": reached, "checkpoint_step": resumed["step"]}


def drain(job_ref: str, workdir: Path) -> dict[str, Any]:
    with LocalJob(job_ref, workdir, min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(3, 1800)
        before = max(job.steps())
        t0 = time.time()
        job.ctl("drain", "w3")
        plan = job.wait_event(lambda e: e["kind"] == "plan" and bool(e.get("layout")) and "w3" not in e["layout"]["members"],
                              600, "the plan without w3")
        done = job.wait_event(lambda e: e["kind"] == "reshard" and e["epoch"] == plan["epoch"], 600, "it in place")
        steps = [e["step"] for e in job.events() if e["kind"] == "step"]
        job.ctl("stop")
        job.wait_coordinator(60)
    return {"drain_to_in_place_s": done["ts"] - t0, "redone": len(steps) - len(set(steps)), "at_step": before}


def restart(job_ref: str, workdir: Path) -> dict[str, Any]:
    with LocalJob(job_ref, workdir, min_workers=2) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(3, 1800)
        assert job.coordinator is not None
        t_kill = time.time()
        job.coordinator.send_signal(signal.SIGKILL)
        job.wait_coordinator(30)
        gone_at = max(job.steps())
        job.start()
        t_ready = time.time()
        recovered = job.wait_event(lambda e: e["kind"] == "recovered", 600, "recovered")
        job.wait_step(recovered["step"] + 1, 600)
        steps = [e["step"] for e in job.events() if e["kind"] == "step"]
        job.ctl("stop")
        job.wait_coordinator(60)
    return {"kill_to_ready_s": t_ready - t_kill, "kill_to_recovered_s": recovered["ts"] - t_kill,
            "steps_while_away": recovered["step"] - gone_at, "missing": sorted(set(range(1, max(steps) + 1)) - set(steps)),
            "redone": 0}


def table(r: dict[str, Any]) -> str:
    rows = [("what", "figure")]
    if c := r.get("checkpoint"):
        rows += [(f"samples/s, no checkpoints ({c['steps']} steps)", f"{c['none_samples_per_s']:.2f}"),
                 (f"samples/s, async_save every {c['every']} steps", f"{c['async_save_samples_per_s']:.2f}"),
                 ("step-time overhead of checkpointing", f"{c['overhead']:+.1%}"),
                 ("checkpoint: step boundary -> complete on disk (median)", f"{c['write_s']:.2f} s"),
                 ("checkpoint: the step's wait (group, state dict, staging; median)", f"{c['staging_s'] * 1e3:.0f} ms"),
                 ("checkpoint size", f"{c['bytes'] / 1e6:.1f} MB ({c['checkpoints']} written)")]
    if t := r.get("total_loss"):
        rows += [("every worker killed -> resumed from the checkpoint", f"{t['kill_to_resumed_s']:.2f} s"),
                 ("every worker killed -> next committed step", f"{t['kill_to_next_step_s']:.2f} s"),
                 ("steps redone (reached, checkpoint)", f"{t['redone']} ({t['reached']}, {t['checkpoint_step']})")]
    if d := r.get("drain"):
        rows += [("ctl drain -> epoch without it in place", f"{d['drain_to_in_place_s']:.2f} s"),
                 ("steps redone by the drain", str(d["redone"]))]
    if c := r.get("restart"):
        rows += [("coordinator SIGKILLed -> restarted, listening", f"{c['kill_to_ready_s']:.2f} s"),
                 ("coordinator SIGKILLed -> members registered again", f"{c['kill_to_recovered_s']:.2f} s"),
                 ("steps committed while it was away (missing from the log)",
                  f"{c['steps_while_away']} ({len(c['missing'])})")]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default=f"{ROOT / 'examples' / 'gpt.py'}:job_10m", help="the job (default the 10M GPT)")
    p.add_argument("--every", type=int, default=5, metavar="K", help="checkpoint every K steps (default 5)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="steps before measuring (default 3)")
    p.add_argument("--steps", type=int, default=20, metavar="N", help="steps measured (default 20)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=Path("bench_faults.json"), help="JSON results (bench_faults.json)")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    sections = [s for s in a.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if a.every < 1 or a.steps < 2 or a.warmup < 1:
        p.error("--every and --warmup must be at least 1, --steps at least 2")
    results: dict[str, Any] = {"job": a.job}
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        work = Path(tmp)
        if "checkpoint" in sections:
            print("checkpoint: two runs of the job, without and with checkpoints ...", flush=True)
            results["checkpoint"] = checkpoint_overhead(a.job, a.every, a.warmup, a.steps, work / "checkpoint")
        if "total_loss" in sections:
            print("total_loss: every worker killed, new ones resume ...", flush=True)
            results["total_loss"] = total_loss(a.job, a.every, work / "total_loss")
        if "restart" in sections:
            print("restart: the coordinator killed and started again ...", flush=True)
            results["restart"] = restart(a.job, work / "restart")
        if "drain" in sections:
            print("drain: one of three members drained ...", flush=True)
            results["drain"] = drain(a.job, work / "drain")
    print(table(results))
    a.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
