"""How long `plan.milp.solve_dp` takes at 8 to 1,024 simulated devices, and how good its plans are.

Two sections, each a function another script can import (add this directory to sys.path):

- `bench_solve(...)`: seeded random clusters of 4-8 device classes at 8, 64, 256 and 1,024
  devices, in several scenarios (large- and small-α links, memory caps, re-plans with a migration
  cost), each solved once with the planner's 1 s limit; wall time of the whole call.
- `bench_quality(...)`: clusters of 3-5 devices small enough to enumerate every integer split of
  the global batch (12-24 samples) over every subset of devices; the plan's predicted step against
  the best enumerated one, with the same formula (max share/speed + ring all-reduce over the
  devices with a share, plan.cost.allreduce_s).

Pure CPU, no network. Run:  python scripts/bench_planner_solve.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import plan.milp
from plan.cost import Link, allreduce_s
from plan.milp import DeviceClass, DpCosts, solve_dp

SIZES = (8, 64, 256, 1024)
SCENARIOS = ("large-alpha", "small-alpha", "caps", "replan-fail", "replan-join", "random-previous")
STATUSES = ("optimal", "time-limited", "fallback", "infeasible")
GOAL_SOLVE_S = 1.0
GOAL_QUALITY = 0.02

EPILOG = """\
solve section, one row per (devices, scenario), over --seeds random clusters:
  devices     simulated devices in the cluster (split at random over the classes)
  classes     device classes (distinct speed and memory), min-max over the seeds
  scenario    large-alpha: α 5-50 ms, no memory caps; small-alpha: α 10-100 µs, no caps;
              caps: α 10 µs-50 ms, a memory cap on about 60% of the classes;
              replan-fail: caps, then one device of the plan fails and the survivors re-plan
              with previous_counts and a migration cost (moving the training state);
              replan-join: a plan without one class, then that class joins (re-plan as above);
              random-previous: a stress case, previous counts drawn at random per class
              (every scenario: β 1e-10..1e-8 s/B, gradients 1 MB..1 GB, global batch 256..8192)
  median_ms   median wall time of solve_dp (model build and solve included; for re-plans, the
  max_ms      re-plan's call), and the worst over the seeds; the goal is at most 1000 ms
  opt/tl/fb   how many calls returned status optimal / time-limited / fallback
  pairs       median (ring size, newcomers) pairs the exact search enumerated ("milp": it used the MILP)

quality section, one row per case and the worst:
  devices, batch   the cluster (3-5 devices, 2-4 classes, memory caps on some) and the global batch
  planned_s   predicted step of solve_dp's plan (rounded shares)
  best_s      least predicted step over every integer split of the batch over every subset
  worse       planned_s / best_s - 1; the goal is at most 2%

--engine milp forces the MILP (plan/_milp_model.py) for every size, to compare with the search.
Every raw number goes to the JSON file (--out).
"""


def scenario(devices: int, seed: int, kind: str) -> dict[str, Any]:
    """One random cluster: classes, costs, batch and (for re-plans) the previous plan's call."""
    rng = random.Random(f"{devices}/{seed}/{kind}")
    num = min(devices, rng.randint(4, 8))
    cuts = sorted(rng.sample(range(1, devices), num - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, devices])]
    grad = 10 ** rng.uniform(6, 9)
    if kind == "large-alpha":
        alpha = 10 ** rng.uniform(math.log10(5e-3), math.log10(5e-2))
    elif kind == "small-alpha":
        alpha = 10 ** rng.uniform(-5, -4)
    else:
        alpha = 10 ** rng.uniform(-5, math.log10(5e-2))
    beta = 10 ** rng.uniform(-10, -8)
    batch = rng.choice([256, 512, 1024, 2048, 4096, 8192])
    act = 10 ** rng.uniform(6, 8)
    costs = DpCosts(allreduce_bytes=grad, static_bytes=4 * grad, activation_bytes_per_sample=act,
                    link=Link(alpha_s=alpha, beta_s_per_byte=beta))
    capped = kind not in ("large-alpha", "small-alpha")
    classes = []
    for i, n in enumerate(sizes):
        memory = math.inf
        if capped and rng.random() < 0.6:
            memory = costs.static_bytes + act * max(1, round(batch / devices * rng.uniform(0.3, 4)))
        classes.append(DeviceClass(name=f"c{i}", available=n, samples_per_s=10 ** rng.uniform(math.log10(5), 2.3),
                                   memory_bytes=memory))
    fits = sum(c.available * min(batch, costs.max_samples(c.memory_bytes) or 0) for c in classes)
    if fits < batch:  # keep every scenario feasible: lift the cap of the first class
        classes[0] = DeviceClass(name="c0", available=classes[0].available, samples_per_s=classes[0].samples_per_s)
    return {"classes": classes, "costs": costs, "batch": batch, "rng": rng,
            "migration_s": alpha + costs.static_bytes * beta}  # move params, grads, optimizer state


