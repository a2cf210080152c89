"""Recovery, join and throughput of adaptrain against torchrun elastic + DDP, in one run.

Both sides train the same job (examples/gpt.py) with the same sampler, optimizer and loss, one
torch thread per process, on this machine over loopback gloo. Three experiments:

1. kill: SIGKILL one of N training "nodes" at a random-ish point inside a step. adaptrain: one
   worker process dies; the coordinator re-plans, the survivors keep their processes. torchrun:
   one node is lost (its agent's process group and its training process are SIGKILLed); the
   surviving agents re-rendezvous and restart their training processes from the checkpoint that
   rank 0 writes after every step. The node hosting the c10d rendezvous store is never the one
   killed (losing it ends a torchrun job that has no external store).
2. join (adaptrain only): from N-1 workers, one more joins; time to its first committed step.
3. steady state: global samples/s from step timestamps, adaptrain (N workers) against plain DDP
   under `torchrun --standalone` (N processes, no checkpoints), after a warm-up.

Every process is started in its own session and killed and reaped on exit. Run it with the
project's venv:  python scripts/bench_recovery.py [--quick] [--model 10m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from localjob import LocalJob, read_jsonl, close_on_sigterm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"small": ("examples/gpt.py:job", 300), "10m": ("examples/gpt.py:job_10m", 100)}  # ref, num_steps

EPILOG = """\
rows of the table (times in seconds, measured from event timestamps, wall clock):
  kill -> next committed step   SIGKILL time -> timestamp of the first committed step numbered above
                                the last step committed before the kill (adaptrain: coordinator
                                `step` event; torchrun: rank 0's line after its checkpoint is in place)
  kill -> first step, new group same, but the first step taken by the reformed group (new epoch /
                                new rendezvous round); differs when the in-flight step still commits
  failure noticed               adaptrain: `failed` event - kill (how: disconnect or lease);
                                torchrun: a surviving agent logs "Worker group FAILED" (its training
                                process crashed on the gloo error), from the agents' INFO logs
  kill -> new group agreed      adaptrain: the `plan` event of the new epoch; torchrun: the agents
                                log "Rendezvous complete" (waits for the lost node's rendezvous
                                keep-alive to expire: keep_alive_interval x keep_alive_max_attempt)
  kill -> processes restarted   torchrun: first restarted training process starts (failure noticed
                                + re-rendezvous); adaptrain restarts nothing
  state moved/reloaded          adaptrain: `reshard` seconds of the post-failure epoch; torchrun:
                                restarted process start -> `resumed` (import torch, build the model,
                                load the checkpoint, init the group)
  steps lost                    steps committed before the kill that were redone after it
  steps continue                step numbers after the kill run on from the last committed one
  join -> first step            adaptrain: `joined` event of the new worker -> first step of the
                                epoch that took it in (includes loading the job, building the model
                                and optimizer, waiting for the step boundary, the state transfer);
                                in brackets: joined -> the `plan` event that takes it in (the
                                joiner is built and Ready) -> the step boundary (last step of the
                                old epoch) -> its first step (state transfer + one step)
  spawn -> first step           the same from the moment its process was started (adds python
                                start-up, importing torch, calibration)
  join reshard                  seconds and MB moved to the joiner
  samples/s                     steady state, global batch x steps / elapsed, between two step
                                timestamps after the warm-up; torchrun = plain DDP, no checkpoints;
                                --repeat windows per side, alternating, pooled
  ratio                         adaptrain samples/s / torchrun samples/s
  CPU s per step                user+system CPU of every process of the side (coordinator or agent
                                included) during the window, per step
  ratio of samples per CPU-s    the same per CPU-second used: less sensitive to other programs
  other programs' load          CPU the rest of the machine used meanwhile, in cores: other
                                programs compete for the 2 cores and skew the comparison
  samples/s, ckpt every step    torchrun elastic as run for the kill experiment (checkpointing)

torchrun settings: N agents, each `--nnodes=2:N --nproc-per-node=1 --rdzv-backend=c10d
--max-restarts=3 --monitor-interval=0.1 --rdzv-conf join_timeout=J,last_call_timeout=L,
keep_alive_interval=K,keep_alive_max_attempt=A`; defaults here J=60 (torch: 600), L=2 (torch: 30),
K=5 and A=3 (torch's); env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (gloo restarts need it on torch
2.13); gloo group timeout --gloo-timeout. adaptrain: LocalJob defaults (lease 1 s, heartbeat 0.2 s).
"""


# --- small helpers -------------------------------------------------------------------------------

def wait_for(get: Callable[[], Any], timeout_s: float, what: str, alive: Callable[[], bool] = lambda: True,
             poll_s: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = get()
        if value is not None:
            return value
        if not alive():
            raise RuntimeError(f"gave up waiting for {what}: the processes died")
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def throughput(steps: list[dict[str, Any]], first: int, last: int, batch: int) -> dict[str, Any]:
    """Global samples/s between the (last) timestamps of steps `first` and `last`."""
    ts = {e["step"]: e["ts"] for e in steps}
    elapsed = ts[last] - ts[first]
    intervals = [ts[k + 1] - ts[k] for k in range(first, last) if k + 1 in ts and k in ts]
    return {"first_step": first, "last_step": last, "elapsed_s": elapsed,
            "samples_per_s": batch * (last - first) / elapsed,
            "median_step_s": statistics.median(intervals) if intervals else None}


def continuity(steps: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
    """From step records (`step`, `ts`) in log order: what the kill did to the step sequence."""
    before = [e["step"] for e in steps if e["ts"] <= t_kill]
    after = [e for e in steps if e["ts"] > t_kill]
    last_before = max(before) if before else 0
    redone = sorted({e["step"] for e in after if e["step"] <= last_before})
    numbers = [e["step"] for e in after]
    contiguous = numbers == list(range(last_before + 1, last_before + 1 + len(numbers)))
    return {"last_committed_before_kill": last_before, "redone_after_kill": redone,
            "steps_lost": len(redone), "first_steps_after_kill": numbers[:8],
            "steps_continue": bool(numbers) and contiguous and not redone}


def mid_step_pause(rng: random.Random, step_s: float) -> tuple[float, float]:
    fraction = rng.uniform(0.15, 0.75)
    return fraction, fraction * step_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def is_ours(pid: int) -> bool:
    try:
        return b"_torchrun_job.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def killpg(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: list[int]) -> dict[str, Any]:
    """CPU seconds used so far by each of `pids` and by the whole machine (busy, all cores)."""
    per_pid = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/status").read_text()
            switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
            per_pid[pid] = (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK, switches)  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(x) for i, x in enumerate(cpu[:8]) if i not in (3, 4))  # all but idle, iowait
    return {"t": time.monotonic(), "pids": per_pid, "busy": busy / CLK_TCK}


def cpu_window(a: dict[str, Any], b: dict[str, Any], steps: int, roles: dict[int, str]) -> dict[str, Any]:
    """Our processes' CPU per step (in all, and per role), and the CPU other programs used meanwhile."""
    per_role: dict[str, list[float]] = {}
    for pid in a["pids"]:
        if pid in b["pids"]:
            role = per_role.setdefault(roles.get(pid, "training processes"), [0.0, 0.0, 0.0])
            for i in (0, 1, 2):
                role[i] += (b["pids"][pid][i] - a["pids"][pid][i]) / steps
    ours = sum(v[0] + v[1] for v in per_role.values()) * steps
    wall = b["t"] - a["t"]
    return {"our_cpu_s_per_step": ours / steps, "per_step_by_role_user_s_sys_s_ctxt_switches": per_role,
            "our_cores": ours / wall,
            "other_cores": max(0.0, (b["busy"] - a["busy"] - ours) / wall), "wall_s": wall}


# --- torchrun ------------------------------------------------------------------------------------

class Torchrun:
    """torchrun agents (each in its own session) running scripts/_torchrun_job.py. The agents start
    their training processes in sessions of their own, so close() stops the agents, collects their
    children, then kills both."""

    def __init__(self, workdir: Path, job_ref: str, gloo_timeout_s: float) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.dir / "events.jsonl"
        self.job_ref = job_ref
        self.gloo_timeout_s = gloo_timeout_s
        self.agents: list[subprocess.Popen[bytes]] = []
        self.killed_workers: set[int] = set()

    def start_agent(self, torchrun_args: list[str], ckpt: Path | None) -> subprocess.Popen[bytes]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   LOGLEVEL="INFO")
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               str(ROOT / "scripts" / "_torchrun_job.py"), "--job", self.job_ref, "--events", str(self.events_path),
               "--threads", "1", "--timeout", str(self.gloo_timeout_s)]
        if ckpt is not None:
            cmd += ["--ckpt", str(ckpt)]
        log = (self.dir / f"agent{len(self.agents)}.log").open("wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=ROOT)
        self.agents.append(proc)
        return proc

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["kind"] == "step"]

    def alive(self) -> bool:
        return any(a.poll() is None for a in self.agents)

    def pids(self) -> list[int]:
        return [p for a in self.agents if a.poll() is None for p in (a.pid, *children(a.pid))]

    def wait_step(self, step: int, timeout_s: float) -> dict[str, Any]:
        event: dict[str, Any] = wait_for(lambda: next((e for e in self.steps() if e["step"] >= step), None),
                                         timeout_s, f"torchrun step {step}", self.alive)
        return event

    def kill_node(self, agent: subprocess.Popen[bytes]) -> float:
        """SIGKILL a node: the agent's process group and its training processes, back to back."""
        workers = children(agent.pid)
        t = time.time()
        killpg(agent.pid)
        for pid in workers:
            killpg(pid)
        self.killed_workers.update(workers)
        agent.wait(timeout=10)
        return t

    def close(self) -> None:
        for a in self.agents:  # freeze the agents so that they cannot start anything new
            if a.poll() is None:
                killpg(a.pid, signal.SIGSTOP)
        workers = {c for a in self.agents if a.poll() is None for c in children(a.pid)}
        workers |= {e["pid"] for e in self.events() if e["kind"] == "start"}
        for a in self.agents:
            killpg(a.pid)
        for pid in workers:
            if is_ours(pid):
                killpg(pid)
        for a in self.agents:
            try:
                a.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while any(is_ours(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)  # orphans are reaped by init

    def tail(self, lines: int = 12) -> str:
        out = []
        for path in sorted(self.dir.glob("agent*.log")):
            text = [ln for ln in path.read_text(errors="replace").splitlines() if "[rank" not in ln[:8]]
            out.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


def torchrun_kill(a: argparse.Namespace, job_ref: str, batch: int, workdir: Path, rng: random.Random) -> dict[str, Any]:
    tr = Torchrun(workdir / "torchrun-elastic", job_ref, a.gloo_timeout)
    port = free_port()
    conf = (f"join_timeout={a.join_timeout},last_call_timeout={a.last_call},keep_alive_interval={a.keep_alive},"
            f"keep_alive_max_attempt={a.keep_alive_attempts}")
    args = [f"--nnodes=2:{a.workers}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--max-restarts=3", "--monitor-interval=0.1",
            f"--rdzv-conf={conf}"]
    ckpt = tr.dir / "ckpt.pt"
    out: dict[str, Any] = {"torchrun_args": args, "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                           "checkpoint": "rank 0, every step, torch.save + os.replace",
                           "killed": "lost node: SIGKILL of one agent's process group and its training process "
                                     "(not the node hosting the c10d store)"}
    try:
        t0 = time.time()
        tr.start_agent(args, ckpt)  # agent 0 binds the rendezvous port: it hosts the c10d store
        wait_for(lambda: _listening(port), 60, "the rendezvous store", tr.alive)
        for _ in range(a.workers - 1):
            tr.start_agent(args, ckpt)
        window = min(a.steps, a.ckpt_window)
        tr.wait_step(a.warmup + window, a.timeout)
        out["startup_s"] = next(e["ts"] for e in tr.steps() if e["step"] == 1) - t0
        out["steady_with_checkpoint"] = throughput(tr.steps(), a.warmup, a.warmup + window, batch)
        k = tr.steps()[-1]["step"]
        tr.wait_step(k + 1, a.timeout)
        fraction, pause = mid_step_pause(rng, out["steady_with_checkpoint"]["median_step_s"])
        time.sleep(pause)
        t_kill = tr.kill_node(tr.agents[-1])
        out.update(kill_fraction_of_step=fraction, t_kill=t_kill)
        cont = continuity(tr.steps(), t_kill)  # provisional, to know what to wait for
        tr.wait_step(cont["last_committed_before_kill"] + a.post_steps, a.recovery_timeout)
        events, steps = tr.events(), tr.steps()
        cont = continuity(steps, t_kill)
        last = cont["last_committed_before_kill"]
        starts = [e for e in events if e["kind"] == "start" and e["ts"] > t_kill]
        resumed = [e for e in events if e["kind"] == "resumed" and e["ts"] > t_kill]
        first_round = min(e["ts"] for e in resumed)
        out.update(cont)
        out["resumed_from_step"] = min(e["step"] for e in resumed)
        out["steps_lost"] = max(out["steps_lost"], last - out["resumed_from_step"])
        out["world_after"] = resumed[0]["world"]
        out["kill_to_next_step_s"] = next(e["ts"] for e in steps if e["step"] > last) - t_kill
        out["kill_to_new_group_step_s"] = next(e["ts"] for e in steps if e["ts"] > first_round) - t_kill
        out["kill_to_restart_s"] = min(e["ts"] for e in starts) - t_kill
        out["restart_to_resumed_s"] = max(e["ts"] for e in resumed) - min(e["ts"] for e in starts)
        out["restart_counts"] = sorted({e["restart"] for e in starts})
        out.update(agent_times(tr, t_kill))
    except Exception as e:  # report it, keep the rest of the benchmark
        out["error"] = f"{type(e).__name__}: {e}\n{tr.tail()}"
    finally:
        tr.close()
        ckpt.unlink(missing_ok=True)
    return out


AGENT_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?) \d+ [^\]]*\] (.*)$")


