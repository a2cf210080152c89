"""Layouts over slow links, for real: 2 x 2 workers, two on each of two simulated hosts (network
namespaces, scripts/netns.py) joined by links rate-limited to `--rate` mbit (default 200: 23.6 MB/s
measured here), the coordinator on the bridge between them, each host on CPUs of its own (the
machine's divided between them: on two cores, one each; `--shared-cpus` lets every worker run on
every core, as namespaces alone do, so that workers of one host slow down those of the other).
Each layout runs pinned (`--layout ...`), one after the other, and then the planner runs free (no
--layout); for each: global samples/s in the steady state (the last plan's epoch, after `--warmup`
steps), the plan's predicted step against the measured one (the cost model on links that are not
loopback), and the layout the free planner chose. Goal: the planner's choice within 5% of the best
pinned layout. Two runs of one plan minutes apart differ by up to 25% on two cores, so the best
pinned layout and the free planner then run again, in turn, until each ran `--rounds` times, and the
choice is judged by the median of the rounds' ratios (free / best pinned, the two runs of a round
side by side).

Needs root (network namespaces); says why and exits 2 where they cannot be made.

usage: sudo python scripts/bench_links.py [--job REF] [--rate MBIT] [--layouts L;L;...] [--rounds R] [--shared-cpus] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import _last_epoch, _steady  # noqa: E402
from localjob import LocalJob, write_report, close_on_sigterm  # noqa: E402
from netns import Hosts, available, split_cpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("fsdp=1", "dp=1", "dp=2,fsdp=2", "pp=2", "pp=2,dp=2", "pp=2,fsdp=2")
PLACEMENT = {"w1": "a", "w2": "a", "w3": "b", "w4": "b"}


def run(job_ref: str, layout: str | None, hosts: Hosts, warmup: int, steps: int, batch: int,
        work: Path) -> dict[str, Any]:
    """One job on the four namespaced workers, pinned to `layout` (None: the planner chooses)."""
    args = ["--layout", layout] if layout else []
    with LocalJob(job_ref, work, min_workers=4, coordinator_args=args, bind_host=hosts.bridge_address) as job:
        job.start()
        for name, host in PLACEMENT.items():
            job.add_worker(name, "--host", host, prefix=hosts.prefix(host), env_extra=hosts.env(host))
        plan, steps_run = job.wait_until(
            lambda ev: (r if (r := _last_epoch(ev, 1)) and len(r[1]) > warmup + steps else None), 900,
            f"{warmup + steps} steps of one epoch", poll_s=0.5)
        job.ctl("stop")
        job.wait_coordinator(60)
    timed = steps_run[warmup + 1:warmup + steps + 1]
    errors = [abs(e["step_s"] - e["predicted_s"]) / e["step_s"] for e in timed if e.get("predicted_s")]
    return {"layout_pinned": layout or "auto", "samples_per_s": _steady(steps_run[:warmup + steps + 1], warmup, batch, None),
            "step_s": statistics.median(e["step_s"] for e in timed),
            "predicted_step_s": statistics.median(e["predicted_s"] for e in timed if e.get("predicted_s")) if errors else None,
            "cost_model_error": statistics.median(errors) if errors else None,
            "layout": plan["layout"], "epoch": plan["epoch"], "reason": plan.get("reason"), "detail": plan.get("detail")}


def describe(layout: dict[str, Any]) -> str:
    degrees = [f"{k}={layout[k]}" for k in ("pp", "dp_replicate", "dp_shard") if layout.get(k, 1) > 1]
    return " x ".join(degrees) or "1 member"


def table(r: dict[str, Any]) -> str:
    s = r["settings"]
    cpus = s.get("cpus") or {}
    on = (", ".join(f"{h} on CPU {','.join(map(str, c))}" for h, c in cpus.items()) if cpus
          else "every worker on every CPU")
    lines = [f"layouts over slow links: {s['job']}, hosts a (w1, w2) and b (w3, w4), {s['rate_mbit']:g} mbit between "
             f"them, {on}, {s['warmup']} warm-up + {s['steps']} timed steps, {s['date']}", "",
             f"{'pinned':<14} {'ran':<26} {'samples/s':>10} {'step ms':>8} {'predicted':>10} {'error':>6}", "-" * 80]
    for run_ in r["runs"]:
        pred = f"{run_['predicted_step_s'] * 1e3:.1f}" if run_["predicted_step_s"] else "-"
        err = f"{run_['cost_model_error']:.0%}" if run_["cost_model_error"] is not None else "-"
        lines.append(f"{run_['layout_pinned']:<14} {describe(run_['layout']):<26} {run_['samples_per_s']:>10.1f} "
                     f"{run_['step_s'] * 1e3:>8.1f} {pred:>10} {err:>6}")
    best = max(r["runs"][:-1], key=lambda x: x["samples_per_s"])
    free = r["runs"][-1]
    rounds = r.get("rounds") or [{"best": best["samples_per_s"], "free": free["samples_per_s"]}]
    ratios = [x["free"] / x["best"] for x in rounds]
    lines += ["", f"best pinned: {best['layout_pinned']}; the planner chose {describe(free['layout'])}; rounds (best "
                  f"pinned, planner free, samples/s): "
                  + ", ".join(f"{x['best']:.1f} / {x['free']:.1f}" for x in rounds),
              f"the planner's choice: {statistics.median(ratios):.2f} of the best pinned layout, the median of "
              f"{len(rounds)} round(s)' ratios ({', '.join(f'{q:.2f}' for q in ratios)}; goal >= 0.95)",
              f"cost model: median error over the layouts run "
              f"{statistics.median(x['cost_model_error'] for x in r['runs'] if x['cost_model_error'] is not None):.0%}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="examples/gpt.py:job", help="PATH.py:NAME (default the small GPT)")
    p.add_argument("--rate", type=float, default=200.0, metavar="MBIT", help="the link between the hosts (default 200)")
    p.add_argument("--layouts", default=";".join(LAYOUTS), help=f"pinned layouts, ';'-separated (default {';'.join(LAYOUTS)})")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, metavar="R",
                   help="runs of the best pinned layout and of the planner free, in turn, for the choice's ratio "
                        "(default 3; the first round is the tour's)")
    p.add_argument("--shared-cpus", action="store_true",
                   help="run every worker on every CPU (default: the CPUs divided between the hosts, as two machines have)")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench-links.json")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the runs' logs and events in DIR")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    why = available()
    if why:
        print(f"bench_links: cannot make network namespaces here: {why}", file=sys.stderr)
        return 2
    from bench_parallel import _job_info

    job_ref = str((ROOT / a.job.split(":")[0]).resolve()) + ":" + a.job.split(":")[1]
    batch = _job_info(job_ref)[0]
    layouts = [x.strip() for x in a.layouts.split(";") if x.strip()]
    cpus = {} if a.shared_cpus else split_cpus(["a", "b"])
    result: dict[str, Any] = {"settings": {"job": a.job, "rate_mbit": a.rate, "warmup": a.warmup, "steps": a.steps,
                                           "cpus": cpus, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                              "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp, \
            Hosts(["a", "b"], rate_mbit=a.rate, cpus=cpus) as hosts:
        work = Path(tmp) if a.keep is None else a.keep
        for k, layout in enumerate([*layouts, None]):
            print(f"{layout or 'the planner free'} ...", flush=True)
            result["runs"].append(run(job_ref, layout, hosts, a.warmup, a.steps, batch, work / f"run{k}"))
        best = max(result["runs"][:-1], key=lambda x: x["samples_per_s"])
        result["rounds"] = [{"best": best["samples_per_s"], "free": result["runs"][-1]["samples_per_s"]}]
        for k in range(1, a.rounds):
            print(f"round {k + 1}: {best['layout_pinned']}, then the planner free ...", flush=True)
            again = run(job_ref, best["layout_pinned"], hosts, a.warmup, a.steps, batch, work / f"best{k}")
            free = run(job_ref, None, hosts, a.warmup, a.steps, batch, work / f"free{k}")
            result["rounds"].append({"best": again["samples_per_s"], "free": free["samples_per_s"],
                                     "free_layout": free["layout"]})
    write_report(table(result), result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
