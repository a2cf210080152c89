"""Imports go one way (DESIGN.md): plan/ knows nothing of torch, trio or zmq; the coordinator and
transport never import torch. Each package is imported in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

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