def _with(classes: list[DeviceClass], name: str, available: int) -> list[DeviceClass]:
    return [DeviceClass(name=c.name, available=available if c.name == name else c.available,
                        samples_per_s=c.samples_per_s, memory_bytes=c.memory_bytes) for c in classes]


def run_one(devices: int, seed: int, kind: str, time_limit_s: float, engine: str = "auto") -> dict[str, Any]:
    s = scenario(devices, seed, kind)
    classes, costs, batch, rng = s["classes"], s["costs"], s["batch"], s["rng"]
    kw: dict[str, Any] = {}
    if kind == "replan-fail":
        before = solve_dp(classes, costs, batch, time_limit_s=time_limit_s, engine=engine)
        victim = max((c for c in classes if before.counts[c.name]), key=lambda c: c.name)
        classes = _with(classes, victim.name, victim.available - 1)
        kw = {"previous_counts": before.counts}
    elif kind == "replan-join":
        late = rng.choice(classes).name
        before = solve_dp(_with(classes, late, 0), costs, batch, time_limit_s=time_limit_s, engine=engine)
        kw = {"previous_counts": before.counts}
    elif kind == "random-previous":
        kw = {"previous_counts": {c.name: rng.randint(0, c.available) for c in classes}}
    if kw:
        kw["migration_s_per_device"] = s["migration_s"]
    start = time.perf_counter()
    result = solve_dp(classes, costs, batch, time_limit_s=time_limit_s, engine=engine, **kw)
    solve_s = time.perf_counter() - start
    pairs = None
    if " pairs, " in result.reason:
        pairs = int(result.reason.split(" (ring size")[0].rsplit(" ", 1)[1])
    return {
        "devices": devices, "seed": seed, "scenario": kind, "classes": len(classes), "batch": batch,
        "alpha_s": costs.link.alpha_s, "beta_s_per_byte": costs.link.beta_s_per_byte,
        "allreduce_bytes": costs.allreduce_bytes,
        "capped_classes": sum(not math.isinf(c.memory_bytes) for c in classes),
        "migration_s_per_device": kw.get("migration_s_per_device", 0.0),
        "solve_s": solve_s, "status": result.status, "reason": result.reason, "pairs": pairs,
        "ranks": sum(result.counts.values()), "predicted_step_s": result.predicted_step_s,
        "objective_s": result.objective_s, "lower_bound_s": result.lower_bound_s,
    }


