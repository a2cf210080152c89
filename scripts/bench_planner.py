"""The planner benchmark: solve time, plan quality, event → delta latency, and the planner on real
workers (heterogeneous throughput, cost-model error, straggler reaction), in one run.

Sections (--sections, default all):

  solve      class-level solve time and status at 8, 64, 256 and 1,024 simulated devices of 4–8
             classes (scripts/bench_planner_solve.py), with the default engine (the exact search)
             and, side by side, the PuLP MILP on HiGHS alone. Goal: <= 1 s at 1,024 devices.
  quality    on clusters small enough to enumerate every plan, the planner's predicted step time
             against the best enumerated plan (solve_dp and the whole make_plan). Goal: <= 2% worse.
  latency    the real coordinator with 16 simulated devices: a failure or a join -> the new plan
             delta at the workers (scripts/bench_planner_latency.py). Goal: p50 <= 50 ms.
  hetero     three real workers on the paced job (examples/paced.py:long_job), one with --slowdown 2:
             measured samples/s with the planner's shares and with an even split (--planner even),
             against the ideal, the sum of the workers' measured compute speeds. Goal >= 0.92.
  cost       one run driven through >= 10 distinct plans (joins, slowdowns, recoveries, a drain):
             for each plan, its predicted step time (from the `plan` event, made before any of its
             steps) against the median measured step time of its epoch. Goal: median error <= 10%.
  straggler  three workers, then `ctl slowdown w2 3`: steps from the slowdown to the re-plan, and
             samples/s before, while slowed and after the re-plan. Goal: <= 10 steps.
  recipe     the GPT on two workers, plain against the training recipe (schedule, clipping, an
             evaluation every 50 steps): median step time and wall time per step
             (scripts/bench_recipe.py). Goal: schedule + clipping <= 2% of a step.
  stability  plan epochs per real event and samples/s, calm planner against the legacy one, on the
             demo's schedule and on a quiet run of three GPT workers
             (scripts/bench_planner_stability.py). Goals: demo <= events + 1, quiet <= 2 plans.

The paced job stands for devices of steady, independent speed (see its comment); `--job` runs the
real-worker sections on another job (e.g. examples/gpt.py:job: real compute, but three workers then
share this machine's two cores and slow each other down, which no per-device model predicts).
Prints a table and writes every raw number to --out (default bench-out/planner.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACED = f"{Path(__file__).resolve().parent.parent / 'examples' / 'paced.py'}:long_job"
SECTIONS = ("solve", "quality", "latency", "hetero", "cost", "straggler", "stability", "recipe")


# --- reading a run ---------------------------------------------------------------------------------


def step_events(job: LocalJob, events: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return sorted((e for e in (job.events() if events is None else events) if e["kind"] == "step"),
                  key=lambda e: e["step"])


def plan_events(job: LocalJob, events: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [e for e in (job.events() if events is None else events) if e["kind"] == "plan" and e.get("layout")]


def samples_per_s(steps: list[dict[str, Any]]) -> float | None:
    """Global samples/s between the first and last of consecutive step events."""
    if len(steps) < 2:
        return None
    elapsed = steps[-1]["ts"] - steps[0]["ts"]
    return sum(e["samples"] for e in steps[1:]) / elapsed if elapsed > 0 else None


def wait_settled(job: LocalJob, steady_steps: int, timeout_s: float) -> int:
    """Wait until the latest plan's epoch has run `steady_steps` steps with no newer plan; its epoch."""
    def steady(events: list[dict[str, Any]]) -> int | None:
        plans = plan_events(job, events)
        if not plans:
            return None
        epoch = int(plans[-1]["epoch"])
        return epoch if sum(e["kind"] == "step" and e["epoch"] == epoch for e in events) >= steady_steps else None

    return job.wait_until(steady, timeout_s, "a steady plan")


def stop(job: LocalJob) -> None:
    try:
        job.ctl("stop")
    except RuntimeError:
        pass
    job.wait_coordinator(30)


