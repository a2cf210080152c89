"""The simulated hosts' CPUs (scripts/netns.py): `split_cpus` divides this process's CPUs between the
hosts, and a program started with a host's prefix runs in its namespace on exactly its CPUs, which
the worker's calibration reports as its host's cores. The last test needs root to make namespaces;
skipped, saying why, where they cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from netns import Hosts, available, split_cpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.pure
def test_the_cpus_are_divided_between_the_hosts_disjoint_and_whole() -> None:
    mine = sorted(os.sched_getaffinity(0))
    names = [f"h{k}" for k in range(min(len(mine), 3))]
    split = split_cpus(names)
    assert list(split) == names
    assert sorted(c for cpus in split.values() for c in cpus) == mine, "every CPU given once"
    sizes = [len(c) for c in split.values()]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert split_cpus([f"h{k}" for k in range(len(mine) + 1)]) == {}, "fewer CPUs than hosts: they share them"


@pytest.mark.pure
def test_cpus_must_name_known_hosts_and_give_each_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least one CPU"):
        Hosts(["a", "b"], rate_mbit=10, cpus={"c": (0,)})
    with pytest.raises(ValueError, match="at least one CPU"):
        Hosts(["a", "b"], rate_mbit=10, cpus={"a": ()})
    assert Hosts(["a"], rate_mbit=10).prefix("a")[-1] != "taskset", "no CPUs of its own: no taskset"


@pytest.mark.process
@pytest.mark.skipif(bool(available()), reason=f"network namespaces: {available()}")
def test_a_program_on_a_host_runs_on_its_cpus_and_counts_them_as_its_cores() -> None:
    mine = sorted(os.sched_getaffinity(0))
    split = split_cpus(["a", "b"]) or {"a": (mine[0],), "b": (mine[0],)}  # (one CPU: both hosts on it)
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); from worker.calibrate import calibrate; "
              "print(sorted(os.sched_getaffinity(0)), calibrate('cpu', duration_s=0.05).cores)")
    with Hosts(["a", "b"], rate_mbit=10, cpus=split) as hosts:
        for host in ("a", "b"):
            out = subprocess.run([*hosts.prefix(host), sys.executable, "-c", script, str(ROOT)], capture_output=True,
                                 text=True, check=True, timeout=120).stdout.split("\n")[-2]
            assert out == f"{list(split[host])} {len(split[host])}", out