def bench_solve(*, quick: bool = False, seeds: int | None = None, sizes: tuple[int, ...] = SIZES,
                scenarios: tuple[str, ...] = SCENARIOS, time_limit_s: float = 1.0, engine: str = "auto") -> dict[str, Any]:
    """Solve every (size, scenario, seed) (seeds: 3 if quick, else 8); returns the raw rows ("rows"),
    one summary per (size, scenario) ("summary") and one per size over all scenarios ("sizes")."""
    seeds = seeds or (3 if quick else 8)
    rows = [run_one(d, seed, kind, time_limit_s, engine) for d in sizes for kind in scenarios for seed in range(seeds)]
    summary = []
    for d in sizes:
        for kind in scenarios:
            mine = [r for r in rows if r["devices"] == d and r["scenario"] == kind]
            times = [r["solve_s"] for r in mine]
            status = Counter(r["status"] for r in mine)
            pairs = [r["pairs"] for r in mine if r["pairs"] is not None]
            summary.append({
                "devices": d, "scenario": kind, "runs": len(mine),
                "classes_min": min(r["classes"] for r in mine), "classes_max": max(r["classes"] for r in mine),
                "median_s": statistics.median(times), "max_s": max(times),
                "status": {k: status.get(k, 0) for k in STATUSES},
                "median_pairs": statistics.median(pairs) if pairs else None,
            })
    per_size = []
    for d in sizes:
        mine = [r for r in rows if r["devices"] == d]
        status = Counter(r["status"] for r in mine)
        per_size.append({
            "devices": d, "classes": f"{min(r['classes'] for r in mine)}-{max(r['classes'] for r in mine)} classes",
            "runs": len(mine), "median_s": statistics.median(r["solve_s"] for r in mine),
            "max_s": max(r["solve_s"] for r in mine),
            "statuses": ", ".join(f"{k} {status.get(k, 0)}" for k in STATUSES[:3]),
        })
    return {"engine": engine, "time_limit_s": time_limit_s, "goal_s": GOAL_SOLVE_S, "seeds": seeds,
            "rows": rows, "summary": summary, "sizes": per_size}


