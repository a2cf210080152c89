"""Pipeline parallelism, adaptrain against torchrun + `torch.distributed.pipelining`, measured side by
side in one run on this machine (gloo over loopback, one torch thread per process), on one model
(default the small GPT, examples/gpt.py:job: the 10M one takes ~1.5 s a step with 3 processes on
2 cores, too slow for a run of minutes):

  throughput   global samples/s in the steady state (the steps of the last plan's epoch after
               `--warmup` of them) for adaptrain `--layout pp=P`, P = 2 and 3, and adaptrain
               `--layout fsdp=1` (plain data parallel) on the same P workers for reference; against
               torchrun + pipelining (scripts/_torchrun_pipeline.py: a `PipelineStage` per rank,
               `Schedule1F1B`, `--microbatches` equal micro-batches) with the same P stages cut as
               adaptrain's last plan cut them, so the ratio compares the runtimes. Goal: >= 0.95.
               Also adaptrain's own 1F1B run by torchrun on the same cuts (`--schedule adaptrain`:
               plain waits, no coordinator, copies or abortable waits): the schedule against
               torch's, and what the rest of the system costs against it.
  hetero       N workers (`--hetero-workers`, default 3 on a machine with 4 or more cores, else 2: the
               full-speed stages need a core each), the last a slow device, pinned `--layout pp=N`:
               adaptrain's samples/s once the stages are re-cut to the measured speeds (a plan past
               the first epoch; the stages read from it), against torchrun + pipelining with even
               cuts and the rank at the slow worker's stage as slow; and the ideal: each stage's
               holder does its part of every sample, so with perfect balance, no bubble and free
               communication the pipeline runs at the sum of its members' whole-model speeds:
               (N - 1) v + v/2 for v, one full-speed worker's samples/s on the whole model
               (measured: a one-worker adaptrain run in the same session). Goals: re-cut >= 0.9 x
               ideal and >= 1.3 x even cuts. Also torchrun running adaptrain's cuts on the same slow
               rank: the re-cut's worth within one runtime, against its even cuts. The slow device
               (`--slow-by`): `cpu` (default where it can run: root and a CPU cgroup,
               scripts/slowcpu.py) runs the slow worker and torchrun's slow rank on half of one core,
               slow in every forward, backward and send as a slower machine is; `sleep` uses
               `--slowdown 2` (the stage sleeps its step's compute again once per step, in both
               systems: not how a slow device delays a pipeline, whose neighbours compute meanwhile).

  live         4 workers, `--layout dp=3` (3 replicas, 1 on standby), then `ctl layout pp=3` (replicas
               to a pipeline), `ctl layout pp=2` (3 stages to 2), then SIGKILL of a stage holder:
               each change's pause (the members' last step of the old epoch to the start of their
               first step in the new one) and the bytes resharded; the kill's time to training again
               (the new epoch's `reshard` event: the standby worker holds the dead member's stage).
               Against torchrun elastic + FSDP2 (bench_parallel.torchrun_kill, 3 workers): SIGKILL
               -> every worker restarted and the DCP checkpoint loaded, which is the least a change of
               layout costs done the torchrun way (it also saves first). Goals: pause <= 1 s,
               torchrun >= 25x longer; kill -> training again <= 0.5 s.

Both systems are timed on training steps alone: the gaps that hold adaptrain's evaluation (after
every `eval_every`-th step) are left out, as the torchrun baseline does not evaluate. Each adaptrain
run also reports, from its workers' --trace-steps, the median shares of a member's step spent on the
ring of copies (redundancy) and on waits and sends (comm). Every figure comes from the run. Prints a table, writes JSON.

usage: python scripts/bench_pipeline.py [--quick] [--repeats R] [--sections throughput,hetero,live] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_parallel import _job_info, torchrun_kill  # noqa: E402
from localjob import LocalJob, read_jsonl, write_report, close_on_sigterm  # noqa: E402
from slowcpu import SlowCpu  # noqa: E402
from slowcpu import available as slow_cpu_available  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("throughput", "hetero", "live")


def _steady(steps: list[dict[str, Any]], warmup: int, batch: int, eval_every: int | None) -> float:
    """Samples/s over `steps` (in order) after the first `warmup` of them, leaving out the gaps that hold
    an evaluation (adaptrain evaluates after every `eval_every`-th step; the torchrun baseline does not
    evaluate, so the two are timed on training steps alone)."""
    run = steps[warmup:]
    assert len(run) >= 2, f"too few steps to time: {len(steps)}"
    gaps = [(b["ts"] - a["ts"]) for a, b in zip(run, run[1:]) if not (eval_every and a["step"] % eval_every == 0)]
    return float(batch * len(gaps) / sum(gaps))


def _last_epoch(events: list[dict[str, Any]], min_epoch: int) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(the last plan with a layout, its epoch's step events), once its epoch is >= `min_epoch`."""
    plan = next((e for e in reversed(events) if e["kind"] == "plan" and e.get("layout")), None)
    if plan is None or plan["epoch"] < min_epoch:
        return None
    return plan, sorted((e for e in events if e["kind"] == "step" and e["epoch"] == plan["epoch"]),
                        key=lambda e: e["step"])