def agent_times(tr: Torchrun, t_kill: float) -> dict[str, float]:
    """From the surviving agents' INFO logs (glog timestamps, local time): when after the kill they
    saw their worker group fail and when the new rendezvous completed."""
    year = time.localtime(t_kill).tm_year
    found: dict[str, float] = {}
    marks = {"Worker group FAILED": "agent_saw_failure_s", "Rendezvous complete": "rendezvous_complete_s"}
    for path in sorted(tr.dir.glob("agent*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = AGENT_LINE.match(line)
            if not m:
                continue
            mon, day, hh, mm, ss, msg = m.groups()
            ts = time.mktime((year, int(mon), int(day), int(hh), int(mm), 0, 0, 0, -1)) + float(ss)
            for text, key in marks.items():
                if text in msg and ts > t_kill:
                    found[key] = min(found.get(key, ts - t_kill), ts - t_kill)
    return found


def _listening(port: int) -> bool | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return None


def torchrun_steady(a: argparse.Namespace, job_ref: str, batch: int, workdir: Path) -> dict[str, Any]:
    tr = Torchrun(workdir, job_ref, a.gloo_timeout)
    args = ["--standalone", "--nnodes=1", f"--nproc-per-node={a.workers}"]
    out: dict[str, Any] = {"torchrun_args": args, "checkpoint": "none"}
    try:
        t0 = time.time()
        tr.start_agent(args, None)
        tr.wait_step(a.warmup, a.timeout)
        before = cpu_snapshot(tr.pids())
        tr.wait_step(a.warmup + a.steps, a.timeout)
        after = cpu_snapshot(tr.pids())
        out["startup_s"] = next(e["ts"] for e in tr.steps() if e["step"] == 1) - t0
        out["steady"] = throughput(tr.steps(), a.warmup, a.warmup + a.steps, batch)
        out["steady"]["cpu"] = cpu_window(before, after, a.steps, {p.pid: "agent" for p in tr.agents})
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}\n{tr.tail()}"
    finally:
        tr.close()
    return out


# --- adaptrain -----------------------------------------------------------------------------------

def adaptrain(a: argparse.Namespace, job_ref: str, batch: int, workdir: Path, rng: random.Random,
              *, steady_only: bool = False) -> dict[str, Any]:
    """One job: N workers (steady state), then kill one (recovery) and add one back (join)."""
    out: dict[str, Any] = {"localjob": {"lease_s": 1.0, "heartbeat_s": 0.2, "threads": 1}}
    job = LocalJob(job_ref, workdir, min_workers=a.workers)
    try:
        t0 = time.time()
        job.start()
        for i in range(a.workers):
            job.add_worker(f"w{i}")
        job.wait_step(a.warmup, a.timeout)
        pids = [p.pid for p in job.workers.values()] + ([job.coordinator.pid] if job.coordinator else [])
        before = cpu_snapshot(pids)
        job.wait_step(a.warmup + a.steps, a.timeout)
        after = cpu_snapshot(pids)
        steps = [e for e in job.events() if e["kind"] == "step"]
        out["startup_s"] = next(e["ts"] for e in steps if e["step"] == 1) - t0
        out["steady"] = throughput(steps, a.warmup, a.warmup + a.steps, batch)
        roles = {job.coordinator.pid: "coordinator"} if job.coordinator else {}
        out["steady"]["cpu"] = cpu_window(before, after, a.steps, roles)
        if steady_only:
            return out

        # kill
        k = steps[-1]["step"]
        job.wait_step(k + 1, a.timeout)
        fraction, pause = mid_step_pause(rng, out["steady"]["median_step_s"])
        time.sleep(pause)
        victim = f"w{a.workers - 1}"
        t_kill = time.time()
        job.kill(victim)
        kill: dict[str, Any] = {"victim": victim, "kill_fraction_of_step": fraction, "t_kill": t_kill}
        out["kill"] = kill
        steps = [e for e in job.events() if e["kind"] == "step"]
        last = continuity(steps, t_kill)["last_committed_before_kill"]
        job.wait_step(last + a.post_steps, a.recovery_timeout)
        events = job.events()
        steps = [e for e in events if e["kind"] == "step"]
        kill.update(continuity(steps, t_kill))
        last = kill["last_committed_before_kill"]
        failed = next(e for e in events if e["kind"] == "failed" and e["worker"] == victim)
        plan = next(e for e in events if e["kind"] == "plan" and e["ts"] >= failed["ts"])
        reshard = next((e for e in events if e["kind"] == "reshard" and e["epoch"] == plan["epoch"]), None)
        kill.update(
            detected_by=failed["detected_by"], detect_s=failed["ts"] - t_kill, epoch=plan["epoch"],
            plan_s=plan["ts"] - t_kill, reshard_s=reshard["seconds"] if reshard else None,
            reshard_bytes=reshard["bytes"] if reshard else None,
            kill_to_next_step_s=next(e["ts"] for e in steps if e["step"] > last) - t_kill,
            kill_to_new_group_step_s=next(e["ts"] for e in steps if e["epoch"] == plan["epoch"]) - t_kill,
        )

        # join
        joiner = f"w{a.workers}"
        t_spawn = time.time()
        job.add_worker(joiner)
        joined = job.wait_event(lambda e: e["kind"] == "joined" and e["worker"] == joiner, a.timeout, "joined")
        plan = job.wait_event(lambda e: e["kind"] == "plan" and joiner in e.get("layout", {}).get("members", []),
                              a.recovery_timeout, "a plan with the joiner")
        first = job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], a.recovery_timeout,
                               "the joiner's first step")
        job.wait_step(first["step"] + 2, a.timeout)
        events = job.events()
        reshard = next((e for e in events if e["kind"] == "reshard" and e["epoch"] == plan["epoch"]), None)
        boundary = [e for e in events if e["kind"] == "step" and e["epoch"] < plan["epoch"]][-1]  # last old step
        out["join"] = {
            "joiner": joiner, "epoch": plan["epoch"], "plan_reason": plan["reason"], "step": first["step"],
            "spawn_to_joined_s": joined["ts"] - t_spawn, "joined_to_plan_s": plan["ts"] - joined["ts"],
            "joined_to_first_step_s": first["ts"] - joined["ts"], "plan_to_first_step_s": first["ts"] - plan["ts"],
            "plan_to_boundary_s": boundary["ts"] - plan["ts"],
            "boundary_to_first_step_s": first["ts"] - boundary["ts"], "spawn_to_first_step_s": first["ts"] - t_spawn,
            "reshard_s": reshard["seconds"] if reshard else None,
            "reshard_bytes": reshard["bytes"] if reshard else None,
        }
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}\n{job.tail('coordinator.out')}"
    finally:
        job.close()
    return out


