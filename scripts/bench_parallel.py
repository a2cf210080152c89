"""Sharded state, measured side by side in one run on this machine (gloo over loopback, one torch
thread per process), on one model (default the 10M-parameter GPT, examples/gpt.py:job_10m):

  throughput   global samples/s after a warm-up, for N = 2..4 workers: adaptrain replicated
               (`--layout fsdp=1`), adaptrain sharded (`--layout dp=1`: FSDP2 over every member, with
               the ring of copies), and torchrun + FSDP2 (scripts/_torchrun_fsdp.py: `fully_shard`
               per block, the same model, batch, sampler and recipe); and each worker's peak resident
               memory (VmHWM), replicated against sharded.
  reshard      a join to a sharded job (2 -> 3 members) in real processes (tests/system/
               parallel_harness.py): the bytes the newcomer receives and how fast, against raw gloo
               p2p between two processes measured in the same run (batch_isend_irecv of 100 MB), and
               raw p2p of the join's own bytes from two senders: in 200 messages, in the reshard's
               message size (~1 MiB), and in that size packed from the senders' items (torch.cat,
               as the reshard packs small items): what the wire allows and what packing costs.
  join         adaptrain sharded, one worker more: from the newcomer's plan (it is planned in as
               soon as it is ready) to its group formed with its slices, and to the first step of
               that epoch; and how long the members paused for it. `--joins K`: K joins one after
               another (each newcomer drained before the next), under the coordinator's defaults
               (--join-abandons auto: the members give the step in flight up when the cost model
               says it pays, or when more than --join-wait-max, 0.5 s, of it is left), and the same
               under --join-abandons always (every join does) and never (every join waits for the
               step boundary), and under auto with --join-wait-max none (no bound on the wait).
  tensor       tensor parallel: for each of `--tp-layouts` (default tp=2 on 2 workers and tp=2,dp=2 on
               4), global samples/s of adaptrain pinned to it against torchrun + `parallelize_module`
               running the same layout (scripts/_torchrun_tp.py: a (dp, tp) mesh, the job's tp plan,
               the dp gradients all-reduced, the same recipe); interleaved over `--repeats` rounds.
  kill         adaptrain sharded: SIGKILL of a member -> training again (its slices come back from
               the copy its keeper holds) and the next committed step; against torchrun elastic +
               FSDP2 with a DCP checkpoint every 5 steps (torchrun restarts every worker, which
               load the newest checkpoint), three workers each.

Goals: sharded and each tensor-parallel layout >= 0.95x torchrun's samples/s on the same layout; reshard >= 0.7x raw p2p; 10M join
<= 1 s from ready to first step; kill -> next step <= 0.5 s. Prints a table, writes JSON.

usage: python scripts/bench_parallel.py [--quick] [--workers 2,3] [--repeats R] [--sections ...] [--joins K]
                                        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, read_jsonl, write_report, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("throughput", "reshard", "join", "kill")  # (default; also: tensor)
ALL_SECTIONS = (*SECTIONS, "tensor")
JOINS = 9  # reshard: the newcomer's receive is measured over this many joins (the median is reported)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples_per_s(steps: list[dict[str, Any]], first: int, last: int, batch: int) -> float:
    ts = {e["step"]: e["ts"] for e in steps}
    return float(batch * (last - first) / (ts[last] - ts[first]))


def _peak_rss(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            out.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024)
        except (OSError, StopIteration):
            pass
    return out


def _job_info(job_ref: str) -> tuple[int, int]:
    from worker.job import load_job, resolve_job_ref

    src = resolve_job_ref(job_ref)
    job = load_job(src.source, src.name, filename=src.ref)
    return job.global_batch, job.num_steps


def adaptrain_throughput(job_ref: str, n: int, layout: str, warmup: int, steps: int, workdir: Path) -> dict[str, Any]:
    batch, _ = _job_info(job_ref)
    with LocalJob(job_ref, workdir, min_workers=n, coordinator_args=["--layout", layout]) as job:
        job.start()
        for i in range(n):
            job.add_worker(f"w{i + 1}", "--trace-steps", str(workdir / f"w{i + 1}.steps.jsonl"))
        job.wait_step(warmup + steps, 1200, poll_s=0.5)  # (as torchrun_throughput polls)
        rss = _peak_rss([p.pid for p in job.workers.values()])
        events = job.events()
        job.ctl("stop")
        job.wait_coordinator(60)
    run = [e for e in events if e["kind"] == "step"]
    # The redundancy's cost (sharded: the gradient slices to the copy's keeper and the optimizer
    # step on the copy), each worker's share of its step time, from its --trace-steps lines.
    traced = [r for path in workdir.glob("w*.steps.jsonl") for r in read_jsonl(path) if warmup < r["step"] <= warmup + steps]
    redundancy = statistics.median(r["redundancy_s"] / r["step_s"] for r in traced) if traced else 0.0
    return {"samples_per_s": _samples_per_s(run, warmup, warmup + steps, batch), "peak_rss_bytes": rss,
            "redundancy_share": redundancy,
            "layout": next(e["layout"] for e in reversed(events) if e["kind"] == "plan" and e.get("layout"))}


def torchrun_throughput(job_ref: str, n: int, warmup: int, steps: int, workdir: Path, *,
                        script: str = "_torchrun_fsdp.py", extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """torchrun --standalone with N processes of `script` (FSDP2, _torchrun_job.py: DDP, or
    _torchrun_tp.py: tensor parallel, `extra` its flags)."""
    batch, _ = _job_info(job_ref)
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={n}",
           str(ROOT / "scripts" / script), "--job", job_ref, "--events", str(events),
           "--steps", str(warmup + steps), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with (workdir / "torchrun.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        peak: list[int] = []
        try:
            while proc.poll() is None:
                kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                rss = _peak_rss([int(k) for k in kids])
                peak = rss if sum(rss) > sum(peak) else peak
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}): {(workdir / 'torchrun.log').read_text()[-2000:]}")
    run = [e for e in read_jsonl(events) if e.get("kind") == "step"]
    return {"samples_per_s": _samples_per_s(run, warmup, warmup + steps, batch), "peak_rss_bytes": peak}


def torchrun_kill(job_ref: str, n: int, workdir: Path, every: int = 5) -> dict[str, Any]:
    """torchrun elastic + FSDP2, as a user would run it for spot machines: `--max-restarts`, a DCP
    checkpoint every `every` steps; SIGKILL of one worker after a checkpoint -> torchrun stops the
    others and starts all of them again, they load the newest checkpoint -> the next step."""
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={n}",
           "--max-restarts=3", "--monitor-interval=0.1", str(ROOT / "scripts" / "_torchrun_fsdp.py"),
           "--job", job_ref, "--events", str(events), "--checkpoint", str(workdir / "checkpoints"),
           "--checkpoint-every", str(every), "--steps", str(3 * every)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def steps() -> list[dict[str, Any]]:
        return [e for e in read_jsonl(events) if e.get("kind") == "step"] if events.exists() else []

    with (workdir / "torchrun.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            while max((e["step"] for e in steps()), default=0) < every + 2:  # past the first checkpoint
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"torchrun ended early: {(workdir / 'torchrun.log').read_text()[-2000:]}")
                time.sleep(0.05)
            last = max(e["step"] for e in steps())
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            t_kill = time.time()
            os.kill(int(kids[-1]), signal.SIGKILL)
            while not [e for e in steps() if e["ts"] > t_kill and e["step"] > last]:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"torchrun did not recover: {(workdir / 'torchrun.log').read_text()[-2000:]}")
                time.sleep(0.05)
            nxt = min((e for e in steps() if e["ts"] > t_kill and e["step"] > last), key=lambda e: e["ts"])
            start = next(e for e in read_jsonl(events) if e.get("kind") == "start" and e["ts"] > t_kill)
            first = min((e for e in steps() if e["ts"] > t_kill), key=lambda e: e["ts"])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return {"kill_to_resumed_s": start["ts"] - t_kill, "kill_to_next_step_s": nxt["ts"] - t_kill,
            "kill_to_first_step_s": first["ts"] - t_kill, "redone_steps": last - start["step"],
            "checkpoint_every": every}


def raw_p2p(workdir: Path, nbytes: int = 100 * 2**20, senders: int = 1, messages: int = 200,
            pieces: int = 0) -> dict[str, Any]:
    """`batch_isend_irecv` of `messages` fp32 tensors (`nbytes` in all) from `senders` processes (each
    its part) to one receiver, into buffers used before (warm), 21 times (the first not counted): the
    receiver's median GB/s (a 2-core machine's noise moves one transfer's rate by 2x). `pieces` > 0:
    each sender holds its part as that many tensors and packs every message from their slices with
    `torch.cat` before sending it, as the reshard packs a message of small items."""
    per = nbytes // 4 // messages
    code = f"""
