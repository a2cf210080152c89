"""Run a whole adaptrain job on this machine: one coordinator and any number of workers as real
processes on loopback. Used by the demo, the benchmarks and the system tests.

Every process is started in its own session and is killed and reaped by `close()` (also on
errors: use it as a context manager), so nothing is left behind.

Keys are on, as in production: `start()` writes a fresh key set into STATE_DIR/keys (or uses
`keys=`), and every process it starts (coordinator, workers, ctl) gets it through $ADAPTRAIN_KEYS.
`insecure=True` runs the coordinator with --insecure and gives nobody keys. `metrics=True` adds
`--metrics-port 0`; the URL of the ready line's `metrics=` is then `job.metrics_url`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
READY = re.compile(r"^ready workers=(\S+) control=(\S+)(?:.* metrics=(\S+))?")
DIGEST = re.compile(r"digest step (\d+) ([0-9a-f]+)")


class LocalJob:
    def __init__(self, job_ref: str, state_dir: Path, *, min_workers: int = 1, lease_s: float = 1.0,
                 heartbeat_s: float = 0.2, coordinator_args: list[str] | None = None,
                 threads: int = 1, insecure: bool = False, keys: Path | None = None,
                 metrics: bool = False, bind_host: str = "127.0.0.1") -> None:
        self.job_ref = job_ref
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.min_workers = min_workers
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.coordinator_args = coordinator_args or []
        self.threads = threads
        self.insecure = insecure
        self.metrics = metrics
        self.bind_host = bind_host  # (a bridge's address where workers run in network namespaces: scripts/netns.py)
        self.keys_dir: Path | None = None if insecure else (keys or self.state_dir / "keys")
        self.coordinator: subprocess.Popen[str] | None = None
        self.previous: list[subprocess.Popen[str]] = []  # coordinators this job ran before (restarts)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.workers_endpoint = ""
        self.control_endpoint = ""
        self.metrics_url = ""  # http://HOST:PORT/metrics with metrics=True

    # --- processes -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment of every process of this job (keys included)."""
        env = _env()
        env.pop("ADAPTRAIN_KEYS", None)
        if self.keys_dir is not None:
            env["ADAPTRAIN_KEYS"] = str(self.keys_dir)
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        if self.keys_dir is not None and not (self.keys_dir / "server.key_secret").exists():
            from transport.security import generate_keys

            generate_keys(self.keys_dir)
        cmd = [sys.executable, "-m", "coordinator", "--bind", f"tcp://{self.bind_host}:0", "--job", self.job_ref,
               "--state-dir", str(self.state_dir), "--min-workers", str(self.min_workers),
               "--lease", str(self.lease_s), "--heartbeat", str(self.heartbeat_s),
               *(["--insecure"] if self.insecure else []), *(["--metrics-port", "0"] if self.metrics else []),
               *self.coordinator_args]
        if self.coordinator is not None:  # a restart on the same state dir: the old one is closed at close()
            self.previous.append(self.coordinator)
        with (self.state_dir / "coordinator.log").open("w") as log:  # the child keeps its own copy
            self.coordinator = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                                start_new_session=True, env=self.env())
        assert self.coordinator.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.coordinator.stdout.readline()
            if not line:
                raise RuntimeError(f"coordinator exited before ready: {self.tail('coordinator')}")
            m = READY.match(line)
            if m:
                self.workers_endpoint, self.control_endpoint = m.group(1), m.group(2)
                self.metrics_url = m.group(3) or ""
                break
        else:
            raise TimeoutError("coordinator did not print its ready line")
        # Keep draining its stdout into the log so it never blocks on a full pipe.
        import threading

        def drain() -> None:
            assert self.coordinator is not None and self.coordinator.stdout is not None
            with (self.state_dir / "coordinator.out").open("a") as out:
                for line in self.coordinator.stdout:
                    out.write(line)
                    out.flush()

        threading.Thread(target=drain, daemon=True).start()

    def add_worker(self, name: str, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
                   env_extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start `worker NAME` with `args`; `env` replaces the job's environment (e.g. without keys),
        `env_extra` adds to it; `prefix` runs it through another program (`ip netns exec NS`, which
        execs the worker: the process is still the worker's)."""
        cmd = [*(prefix or []), sys.executable, "-m", "worker", "--join", self.workers_endpoint, "--name", name,
               "--threads", str(self.threads), *args]
        with (self.state_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**(self.env() if env is None else env), **(env_extra or {})})
        self.workers[name] = proc
        return proc

    def signal(self, name: str, sig: int) -> None:
        self.workers[name].send_signal(sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.workers[name].wait(timeout=10)

    def wait_workers(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {n: p.poll() for n, p in self.workers.items()}

    def wait_coordinator(self, timeout_s: float) -> int | None:
        assert self.coordinator is not None
        try:
            return self.coordinator.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        procs: list[subprocess.Popen[Any]] = list(self.workers.values())
        if self.coordinator is not None:
            procs.append(self.coordinator)
        kill_and_reap(procs)
        for coordinator in [*self.previous, *([self.coordinator] if self.coordinator else [])]:
            if coordinator.poll() is None:
                coordinator.kill()
                coordinator.wait(timeout=10)
            if coordinator.stdout is not None:
                coordinator.stdout.close()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- observing -------------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.state_dir / "events.jsonl")

    def wait_until(self, found: Callable[[list[dict[str, Any]]], T | None], timeout_s: float, what: str,
                   poll_s: float = 0.02) -> T:
        """Poll the event log (read once a poll, every `poll_s`) until `found(events)` is not None;
        return it. (A benchmark polls slowly: each poll parses the whole log, CPU the job would use.)"""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = found(self.events())
            if result is not None:
                return result
            if self.coordinator is not None and self.coordinator.poll() is not None:
                break
            time.sleep(poll_s)
        decisions = [e for e in self.events() if e["kind"] not in ("step", "heartbeat")][-12:]
        said = "\n".join(json.dumps(e)[:400] for e in decisions)
        raise TimeoutError(f"no {what} within {timeout_s} s; the last decisions:\n{said}\n"
                           f"coordinator: {self.tail('coordinator.out')}")

    def wait_event(self, match: Callable[[dict[str, Any]], bool], timeout_s: float,
                   what: str = "event", poll_s: float = 0.02) -> dict[str, Any]:
        """The first event that `match`es."""
        return self.wait_until(lambda events: next((e for e in events if match(e)), None), timeout_s, what, poll_s)

    def wait_epoch_steps(self, epoch: int, n: int, timeout_s: float) -> None:
        """Wait until epoch `epoch` has committed `n` steps."""
        self.wait_until(lambda events: sum(e["kind"] == "step" and e["epoch"] == epoch for e in events) >= n or None,
                        timeout_s, f"{n} steps of epoch {epoch}")

    def wait_step(self, step: int, timeout_s: float, poll_s: float = 0.02) -> dict[str, Any]:
        return self.wait_event(lambda e: e["kind"] == "step" and e["step"] >= step, timeout_s, f"step {step}", poll_s)

    def steps(self) -> dict[int, dict[str, Any]]:
        """The last `step` event of every step number."""
        return {e["step"]: e for e in self.events() if e["kind"] == "step"}

    def ctl(self, *args: str) -> Any:
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("ctl.py")), "--control",
                              self.control_endpoint, *args, "--json"], capture_output=True, text=True,
                             timeout=30, env=self.env())
        if out.returncode != 0:
            raise RuntimeError(f"ctl {' '.join(args)} failed: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def losses(self) -> dict[int, float]:
        """The loss of every committed step."""
        return {s: e["loss"] for s, e in self.steps().items()}

    def loss_gap(self, reference: dict[int, float]) -> float:
        """The largest relative difference between this run's loss and `reference`'s, step by step
        (inf if a step of the reference is missing here)."""
        mine = self.losses()
        return max((abs(mine[s] - ref) / abs(ref) if s in mine else float("inf") for s, ref in reference.items()),
                   default=0.0)

    def liveness(self) -> list[str]:
        """The liveness invariants this run broke (scripts/liveness.py), from its events and every
        worker's log; [] when none."""
        from liveness import problems

        logs = {n: (self.state_dir / f"{n}.log").read_text(errors="replace") for n in self.workers
                if (self.state_dir / f"{n}.log").exists()}
        return problems(self.events(), logs)

    def digests(self, name: str) -> dict[int, str]:
        """The parameter digests a worker run with `--digest-every` printed, by step."""
        text = (self.state_dir / f"{name}.log").read_text(errors="replace")
        return {int(m.group(1)): m.group(2) for m in DIGEST.finditer(text)}

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.state_dir / (name if "." in name else f"{name}.log")
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def tails(self, names: Iterable[str], lines: int = 30) -> str:
        """Each worker's last lines under its name: one string, which pytest prints whole in a failed
        assertion's message (a dict of them it cuts to a line)."""
        return "\n".join(f"--- {n} ---\n{self.tail(n, lines)}" for n in names)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a file that may be being appended to."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return out


def write_report(text: str, result: dict[str, Any], out: Path) -> None:
    """A benchmark's end: print its table, write its JSON to `out` and say where."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


def close_on_sigterm() -> None:
    """Make SIGTERM (a `timeout`, a CI runner's cancel, `kill`) unwind the script as Ctrl-C does, exit
    status 143: every `with` block on the way out closes what it holds (a job's processes, network
    namespaces, a CPU cgroup). By default SIGTERM ends Python at once and leaves them behind. A
    second SIGTERM (a runner that repeats it) is ignored, so that it cannot cut the closing short."""

    def unwind(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, unwind)


def kill_and_reap(procs: Iterable[subprocess.Popen[Any]]) -> None:
    """SIGKILL each process's whole session (each was started in a session of its own) and reap it."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