def _splits(batch: int, caps: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to give each device 0..cap samples, summing to batch."""
    if len(caps) == 1:
        if batch <= caps[0]:
            yield (batch,)
        return
    for s in range(min(batch, caps[0]) + 1):
        for rest in _splits(batch - s, caps[1:]):
            yield (s, *rest)


def bench_quality(*, quick: bool = False, cases: int | None = None, seed: int = 0) -> dict[str, Any]:
    """solve_dp's predicted step against the best over every integer split on tiny clusters (cases:
    12 if quick, else 30). "per_case" holds each case, "worst_gap" the worst relative excess."""
    cases = cases or (12 if quick else 30)
    out: list[dict[str, Any]] = []
    for case in range(cases):
        rng = random.Random(f"quality/{seed}/{case}")
        devices = rng.randint(3, 5)
        num = rng.randint(2, min(4, devices))
        sizes = [1] * num
        for _ in range(devices - num):
            sizes[rng.randrange(num)] += 1
        batch = rng.randint(12, 24)
        costs = DpCosts(allreduce_bytes=10 ** rng.uniform(6, 8.5), static_bytes=1e9, activation_bytes_per_sample=1e8,
                        link=Link(alpha_s=10 ** rng.uniform(-4, -1.3), beta_s_per_byte=10 ** rng.uniform(-10, -8)))
        classes = [DeviceClass(name=f"c{i}", available=n, samples_per_s=10 ** rng.uniform(0.5, 2),
                               memory_bytes=rng.choice([math.inf, 1e9 + 1e8 * rng.randint(2, 12)]))
                   for i, n in enumerate(sizes)]
        speeds = [c.samples_per_s for c in classes for _ in range(c.available)]
        caps = [int(min(batch, costs.max_samples(c.memory_bytes) or 0)) for c in classes for _ in range(c.available)]
        best, best_split, splits = math.inf, None, 0
        for split in _splits(batch, caps):
            splits += 1
            used = [i for i, s in enumerate(split) if s > 0]
            step = max(split[i] / speeds[i] for i in used) + allreduce_s(costs.allreduce_bytes, len(used), costs.link)
            if step < best:
                best, best_split = step, split
        result = solve_dp(classes, costs, batch)
        planned = result.predicted_step_s
        out.append({
            "case": case, "devices": devices, "classes": num, "batch": batch, "splits": splits,
            "speeds": speeds, "caps": caps, "alpha_s": costs.link.alpha_s,
            "beta_s_per_byte": costs.link.beta_s_per_byte, "allreduce_bytes": costs.allreduce_bytes,
            "best_s": best, "best_split": best_split, "planned_s": planned, "status": result.status,
            "planned_shares": result.shares, "worse": None if planned is None or math.isinf(best) else planned / best - 1,
        })
    ratios: list[float] = [c["worse"] for c in out if c["worse"] is not None]
    worst = max(range(len(out)), key=lambda i: out[i]["worse"] if out[i]["worse"] is not None else -1)
    return {"goal": GOAL_QUALITY, "cases": len(out), "per_case": out, "worst_gap": out[worst]["worse"],
            "worst_case": worst, "within_goal": sum(r <= GOAL_QUALITY for r in ratios), "compared": len(ratios)}


def print_solve(res: dict[str, Any]) -> None:
    print(f"solve_dp wall time (engine {res['engine']}, time limit {res['time_limit_s']:g} s, goal <= "
          f"{res['goal_s'] * 1000:.0f} ms)")
    print(f"{'devices':>7} {'classes':>7}  {'scenario':<16} {'median_ms':>9} {'max_ms':>8}  {'opt/tl/fb':>9} {'pairs':>8}")
    for s in res["summary"]:
        st = s["status"]
        pairs = "milp" if s["median_pairs"] is None else f"{s['median_pairs']:.0f}"
        print(f"{s['devices']:>7} {s['classes_min']:>3}-{s['classes_max']:<3}  {s['scenario']:<16} "
              f"{s['median_s'] * 1000:>9.1f} {s['max_s'] * 1000:>8.1f}  "
              f"{st['optimal']:>3}/{st['time-limited']}/{st['fallback']:<3} {pairs:>8}")
    worst = max(res["rows"], key=lambda r: r["solve_s"])
    print(f"worst: {worst['solve_s'] * 1000:.1f} ms ({worst['devices']} devices, {worst['scenario']}, "
          f"seed {worst['seed']}, {worst['status']})")


def print_quality(res: dict[str, Any]) -> None:
    print(f"\nplan quality against every integer split (goal: at most {res['goal']:.0%} worse)")
    print(f"{'case':>4} {'devices':>7} {'batch':>5} {'splits':>6} {'planned_s':>10} {'best_s':>10} {'worse':>8}  status")
    for c in res["per_case"]:
        worse = "-" if c["worse"] is None else f"{c['worse']:.2%}"
        planned = "-" if c["planned_s"] is None else f"{c['planned_s']:.5f}"
        print(f"{c['case']:>4} {c['devices']:>7} {c['batch']:>5} {c['splits']:>6} {planned:>10} "
              f"{c['best_s']:>10.5f} {worse:>8}  {c['status']}")
    print(f"worst: {res['worst_gap']:.3%} (case {res['worst_case']}); {res['within_goal']} of {res['compared']} "
          f"within {res['goal']:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out/planner-solve.json", help="JSON with every raw number")
    ap.add_argument("--quick", action="store_true", help="3 seeds per row and 12 quality cases")
    ap.add_argument("--seeds", type=int, default=None, help="random clusters per (devices, scenario) (default 8)")
    ap.add_argument("--cases", type=int, default=None, help="quality cases (default 30)")
    ap.add_argument("--time-limit", type=float, default=1.0, help="solve_dp's time_limit_s (default 1)")
    ap.add_argument("--engine", choices=("auto", "search", "milp"), default="auto",
                    help="auto: as the planner runs; milp: force the MILP at every size")
    args = ap.parse_args()
    solve = bench_solve(quick=args.quick, seeds=args.seeds, time_limit_s=args.time_limit, engine=args.engine)
    print_solve(solve)
    quality = bench_quality(quick=args.quick, cases=args.cases)
    print_quality(quality)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"python": sys.version.split()[0], "platform": platform.platform(), "argv": sys.argv[1:]}
    out.write_text(json.dumps({"meta": meta, "solve": solve, "quality": quality}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