import sys, time, json, torch, torch.distributed as dist
from datetime import timedelta
rank, port, world = int(sys.argv[1]), int(sys.argv[2]), {senders} + 1
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
ts = [torch.ones({per}) for _ in range({messages})]
me = [t for i, t in enumerate(ts) if i % {senders} == rank]
held = torch.ones({per} * max(len(me), 1)).chunk({pieces}) if {pieces} else ()
def packed(k):  # message k of this sender, cut from the held pieces
    lo, hi, out, at = k * {per}, (k + 1) * {per}, [], 0
    for p in held:
        a, b = max(lo, at), min(hi, at + p.numel())
        if a < b:
            out.append(p[a - at:b - at])
        at += p.numel()
    return torch.cat(out)
rates = []
for _ in range(21):
    dist.barrier(); t0 = time.perf_counter()
    if rank < {senders}:
        ops = [dist.P2POp(dist.isend, packed(k) if held else t, {senders}) for k, t in enumerate(me)]
    else:
        ops = [dist.P2POp(dist.irecv, t, i % {senders}) for i, t in enumerate(ts)]
    for w in dist.batch_isend_irecv(ops): w.wait()
    rates.append({per * 4 * messages} / (time.perf_counter() - t0))
if rank == {senders}: print(json.dumps(rates[1:]))
"""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(senders + 1)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    rates = json.loads(out[senders].strip().splitlines()[-1])
    return {"bytes": per * 4 * messages, "senders": senders, "messages": messages, "pieces": pieces,
            "bytes_per_s": statistics.median(rates)}


def reshard_join(job_ref: str, workdir: Path) -> dict[str, Any]:
    """2 -> 3 members, sharded, in real processes: what the newcomer received and how fast."""
    from plan.layout import Layout
    from plan.reshard import least_moving_order
    from worker.graph import capture_graph
    from worker.job import load_job, resolve_job_ref

    src = resolve_job_ref(job_ref)
    job = load_job(src.source, src.name, filename=src.ref)
    workdir.mkdir(parents=True, exist_ok=True)
    graph = workdir / "graph.json"
    captured = capture_graph(job)
    graph.write_text(json.dumps(captured.to_dict()))
    G = job.global_batch

    def layout(members: list[str]) -> dict[str, Any]:
        shares = [G // len(members) + (1 if i < G % len(members) else 0) for i in range(len(members))]
        return {"dp_replicate": 1, "dp_shard": len(members), "pp": 1, "tp": 1, "members": members, "shares": shares}

    # c joins where the planner ranks it (`least_moving_order`; the harness keeps no copies): between
    # a and b, so it pulls its third from both and neither of them receives anything.
    joined, _ = least_moving_order(Layout.from_dict(layout(["a", "b"])), ["a", "b"], ["a", "b", "c"], dp_shard=3,
                                   copies=False)

    scenario = workdir / "scenario.json"
    path, name = job_ref.split(":")
    scenario.write_text(json.dumps({"processes": ["a", "b", "c"], "job": str(Path(path).resolve().relative_to(ROOT)),
                                    "job_name": name, "graph": str(graph), "dump": False,
                                    # c joins, is drained, joins again, ...: JOINS joins measured
                                    "epochs": [{"layout": layout(["a", "b"]), "steps": 1},
                                               *[{"layout": layout(m), "steps": 1} for _ in range(JOINS)
                                                 for m in (joined, ["a", "b"])]]}))
    harness = ROOT / "tests" / "system" / "parallel_harness.py"
    (workdir / "store.port").unlink(missing_ok=True)  # (process a writes its store's port there)
    procs = [subprocess.Popen([sys.executable, str(harness), str(scenario), n, str(workdir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in ("a", "b", "c")]
    outs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for p, text in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(text[-2000:])
    runs = {n: {r["epoch"]: r for r in json.loads((workdir / f"{n}.json").read_text())["reshard"]} for n in "abc"}
    joins = [e for e in sorted(runs["c"]) if runs["c"][e]["received"] > 0]
    rates = [runs["c"][e]["received"] / runs["c"][e]["seconds"] for e in joins]
    whole = [max(runs[n][e]["seconds"] for n in "abc" if e in runs[n]) for e in joins]
    first = runs["c"][joins[0]]
    return {"received_bytes": first["received"], "joins": len(joins),
            "seconds": statistics.median(runs["c"][e]["seconds"] for e in joins),
            "bytes_per_s": statistics.median(rates), "all_bytes_per_s": rates,
            "slowest_member_s": statistics.median(whole), "state_bytes": first["bytes"],
            "largest_sender_elements": max(runs[n][joins[0]]["sent"] for n in "ab"),
            "tensors": len(captured.tensors)}


def join_and_kill(job_ref: str, n: int, workdir: Path, sections: tuple[str, ...], *, joins: int = 1,
                  policy: str = "auto", wait_max: str | None = None) -> dict[str, Any]:
    """adaptrain sharded: N-1 workers, one joins (plan -> its first step), `joins` times (each
    newcomer is drained again before the next one starts); then SIGKILL of one (kill -> the next
    committed step). `policy`: the coordinator's --join-abandons; `wait_max`: its --join-wait-max."""
    out: dict[str, Any] = {}
    with LocalJob(job_ref, workdir, min_workers=n - 1,
                  coordinator_args=["--layout", "dp=1", "--join-abandons", policy,
                                    *(["--join-wait-max", wait_max] if wait_max is not None else [])]) as job:
        job.start()
        for i in range(n - 1):
            job.add_worker(f"w{i + 1}")
        job.wait_step(3, 900)
        if "join" in sections:
            every: list[dict[str, Any]] = []
            for k in range(joins):
                name = f"w{n}" if k == 0 else f"w{n}-{k + 1}"
                every.append(_one_join(job, name))
                if k < joins - 1:  # the newcomer goes again (it hands its slices over), the next one comes
                    job.ctl("drain", name)
                    out_plan = job.wait_event(lambda e: e["kind"] == "plan" and e["layout"] is not None
                                              and name not in e["layout"]["members"] and e["epoch"] > every[-1]["epoch"],
                                              600, f"{name} planned out")
                    job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == out_plan["epoch"], 600,
                                   "a step without it")
                    job.workers[name].wait(timeout=120)
            first_join = every[0]
            formed = [j["plan_to_formed_s"] for j in every]
            out["join"] = {**first_join, "policy": _policy(policy, wait_max), "joins": every,
                           "median_plan_to_formed_s": statistics.median(formed), "max_plan_to_formed_s": max(formed),
                           "abandoned": sum(1 for j in every if j["abandoned"]),
                           "missed_vote": sum(1 for j in every if j["missed_vote"])}
        if "kill" in sections:
            job.wait_step(max(job.steps()) + 2, 600)
            last = max(job.steps())
            t_kill = time.time()
            job.kill("w2")
            nxt = job.wait_event(lambda e: e["kind"] == "step" and e["step"] > last and e["ts"] > t_kill, 600,
                                 "the next committed step")
            failed = job.wait_event(lambda e: e["kind"] == "failed", 60, "failed")
            resumed = job.wait_event(lambda e: e["kind"] == "reshard" and e["epoch"] == nxt["epoch"], 60, "reshard")
            # Training resumes when every survivor has formed the new group and rebuilt the dead
            # member's slices from the copies (the `reshard` event); the next step commits one step
            # time later (the step the kill interrupted is done again).
            out["kill"] = {"kill_to_next_step_s": nxt["ts"] - t_kill, "failure_noticed_s": failed["ts"] - t_kill,
                           "kill_to_resumed_s": resumed["ts"] - t_kill, "step_s": nxt["step_s"],
                           "lost": any(e["kind"] == "state_lost" for e in job.events())}
        job.ctl("stop")
        job.wait_coordinator(60)
    return out


