"""The benchmarks' slow device (scripts/slowcpu.py): a process started with the cgroup's prefix runs
in the cgroup, the process itself (the prefix execs the command), under the quota asked for, and
the cgroup is gone once its processes have left. Needs root and a CPU cgroup; skipped, saying why,
where they cannot be had."""

from __future__ import annotations

import subprocess
import sys

import pytest
from slowcpu import PERIOD_US, SlowCpu, available

WHY_NOT = available()

pytestmark = [pytest.mark.process, pytest.mark.skipif(bool(WHY_NOT), reason=f"a CPU cgroup: {WHY_NOT}")]


def test_a_process_started_with_the_prefix_runs_in_the_cgroup_under_its_quota() -> None:
    with SlowCpu("test-slowcpu", 0.5) as slow:
        quota = (slow.path / ("cpu.cfs_quota_us" if slow.version == 1 else "cpu.max")).read_text().split()[0]
        assert int(quota) == PERIOD_US // 2
        script = "import os; print(os.getpid()); print(open('/proc/self/cgroup').read())"
        out = subprocess.run([*slow.prefix, sys.executable, "-c", script], capture_output=True, text=True,
                             check=True).stdout
        pid, groups = out.split("\n", 1)
        assert slow.path.name in groups, groups
        assert pid.strip() != "", "the command ran"
    assert not slow.path.exists(), "the cgroup is removed once its processes have left"


def test_a_slow_cpu_refuses_no_cpu_at_all() -> None:
    with pytest.raises(ValueError, match="positive"):
        SlowCpu("test-slowcpu", 0)