# --- report --------------------------------------------------------------------------------------

def pooled(runs: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Steady-state numbers over every run's window: total samples / total elapsed, and so on."""
    windows = [r["steady"] for r in runs if "steady" in r]
    if not windows:
        return {}
    steps = sum(w["last_step"] - w["first_step"] for w in windows)
    elapsed = sum(w["elapsed_s"] for w in windows)
    cpu = sum(w["cpu"]["our_cpu_s_per_step"] * (w["last_step"] - w["first_step"]) for w in windows) / steps
    return {"windows": len(windows), "steps": steps, "samples_per_s": batch * steps / elapsed,
            "per_window_samples_per_s": [w["samples_per_s"] for w in windows], "cpu_s_per_step": cpu,
            "samples_per_cpu_s": batch / cpu,
            "other_cores": sum(w["cpu"]["other_cores"] * w["cpu"]["wall_s"] for w in windows)
            / sum(w["cpu"]["wall_s"] for w in windows)}


def table(r: dict[str, Any]) -> str:
    ours, el = r["adaptrain"], r["torchrun_elastic"]
    ok, ej = ours.get("kill", {}), ours.get("join", {})
    so, sd = r["steady"]["adaptrain"], r["steady"]["torchrun"]

    def f(x: Any, fmt: str = "{:.2f}") -> str:
        if x is None:
            return "-"  # not measured: skipped, or failed (errors are listed under the table)
        if isinstance(x, bool):
            return "yes" if x else "NO"
        return fmt.format(x) if isinstance(x, (int, float)) else str(x)

    def mb(s: Any, b: Any) -> str:
        return "-" if s is None or b is None else f"{s:.2f} s / {b / 1e6:.1f} MB"

    ours_sps, ddp_sps = so.get("samples_per_s"), sd.get("samples_per_s")
    ratio = r["steady"]["ratio"] = ours_sps / ddp_sps if ours_sps and ddp_sps else None
    per_cpu = r["steady"]["ratio_per_cpu_s"] = (so["samples_per_cpu_s"] / sd["samples_per_cpu_s"]
                                                 if so and sd else None)
    join_parts = ("" if "boundary_to_first_step_s" not in ej else
                  f" ({ej['joined_to_plan_s']:.2f} to plan, {ej['plan_to_boundary_s']:.2f} to boundary, "
                  f"{ej['boundary_to_first_step_s']:.2f} to step)")
    rows = [
        ("kill -> next committed step (s)", f(ok.get("kill_to_next_step_s")), f(el.get("kill_to_next_step_s")),
         "small"),
        ("kill -> first step, new group (s)", f(ok.get("kill_to_new_group_step_s")),
         f(el.get("kill_to_new_group_step_s")), "small"),
        ("failure noticed (s)", f"{f(ok.get('detect_s'), '{:.3f}')} ({ok.get('detected_by', '?')})",
         f"{f(el.get('agent_saw_failure_s'))} (worker crash)", "< lease"),
        ("kill -> new group agreed (s)", f"{f(ok.get('plan_s'), '{:.3f}')} (plan)",
         f"{f(el.get('rendezvous_complete_s'))} (rendezvous)", ""),
        ("kill -> processes restarted (s)", "none restarted", f(el.get("kill_to_restart_s")), ""),
        ("state moved / reloaded (s)", f"{f(ok.get('reshard_s'), '{:.3f}')} (reshard)",
         f"{f(el.get('restart_to_resumed_s'))} (restart->resumed)", ""),
        ("steps lost", f(ok.get("steps_lost"), "{}"), f(el.get("steps_lost"), "{}"), "0"),
        ("steps continue from last committed", f(ok.get("steps_continue")), f(el.get("steps_continue")), "yes"),
        ("join -> joiner's first step (s)", f(ej.get("joined_to_first_step_s")) + join_parts, "n/a",
         "<= 1 s (10M params)"),
        ("spawn -> joiner's first step (s)", f(ej.get("spawn_to_first_step_s")), "n/a", ""),
        ("join reshard", mb(ej.get("reshard_s"), ej.get("reshard_bytes")), "n/a", ""),
        (f"steady samples/s ({so.get('windows', 0)} + {sd.get('windows', 0)} windows)", f(ours_sps, "{:.1f}"),
         f(ddp_sps, "{:.1f}"), ""),
        ("ratio adaptrain / torchrun DDP", f(ratio, "{:.3f}"), "", ">= 0.97"),
        ("CPU s per step, all processes", f(so.get("cpu_s_per_step"), "{:.3f}"),
         f(sd.get("cpu_s_per_step"), "{:.3f}"), ""),
        ("ratio of samples per CPU-second", f(per_cpu, "{:.3f}"), "", ""),
        ("other programs' load (cores)", f(so.get("other_cores")), f(sd.get("other_cores")), "~0"),
        ("samples/s, ckpt every step", "n/a",
         f(el.get("steady_with_checkpoint", {}).get("samples_per_s"), "{:.1f}"), ""),
    ]
    head = ["metric", "adaptrain", "torchrun", "goal"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells: tuple[str, ...] | list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_recovery.py", description=__doc__.split("\n\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="small: examples/gpt.py:job (0.8M params); 10m: job_10m (10.8M params)")
    p.add_argument("--workers", type=int, default=3, help="training processes (nodes) per side (default 3)")
    p.add_argument("--steps", type=int, help="steady-state window in steps (default: small 100, 10m 10)")
    p.add_argument("--warmup", type=int, help="steps before the window (default: small 10, 10m 3)")
    p.add_argument("--post-steps", type=int, default=3, help="steps to wait for after the kill (default 3)")
    p.add_argument("--ckpt-window", type=int, default=20,
                   help="steps measured in the checkpointing torchrun run before its kill (default 20)")
    p.add_argument("--repeat", type=int, help="steady-state windows per side, alternating adaptrain and "
                   "torchrun, pooled (default 2; --quick 1): other programs' load varies")
    p.add_argument("--quick", action="store_true", help="short run: fewer steps (about 2 minutes)")
    p.add_argument("--seed", type=int, default=0, help="seeds where in the step the kill lands")
    p.add_argument("--last-call", type=int, default=2, help="torchrun rdzv last_call_timeout, s (default 2)")
    p.add_argument("--join-timeout", type=int, default=60, help="torchrun rdzv join_timeout, s (default 60)")
    p.add_argument("--keep-alive", type=int, default=5, help="torchrun rdzv keep_alive_interval, s (default 5)")
    p.add_argument("--keep-alive-attempts", type=int, default=3,
                   help="torchrun rdzv keep_alive_max_attempt (default 3)")
    p.add_argument("--gloo-timeout", type=float, default=30.0, help="torchrun gloo group timeout, s (default 30)")
    p.add_argument("--timeout", type=float, default=180.0, help="give up waiting for start-up or steps after S s")
    p.add_argument("--recovery-timeout", type=float, default=120.0, help="give up waiting for a recovery after S s")
    p.add_argument("--skip-torchrun", action="store_true", help="run only the adaptrain side")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs) instead of deleting it")
    p.add_argument("--out", type=Path, default=Path("bench-out/recovery.json"),
                   help="JSON results (default %(default)s)")
    a = p.parse_args(argv)
    small = a.model == "small"
    a.steps = a.steps or ((30 if small else 5) if a.quick else (100 if small else 10))
    a.warmup = a.warmup or ((5 if small else 2) if a.quick else (10 if small else 3))
    a.repeat = a.repeat or (1 if a.quick else 2)
    if a.quick:
        a.ckpt_window = min(a.ckpt_window, 10 if small else 3)
    if a.workers < 3:
        p.error("--workers must be at least 3 (one is killed, the rest must still form a group of 2)")
    needed = a.warmup + a.steps + a.post_steps + 8
    if needed > MODELS[a.model][1]:
        p.error(f"--warmup + --steps + --post-steps + 8 = {needed} exceeds the job's {MODELS[a.model][1]} steps")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    close_on_sigterm()  # (SIGTERM closes what the `with` blocks below hold)
    job_ref, _ = MODELS[a.model]
    sys.path.insert(0, str(ROOT))
    from worker.job import load_job, resolve_job_ref

    src = resolve_job_ref(str(ROOT / job_ref))
    job = load_job(src.source, src.name, src.ref)
    n_params = sum(p.numel() for p in job.model().parameters())
    job_ref = src.ref
    rng = random.Random(a.seed)
    workdir = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    r: dict[str, Any] = {"settings": settings, "job": job_ref, "params": n_params, "global_batch": job.global_batch,
                         "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                     "torch": _torch_version(), "loadavg_before": os.getloadavg()},
                         "workdir": str(workdir) if a.keep else None}
    t0 = time.time()
    try:
        print(f"adaptrain: {a.workers} workers, {job_ref} ({n_params / 1e6:.1f}M params): steady, kill, join ...",
              flush=True)
        r["adaptrain"] = adaptrain(a, job_ref, job.global_batch, workdir / "adaptrain", rng)
        r["adaptrain_repeats"], r["torchrun_ddp"] = [], []
        for i in range(a.repeat):
            if a.skip_torchrun:
                break
            print(f"torchrun DDP, steady state ({i + 1}/{a.repeat}) ...", flush=True)
            r["torchrun_ddp"].append(torchrun_steady(a, job_ref, job.global_batch, workdir / f"torchrun-ddp{i}"))
            if i + 1 < a.repeat:
                print(f"adaptrain, steady state ({i + 2}/{a.repeat}) ...", flush=True)
                r["adaptrain_repeats"].append(adaptrain(a, job_ref, job.global_batch, workdir / f"adaptrain{i + 1}",
                                                        rng, steady_only=True))
        if a.skip_torchrun:
            r["torchrun_elastic"] = {"error": "skipped"}
        else:
            print("torchrun elastic, kill a node ...", flush=True)
            r["torchrun_elastic"] = torchrun_kill(a, job_ref, job.global_batch, workdir, rng)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    r["machine"]["loadavg_after"] = os.getloadavg()
    r["steady"] = {"adaptrain": pooled([r["adaptrain"], *r["adaptrain_repeats"]], job.global_batch),
                   "torchrun": pooled(r["torchrun_ddp"], job.global_batch)}
    r["total_s"] = time.time() - t0
    text = table(r)
    print(text)
    runs = {"adaptrain": r["adaptrain"], "torchrun_elastic": r["torchrun_elastic"],
            **{f"adaptrain_repeat{i}": x for i, x in enumerate(r["adaptrain_repeats"])},
            **{f"torchrun_ddp{i}": x for i, x in enumerate(r["torchrun_ddp"])}}
    errors = {k: x["error"] for k, x in runs.items() if "error" in x and x["error"] != "skipped"}
    for k, e in errors.items():
        print(f"\n{k} failed: {e}", file=sys.stderr)
    print(f"\ntotal {r['total_s']:.0f} s; model {a.model} ({n_params / 1e6:.2f}M params), global batch "
          f"{job.global_batch}, {a.workers} processes x 1 thread, load average {r['machine']['loadavg_before'][0]:.1f}"
          f" -> {r['machine']['loadavg_after'][0]:.1f}" + (f"; logs in {workdir}" if a.keep else ""))
    r["table"] = text
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 1 if errors else 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    sys.exit(main())