# --- real-worker sections --------------------------------------------------------------------------


def bench_hetero(job_ref: str, workdir: Path, *, window: int) -> dict[str, Any]:
    out: dict[str, Any] = {"job": job_ref, "slowdown": {"w3": 2.0}}
    for policy in ("milp", "even"):
        with LocalJob(job_ref, workdir / f"hetero-{policy}", min_workers=3,
                      coordinator_args=["--planner", policy]) as job:
            job.start()
            job.add_worker("w1")
            job.add_worker("w2")
            job.add_worker("w3", "--slowdown", "2")
            epoch = wait_settled(job, window + 10, 240)
            measured = [e for e in step_events(job) if e["epoch"] == epoch][-window:]
            status = job.ctl("status")
            plan = plan_events(job)[-1]
            stop(job)
        speeds = {w["name"]: w["speed"] for w in status["workers"]}
        ideal = sum(speeds.values())
        got = samples_per_s(measured)
        out[policy] = {"samples_per_s": got, "ideal_samples_per_s": ideal, "speeds": speeds,
                       "ratio": got / ideal if got else None, "shares": plan["layout"]["shares"],
                       "members": plan["layout"]["members"], "plans": len(plan_events(job)),
                       "step_s": statistics.median(e["step_s"] for e in measured)}
    return out


COST_ACTIONS: list[tuple[str, ...]] = [
    ("join", "w3"), ("slowdown", "w2", "2"), ("slowdown", "w3", "3"), ("slowdown", "w2", "1"),
    ("join", "w4"), ("slowdown", "w4", "1.5"), ("drain", "w1"), ("slowdown", "w3", "1"),
    ("join", "w5"), ("slowdown", "w5", "4"), ("slowdown", "w4", "1"), ("slowdown", "w2", "2.5"),
]


def bench_cost(job_ref: str, workdir: Path, *, per_plan: int, min_plans: int) -> dict[str, Any]:
    with LocalJob(job_ref, workdir / "cost", min_workers=2) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        wait_settled(job, per_plan, 240)
        for action in COST_ACTIONS:
            if len(plan_events(job)) >= min_plans + 1:
                break
            before = len(plan_events(job))
            if action[0] == "join":
                job.add_worker(action[1])
            else:
                job.ctl(*action)
            def more_plans(events: list[dict[str, Any]], n: int = before) -> bool | None:
                return len(plan_events(job, events)) > n or None

            try:
                job.wait_until(more_plans, 60, f"a plan after {action}")
            except TimeoutError:
                continue  # the planner kept the current plan
            wait_settled(job, per_plan, 120)
        steps, plans = step_events(job), plan_events(job)
        stop(job)
    rows = []
    for p in plans:
        mine = [e["step_s"] for e in steps if e["epoch"] == p["epoch"]][2:]
        if len(mine) < 3 or not p.get("predicted_step_s"):
            continue
        measured = statistics.median(mine)
        rows.append({"epoch": p["epoch"], "reason": p["reason"], "members": p["layout"]["members"],
                     "shares": p["layout"]["shares"], "predicted_step_s": p["predicted_step_s"],
                     "measured_step_s": measured, "steps": len(mine),
                     "error": (p["predicted_step_s"] - measured) / measured})
    # The first plan is made before any step was measured (join-time calibration only).
    informed = [r for r in rows if r["epoch"] > plans[0]["epoch"]] if plans else []
    return {"job": job_ref, "plans": rows, "distinct_plans": len(rows),
            "median_abs_error": statistics.median(abs(r["error"]) for r in informed) if informed else None,
            "median_abs_error_all": statistics.median(abs(r["error"]) for r in rows) if rows else None,
            "informed_plans": len(informed)}


