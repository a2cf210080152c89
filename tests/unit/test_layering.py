"""Imports go one way (DESIGN.md): plan/ knows nothing of torch, trio or zmq; the coordinator and
transport never import torch. Each package is imported in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_ctl_script_does_not_load_torch() -> None:
    code = ("import sys, runpy; sys.argv = ['ctl', '--help']\n"
            "try:\n    runpy.run_path('scripts/ctl.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'coordinator' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.strip().splitlines()[-1] == "False False"
