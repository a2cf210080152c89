"""`ctl report --events` as the operator runs it (scripts/ctl.py, from another directory): a damaged
events file is read past its bad lines, which are named on stderr, and plotted; bad input is a clear
error with exit status 2 (or 1 when there is nothing to plot), never a traceback. The live
control endpoint's `report` is in test_metrics_endpoint.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _step(step: int, epoch: int, loss: float, step_s: float) -> dict[str, Any]:
    return {"kind": "step", "step": step, "epoch": epoch, "loss": loss, "samples": 16, "step_s": step_s}


def _write(tmp_path: Path) -> Path:
    """An events.jsonl of 4 steps around a failure, with a malformed line 6, a non-event line 10
    and a truncated last line 16 (after a blank line 15)."""
    events: list[dict[str, Any]] = [
        {"kind": "joined", "worker": "w1"}, {"kind": "joined", "worker": "w2"},
        {"kind": "plan", "epoch": 1, "reason": "join", "layout": {"members": ["w1", "w2"], "shares": [8, 8]}},
        {"kind": "reshard", "epoch": 1, "bytes": 0, "seconds": 0.01}, _step(1, 1, 3.0, 0.5), _step(2, 1, 2.5, 0.25),
        {"kind": "failed", "worker": "w2", "detected_by": "disconnect"},
        {"kind": "plan", "epoch": 2, "reason": "failure", "layout": {"members": ["w1"], "shares": [16]}},
        _step(3, 2, 2.0, 0.5), _step(4, 2, 1.5, 0.5), {"kind": "straggler", "worker": "w1"},
        {"kind": "reshard", "epoch": 2, "bytes": 0, "seconds": 0.01}]
    lines = [json.dumps({"ts": 100.0 + i, **e}) for i, e in enumerate(events)]
    lines.insert(5, '{"ts": 105.5, "kind": "step", "step": 99 GARBAGE')
    lines.insert(9, "[1, 2, 3]")
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + '\n\n{"ts": 200.0, "kind": "step", "st')
    return path


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "ctl.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=Path(ROOT.anchor))


def test_ctl_report_from_a_damaged_file(tmp_path: Path) -> None:
    path, png = _write(tmp_path), tmp_path / "out.png"
    out = _ctl("report", "--events", str(path), "--plot", str(png), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["steps"] == 4 and summary["plot"] == str(png)
    assert f"{path} line 6: not JSON" in out.stderr and "line 16" in out.stderr and "line 10" in out.stderr
    assert "Traceback" not in out.stderr
    assert png.read_bytes().startswith(PNG)
    human = _ctl("report", "--events", str(path))
    assert human.returncode == 0 and "4 committed steps" in human.stdout


@pytest.mark.parametrize("case", ["missing", "empty", "bad-format"])
def test_ctl_report_bad_input_is_a_clear_error(tmp_path: Path, case: str) -> None:
    path = tmp_path / "events.jsonl"
    plot = tmp_path / "out.png"
    if case == "empty":
        path.write_text("")
    elif case == "bad-format":
        path.write_text(json.dumps({"ts": 1.0, **_step(1, 1, 1.0, 0.1)}) + "\n")
        plot = tmp_path / "out.nosuchformat"
    out = _ctl("report", "--events", str(path), "--plot", str(plot))
    assert "Traceback" not in out.stderr
    assert out.returncode == {"missing": 2, "empty": 1, "bad-format": 2}[case], out.stderr
    assert {"missing": "cannot read the events file", "empty": "nothing to plot",
            "bad-format": "cannot write the plot"}[case] in out.stderr
    assert not plot.exists()


def test_adaptrain_ctl_console_script(tmp_path: Path) -> None:
    """The installed entry point (pyproject [project.scripts]) is the same tool."""
    exe = Path(sys.executable).parent / "adaptrain-ctl"
    assert exe.exists(), f"{exe} is missing: the test command installs adaptrain (make test), which must install it"
    out = subprocess.run([str(exe), "report", "--events", str(_write(tmp_path)), "--json"], capture_output=True,
                         text=True, timeout=120, cwd=Path(ROOT.anchor))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["steps"] == 4
    usage = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: adaptrain-ctl")
