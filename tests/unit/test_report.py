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


# A job whose every worker was lost at step 7 and resumed from the checkpoint of step 5 (redoing 6
# and 7), with a coordinator restart in between.
RESUMED: list[dict[str, Any]] = [
    _plan(1, "join", ["w1", "w2"]),
    *(_step(i, 1, 3.0 - i / 10, 0.5) for i in range(1, 6)),
    {"kind": "checkpoint", "step": 5, "path": "/ck/step-5", "seconds": 0.1, "bytes": 10, "worker": "w1"},
    _step(6, 1, 2.4, 0.5),
    _step(7, 1, 2.3, 0.5),
    {"kind": "restarted", "epoch": 1, "step": 7, "expecting": ["w1", "w2"], "journal": "/s/journal.sqlite",
     "events": 9, "skipped_lines": 0},
    {"kind": "failed", "worker": "w1", "detected_by": "recovery"},
    {"kind": "state_lost", "epoch": 1, "step": 7, "detail": "no worker holds the training state",
     "resume_from": "/ck/step-5", "redo": 2},
    _plan(2, "resume", ["w3"]),
    {"kind": "resumed", "step": 5, "path": "/ck/step-5", "epoch": 2, "redone": 2},
    {"kind": "joined", "worker": "w4", "host": "h", "device": "cpu"},
    *(_step(i, 2, 3.0 - i / 10, 0.25) for i in range(6, 10)),
]


def test_segments_break_where_the_steps_go_back() -> None:
    assert report.segments([]) == []
    assert report.segments([1, 2, 3]) == [(0, 3)]
    assert report.segments([1, 2, 3, 2, 3, 4, 1]) == [(0, 3), (3, 6), (6, 7)]
    assert report.segments([4, 4, 5]) == [(0, 1), (1, 3)], "a step done again is a rewind"
    assert report.segments([0, 0, 5, 3], repeats=True) == [(0, 3), (3, 4)], "plans made at one step"


def test_a_resume_is_marked_and_its_rewind_is_not_joined(tmp_path: Path) -> None:
    s = report.build_series(RESUMED)
    assert s.steps == [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9]
    assert [(m.kind, m.step, m.label) for m in s.marks] == [
        ("plan", 0, "e1"), ("checkpoint", 5, "s5"), ("restarted", 7, "e1"), ("failed", 7, "w1"),
        ("state_lost", 7, "e1"), ("plan", 7, "e2"), ("resumed", 5, "s5"), ("joined", 5, "w4")]
    summary = report.summarize(s)
    assert (summary["steps"], summary["step_events"], summary["redone"], summary["rewinds"]) == (9, 11, 2, 1)
    assert (summary["first_step"], summary["last_step"]) == (1, 9)
    text = report.format_summary(summary)
    assert "9 committed steps (1 to 9); 2 redone after 1 rewind(s) to a checkpoint" in text, text
    assert "checkpoint 1" in text and "resumed 1" in text and "state_lost 1" in text and "restarted 1" in text

    fig = report.plot(s, tmp_path / "resumed.png")
    assert (tmp_path / "resumed.png").read_bytes().startswith(PNG)
    rate_ax, loss_ax, _, marks_ax = fig.axes
    for ax in (rate_ax, loss_ax):
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]  # (not the marks' vertical lines)
        assert [list(line.get_xdata()) for line in curves] == [[1, 2, 3, 4, 5, 6, 7], [6, 7, 8, 9]]
    legend = loss_ax.get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} == {"checkpoint", "state lost", "resumed (from checkpoint)",
                                                          "coordinator restarted"}
    rows = [t.get_text() for t in marks_ax.get_yticklabels()]
    assert {"checkpoint", "state lost", "resumed (from checkpoint)", "coordinator restarted"} <= set(rows), rows
