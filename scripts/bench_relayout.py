"""Live layout changes against checkpoint-and-relaunch, measured side by side in one run on this
machine (gloo over loopback, one torch thread per process), on the 10M GPT (examples/gpt.py:job_10m)
over four workers (`scripts/_relayout_job.py`: `job_10m` with room for the tour's steps).

A tour of layouts, each change made two ways:

  live       one job; `adaptrain-ctl layout B` while it trains: the plan goes out for the next step
             boundary, the members reshard into B and train on.
  relaunch   what a change costs without live resharding: a durable checkpoint at the next step
             boundary (SIGTERM to the coordinator, which checkpoints, stops the workers and exits),
             then the coordinator restarted on the same state directory with `--layout B` and four
             new worker processes, which load the checkpoint (DCP, resharded into B on load).

Measured for each: the downtime, training stopped for the change (from the last step committed in
the old layout to the start of the first one in B: that step's commit less its own time), and the
time from the request (the coordinator's `layout` event; SIGTERM) to that first step committed; live,
also the members' epoch entry (group + reshard + executor: the `reshard` event's seconds).

The default tour visits data parallel, FSDP, HSDP, a pipeline with replicas, tensor parallel with
replicas, and two hybrids (pp x tp, FSDP x tp), then goes back to data parallel: seven changes.
The live job also gives the cost model's error in every layout: each epoch's predicted step time
against the median of its measured steps (after it settles). With `--laps 2` the live job tours
twice: on the first lap every layout kind is new to the cost model (predicted from speeds measured
in another layout), on the second each kind's efficiency has been learned from its first visit
(the model as calibrated online); the relaunch makes the first lap's changes only.

Goals: each live downtime <= 1 s; live downtime >= 25x shorter than relaunch's; cost-model median
error across the layouts <= 10%. Prints a table, writes JSON.

usage: python scripts/bench_relayout.py [--tour "fsdp=1;dp=1;..."] [--laps N] [--workers 4] [--job REF]
                                        [--out FILE] [--keep DIR]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, write_report, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOB = f"{ROOT / 'scripts' / '_relayout_job.py'}:job_10m"  # (examples/gpt.py's 10M GPT, with steps for two laps)
TOUR = ("fsdp=1", "dp=1", "dp=2,fsdp=2", "pp=2,dp=2", "tp=2,dp=2", "pp=2,tp=2", "fsdp=2,tp=2", "fsdp=1")
SETTLE = 3  # steps of an epoch not counted in its measured step time (its entry, the first re-plans)
MEASURE = 4  # steps of each layout whose median is its measured step time


def _plan_after(events: list[dict[str, Any]], seen: int) -> dict[str, Any] | None:
    return next((e for e in events[seen:] if e["kind"] == "plan" and e["reason"] == "layout" and e.get("layout")), None)


def _started(job_ref: str, layout: str, workers: int, work: Path) -> LocalJob:
    """A job pinned to `layout`, its coordinator and `workers` workers (w1, w2, ...) started."""
    job = LocalJob(job_ref, work, min_workers=workers, coordinator_args=["--layout", layout])
    job.start()
    for i in range(workers):
        job.add_worker(f"w{i + 1}")
    return job


def live(job_ref: str, tour: list[str], workers: int, work: Path, laps: int = 1) -> list[dict[str, Any]]:
    """One job through the tour `laps` times, each change by `ctl layout`; a row per change."""
    rows: list[dict[str, Any]] = []
    stops = tour + tour[1:] * (laps - 1)
    with _started(job_ref, tour[0], workers, work) as job:
        start = job.wait_step(SETTLE + MEASURE, 600, poll_s=0.2)
        epoch = start["epoch"]
        for i, (before, after) in enumerate(zip(stops, stops[1:])):
            measured = _steps_of(job.events(), epoch)
            seen = len(job.events())
            assert "layout" in job.ctl("layout", after)
            plan = job.wait_until(lambda events: _plan_after(events, seen), 300, f"a plan for {after}")
            epoch = plan["epoch"]
            first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == epoch, 300, f"a step in {after}")
            job.wait_epoch_steps(epoch, SETTLE + MEASURE, 600)
            events = job.events()
            asked = next(e["ts"] for e in events[seen:] if e["kind"] == "layout")
            last = [e for e in events if e["kind"] == "step" and e["epoch"] < epoch][-1]
            entry = next((e for e in events if e["kind"] == "reshard" and e["epoch"] == epoch), {})
            rows.append({"change": f"{before} -> {after}", "from": before, "to": after, "lap": 1 + i // (len(tour) - 1),
                         "layout": plan["layout"], "pause_s": entry.get("seconds"), "moved_bytes": entry.get("bytes"),
                         "downtime_s": first["ts"] - first["step_s"] - last["ts"],
                         "request_to_step_s": first["ts"] - asked,
                         "predicted_step_s": plan.get("predicted_step_s"),
                         "measured_step_s": _median_step(_steps_of(events, epoch)),
                         "before_measured_step_s": _median_step(measured)})
            print(f"live (lap {rows[-1]['lap']}) {before} -> {after}: downtime {rows[-1]['downtime_s']:.2f} s (entry {rows[-1]['pause_s']} s), "
                  f"request to step {rows[-1]['request_to_step_s']:.2f} s", flush=True)
        job.ctl("stop")
        job.wait_coordinator(60)
    return rows


def relaunch(job_ref: str, tour: list[str], workers: int, work: Path) -> list[dict[str, Any]]:
    """The same tour by checkpoint, stop and relaunch on the same state directory; a row per change."""
    names = [f"w{i + 1}" for i in range(workers)]
    rows: list[dict[str, Any]] = []
    with _started(job_ref, tour[0], workers, work) as job:
        job.wait_step(SETTLE, 600, poll_s=0.2)
        for before, after in zip(tour, tour[1:]):
            seen = len(job.events())
            asked = time.time()  # (SIGTERM: the request)
            assert job.coordinator is not None
            job.coordinator.send_signal(signal.SIGTERM)  # (a checkpoint at the next boundary, then stop)
            if job.wait_coordinator(300) != 0:
                raise RuntimeError(f"the coordinator did not stop cleanly: {job.tail('coordinator.out')}")
            job.wait_workers(120)
            stopped = time.time()
            job.coordinator_args = ["--layout", after]
            job.start()
            for name in names:
                job.add_worker(name)
            first = job.wait_until(lambda events: next((e for e in events[seen:] if e["kind"] == "step"
                                                        and e["ts"] > stopped), None), 600, f"a step in {after}")
            events = job.events()
            written = next((e for e in events[seen:] if e["kind"] == "checkpoint"), {})
            last = [e for e in events if e["kind"] == "step" and e["ts"] < stopped][-1]
            rows.append({"change": f"{before} -> {after}", "request_to_step_s": first["ts"] - asked,
                         "downtime_s": first["ts"] - first["step_s"] - last["ts"],
                         "stop_s": stopped - asked, "checkpoint_bytes": written.get("bytes")})
            print(f"relaunch {before} -> {after}: downtime {rows[-1]['downtime_s']:.2f} s, request to step "
                  f"{rows[-1]['request_to_step_s']:.2f} s (stop {rows[-1]['stop_s']:.2f} s)", flush=True)
            job.wait_step(first["step"] + 1, 600, poll_s=0.2)
        job.ctl("stop")
        job.wait_coordinator(60)
    return rows


def _steps_of(events: list[dict[str, Any]], epoch: int) -> list[float]:
    return [e["step_s"] for e in events if e["kind"] == "step" and e["epoch"] == epoch][SETTLE:]


def _median_step(steps: list[float]) -> float | None:
    return statistics.median(steps) if steps else None


def table(result: dict[str, Any]) -> str:
    lines = [f"{'change':<26} {'downtime s: live':>16} {'(entry)':>7} {'relaunch':>8} {'shorter':>8}   "
             f"{'request->step s: live':>21} {'relaunch':>8}   {'predicted ms':>12} {'measured ms':>11} {'error':>5}"]
    for ours, theirs in zip(result["live"], result["relaunch"]):
        shorter = theirs["downtime_s"] / ours["downtime_s"]
        pred, meas = ours["predicted_step_s"], ours["measured_step_s"]
        error = f"{abs(pred - meas) / meas:.0%}" if pred and meas else "-"
        entry = f"{ours['pause_s']:.2f}" if ours["pause_s"] is not None else "-"
        lines.append(f"{ours['change']:<26} {ours['downtime_s']:>16.2f} {entry:>7} {theirs['downtime_s']:>8.2f} "
                     f"{shorter:>7.0f}x   {ours['request_to_step_s']:>21.2f} {theirs['request_to_step_s']:>8.2f}   "
                     f"{(pred or 0) * 1e3:>12.0f} {(meas or 0) * 1e3:>11.0f} {error:>5}")
    later = [r for r in result["live"] if r["lap"] > 1]
    if later:
        lines.append(f"\nlater laps (each layout kind's efficiency learned on its first visit)\n"
                     f"{'lap':>3} {'change':<26} {'downtime s: live':>16} {'(entry)':>7}   {'predicted ms':>12} "
                     f"{'measured ms':>11} {'error':>5}")
        for r in later:
            pred, meas = r["predicted_step_s"], r["measured_step_s"]
            error = f"{abs(pred - meas) / meas:.0%}" if pred and meas else "-"
            entry = f"{r['pause_s']:.2f}" if r["pause_s"] is not None else "-"
            lines.append(f"{r['lap']:>3} {r['change']:<26} {r['downtime_s']:>16.2f} {entry:>7}   {(pred or 0) * 1e3:>12.0f} "
                         f"{(meas or 0) * 1e3:>11.0f} {error:>5}")
    s = result["summary"]
    lines.append(f"\nlive downtime: median {s['median_downtime_s']:.2f} s, most {s['max_downtime_s']:.2f} s (goal <= 1 s "
                 f"each); {s['median_shorter']:.0f}x shorter than relaunch's (median; least {s['least_shorter']:.0f}x; "
                 f"goal >= 25x); cost model median error {s['median_error']:.0%} across the layouts (goal <= 10%)"
                 + "".join(f"; lap {lap}: {e:.0%}" for lap, e in s["median_error_by_lap"].items() if len(s["median_error_by_lap"]) > 1))
    return "\n".join(lines)


def _error(row: dict[str, Any]) -> float | None:
    pred, meas = row["predicted_step_s"], row["measured_step_s"]
    return abs(pred - meas) / meas if pred and meas else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Downtimes over every live change; relaunch ratios over the first lap (the one relaunched); the
    cost model's median error over the first lap, and per lap."""
    pairs = list(zip(result["live"], result["relaunch"]))
    downtimes = [o["downtime_s"] for o in result["live"]]
    shorter = [t["downtime_s"] / o["downtime_s"] for o, t in pairs]
    by_lap: dict[int, list[float]] = {}
    for row in result["live"]:
        if (e := _error(row)) is not None:
            by_lap.setdefault(row["lap"], []).append(e)
    medians = {lap: statistics.median(errors) for lap, errors in sorted(by_lap.items())}
    return {"median_downtime_s": statistics.median(downtimes), "max_downtime_s": max(downtimes),
            "median_shorter": statistics.median(shorter), "least_shorter": min(shorter),
            "median_error": medians.get(1, float("nan")), "median_error_by_lap": medians}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default=JOB, help="the job (FILE:FUNCTION; default the 10M GPT)")
    p.add_argument("--tour", default=";".join(TOUR), help="the layouts visited, ';'-separated --layout specs "
                   f"(default {';'.join(TOUR)})")
    p.add_argument("--laps", type=int, default=1, help="times the live job tours the layouts (2: the second lap "
                   "shows the cost model calibrated on the first; the relaunch makes the first lap only)")
    p.add_argument("--workers", type=int, default=4, help="workers (every layout of the tour must take them all)")
    p.add_argument("--out", type=Path, default=Path("bench-out/relayout.json"))
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="run the jobs in DIR and keep their logs and events there (default: a temporary directory)")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    tour = [t.strip() for t in a.tour.split(";") if t.strip()]
    if len(tour) < 2:
        p.error("--tour needs at least two layouts")
    if a.laps < 1:
        p.error("--laps must be at least 1")
    if a.laps > 1 and tour[-1] != tour[0]:
        p.error("--laps above 1 needs a tour that ends where it starts (the default does)")
    from plan.layout import LayoutError, parse_pin

    for spec in tour:
        try:
            parse_pin(spec, source="--tour")
        except LayoutError as e:
            p.error(str(e))
    with tempfile.TemporaryDirectory(prefix="bench-relayout-") as tmp:
        work = a.keep or Path(tmp)
        result: dict[str, Any] = {"job": a.job, "workers": a.workers, "tour": tour, "laps": a.laps,
                                  "date": time.strftime("%Y-%m-%d")}
        result["live"] = live(a.job, tour, a.workers, work / "live", a.laps)
        result["relaunch"] = relaunch(a.job, tour, a.workers, work / "relaunch")
    result["summary"] = summarize(result)
    write_report(table(result), result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