def _policy(policy: str, wait_max: str | None) -> str:
    """How a join policy reads in the table: the coordinator's --join-abandons value (and --join-wait-max,
    where not the default)."""
    return policy + (f" --join-wait-max {wait_max}" if wait_max is not None else "")


def _one_join(job: LocalJob, name: str) -> dict[str, Any]:
    """Start worker `name` and measure its join: from its plan (it is planned in the moment it is
    ready) to its group formed with its slices, and to the first step of that epoch."""
    job.add_worker(name)
    plan = job.wait_event(lambda e: e["kind"] == "plan" and name in (e["layout"] or {}).get("members", []),
                          600, f"{name} planned in")
    first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 600, "its first step")
    reshard = job.wait_event(lambda e: e["kind"] == "reshard" and e["epoch"] == plan["epoch"], 60, "reshard")
    events = job.events()
    before = max((e for e in events if e["kind"] == "step" and e["epoch"] < plan["epoch"]), key=lambda e: e["step"])
    last = max((e["ts"] for e in events if e["kind"] == "step" and e["ts"] <= plan["ts"]), default=plan["ts"])
    missed = [e for e in events if e["kind"] == "abandon" and e["epoch"] == plan["epoch"]]
    # The newcomer is planned in the moment it is ready. The members either finish the step they
    # are in and switch at its boundary, or (`abandons_step`: the cost model says it pays) give it
    # up at once, or (an `abandon` event) give up the step after it, which the plan reached them too
    # late to vote on; then the group forms and the slices move (the pause: the time between the old
    # epoch's last step and the new one's first, less that step's own time); then the first step
    # of the new epoch commits.
    return {"epoch": plan["epoch"], "abandoned": bool(plan.get("abandons_step")), "missed_vote": bool(missed),
            "plan_to_first_step_s": first["ts"] - plan["ts"], "plan_to_formed_s": reshard["ts"] - plan["ts"],
            "since_last_step_s": plan["ts"] - last,  # (how far into the members' step it came)
            "pause_s": first["ts"] - before["ts"] - first["step_s"], "step_s": first["step_s"],
            "reshard_bytes": reshard["bytes"], "reshard_s": reshard["seconds"]}


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from interleaved rounds: each system's run with its median samples/s (and that run's
    other figures), every round's samples/s, and the median of the rounds' ratios (each ratio
    compares runs made minutes apart, so the machine's drift cancels in it)."""
    out: dict[str, Any] = {}
    for system in rounds[0]:
        runs = sorted((r[system] for r in rounds), key=lambda x: x["samples_per_s"])
        out[system] = {**runs[len(runs) // 2], "rounds": [r[system]["samples_per_s"] for r in rounds]}
    out["ratio_replicated_ddp"] = statistics.median(r["replicated"]["samples_per_s"] / r["torchrun_ddp"]["samples_per_s"]
                                                    for r in rounds)
    out["ratio_sharded_fsdp2"] = statistics.median(r["sharded"]["samples_per_s"] / r["torchrun_fsdp2"]["samples_per_s"]
                                                   for r in rounds)
    return out


def tensor_rounds(job_ref: str, spec: str, repeats: int, warmup: int, steps: int, work: Path) -> dict[str, Any]:
    """adaptrain pinned to the tensor-parallel layout `spec` against torchrun + parallelize_module on
    the same layout, `repeats` interleaved rounds: each one's median samples/s and the median ratio."""
    from plan.layout import parse_pin

    pin = parse_pin(spec)
    tp, replicas = pin.tp or 1, pin.dp_replicate or 1
    n = tp * replicas
    rounds = []
    for k in range(repeats):
        print(f"tensor parallel {spec} on {n} workers, round {k + 1}/{repeats} ...", flush=True)
        ours = adaptrain_throughput(job_ref, n, spec, warmup, steps, work / f"tp-{spec}-{k}")
        theirs = torchrun_throughput(job_ref, n, warmup, steps, work / f"torchrun-tp-{spec}-{k}",
                                     script="_torchrun_tp.py", extra=("--tp", str(tp)))
        rounds.append((ours, theirs))
    mid = sorted(range(repeats), key=lambda i: rounds[i][0]["samples_per_s"])[repeats // 2]
    return {"workers": n, "adaptrain": {**rounds[mid][0], "rounds": [r[0]["samples_per_s"] for r in rounds]},
            "torchrun": {"samples_per_s": statistics.median(r[1]["samples_per_s"] for r in rounds),
                         "rounds": [r[1]["samples_per_s"] for r in rounds]},
            "ratio": statistics.median(r[0]["samples_per_s"] / r[1]["samples_per_s"] for r in rounds)}


def table(r: dict[str, Any]) -> str:
    lines = [f"bench_parallel: {r['settings']['job']} ({r['settings']['machine']})", ""]
    if "tensor" in r:
        lines.append(f"{'layout':>10} {'workers':>8} {'adaptrain':>10} {'torchrun+TP':>12} {'ratio':>6}  rounds "
                     "(adaptrain; torchrun)")
        for spec, row in r["tensor"].items():
            if "error" in row:
                lines.append(f"{spec:>10} error: {row['error']}")
                continue
            lines.append(f"{spec:>10} {row['workers']:>8} {row['adaptrain']['samples_per_s']:>10.1f}"
                         f" {row['torchrun']['samples_per_s']:>12.1f} {row['ratio']:>6.3f}  "
                         f"{' '.join(f'{v:.1f}' for v in row['adaptrain']['rounds'])}; "
                         f"{' '.join(f'{v:.1f}' for v in row['torchrun']['rounds'])}")
        lines.append("  (samples/s: adaptrain's median round, torchrun's median; ratio: the median of the rounds' "
                     "ratios; goal >= 0.95)")
        lines.append("")
    if "throughput" in r:
        lines.append(f"{'workers':>8} {'replicated':>11} {'torchrun+DDP':>13} {'repl/DDP':>9} {'sharded':>9}"
                     f" {'torchrun+FSDP2':>15} {'shard/FSDP2':>12} {'copies':>7} {'peak MB repl':>13} {'peak MB shard':>14}")
        for n, row in sorted(r["throughput"].items()):
            rep, sh, tr, ddp = row["replicated"], row["sharded"], row["torchrun_fsdp2"], row["torchrun_ddp"]
            lines.append(f"{n:>8} {rep['samples_per_s']:>11.1f} {ddp['samples_per_s']:>13.1f}"
                         f" {row['ratio_replicated_ddp']:>9.3f} {sh['samples_per_s']:>9.1f}"
                         f" {tr['samples_per_s']:>15.1f} {row['ratio_sharded_fsdp2']:>12.3f}"
                         f" {sh.get('redundancy_share', 0.0):>7.1%}"
                         f" {max(rep['peak_rss_bytes']) / 2**20:>13.0f} {max(sh['peak_rss_bytes']) / 2**20:>14.0f}")
        lines.append("  (samples/s, each system's median over the rounds; ratios: the median of the rounds' ratios;"
                     " copies = the sharded step's time on the redundancy, median per worker and step;"
                     " peak = the largest worker's VmHWM)")
        for n, row in sorted(r["throughput"].items()):
            if len(row["sharded"]["rounds"]) > 1:
                lines.append(f"  {n} workers, every round: " + "; ".join(
                    f"{name} {' '.join(f'{v:.1f}' for v in row[key]['rounds'])}" for name, key in
                    (("replicated", "replicated"), ("DDP", "torchrun_ddp"), ("sharded", "sharded"),
                     ("FSDP2", "torchrun_fsdp2"))))
    if "reshard" in r:
        rs, p2p = r["reshard"], r["raw_p2p"]
        lines.append("")
        lines.append(f"reshard 2->3 (newcomer, median of {rs['joins']} joins): {rs['received_bytes'] / 1e6:.1f} MB in "
                     f"{rs['seconds'] * 1e3:.0f} ms = {rs['bytes_per_s'] / 1e9:.2f} GB/s; raw p2p "
                     f"{p2p['bytes_per_s'] / 1e9:.2f} GB/s -> {rs['bytes_per_s'] / p2p['bytes_per_s']:.2f}x; "
                     f"the slowest member done in {rs['slowest_member_s'] * 1e3:.0f} ms")
        two = r.get("raw_p2p_two_senders")
        if two:
            lines.append(f"  raw p2p with the join's shape (two senders -> one receiver, three processes): "
                         f"{two['bytes_per_s'] / 1e9:.2f} GB/s -> {rs['bytes_per_s'] / two['bytes_per_s']:.2f}x")
        for key, how in (("raw_p2p_join_bytes", ""), ("raw_p2p_join_messages", ", the reshard's message size"),
                         ("raw_p2p_join_packed", ", each message packed from the sender's {pieces} pieces")):
            same = r.get(key)
            if same:
                lines.append(f"  raw p2p of the join's bytes in its shape ({same['bytes'] / 1e6:.1f} MB from two senders, "
                             f"{same['messages']} messages{how.format(pieces=same.get('pieces'))}): "
                             f"{same['bytes_per_s'] / 1e9:.2f} GB/s -> {rs['bytes_per_s'] / same['bytes_per_s']:.2f}x")
    for key in ("join", "join_always", "join_never", "join_unbounded"):
        if key not in r:
            continue
        j = r[key]
        lines.append(f"join (sharded, --join-abandons {j.get('policy', 'auto')}): ready (planned) -> group formed and "
                     f"slices moved {j['plan_to_formed_s']:.2f} s, -> first step {j['plan_to_first_step_s']:.2f} s "
                     f"(a step: {j['step_s']:.2f} s); the members paused {j['pause_s']:.2f} s")
        if len(j.get("joins", [])) > 1:
            lines.append(f"  {len(j['joins'])} joins: ready -> formed median {j['median_plan_to_formed_s']:.2f} s, "
                         f"longest {j['max_plan_to_formed_s']:.2f} s; each (s after the members' last step, "
                         f"abandoned?): " + ", ".join(f"{x['plan_to_formed_s']:.2f} ({x['since_last_step_s']:.2f}"
                                                      f"{', abandoned' if x['abandoned'] else ''}"
                                                      f"{', next step abandoned' if x['missed_vote'] else ''})"
                                                      for x in j["joins"]))
        lines.append(f"  reshard {j['reshard_bytes'] / 1e6:.1f} MB; the slowest member's entry took "
                     f"{j['reshard_s']:.2f} s (the newcomer's: from its plan, through the members' steps)")
    if "kill" in r:
        k = r["kill"]
        lines.append(f"kill (sharded): noticed {k['failure_noticed_s'] * 1e3:.0f} ms, training again (group formed, "
                     f"slices rebuilt from the copies) {k['kill_to_resumed_s']:.2f} s, next committed step "
                     f"{k['kill_to_next_step_s']:.2f} s (a step: {k['step_s']:.2f} s); state lost: {k['lost']}")
    if "torchrun_kill" in r and "error" in r["torchrun_kill"]:
        lines.append(f"kill (torchrun elastic + FSDP2): did not recover: {r['torchrun_kill']['error']}")
    elif "torchrun_kill" in r:
        t = r["torchrun_kill"]
        lines.append(f"kill (torchrun elastic + FSDP2, DCP checkpoint every {t['checkpoint_every']} steps): all "
                     f"restarted and the checkpoint loaded {t['kill_to_resumed_s']:.2f} s, next new step "
                     f"{t['kill_to_next_step_s']:.2f} s ({t['redone_steps']} steps done again)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="examples/gpt.py:job_10m", help="PATH.py:NAME (default the 10M GPT)")
    p.add_argument("--workers", default="2,3", help="comma-separated worker counts for throughput (default 2,3)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {', '.join(ALL_SECTIONS)} "
                   f"(default {','.join(SECTIONS)})")
    p.add_argument("--tp-layouts", default="tp=2;tp=2,dp=2", metavar="SPECS",
                   help="tensor section: the layouts to run, ';'-separated --layout specs (default tp=2;tp=2,dp=2)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="throughput: run the four systems R times, interleaved, and report each one's median "
                        "samples/s and the median of the rounds' ratios (this machine's speed drifts by 20%%)")
    p.add_argument("--joins", type=int, default=1, metavar="K",
                   help="joins measured one after another in the join section (each newcomer is drained before "
                        "the next); with K > 1 the same joins run again under --join-abandons always and never, "
                        "and under auto with --join-wait-max none (no bound on a join's wait), side by side")
    p.add_argument("--quick", action="store_true", help="the small GPT, 2 workers, fewer steps (minutes)")
    p.add_argument("--out", type=Path, default=Path("bench-out/parallel.json"))
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="run the jobs in DIR and keep their logs and events there (default: a temporary "
                        "directory, removed at the end)")
    a = p.parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    sections = tuple(s.strip() for s in a.sections.split(","))
    unknown = set(sections) - set(ALL_SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(ALL_SECTIONS)}")
    if a.quick:
        a.job, a.workers, a.warmup, a.steps = "examples/gpt.py:job", "2", 3, 10
    try:
        counts = [int(n) for n in a.workers.split(",")]
    except ValueError:
        p.error(f"--workers wants numbers like 2,3, got {a.workers!r}")
    if a.joins < 1:
        p.error(f"--joins: at least 1, got {a.joins}")
    if any(n < 2 for n in counts):
        p.error("--workers: at least 2 (sharding needs two members)")
    job_ref = str((ROOT / a.job.split(":")[0]).resolve()) + ":" + a.job.split(":")[1]
    result: dict[str, Any] = {"settings": {"job": a.job, "workers": counts, "warmup": a.warmup, "steps": a.steps,
                                           "sections": list(sections),
                                           "machine": f"{os.cpu_count()} cores, torch threads 1"}}
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        work = Path(tmp) if a.keep is None else a.keep
        work.mkdir(parents=True, exist_ok=True)
        if "throughput" in sections:
            result["throughput"] = {}
            for n in counts:
                rounds: list[dict[str, Any]] = []
                for k in range(a.repeats):  # interleaved: a slow spell of the machine hits every system alike
                    print(f"throughput with {n} workers, round {k + 1}/{a.repeats} ...", flush=True)
                    rounds.append({
                        "replicated": adaptrain_throughput(job_ref, n, "fsdp=1", a.warmup, a.steps, work / f"rep{n}-{k}"),
                        "sharded": adaptrain_throughput(job_ref, n, "dp=1", a.warmup, a.steps, work / f"shard{n}-{k}"),
                        "torchrun_fsdp2": torchrun_throughput(job_ref, n, a.warmup, a.steps, work / f"torchrun{n}-{k}"),
                        "torchrun_ddp": torchrun_throughput(job_ref, n, a.warmup, a.steps, work / f"ddp{n}-{k}",
                                                            script="_torchrun_job.py"),
                    })
                result["throughput"][n] = _median_round(rounds)
        if "tensor" in sections:
            result["tensor"] = {}
            for spec in (x.strip() for x in a.tp_layouts.split(";") if x.strip()):
                try:
                    result["tensor"][spec] = tensor_rounds(job_ref, spec, a.repeats, a.warmup, a.steps, work)
                except (RuntimeError, TimeoutError) as e:  # reported in the table; the rest still runs
                    result["tensor"][spec] = {"error": str(e).splitlines()[0][:300]}
        if "reshard" in sections:
            print("reshard and raw p2p ...", flush=True)
            result["raw_p2p"] = raw_p2p(work / "p2p")
            result["raw_p2p_two_senders"] = raw_p2p(work / "p2p2", senders=2)  # the join's own shape
            result["reshard"] = reshard_join(a.job, work / "reshard")
            # The join's own bytes and shape (two senders, one receiver): a like-for-like wire baseline.
            joined = result["reshard"]["received_bytes"]
            result["raw_p2p_join_bytes"] = raw_p2p(work / "p2p3", nbytes=joined, senders=2)
            # ... and in the reshard's message size (~1 MiB), as sent from one buffer, and as packed
            # from a sender's items (a parameter and AdamW's two states per tensor): what packing costs.
            from worker.parallel.slices import MESSAGE  # (the reshard's message size)
            in_messages = max(2, round(joined / MESSAGE))
            result["raw_p2p_join_messages"] = raw_p2p(work / "p2p4", nbytes=joined, senders=2, messages=in_messages)
            result["raw_p2p_join_packed"] = raw_p2p(work / "p2p5", nbytes=joined, senders=2, messages=in_messages,
                                                    pieces=3 * result["reshard"]["tensors"])
        if "join" in sections or "kill" in sections:
            print("join and kill ...", flush=True)
            result.update(join_and_kill(job_ref, 3, work / "joinkill", sections, joins=a.joins))
        if "join" in sections and a.joins > 1:  # the same joins under the other policies, side by side
            for key, policy, wait_max in (("always", "always", None), ("never", "never", None),
                                          ("unbounded", "auto", "none")):
                print(f"joins under --join-abandons {_policy(policy, wait_max)} ...", flush=True)
                result[f"join_{key}"] = join_and_kill(job_ref, 3, work / f"join-{key}", ("join",), joins=a.joins,
                                                      policy=policy, wait_max=wait_max)["join"]
        if "kill" in sections:
            print("torchrun elastic kill ...", flush=True)
            try:
                result["torchrun_kill"] = torchrun_kill(job_ref, 3, work / "torchrun-kill")
            except RuntimeError as e:  # reported in the table, the other figures still count
                result["torchrun_kill"] = {"error": str(e).splitlines()[0][:300]}
    write_report(table(result), result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