def bench_straggler(job_ref: str, workdir: Path, *, window: int) -> dict[str, Any]:
    with LocalJob(job_ref, workdir / "straggler", min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        epoch = wait_settled(job, window + 5, 240)
        before = [e for e in step_events(job) if e["epoch"] == epoch][-window:]
        job.ctl("slowdown", "w2", "3")
        slow = job.wait_event(lambda e: e["kind"] == "slowdown", 10, "slowdown event")
        replan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "straggler", 60, "straggler plan")
        job.wait_epoch_steps(replan["epoch"], window + 5, 120)
        straggler = next(e for e in job.events() if e["kind"] == "straggler")
        steps = step_events(job)
        stop(job)
    at_slowdown = max((e["step"] for e in steps if e["ts"] <= slow["ts"]), default=0)
    at_plan = max((e["step"] for e in steps if e["ts"] <= replan["ts"]), default=0)
    first_new = min(e["step"] for e in steps if e["epoch"] == replan["epoch"])
    slowed = [e for e in steps if at_slowdown < e["step"] < first_new]
    after = [e for e in steps if e["epoch"] == replan["epoch"]][5:5 + window]
    return {"job": job_ref, "steps_to_straggler_event": straggler["step"] - at_slowdown,
            "steps_to_replan": at_plan - at_slowdown, "steps_to_new_epoch": first_new - at_slowdown,
            "samples_per_s_before": samples_per_s(before), "samples_per_s_slowed": samples_per_s(slowed),
            "samples_per_s_after": samples_per_s(after), "shares_after": replan["layout"]["shares"],
            "members_after": replan["layout"]["members"], "straggler": straggler}


# --- the table -------------------------------------------------------------------------------------


