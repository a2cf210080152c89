"""The adaptrain demo: a live elastic job on this machine, on loopback.

Starts a coordinator and three workers training the character-level GPT of examples/gpt.py,
prints progress as it goes, SIGKILLs one worker mid-run, starts a new one later, slows another
down three times (`ctl slowdown`: the planner finds the straggler from its step times and moves
its share to the others), and at the end prints a summary: steps, final loss, and what each change
cost, and draws the run (samples/s, loss and members over steps, every join, failure, straggler,
plan and reshard marked; coordinator/report.py, as `adaptrain-ctl report --plot` draws it) into
STATE_DIR/report.png with --state-dir, else ./adaptrain-demo.png (the temporary state directory is
deleted at the end). Exits 0 and leaves no process behind (every process is killed and reaped,
also on Ctrl-C, SIGTERM or an error).

    python scripts/demo.py                          # about a minute on 2 cores
    python scripts/demo.py --state-dir runs/demo    # keep logs, events.jsonl and report.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # coordinator.report, when adaptrain is not installed
from localjob import LocalJob, close_on_sigterm  # noqa: E402

from coordinator import report  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default=f"{ROOT / 'examples' / 'gpt.py'}:job", help="job to train (default: the GPT)")
    p.add_argument("--kill-at", type=int, default=60, metavar="STEP", help="SIGKILL worker w2 at this step")
    p.add_argument("--join-at", type=int, default=100, metavar="STEP", help="start worker w4 at this step")
    p.add_argument("--slow-at", type=int, default=200, metavar="STEP",
                   help="slow worker w3 down 3x at this step (ctl slowdown; 0: never)")
    p.add_argument("--state-dir", type=Path,
                   help="keep logs, events.jsonl and report.png here (default: a temp dir, deleted at the end; "
                        "the plot then goes to ./adaptrain-demo.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    if args.join_at <= args.kill_at:
        p.error("--join-at must come after --kill-at")

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="adaptrain-demo-"))
    plot_path = (args.state_dir / "report.png") if args.state_dir else Path("adaptrain-demo.png").resolve()
    print(f"adaptrain demo: coordinator + 3 workers on loopback; logs in {state_dir}\n")
    with LocalJob(args.job, state_dir, min_workers=3) as job:
        try:
            return run(job, args.kill_at, args.join_at, args.slow_at, plot_path)
        except KeyboardInterrupt:
            print("\ninterrupted: stopping every process")
            return 130
        except (TimeoutError, RuntimeError) as e:
            print(f"\ndemo failed: {e}", file=sys.stderr)
            return 1
        finally:
            if args.state_dir is None and job.coordinator is not None and job.coordinator.poll() == 0:
                shutil.rmtree(state_dir, ignore_errors=True)


def run(job: LocalJob, kill_at: int, join_at: int, slow_at: int, plot_path: Path) -> int:
    job.start()
    print(f"coordinator ready: workers={job.workers_endpoint} control={job.control_endpoint}")
    print(f"CURVE keys in {job.keys_dir} (`coordinator keygen`): the coordinator, every worker and ctl use them; "
          "anyone else is refused and counted")
    for name in ("w1", "w2", "w3"):
        job.add_worker(name, "--log-every", "0")
    print("started w1 w2 w3 (each calibrates, loads the job, joins)\n")
    print(f"{'step':>6} {'loss':>8} {'samples/s':>10} {'epoch':>5}  members")
    marks: dict[str, float] = {}
    shown = 0
    recent: list[tuple[float, int]] = []
    running = True
    while running:
        running = job.coordinator is not None and job.coordinator.poll() is None
        events = job.events()  # (read once more after the coordinator exited: its last events)
        steps = [e for e in events if e["kind"] == "step"]
        last = steps[-1]["step"] if steps else 0
        if "kill" not in marks and last >= kill_at:
            marks["kill"] = time.time()
            job.kill("w2")
            print(f"{'':>6} -- SIGKILL w2 at step {last} --")
        if "join" not in marks and last >= join_at:
            marks["join"] = time.time()
            job.add_worker("w4", "--log-every", "0")
            print(f"{'':>6} -- started w4 at step {last} (it joins once torch is imported and the job built) --")
        if slow_at and "slow" not in marks and last >= slow_at and "w3" in job.workers:
            marks["slow"] = last
            job.ctl("slowdown", "w3", "3")
            print(f"{'':>6} -- ctl slowdown w3 3 at step {last} (its compute now takes 3x as long) --")
        for e in events[shown:]:
            if e["kind"] == "step":
                recent = (recent + [(e["ts"], e["samples"])])[-20:]
                if e["step"] % 10 == 0:
                    rate = sum(s for _, s in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-9)
                    members = _members_at(events, e["epoch"])
                    print(f"{e['step']:>6} {e['loss']:>8.4f} {rate:>10.1f} {e['epoch']:>5}  {members}")
            elif e["kind"] in ("failed", "joined", "left", "plan", "reshard", "straggler", "recovered"):
                print(f"{'':>6} {_describe(e)}")
        shown = len(events)
        if running:
            time.sleep(0.2)

    code = job.wait_coordinator(10)
    exits = job.wait_workers(30)
    summary(job, marks)
    draw(job.state_dir / "events.jsonl", plot_path)
    bad = {n: c for n, c in exits.items() if c not in (0, -9)}
    if code != 0 or bad:
        print(f"\nunexpected exit codes: coordinator={code} workers={bad}", file=sys.stderr)
        return 1
    return 0


def _members_at(events: list[dict[str, Any]], epoch: int) -> str:
    for e in events:
        if e["kind"] == "plan" and e["epoch"] == epoch and e["layout"]:
            return " ".join(f"{n}:{s}" for n, s in zip(e["layout"]["members"], e["layout"]["shares"]))
    return "?"


def _describe(e: dict[str, Any]) -> str:
    kind = e["kind"]
    if kind == "plan":
        predicted = e.get("predicted_step_s")
        guess = f", predicted {predicted * 1e3:.0f} ms/step" if isinstance(predicted, float) else ""
        return f"plan epoch {e['epoch']} ({e['reason']}, {e['status']}): solved in {e['solve_s'] * 1e3:.1f} ms{guess}"
    if kind in ("straggler", "recovered"):
        return (f"{e['worker']} {'is a straggler' if kind == 'straggler' else 'recovered'}: {e['speed']:.0f} "
                f"samples/s against {e['expected']:.0f} expected (step {e['step']})")
    if kind == "reshard":
        return f"epoch {e['epoch']} formed: {e['bytes'] / 1e6:.1f} MB moved, {e['seconds'] * 1e3:.0f} ms"
    if kind == "failed":
        return f"{e['worker']} failed (detected by {e['detected_by']})"
    if kind == "left":
        return f"{e['worker']} left ({e['reason']})"
    return f"{e['worker']} joined"


def summary(job: LocalJob, marks: dict[str, float]) -> None:
    events = job.events()
    steps = job.steps()
    print("\nsummary")
    print(f"  steps committed : {len(steps)} (last {max(steps) if steps else 0}), none lost or repeated: "
          f"{sorted(steps) == list(range(1, len(steps) + 1))}")
    if steps:
        print(f"  final loss      : {steps[max(steps)]['loss']:.4f} (first {steps[min(steps)]['loss']:.4f})")
    rows: list[tuple[str, str]] = []
    failed = next((e for e in events if e["kind"] == "failed"), None)
    if failed and "kill" in marks:
        plan = next(e for e in events if e["kind"] == "plan" and e["reason"] == "failure")
        first = next((e for e in events if e["kind"] == "step" and e["epoch"] == plan["epoch"]), None)
        rows.append(("kill w2 -> failure detected", f"{failed['ts'] - marks['kill']:.3f} s ({failed['detected_by']})"))
        if first:
            rows.append(("kill w2 -> next committed step", f"{first['ts'] - marks['kill']:.3f} s (step {first['step']})"))
    joined = next((e for e in events if e["kind"] == "joined" and e["worker"] == "w4"), None)
    if joined and "join" in marks:
        w4_plan = next((e for e in events if e["kind"] == "plan" and e["layout"] and "w4" in e["layout"]["members"]),
                       None)
        rows.append(("start w4 -> joined (import torch, calibrate)", f"{joined['ts'] - marks['join']:.3f} s"))
        if w4_plan:
            reshard = next((e for e in events if e["kind"] == "reshard" and e["epoch"] == w4_plan["epoch"]), None)
            first = next((e for e in events if e["kind"] == "step" and e["epoch"] == w4_plan["epoch"]), None)
            rows.append(("w4 ready -> in the group with state", f"{reshard['seconds']:.3f} s, {reshard['bytes'] / 1e6:.1f} MB"
                         if reshard else "-"))
            if first:
                rows.append(("w4 planned in -> its first committed step", f"{first['ts'] - w4_plan['ts']:.3f} s"))
    straggler = next((e for e in events if e["kind"] == "straggler" and e["worker"] == "w3"
                      and e["step"] >= marks.get("slow", 0)), None)
    if straggler and "slow" in marks:
        replan = next((e for e in events if e["kind"] == "plan" and e["reason"] == "straggler"
                       and e["ts"] >= straggler["ts"]), None)
        rows.append(("slowdown w3 -> straggler found", f"{straggler['step'] - marks['slow']} steps"))
        if replan:
            first = next((e for e in events if e["kind"] == "step" and e["epoch"] == replan["epoch"]), None)
            shares = dict(zip(replan["layout"]["members"], replan["layout"]["shares"]))
            if first:
                rows.append(("slowdown w3 -> first step at new shares",
                             f"{first['step'] - marks['slow']} steps (w3 now takes {shares.get('w3', 0)} samples)"))
    for e in events:
        if e["kind"] == "plan":
            rows.append((f"plan epoch {e['epoch']} ({e['reason']}) solve", f"{e['solve_s'] * 1e3:.2f} ms"))
    width = max(len(r[0]) for r in rows) if rows else 10
    for what, cost in rows:
        print(f"  {what:<{width}} : {cost}")


def draw(events_path: Path, plot_path: Path) -> None:
    """The run as a picture (what `adaptrain-ctl report --events ... --plot ...` draws)."""
    try:
        read = report.read_events(events_path)
        series = report.build_series(read.events)
        if not series.steps:
            print("\nno committed step: nothing to plot", file=sys.stderr)
            return
        report.plot(series, plot_path, title="adaptrain demo")
    except (OSError, ValueError) as e:
        print(f"\ncould not draw the run into {plot_path}: {e}", file=sys.stderr)
        return
    print(f"\nplot of the run (samples/s, loss, members; every join, failure, straggler, plan, reshard): "
          f"{plot_path}")


if __name__ == "__main__":
    raise SystemExit(main())
