"""coordinator.report: series from a recorded events.jsonl with a malformed middle line and a
truncated last line (named, skipped, the rest used), marks at the step they happened, the JSON
summary, and the PNG. `ctl report` as a process: tests/system/test_ctl_report.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator import report

PNG = b"\x89PNG\r\n\x1a\n"


def _plan(epoch: int, reason: str, members: list[str]) -> dict[str, Any]:
    return {"kind": "plan", "epoch": epoch, "reason": reason, "status": "optimal", "solve_s": 0.002,
            "predicted_step_s": 0.05, "mode": "sync",
            "layout": {"dp_replicate": len(members), "members": members, "shares": [8] * len(members)}}


def _step(step: int, epoch: int, loss: float, step_s: float) -> dict[str, Any]:
    return {"kind": "step", "step": step, "epoch": epoch, "loss": loss, "samples": 16, "step_s": step_s}


EVENTS: list[dict[str, Any]] = [
    {"kind": "joined", "worker": "w1", "host": "h", "device": "cpu"},
    {"kind": "joined", "worker": "w2", "host": "h", "device": "cpu"},
    _plan(1, "join", ["w1", "w2"]),
    {"kind": "reshard", "epoch": 1, "bytes": 0, "seconds": 0.01},
    _step(1, 1, 3.0, 0.5),
    _step(2, 1, 2.5, 0.25),
    {"kind": "failed", "worker": "w2", "detected_by": "disconnect"},
    _plan(2, "failure", ["w1"]),
    {"kind": "reshard", "epoch": 2, "bytes": 0, "seconds": 0.01},
    _step(3, 2, 2.0, 0.5),
    {"kind": "straggler", "worker": "w1", "speed": 10.0, "expected": 20.0, "step": 3},
    _step(4, 2, 1.5, 0.0),  # a step time of 0: no rate for this step
]


def _write(tmp_path: Path) -> Path:
    """EVENTS as events.jsonl, with a malformed line 6, a non-event line 10 and a truncated line 16 (the last)."""
    lines = [json.dumps({"ts": 100.0 + i, **e}) for i, e in enumerate(EVENTS)]
    lines.insert(5, '{"ts": 105.5, "kind": "step", "step": 99 GARBAGE')  # line 6
    lines.insert(9, "[1, 2, 3]")  # line 10: JSON, but not an event
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + '\n\n{"ts": 200.0, "kind": "step", "st')  # a blank line 15, then 16
    return path


def test_series_from_a_damaged_events_file(tmp_path: Path) -> None:
    read = report.read_events(_write(tmp_path))
    assert [b.number for b in read.bad] == [6, 10, 16]
    assert "not JSON" in read.bad[0].why and "not an event" in read.bad[1].why
    assert len(read.events) == len(EVENTS)
    s = report.build_series(read.events)
    assert s.steps == [1, 2, 3, 4]
    assert s.loss == [3.0, 2.5, 2.0, 1.5]
    assert s.samples_per_s == [32.0, 64.0, 32.0, None]
    assert s.members == [(0, 2), (2, 1)]
    assert [(m.kind, m.step, m.label) for m in s.marks] == [
        ("joined", 0, "w1"), ("joined", 0, "w2"), ("plan", 0, "e1"), ("reshard", 0, "e1"),
        ("failed", 2, "w2"), ("plan", 2, "e2"), ("reshard", 2, "e2"), ("straggler", 3, "w1")]
    summary = report.summarize(s)
    assert summary["steps"] == 4 and summary["first_step"] == 1 and summary["last_step"] == 4
    assert summary["loss"] == {"points": 4, "first": 3.0, "last": 1.5, "min": 1.5}
    assert summary["samples_per_s"]["points"] == 3
    assert summary["members"] == {"plans": 2, "min": 1, "max": 2, "last": 1}
    assert summary["marks"] == {"joined": 2, "plan": 2, "reshard": 2, "failed": 1, "straggler": 1}
    assert "4 committed steps" in report.format_summary(summary)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    s = report.build_series(EVENTS)
    out = tmp_path / "report.png"
    report.plot(s, out, title="test")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