def _f(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def table(r: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    for key, engine in (("solve", "auto"), ("solve_milp", "MILP only")):
        for size in r.get(key, {}).get("sizes", []):
            rows.append((f"solve ({engine}), {size['devices']} devices ({size['classes']})",
                         f"median {_f(size['median_s'])} s, max {_f(size['max_s'])} s, {size['statuses']}",
                         "<= 1 s at 1024" if size["devices"] == 1024 else ""))
    if "quality" in r:
        q = r["quality"]
        rows.append(("quality, MILP vs enumeration (worst)", f"{_f(q.get('worst_gap'), '+.2%')} over "
                     f"{q.get('cases')} cases", "<= 2%"))
        if "planner_worst_gap" in q:
            rows.append(("quality, make_plan vs enumeration", f"{_f(q['planner_worst_gap'], '+.2%')} over "
                         f"{q['planner_cases']} cases", "<= 2%"))
    if "latency" in r:
        devices = r["latency"].get("settings", {}).get("devices", "?")
        for name, m in r["latency"].get("summary", {}).get("rows", {}).items():
            ms = {k: None if m.get(k) is None else m[k] * 1e3 for k in ("p50", "p95", "max")}
            rows.append((f"latency, {devices} devices: {name}", f"p50 {_f(ms['p50'], '.1f')} ms, p95 "
                         f"{_f(ms['p95'], '.1f')} ms, max {_f(ms['max'], '.1f')} ms", m.get("goal", "")))
    if "hetero" in r:
        h = r["hetero"]
        for policy in ("milp", "even"):
            p = h[policy]
            rows.append((f"hetero, {policy} shares {p['shares']}",
                         f"{_f(p['samples_per_s'], '.1f')} samples/s = {_f(p['ratio'], '.3f')} of ideal "
                         f"{_f(p['ideal_samples_per_s'], '.1f')}", ">= 0.92" if policy == "milp" else "~0.67"))
    if "cost" in r:
        c = r["cost"]
        rows.append((f"cost model, {c['informed_plans']} plans after calibration",
                     f"median |error| {_f(c['median_abs_error'], '.1%')} (all {c['distinct_plans']}: "
                     f"{_f(c['median_abs_error_all'], '.1%')})", "<= 10%, >= 10 plans"))
    if "straggler" in r:
        s = r["straggler"]
        rows.append(("straggler: steps slowdown -> event / re-plan / new epoch",
                     f"{s['steps_to_straggler_event']} / {s['steps_to_replan']} / {s['steps_to_new_epoch']}",
                     "<= 10"))
        rows.append(("straggler: samples/s before / slowed / after",
                     f"{_f(s['samples_per_s_before'], '.1f')} / {_f(s['samples_per_s_slowed'], '.1f')} / "
                     f"{_f(s['samples_per_s_after'], '.1f')}, shares {s['shares_after']}", ""))
    if "recipe" in r:
        rc = r["recipe"]
        rows.append(("recipe: median step, plain / schedule + clipping",
                     f"{rc['plain']['median_step_s'] * 1e3:.1f} / {rc['recipe']['median_step_s'] * 1e3:.1f} ms "
                     f"({rc['step_overhead']:+.1%})", "<= 2%"))
        rows.append(("recipe: wall per step, plain / with evals every 50",
                     f"{rc['plain']['wall_per_step_s'] * 1e3:.1f} / {rc['recipe']['wall_per_step_s'] * 1e3:.1f} ms "
                     f"({rc['wall_overhead']:+.1%}, {rc['recipe']['evals']} evals)", ""))
    for key, st in sorted(r.get("stability", {}).items()):
        schedule, mode = key.rsplit("_", 1)
        goal = {"demo": f"<= {st['real_events'] + 1} epochs", "quiet": "<= 2 plans"}.get(schedule, "")
        rows.append((f"stability, {schedule} ({mode})",
                     f"{st['epochs']} epochs for {st['real_events']} real events, {st['kept']} kept, "
                     f"{st['stragglers']} stragglers, {_f(st['samples_per_s'], '.1f')} samples/s",
                     goal if mode == "calm" else "baseline"))
    widths = [max(len(row[i]) for row in rows + [("metric", "measured", "goal")]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("metric", "measured", "goal"), widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_planner.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--job", default=PACED, help="job of the real-worker sections (default: the paced job)")
    p.add_argument("--quick", action="store_true", help="fewer scenarios, trials and steps (a smoke run)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-out" / "planner.json", help="where the JSON goes")
    p.add_argument("--table-from", type=Path, metavar="JSON", help="only print the table of an earlier run's JSON")
    a = p.parse_args(argv)
    unknown = set(a.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    if a.table_from is not None:  # print the table of an earlier run
        print(table(json.loads(a.table_from.read_text())))
        return 0
    sections = a.sections.split(",")
    results: dict[str, Any] = {"settings": {"sections": sections, "job": a.job, "quick": a.quick}}
    workdir = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    window = 15 if a.quick else 40
    for section in sections:
        print(f"-- {section} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if section == "solve":
            from bench_planner_solve import bench_solve

            results["solve"] = bench_solve(quick=a.quick)
            results["solve_milp"] = bench_solve(quick=True, engine="milp")  # the MILP alone, side by side
        elif section == "quality":
            from bench_planner_quality import bench_planner_quality
            from bench_planner_solve import bench_quality

            results["quality"] = {**bench_quality(quick=a.quick), **bench_planner_quality(quick=a.quick)}
        elif section == "latency":
            from bench_planner_latency import bench_event_to_delta

            results["latency"] = bench_event_to_delta(devices=16, trials=5 if a.quick else 20,
                                                      out_dir=workdir / "latency")
        elif section == "hetero":
            results["hetero"] = bench_hetero(a.job, workdir, window=window)
        elif section == "cost":
            results["cost"] = bench_cost(a.job, workdir, per_plan=8 if a.quick else 14, min_plans=10)
        elif section == "straggler":
            results["straggler"] = bench_straggler(a.job, workdir, window=window)
        elif section == "recipe":
            from bench_recipe import bench_recipe

            results["recipe"] = bench_recipe(workdir)
        elif section == "stability":
            from bench_planner_stability import bench_stability

            results["stability"] = bench_stability(workdir)
        print(f"   {section}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"\nraw numbers: {a.out}; logs of the real runs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
