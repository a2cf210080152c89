"""Soak the main job's liveness: the demo's schedule (SIGKILL w2, start w4, `ctl slowdown w3 3`) run
again and again on three GPT workers, the kill and the join at a different step each run.

Per layout (replicated `--layout fsdp=1` and sharded `--layout dp=1` by default), one undisturbed
reference run gives each step's loss; then RUNS disturbed runs alternate the two orders of timing the
schedule can produce:

  kill-first  SIGKILL w2 at a drawn step, start w4 a drawn number of steps later;
  join-first  start w4 at a drawn step and SIGKILL w2 as soon as w4's plan appears (the join's
              epoch being entered) or after one or two of its steps;

and slow w3 down 3x 10-14 steps into the epoch that follows both (w4 planned in, w2's failure
re-planned), once that epoch's speed baseline is measured, as in the demo. The steps come from a
seeded RNG (`--seed`): the first fault's step differs from run to run. Per run, from the events and
the workers' logs:

  recovery   SIGKILL -> the first committed step of the failure plan's epoch or later (training
             again); a stall when over 2 s plus one step (the run's median), the bound of the
             design's liveness invariant. Also in the JSON: kill -> `failed`, `failed` -> step.
  joins      every `joined` worker later planned in, put on standby with a reason, or gone.
  stragglers every `straggler` followed by a `plan` or `kept`; and the slowdown found at all (a
             `straggler` or `contention` event for w3) where w3 was a member when slowed.
             (Neither is owed in the job's last steps: liveness.py's grace.)
  steps      every step of the job committed exactly once (lost, doubled).
  loss gap   the largest relative difference from the reference run's loss, step by step.
  liveness   scripts/liveness.py's problems(events, logs): any problem counts against the run.

Goals: 0 stalls, 0 lost or doubled steps, every join and straggler handled, no liveness problem, no
run that failed to finish (a frozen planner). The exit status is 1 when one is missed, else 0.

    python scripts/soak.py --runs 40                  # 40 runs per layout, 80 in all (~75 min here)
    python scripts/soak.py --runs 2 --layout dp=1     # a quick look at the sharded layout

A run takes about 50 s replicated and 75 s sharded on a 2-core machine (180 steps of
examples/gpt.py:job_soak, four workers sharing the cores), plus one reference run per layout. Prints a progress line per run and one table;
writes every run's details to --out (bench-out/soak.json). Each run's logs and events go to a
temporary directory, kept (and named) only when the run missed a goal, or all of them with --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from liveness import JOIN_GRACE_STEPS, STRAGGLER_STEPS  # noqa: E402
from localjob import LocalJob, close_on_sigterm  # noqa: E402

Event = dict[str, Any]
STALL_S = 2.0  # plus one step: the first committed step of the new epoch includes that step
SLOW_ROOM_STEPS = STRAGGLER_STEPS + 10  # steps a slowdown needs before the end: found in ~5, then answered
POLL_S = 0.02  # the join-first kill lands on w4's plan: poll the event log often


def _find(events: list[Event], kind: str, worker: str, after_ts: float = 0.0) -> Event | None:
    return next((e for e in events if e["kind"] == kind and e.get("worker") == worker and e["ts"] >= after_ts), None)


def _planned(events: list[Event], worker: str) -> Event | None:
    """The first plan with `worker` in it, or its standby with a reason, or its exit."""
    return next((e for e in events if (e["kind"] == "plan" and e.get("layout") and worker in e["layout"]["members"])
                 or (e["kind"] == "standby" and e.get("worker") == worker and e.get("why"))
                 or (e["kind"] in ("left", "failed") and e.get("worker") == worker)), None)


def schedule(rng: random.Random, runs: int, num_steps: int) -> list[dict[str, Any]]:
    """Each run's order, first fault's step (distinct while the range lasts), the other's offset and
    the slowdown's delay."""
    lo, hi = max(3, num_steps // 20), max(4, num_steps // 6)
    firsts = rng.sample(range(lo, hi + 1), hi - lo + 1)
    return [{"order": "kill-first" if k % 2 == 0 else "join-first", "first_at": firsts[k % len(firsts)],
             "gap": rng.randint(3, max(4, num_steps // 12)) if k % 2 == 0 else rng.randint(0, 2),
             "slow_after": rng.randint(10, 14)} for k in range(runs)]


def drive(job: LocalJob, d: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one job through the schedule `d` until it ends; when and at which step each fault landed."""
    job.start()
    for name in ("w1", "w2", "w3"):
        job.add_worker(name, "--log-every", "0")
    at: dict[str, int] = {}  # kill / join / slow -> the last committed step when it was issued
    ts: dict[str, float] = {}
    notes: list[str] = []
    settled: int | None = None  # the first step of the epoch that followed both faults
    deadline = time.monotonic() + timeout_s

    def act(what: str, last: int) -> None:
        at[what], ts[what] = last, time.time()
        if what == "kill":
            job.kill("w2")
        elif what == "join":
            job.add_worker("w4", "--log-every", "0")
        else:
            try:
                job.ctl("slowdown", "w3", "3")
            except RuntimeError as e:  # the job ended meanwhile
                notes.append(f"slowdown not sent: {e}")

    while job.coordinator is not None and job.coordinator.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job did not end within {timeout_s:.0f} s")
        events = job.events()
        last = max((e["step"] for e in events if e["kind"] == "step"), default=0)
        # w4's first plan, or its standby (a joiner that fails its lease while loading joins again)
        w4 = next((e for e in events if (e["kind"] == "plan" and e.get("layout") and "w4" in e["layout"]["members"])
                   or (e["kind"] == "standby" and e.get("worker") == "w4")), None) if "join" in at else None
        if d["order"] == "kill-first":
            if "kill" not in at and last >= d["first_at"]:
                act("kill", last)
            if "kill" in at and "join" not in at and last >= at["kill"] + d["gap"]:
                act("join", last)
        else:
            if "join" not in at and last >= d["first_at"]:
                act("join", last)
            if "join" in at and "kill" not in at:
                entered = sum(1 for e in events if e["kind"] == "step" and e["epoch"] >= w4["epoch"]) \
                    if w4 is not None and w4["kind"] == "plan" else 0
                if w4 is not None and (entered >= d["gap"] or w4["kind"] == "standby"):
                    act("kill", last)
                    notes.append(f"w2 killed after {entered} committed steps of w4's epoch" if w4["kind"] == "plan"
                                 else "w4 on standby: w2 killed at once")
                elif time.time() - ts["join"] > 120:
                    notes.append("w4 not planned 120 s after its start: w2 killed anyway")
                    act("kill", last)
        if "kill" in at and w4 is not None and "slow" not in at:
            failed = _find(events, "failed", "w2", ts["kill"])
            replanned = failed is not None and any(e["kind"] == "plan" for e in events[events.index(failed):])
            if settled is None and replanned:
                # Both faults planned: count from the newest epoch's first step, so the slowdown lands
                # after its baseline is measured (coordinator/steps.py), as the demo's does.
                newest = max(e["epoch"] for e in events if e["kind"] == "plan")
                settled = next((e["step"] for e in events if e["kind"] == "step" and e["epoch"] >= newest), None)
            if settled is not None and last >= settled + d["slow_after"]:
                act("slow", last)
        time.sleep(POLL_S)
    return {"at": at, "ts": ts, "notes": notes, "coordinator_exit": job.wait_coordinator(30),
            "worker_exits": job.wait_workers(60)}


def analyse(job: LocalJob, run: dict[str, Any], reference: dict[int, float], num_steps: int) -> dict[str, Any]:
    """The run's figures and goal misses, from its events and logs."""
    events = job.events()
    t_kill = run["ts"].get("kill", float("inf"))
    out: dict[str, Any] = {"recovery_s": None, "detect_s": None, "failed_to_step_s": None, "stall": False}
    failed = _find(events, "failed", "w2", t_kill)
    if "kill" in run["at"]:
        i = events.index(failed) if failed else len(events)
        members = next((set(e["layout"]["members"]) for e in reversed(events[:i])
                        if e["kind"] == "plan" and e.get("layout")), set())
        plan = next((e for e in events[i:] if e["kind"] == "plan" and e.get("layout")), None)
        step = next((e for e in events[i:] if e["kind"] == "step" and plan and e["epoch"] >= plan["epoch"]), None)
        if failed:
            out["detect_s"] = failed["ts"] - t_kill
        if step and failed:
            out["recovery_s"], out["failed_to_step_s"] = step["ts"] - t_kill, step["ts"] - failed["ts"]
        out["w2_was_member"] = "w2" in members
        step_s = statistics.median(e["step_s"] for e in events if e["kind"] == "step")
        out["stall_bound_s"] = STALL_S + step_s
        out["stall"] = "w2" in members and (out["recovery_s"] is None or out["recovery_s"] > STALL_S + step_s)
    def due(e: Event, grace: int) -> bool:  # liveness.py's rule: not owed an answer in the job's last steps
        return sum(1 for x in events[events.index(e):] if x["kind"] == "step") >= grace

    joined = [e for e in events if e["kind"] == "joined"]
    out["joins_never_planned"] = [e["worker"] for e in joined if due(e, JOIN_GRACE_STEPS)
                                  and not _planned(events[events.index(e) + 1:], e["worker"])]
    stragglers = [e for e in events if e["kind"] == "straggler"]
    out["stragglers"] = [f"{e['worker']}@{e['step']}" for e in stragglers]
    out["stragglers_never_handled"] = [f"{e['worker']}@{e['step']}" for e in stragglers if due(e, STRAGGLER_STEPS)
                                       and not any(x["kind"] in ("plan", "kept") for x in events[events.index(e) + 1:])]
    slow_step = run["at"].get("slow")
    # Found: w3 named a straggler, or its whole host found busier (contention), after the slowdown.
    # Owed only where w3 trained then (the planner may have put it on standby before).
    slowed = next((i for i, e in enumerate(events) if e["kind"] == "slowdown"), None)
    out["w3_was_member"] = slowed is not None and "w3" in next(
        (e["layout"]["members"] for e in reversed(events[:slowed]) if e["kind"] == "plan" and e.get("layout")), [])
    out["slowdown_found"] = slow_step is not None and any(
        e["kind"] in ("straggler", "contention") and e["worker"] == "w3" and e["step"] > slow_step for e in events)
    if out["w3_was_member"] and not out["slowdown_found"] and num_steps - slow_step >= SLOW_ROOM_STEPS:
        out["stragglers_never_handled"].append(f"w3 slowed at step {slow_step}: never found (no straggler or contention event)")
    counts = Counter(e["step"] for e in events if e["kind"] == "step")
    out["lost_steps"] = [s for s in range(1, num_steps + 1) if s not in counts]
    out["doubled_steps"] = sorted(s for s, n in counts.items() if n > 1)
    losses = job.losses()
    out["loss_gap"] = max((abs(losses[s] - r) / abs(r) for s, r in reference.items() if s in losses), default=None)
    out["liveness"] = job.liveness()
    exits = {n: c for n, c in run["worker_exits"].items() if c != (-9 if n == "w2" else 0)}
    out["errors"] = ([f"coordinator exit {run['coordinator_exit']}"] if run["coordinator_exit"] != 0 else []) + \
        [f"{n} exit {c}" for n, c in exits.items()] + \
        [f"never issued: {w}" for w in ("kill", "join", "slow") if w not in run["at"]]
    return out


def misses(r: dict[str, Any]) -> int:
    return (bool(r.get("stall")) + len(r.get("joins_never_planned", [])) + len(r.get("stragglers_never_handled", []))
            + len(r.get("lost_steps", [])) + len(r.get("doubled_steps", [])) + len(r.get("liveness", []))
            + len(r.get("errors", [])))


def one_run(job_ref: str, layout: str, state_dir: Path, d: dict[str, Any] | None, reference: dict[int, float],
            num_steps: int, timeout_s: float) -> dict[str, Any]:
    """One job (d None: the undisturbed reference) from start to end, analysed."""
    t0 = time.time()
    with LocalJob(job_ref, state_dir, min_workers=3, coordinator_args=["--layout", layout]) as job:
        try:
            if d is None:
                job.start()
                for name in ("w1", "w2", "w3"):
                    job.add_worker(name, "--log-every", "0")
                code = job.wait_coordinator(timeout_s)
                if code is None:
                    raise TimeoutError(f"the reference run did not end within {timeout_s:.0f} s")
                losses = job.losses()
                return {"losses": losses, "num_steps": max(losses, default=0), "wall_s": time.time() - t0,
                        "liveness": job.liveness(), "errors": [] if code == 0 else [f"coordinator exit {code}"]}
            run = drive(job, d, timeout_s)
        except (TimeoutError, RuntimeError) as e:
            return {**(d or {}), "errors": [f"{type(e).__name__}: {e}"], "wall_s": time.time() - t0,
                    "last_step": max(job.steps(), default=0), "liveness": job.liveness()}
        return {**d, **run, **analyse(job, run, reference, num_steps), "wall_s": time.time() - t0}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rec = [r["recovery_s"] for r in runs if r.get("recovery_s") is not None]
    gaps = [r["loss_gap"] for r in runs if r.get("loss_gap") is not None]
    return {"runs": len(runs), "stalls": sum(bool(r.get("stall")) for r in runs),
            "longest_recovery_s": max(rec, default=None), "median_recovery_s": statistics.median(rec) if rec else None,
            "joins_never_planned": sum(len(r.get("joins_never_planned", [])) for r in runs),
            "stragglers_never_handled": sum(len(r.get("stragglers_never_handled", [])) for r in runs),
            "lost_steps": sum(len(r.get("lost_steps", [])) for r in runs),
            "doubled_steps": sum(len(r.get("doubled_steps", [])) for r in runs),
            "worst_loss_gap": max(gaps, default=None),
            "runs_with_liveness_problems": sum(bool(r.get("liveness")) for r in runs),
            "runs_failed": sum(bool(r.get("errors")) for r in runs)}


COLUMNS = [("runs", "runs", "{}"), ("stalls", "stalls", "{}"), ("longest rec. s", "longest_recovery_s", "{:.2f}"),
           ("median rec. s", "median_recovery_s", "{:.2f}"), ("joins unplanned", "joins_never_planned", "{}"),
           ("stragglers unhandled", "stragglers_never_handled", "{}"), ("lost steps", "lost_steps", "{}"),
           ("doubled", "doubled_steps", "{}"), ("worst loss gap", "worst_loss_gap", "{:.1e}"),
           ("liveness problems", "runs_with_liveness_problems", "{}"), ("failed", "runs_failed", "{}")]


def table(rows: dict[str, dict[str, Any]]) -> str:
    cells = [["layout", *(c[0] for c in COLUMNS)]] + [
        [name, *("-" if s[k] is None else f.format(s[k]) for _, k, f in COLUMNS)] for name, s in rows.items()]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="disturbed runs per layout (default 20)")
    p.add_argument("--layout", action="append", metavar="SPEC",
                   help="coordinator --layout of the runs; repeat for several (default: fsdp=1 and dp=1)")
    p.add_argument("--job", default=f"{ROOT / 'examples' / 'gpt.py'}:job_soak",
                   help="job to train (default examples/gpt.py:job_soak, 180 steps)")
    p.add_argument("--seed", type=int, default=0, help="seeds each run's fault steps (default 0)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="give a run up after S s (default 600)")
    p.add_argument("--out", type=Path, default=Path("bench-out/soak.json"), help="JSON results (default %(default)s)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep every run's logs and events under DIR")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be at least 1")
    layouts: list[str] = a.layout or ["fsdp=1", "dp=1"]
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    workdir = a.keep or Path(tempfile.mkdtemp(prefix="soak-"))
    result: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                              "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
                              "reference": {}, "runs": [], "summary": {}}
    t0 = time.time()
    for layout in layouts:
        tag = layout.replace("=", "-").replace(",", "_")
        print(f"[{layout}] reference run (no faults) ...", flush=True)
        ref = one_run(a.job, layout, workdir / tag / "reference", None, {}, 0, a.run_timeout)
        result["reference"][layout] = {k: v for k, v in ref.items() if k != "losses"}
        if ref["errors"] or not ref.get("num_steps"):
            print(f"[{layout}] the reference run failed: {ref['errors']}; logs in {workdir / tag}", file=sys.stderr)
            return 1
        print(f"[{layout}] reference: {ref['num_steps']} steps in {ref['wall_s']:.0f} s", flush=True)
        draws = schedule(random.Random(f"{a.seed}/{layout}"), a.runs, ref["num_steps"])
        for k, d in enumerate(draws):
            state_dir = workdir / tag / f"run{k + 1}"
            r = {"layout": layout, "run": k + 1, **one_run(a.job, layout, state_dir, d, ref["losses"],
                                                           ref["num_steps"], a.run_timeout)}
            kept = a.keep is not None or misses(r) > 0
            r["logs"] = str(state_dir) if kept else None
            if not kept:
                shutil.rmtree(state_dir, ignore_errors=True)
            result["runs"].append(r)
            at = r.get("at", {})
            rec = "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.2f} s"
            print(f"[{layout}] run {k + 1} of {a.runs} ({d['order']}): kill at step {at.get('kill', '-')}, "
                  f"join at {at.get('join', '-')}, slowdown at {at.get('slow', '-')}: recovery {rec}"
                  + (f"; MISSED {misses(r)}: see {r['logs']}" if misses(r) else "; ok"), flush=True)
            for line in [*r.get("errors", []), *r.get("liveness", [])]:
                print(f"    {line}", flush=True)
        result["summary"][layout] = summarise([r for r in result["runs"] if r["layout"] == layout])
    if len(layouts) > 1:
        result["summary"]["total"] = summarise(result["runs"])
    result["machine"]["loadavg_after"] = os.getloadavg()
    result["total_s"] = time.time() - t0
    result["table"] = table(result["summary"])
    total = result["summary"]["total" if len(layouts) > 1 else layouts[0]]
    goals = {"stalls": 0, "joins_never_planned": 0, "stragglers_never_handled": 0, "lost_steps": 0,
             "doubled_steps": 0, "runs_with_liveness_problems": 0, "runs_failed": 0}
    missed = [k for k in goals if total[k] != goals[k]]
    result["goals_missed"] = missed
    print("\n" + result["table"])
    print(f"\n{total['runs']} runs in {result['total_s'] / 60:.1f} min, {os.cpu_count()} cores, load average "
          f"{result['machine']['loadavg_before'][0]:.1f} -> {result['machine']['loadavg_after'][0]:.1f}; "
          + (f"goals missed: {', '.join(missed)}" if missed else "every goal met"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {a.out}")
    if a.keep is None and not any(r["logs"] for r in result["runs"]):
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
