"""Imports go one way (DESIGN.md): plan/ knows nothing of torch, trio or zmq; the coordinator and
transport never import torch. Each package is imported in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

FORBIDDEN = {
    "plan": ("torch", "trio", "zmq", "msgpack"),
    "transport": ("torch",),
    "coordinator": ("torch",),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_load_forbidden_modules(package: str) -> None:
    code = (f"import sys, {package}; "
            f"print(','.join(m for m in {FORBIDDEN[package]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} loaded {out.stdout.strip()}"


HEAVY_FOR_CTL = ("torch", "trio", "pulp", "numpy", "matplotlib", "coordinator.daemon")


@pytest.mark.parametrize("how", ["script", "module"])
def test_ctl_script_does_not_load_torch(how: str) -> None:
    """ctl starts fast: neither scripts/ctl.py nor coordinator.ctl (adaptrain-ctl) loads torch, trio,
    the planner's solvers, matplotlib (only `report --plot` does) or the daemon."""
    run = ("runpy.run_path('scripts/ctl.py', run_name='__main__')" if how == "script"
           else "runpy.run_module('coordinator.ctl', run_name='__main__')")
    code = (f"import sys, runpy; sys.argv = ['ctl', '--help']\n"
            f"try:\n    {run}\nexcept SystemExit:\n    pass\n"
            f"print(','.join(m for m in {HEAVY_FOR_CTL!r} if m in sys.modules) or 'none', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage:" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "none"


def test_the_daemon_loads_no_solver_before_it_listens() -> None:
    """A restarted coordinator listens within a second: the daemon's imports leave the planner's
    numeric backends (numpy, PuLP and HiGHS, a quarter of a second) to the first solve."""
    code = ("import sys, coordinator.cli, coordinator.daemon; "
            "print(','.join(m for m in ('numpy', 'pulp', 'highspy', 'torch') if m in sys.modules) or 'none')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "none"


# The loop, the epoch's entry, the coordinator's decisions and the wire: none of them may branch on
# which layout runs (DESIGN.md, "Parallelism as a plug-in"); a layout kind lives in its executor
# (worker/parallel/, registered in worker/parallel/table.py) and its plan file (plan/). Whether every
# member holds the whole state (`Layout.whole_replicas`: the replicated fast path, the senders of a
# hand-off) is a property of placement, not a kind, and is allowed. (ctl's and explain's displays
# describe a layout to a person and are not scanned.)
NO_KIND_BRANCHES = ("worker/trainer.py", "worker/executor.py", "worker/epoch.py", "coordinator/membership.py",
                    "coordinator/replan.py", "coordinator/state.py", "coordinator/daemon.py", "coordinator/steps.py",
                    "transport/worker_side.py", "transport/codec.py")
KIND = {"dp_shard", "sharded", "dp_replicate", "pp", "tp", "stages", "FsdpExecutor", "StageExecutor", "ShardedStageExecutor",
        "TensorParallelExecutor",
        "ReplicaExecutor"}


def _kind_tests(path: Path) -> list[str]:
    """The conditions (of if, elif, while, a conditional expression, a comprehension's filter, a
    case's guard) in
    `path` that read a layout kind's attribute (`layout.pp`, `plan.dp_shard`) or name an executor."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        tests = ([node.test] if isinstance(node, (ast.If, ast.While, ast.IfExp))
                 else node.ifs if isinstance(node, ast.comprehension)
                 else [node.guard] if isinstance(node, ast.match_case) and node.guard is not None else [])
        for test in tests:
            names = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(test) if isinstance(n, ast.Name) and n.id.endswith("Executor")}
            if names & KIND:
                found.append(f"{path.name}:{test.lineno}: {ast.unparse(test)}")
    return found


@pytest.mark.pure
def test_the_loop_the_coordinator_and_the_wire_never_branch_on_the_layout_kind() -> None:
    root = Path(__file__).resolve().parents[2]
    found = [line for name in NO_KIND_BRANCHES for line in _kind_tests(root / name)]
    assert not found, "\n".join(found)