def _eval_every(job_ref: str) -> int | None:
    from worker.job import load_job, resolve_job_ref

    src = resolve_job_ref(job_ref)
    return load_job(src.source, src.name, filename=src.ref).eval_every


def adaptrain_run(job_ref: str, layout: str, workers: dict[str, list[str]], warmup: int, steps: int,
                  workdir: Path, *, min_epoch: int = 1, prefixes: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """adaptrain with `workers` (name -> extra worker flags; `prefixes`: a command prefix for some, e.g.
    a slow CPU's) pinned to `layout`: the steady samples/s of the last plan's epoch, once it is >=
    `min_epoch` and has `warmup + steps` steps."""
    batch, _ = _job_info(job_ref)
    with LocalJob(job_ref, workdir, min_workers=len(workers), coordinator_args=["--layout", layout]) as job:
        job.start()
        for name, flags in workers.items():
            job.add_worker(name, *flags, "--trace-steps", str(workdir / f"{name}.steps.jsonl"),
                           prefix=(prefixes or {}).get(name))
        plan, run = job.wait_until(lambda ev: (r if (r := _last_epoch(ev, min_epoch)) and len(r[1]) > warmup + steps
                                               else None), 900, f"{warmup + steps} steps of one epoch", poll_s=0.5)
        job.ctl("stop")
        job.wait_coordinator(60)
    timed = {e["step"] for e in run[warmup:warmup + steps + 1]}
    traced = [t for name in workers for t in read_jsonl(workdir / f"{name}.steps.jsonl")
              if t["epoch"] == plan["epoch"] and t["step"] in timed]
    # What each member's step spends beside its stage's compute: the copies' gradient exchange
    # (redundancy_s) and its waits and sends (comm_s), as shares of its step (medians over members x steps).
    share = {k: statistics.median(t[k] / t["step_s"] for t in traced) if traced else None
             for k in ("redundancy_s", "comm_s")}
    # The cost model against the run: each timed step's prediction (the plan's, as the step event
    # carries it) beside its measured step time.
    timed_steps = run[warmup + 1:warmup + steps + 1]
    errors = [abs(e["step_s"] - e["predicted_s"]) / e["step_s"] for e in timed_steps if e.get("predicted_s")]
    return {"samples_per_s": _steady(run[:warmup + steps + 1], warmup, batch, _eval_every(job_ref)),
            "step_s": statistics.median(e["step_s"] for e in timed_steps),
            "predicted_step_s": statistics.median(e["predicted_s"] for e in timed_steps if e.get("predicted_s"))
            if errors else None,
            "cost_model_error": statistics.median(errors) if errors else None,
            "step_shares": share, "epoch": plan["epoch"],
            "layout": plan["layout"], "micro_batch": plan.get("micro_batch"), "detail": plan.get("detail"),
            "steps_timed": steps}


def torchrun_run(job_ref: str, n: int, warmup: int, steps: int, workdir: Path, *, cuts: str = "",
                 microbatches: int = 4, slowdown: str = "", slow_cgroup: str = "", schedule: str = "1f1b"
                 ) -> dict[str, Any]:
    """torchrun --standalone, N processes of _torchrun_pipeline.py: the steady samples/s."""
    batch, _ = _job_info(job_ref)
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={n}",
           str(ROOT / "scripts" / "_torchrun_pipeline.py"), "--job", job_ref, "--events", str(events),
           "--steps", str(warmup + steps + 1), "--microbatches", str(microbatches),
           *(["--cuts", cuts] if cuts else []), *(["--slowdown", slowdown] if slowdown else []),
           *(["--slow-cgroup", slow_cgroup] if slow_cgroup else []), "--schedule", schedule]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with (workdir / "torchrun.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=600)  # a hang of torch's batched p2p on gloo (pytorch#132644) ends here
        except subprocess.TimeoutExpired:
            raise RuntimeError("torchrun pipelining hung (600 s); see " + str(workdir / "torchrun.log")) from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {(workdir / 'torchrun.log').read_text()[-2000:]}")
    ev = read_jsonl(events)
    run = sorted((e for e in ev if e.get("kind") == "step"), key=lambda e: e["step"])
    start = [e for e in ev if e.get("kind") == "start"]
    return {"samples_per_s": _steady(run, warmup, batch, None), "cuts": start[0]["cuts"] if start else None,
            "microbatches": microbatches, "slowdown": slowdown, "slow_cgroup": slow_cgroup, "schedule": schedule}


def _cuts(layout: dict[str, Any]) -> str:
    """A plan's stages as _torchrun_pipeline.py's --cuts ('0,1|2,3,4|5')."""
    return "|".join(",".join(stage) for stage in layout["stages"])


def _micro_count(run: dict[str, Any], batch: int, stages: int, requested: int) -> int:
    """torchrun's micro-batch count: `requested`, or (0) as many as adaptrain's plan ran, raised to the
    smallest divisor of the batch that is >= the stage count (Schedule1F1B refuses fewer micro-batches
    than stages, and torch's pipelining wants equal ones)."""
    if requested:
        return requested
    largest = max(run.get("micro_batch") or [batch])
    want = max(stages, -(-batch // largest))
    return next(k for k in range(want, batch + 1) if batch % k == 0)


def throughput(job_ref: str, stages: int, warmup: int, steps: int, microbatches: int, work: Path) -> dict[str, Any]:
    names: dict[str, list[str]] = {f"w{i + 1}": [] for i in range(stages)}
    ours = adaptrain_run(job_ref, f"pp={stages}", names, warmup, steps, work / f"pp{stages}")
    micro = _micro_count(ours, _job_info(job_ref)[0], stages, microbatches)
    theirs = torchrun_run(job_ref, stages, warmup, steps, work / f"torchrun{stages}", cuts=_cuts(ours["layout"]),
                          microbatches=micro)
    # adaptrain's own 1F1B run by torchrun on the same cuts and micro-batches, plain waits, no
    # coordinator or copies: the schedule against torch's, and the rest of the system against it
    schedule = torchrun_run(job_ref, stages, warmup, steps, work / f"schedule{stages}", cuts=_cuts(ours["layout"]),
                            microbatches=micro, schedule="adaptrain")
    dp = adaptrain_run(job_ref, "fsdp=1", names, warmup, steps, work / f"dp{stages}")
    return {"adaptrain_pp": ours, "torchrun_pp": theirs, "schedule_alone": schedule, "adaptrain_dp": dp,
            "ratio": ours["samples_per_s"] / theirs["samples_per_s"],
            "schedule_ratio": schedule["samples_per_s"] / theirs["samples_per_s"],
            "system_ratio": ours["samples_per_s"] / schedule["samples_per_s"]}


def hetero(job_ref: str, n: int, warmup: int, steps: int, microbatches: int, work: Path, slow_by: str
           ) -> dict[str, Any]:
    one = adaptrain_run(job_ref, "fsdp=1", {"w1": []}, warmup, steps, work / "one")
    v = one["samples_per_s"]
    slow = f"w{n}"
    with contextlib.ExitStack() as stack:
        cgroup = stack.enter_context(SlowCpu("bench-pipeline-slow", 0.5)) if slow_by == "cpu" else None
        workers: dict[str, list[str]] = {f"w{i + 1}": [] for i in range(n - 1)}
        workers[slow] = [] if cgroup is not None else ["--slowdown", "2"]
        ours = adaptrain_run(job_ref, f"pp={n}", workers, warmup, steps, work / "hetero", min_epoch=2,
                             prefixes={slow: cgroup.prefix} if cgroup is not None else None)
        slow_stage = ours["layout"]["members"].index(slow)
        micro = _micro_count(ours, _job_info(job_ref)[0], n, microbatches)
        slowed = ({"slow_cgroup": f"{slow_stage}:{cgroup.path}"} if cgroup is not None
                  else {"slowdown": f"{slow_stage}:2"})
        even = torchrun_run(job_ref, n, warmup, steps, work / "torchrun-even", microbatches=micro, **slowed)
        # adaptrain's cuts run by torchrun with the same rank slowed: what the re-cut is worth in one
        # runtime (against `even`), apart from the two runtimes' difference (the throughput section's ratio)
        recut = torchrun_run(job_ref, n, warmup, steps, work / "torchrun-recut", cuts=_cuts(ours["layout"]),
                             microbatches=micro, **slowed)
    ideal = _ideal(v, n)
    # 1F1B over m micro-batches keeps each stage idle (p - 1) of every (m + p - 1) micro-batch slots
    # however well it is cut: the most the re-cut pipeline can reach with the micro-batches it ran
    batch = _job_info(job_ref)[0]
    m = -(-batch // max(ours["micro_batch"] or [batch]))
    bound = ideal * m / (m + n - 1)
    return {"workers": n, "slow": slow, "slow_by": slow_by, "one_worker": one, "adaptrain_recut": ours,
            "micro_batches": m, "bubble_bound_samples_per_s": bound, "of_bound": ours["samples_per_s"] / bound,
            "torchrun_even": even, "torchrun_recut": recut, "ideal_samples_per_s": ideal, "slow_stage": slow_stage,
            "cores": os.cpu_count() or 1, "of_ideal": ours["samples_per_s"] / ideal,
            "over_even": ours["samples_per_s"] / even["samples_per_s"],
            "cut_worth": recut["samples_per_s"] / even["samples_per_s"]}


def _ideal(v: float, n: int) -> float:
    """The pipeline of n - 1 full-speed workers and one at half speed with perfect cuts, no bubble and
    free sends: the sum of the members' whole-model speeds."""
    return (n - 1) * v + v / 2


def _pause(job: LocalJob, plan: dict[str, Any]) -> dict[str, Any]:
    """A change's pause for the members of `plan`'s epoch: from the old epoch's last committed step to
    the start of the new epoch's first step (its commit less its step time), and the reshard's bytes."""
    first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 600, "a step of the new epoch")
    events = job.events()
    last_old = max(e["ts"] for e in events if e["kind"] == "step" and e["epoch"] < plan["epoch"])
    reshard = next((e for e in events if e["kind"] == "reshard" and e["epoch"] == plan["epoch"]), {})
    return {"pause_s": first["ts"] - first["step_s"] - last_old, "bytes": reshard.get("bytes"),
            "layout": plan["layout"], "epoch": plan["epoch"]}


def live(job_ref: str, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with LocalJob(job_ref, work / "live", min_workers=3, coordinator_args=["--layout", "dp=3"]) as job:
        job.start()
        for name in ("w1", "w2", "w3", "w4"):
            job.add_worker(name)
        job.wait_step(5, 900)
        for spec, key in (("pp=3", "dp_to_pp3"), ("pp=2", "pp3_to_pp2")):
            seen = len(job.events())
            job.ctl("layout", spec)
            plan = job.wait_until(lambda ev: next((e for e in ev[seen:] if e["kind"] == "plan" and e.get("layout")
                                                   and e["reason"] == "layout"), None), 600, f"the plan for {spec}")
            out[key] = _pause(job, plan)
            job.wait_step(max(job.steps()) + 3, 600)
        last = max(job.steps())
        victim = out["pp3_to_pp2"]["layout"]["members"][-1]
        t_kill = time.time()
        job.kill(victim)
        nxt = job.wait_event(lambda e: e["kind"] == "step" and e["step"] > last and e["ts"] > t_kill, 600,
                             "the next committed step")
        resumed = job.wait_event(lambda e: e["kind"] == "reshard" and e["epoch"] == nxt["epoch"], 60, "reshard")
        failed = job.wait_event(lambda e: e["kind"] == "failed", 60, "failed")
        out["kill"] = {"victim": victim, "failure_noticed_s": failed["ts"] - t_kill,
                       "kill_to_resumed_s": resumed["ts"] - t_kill, "kill_to_next_step_s": nxt["ts"] - t_kill,
                       "step_s": nxt["step_s"], "lost": any(e["kind"] == "state_lost" for e in job.events())}
        job.ctl("stop")
        job.wait_coordinator(60)
    out["torchrun_restart"] = torchrun_kill(job_ref, 3, work / "torchrun-restart")
    worst = max(out["dp_to_pp3"]["pause_s"], out["pp3_to_pp2"]["pause_s"])
    out["torchrun_over_pause"] = out["torchrun_restart"]["kill_to_resumed_s"] / worst
    return out


def _median_rounds(rounds: list[dict[str, Any]], ratios: tuple[str, ...]) -> dict[str, Any]:
    """R rounds of one section as one: the last round's runs with each system's median samples/s (its
    every round kept in `rounds_samples_per_s`) and the median of each round's `ratios`."""
    out = dict(rounds[-1])
    for key, run in rounds[-1].items():
        if isinstance(run, dict) and "samples_per_s" in run:
            each = [r[key]["samples_per_s"] for r in rounds]
            out[key] = {**run, "samples_per_s": statistics.median(each), "rounds_samples_per_s": each}
    for key in ratios:
        out[key] = statistics.median(r[key] for r in rounds)
    out["rounds"] = len(rounds)
    return out


def _shares(run: dict[str, Any]) -> str:
    sh = run.get("step_shares") or {}
    text = ", ".join(f"{k[:-2]} {v:.0%}" for k, v in sh.items() if v is not None) or "(no trace)"
    if run.get("cost_model_error") is not None:
        text += (f"; step {run['step_s'] * 1e3:.1f} ms, predicted {run['predicted_step_s'] * 1e3:.1f} ms "
                 f"(error {run['cost_model_error']:.0%})")
    return text


def _cost_model_errors(r: dict[str, Any]) -> list[tuple[str, float]]:
    """(run, the cost model's median error over its timed steps) for every adaptrain run in `r`."""
    out = []
    for p, t in r.get("throughput", {}).items():
        for key in ("adaptrain_pp", "adaptrain_dp"):
            if isinstance(t.get(key), dict) and t[key].get("cost_model_error") is not None:
                out.append((f"{key.removeprefix('adaptrain_')} on {p}", t[key]["cost_model_error"]))
    h = r.get("hetero", {})
    for key in ("one_worker", "adaptrain_recut"):
        if isinstance(h.get(key), dict) and h[key].get("cost_model_error") is not None:
            out.append((f"hetero {key}", h[key]["cost_model_error"]))
    return out


def table(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [f"pipeline benchmark: {s['job']}, {s['machine']}, {s['warmup']} warm-up + {s['steps']} timed steps, "
             f"torchrun: Schedule1F1B, {s['date']}, median of {s['repeats']} round(s)"]
    if "throughput" in r:
        lines += ["", f"{'stages':>6}  {'adaptrain pp':>13}  {'torchrun pp':>12}  {'ratio':>6}  {'adaptrain dp':>13}  "
                  f"cuts (both)  micro-batches (adaptrain; torchrun)", "-" * 100]
    for p, t in r.get("throughput", {}).items():
        if "error" in t:
            lines.append(f"{p:>6}  error: {t['error']}")
            continue
        lines.append(f"{p:>6}  {t['adaptrain_pp']['samples_per_s']:>9.1f} s/s  {t['torchrun_pp']['samples_per_s']:>8.1f} s/s"
                     f"  {t['ratio']:>6.2f}  {t['adaptrain_dp']['samples_per_s']:>9.1f} s/s  "
                     f"{_cuts(t['adaptrain_pp']['layout']):<11}  {t['adaptrain_pp']['micro_batch']}; "
                     f"{t['torchrun_pp']['microbatches']} of {r['settings']['batch'] // t['torchrun_pp']['microbatches']}")
        if isinstance(t.get("schedule_alone"), dict):
            lines.append(f"{'':>6}  adaptrain's 1F1B alone under torchrun: {t['schedule_alone']['samples_per_s']:.1f} s/s, "
                         f"{t['schedule_ratio']:.2f} of torch's; adaptrain pp {t['system_ratio']:.2f} of it "
                         "(the coordinator, the copies, the abortable waits)")
        lines.append(f"{'':>6}  adaptrain pp step shares: {_shares(t['adaptrain_pp'])}")
        lines.append(f"{'':>6}  adaptrain dp: {_shares(t['adaptrain_dp'])}")
    if "throughput" in r:
        lines.append("(samples/s; ratio = adaptrain pp / torchrun pp, goal >= 0.95; dp = --layout fsdp=1 on the "
                     "same workers, for reference)")
    if "hetero" in r:
        h = r["hetero"]
        if "error" in h:
            lines.append(f"\nhetero: error: {h['error']}")
        else:
            v = h["one_worker"]["samples_per_s"]
            n = h.get("workers", 3)
            how = "on half of one core (a CPU cgroup)" if h.get("slow_by") == "cpu" else "at --slowdown 2"
            lines += ["", f"hetero: {n} workers, {h.get('slow', 'w3')} {how}, --layout pp={n}",
                      f"  one full-speed worker, whole model (fsdp=1): v = {v:.1f} samples/s",
                      f"  ideal = {n - 1} v + v/2 = {h['ideal_samples_per_s']:.1f} samples/s (each member does its "
                      f"stage of every sample: perfect balance, no bubble, free sends)",
                      *([f"  (a sleeping --slowdown uses no CPU, so on this machine's {h['cores']} cores the {n} "
                         f"can reach at most {h['cores']} x v = {h['cores'] * v:.1f} samples/s)"]
                        if h["cores"] < n and h.get("slow_by") != "cpu" else []),
                      f"  adaptrain re-cut {_cuts(h['adaptrain_recut']['layout'])} (members "
                      f"{','.join(h['adaptrain_recut']['layout']['members'])}): "
                      f"{h['adaptrain_recut']['samples_per_s']:.1f} samples/s",
                      f"    step shares: {_shares(h['adaptrain_recut'])}",
                      f"    micro-batches {h['adaptrain_recut']['micro_batch']}; plan: {h['adaptrain_recut']['detail']}",
                      f"  torchrun even cuts {h['torchrun_even']['cuts']}, rank {h['slow_stage']} as slow, "
                      f"{h['torchrun_even']['microbatches']} micro-batches: "
                      f"{h['torchrun_even']['samples_per_s']:.1f} samples/s",
                      f"  torchrun with adaptrain's cuts, the same rank slowed: "
                      f"{h['torchrun_recut']['samples_per_s']:.1f} samples/s: the cut's worth in one runtime "
                      f"= {h['cut_worth']:.2f} x even",
                      f"  re-cut / ideal = {h['of_ideal']:.2f} (goal >= 0.9); re-cut / even = {h['over_even']:.2f} "
                      f"(goal >= 1.3)",
                      *([f"  (1F1B's bubble with the {h['micro_batches']} micro-batches it ran bounds any cut at "
                         f"{h['micro_batches']}/{h['micro_batches'] + n - 1} of the ideal, "
                         f"{h['bubble_bound_samples_per_s']:.1f} samples/s: the re-cut reached {h['of_bound']:.2f} of that)"]
                        if "of_bound" in h else [])]
    errors = _cost_model_errors(r)
    if errors:
        lines += ["", f"cost model: median error over the layouts run {statistics.median(e for _, e in errors):.0%} "
                      f"(goal <= 10%): " + ", ".join(f"{name} {e:.0%}" for name, e in errors)]
    if "live" in r:
        v = r["live"]
        if "error" in v:
            lines.append(f"\nlive: error: {v['error']}")
        else:
            t = v["torchrun_restart"]
            lines += ["", "live layout changes: 4 workers, --layout dp=3, then ctl layout pp=3, pp=2, then a kill"]
            for key, what in (("dp_to_pp3", "dp=3 -> pp=3"), ("pp3_to_pp2", "pp=3 -> pp=2")):
                c = v[key]
                lines.append(f"  {what}: members' pause {c['pause_s']:.2f} s (goal <= 1 s), "
                             f"{(c['bytes'] or 0) / 1e6:.1f} MB resharded, stages {_cuts(c['layout'])}")
            k = v["kill"]
            lines.append(f"  SIGKILL of {k['victim']} (a stage holder): noticed {k['failure_noticed_s'] * 1e3:.0f} ms, "
                         f"training again {k['kill_to_resumed_s']:.2f} s (goal <= 0.5 s), next committed step "
                         f"{k['kill_to_next_step_s']:.2f} s; {'state LOST' if k['lost'] else 'nothing lost'}")
            lines.append(f"  torchrun elastic + FSDP2 (3 workers): kill -> every worker restarted and the checkpoint "
                         f"loaded {t['kill_to_resumed_s']:.2f} s, next new step {t['kill_to_next_step_s']:.2f} s: "
                         f"{v['torchrun_over_pause']:.0f}x the longer pause (goal >= 25x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="examples/gpt.py:job", help="PATH.py:NAME (default the small GPT)")
    p.add_argument("--stages", default="2,3", help="pipeline stage counts for throughput (default 2,3)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--microbatches", type=int, default=0,
                   help="torchrun's micro-batches (must divide the batch; default 0: as many as adaptrain's plan)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="run each section R times and report each system's median samples/s and the median of "
                        "the rounds' ratios (this 2-core machine's speed drifts by 2x between runs)")
    p.add_argument("--hetero-workers", type=int, default=3 if (os.cpu_count() or 1) >= 4 else 2, metavar="N",
                   help="the hetero section's workers, the last a slow device (default 3 with 4 or more cores, else 2: "
                        "the full-speed stages need a core each to show the re-cut's worth)")
    p.add_argument("--slow-by", choices=("auto", "cpu", "sleep"), default="auto",
                   help="the hetero section's slow device: cpu (half of one core, a CPU cgroup: needs root), sleep "
                        "(--slowdown 2), auto (cpu where it can run, else sleep)")
    p.add_argument("--quick", action="store_true", help="fewer steps, 2 stages only (a smoke run)")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "bench-pipeline.json")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the runs' logs and events in DIR")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    sections = tuple(s.strip() for s in a.sections.split(","))
    if set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    if a.slow_by == "cpu" and (why := slow_cpu_available()) is not None:
        p.error(f"--slow-by cpu: {why}")
    if a.slow_by == "auto":
        a.slow_by = "cpu" if slow_cpu_available() is None else "sleep"
    if a.hetero_workers < 2:
        p.error("--hetero-workers: a pipeline needs at least 2 workers")
    if a.quick:
        a.stages, a.warmup, a.steps = "2", 3, 10
    counts = [int(n) for n in a.stages.split(",")]
    job_ref = str((ROOT / a.job.split(":")[0]).resolve()) + ":" + a.job.split(":")[1]
    result: dict[str, Any] = {"settings": {"job": a.job, "stages": counts, "warmup": a.warmup, "steps": a.steps,
                                           "microbatches": a.microbatches, "repeats": a.repeats,
                                           "hetero_workers": a.hetero_workers, "slow_by": a.slow_by, "batch": _job_info(job_ref)[0], "sections": list(sections),
                                           "machine": f"{os.cpu_count()} cores, torch threads 1",
                                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        work = Path(tmp) if a.keep is None else a.keep
        work.mkdir(parents=True, exist_ok=True)
        if "throughput" in sections:
            result["throughput"] = {}
            for n in counts:
                print(f"throughput, {n} stages ...", flush=True)
                try:
                    result["throughput"][n] = _median_rounds(
                        [throughput(job_ref, n, a.warmup, a.steps, a.microbatches, work / f"r{k}")
                         for k in range(a.repeats)], ("ratio", "schedule_ratio", "system_ratio"))
                except (RuntimeError, TimeoutError) as e:  # reported in the table; the rest still runs
                    result["throughput"][n] = {"error": str(e).splitlines()[0][:300]}
        if "hetero" in sections:
            print("hetero ...", flush=True)
            try:
                h = _median_rounds([hetero(job_ref, a.hetero_workers, a.warmup, a.steps, a.microbatches, work / f"r{k}",
                                           a.slow_by)
                                    for k in range(a.repeats)], ("of_ideal", "over_even", "cut_worth", "of_bound"))
                h["ideal_samples_per_s"] = _ideal(h["one_worker"]["samples_per_s"], a.hetero_workers)  # (median v)
                m = h["micro_batches"]
                h["bubble_bound_samples_per_s"] = h["ideal_samples_per_s"] * m / (m + a.hetero_workers - 1)
                result["hetero"] = h
            except (RuntimeError, TimeoutError) as e:
                result["hetero"] = {"error": str(e).splitlines()[0][:300]}
        if "live" in sections:
            print("live ...", flush=True)
            try:
                result["live"] = live(job_ref, work)
            except (RuntimeError, TimeoutError) as e:
                result["live"] = {"error": str(e).splitlines()[0][:300]}
    write_report(table(result), result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
