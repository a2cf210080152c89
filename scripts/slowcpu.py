"""A slow device on this machine: a CPU cgroup whose quota lets its processes run a fraction of one
core (`cpu.cfs_quota_us` / `cpu.cfs_period_us` under cgroup v1's cpu controller, `cpu.max` under
cgroup v2), for the benchmarks' heterogeneous runs (`bench_pipeline.py --sections hetero`).

Why not a sleep (the worker's `--slowdown`): a sleep stretches a step by the compute it follows, once
and in one place; a pipeline stage on a slow device is slow in every forward and backward, and its
neighbours keep computing meanwhile. A quota slows everything the process does, as a slower machine
would, in both systems alike (measured here: a 256 x 256 matmul loop at 0.5 of a core runs 0.47x).
A short period (10 ms) keeps the throttling fine-grained next to steps of tens of milliseconds.

Needs root and a writable cgroup hierarchy; `available()` says why not where it cannot run.

    with SlowCpu("bench-slow", 0.5) as slow:
        subprocess.Popen([*slow.prefix, sys.executable, "-m", "worker", ...])
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000


def _root() -> tuple[Path, int] | None:
    """(the hierarchy's root, its version) where a CPU quota can be set, else None."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, 1
    controllers = V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2, 2
    return None


def available() -> str | None:
    """None where a slow CPU can be made here, else why not."""
    if os.geteuid() != 0:
        return "a CPU cgroup needs root"
    found = _root()
    if found is None:
        return "no cgroup hierarchy with the cpu controller is mounted"
    root, _ = found
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return None


class SlowCpu:
    """A cgroup that gives its processes `cores` of CPU time per second (0.5: half of one core)."""

    def __init__(self, name: str, cores: float) -> None:
        if cores <= 0:
            raise ValueError(f"cores must be positive, not {cores}")
        why = available()
        if why is not None:
            raise RuntimeError(f"cannot make a slow CPU: {why}")
        found = _root()
        assert found is not None
        root, self.version = found
        self.path = root / f"{name}-{os.getpid()}"
        self.cores = cores

    @property
    def prefix(self) -> list[str]:
        """A command prefix that moves the process into the cgroup, then execs the command (the
        process stays the command's)."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "slowcpu"]

    def join(self, pid: int | None = None) -> None:
        """Move `pid` (default this process, every thread) into the cgroup."""
        (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")

    def __enter__(self) -> SlowCpu:
        self.path.mkdir(exist_ok=True)
        quota = max(1_000, round(self.cores * PERIOD_US))
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Remove the cgroup once its processes have left (they exit with their run)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # (a process still in it: exiting)
                time.sleep(0.1)
