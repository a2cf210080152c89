"""coordinator.events: a coordinator opening an existing events.jsonl (a restart) streams it once,
skipping bad lines (a malformed middle line, a last line cut short by a crash mid-write) with their
numbers, closes the cut-short line so the next event is a line of its own, serves the whole log by
index from the file, and seeds the metrics from it (`daemon.open_log`); `Core` marks the start with
a `restarted` event that counts what it read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.daemon import Core, CoordinatorConfig, open_log
from coordinator.events import EventLog
from coordinator.jobinfo import JobInfo
from coordinator.metrics import Metrics
from coordinator.report import read_events


def _step(step: int, loss: float = 1.0) -> dict[str, Any]:
    return {"kind": "step", "step": step, "epoch": 1, "loss": loss, "samples": 64, "step_s": 0.5}


BEFORE: list[dict[str, Any]] = [
    {"kind": "joined", "worker": "w1", "host": "h", "device": "cpu"},
    {"kind": "joined", "worker": "w2", "host": "h", "device": "cpu"},
    {"kind": "plan", "epoch": 1, "reason": "join", "solve_s": 0.01, "predicted_step_s": 0.4,
     "layout": {"members": ["w1", "w2"], "shares": [32, 32]}},
    *(_step(i, 3.0 - i / 10) for i in range(1, 6)),
    {"kind": "failed", "worker": "w2", "detected_by": "disconnect"},
    {"kind": "plan", "epoch": 2, "reason": "failure", "solve_s": 0.01, "predicted_step_s": 0.6,
     "layout": {"members": ["w1"], "shares": [64]}},
    *(_step(i, 3.0 - i / 10) for i in range(6, 9)),
]


def _write_damaged(path: Path) -> None:
    """BEFORE with a malformed line 4 and a last line cut short mid-write (no newline)."""
    lines = [json.dumps({"ts": 100.0 + i, **e}) for i, e in enumerate(BEFORE)]
    lines.insert(3, '{"ts": 103.5, "kind": "step", "st GARBAGE')
    path.write_text("\n".join(lines) + '\n{"ts": 200.0, "kind": "step", "step": 9, "lo')


def test_a_reopened_log_is_read_past_bad_lines_and_seeds_the_metrics(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    _write_damaged(path)
    log, metrics = open_log(path)
    try:
        r = log.replayed
        assert r.events == len(BEFORE) == len(log.events)
        assert r.bad == 2 and [b.number for b in r.first_bad] == [4, len(BEFORE) + 2]
        assert all("not JSON" in b.why for b in r.first_bad)
        assert [e["kind"] for e in log.events] == [e["kind"] for e in BEFORE]
        assert log.events[-1]["step"] == 8 and log.events[3]["step"] == 1
        # Counters cover the whole log, not the time since this coordinator started.
        assert metrics.value("adaptrain_failures_total") == 1
        assert metrics.value("adaptrain_steps_committed_total") == 8
        assert metrics.value("adaptrain_events_total", kind="step") == 8
        assert metrics.value("adaptrain_events_total", kind="joined") == 2
        assert metrics.value("adaptrain_replans_total", reason="failure") == 1
        assert metrics.value("adaptrain_step") == 8 and metrics.value("adaptrain_epoch") == 2
        assert metrics.value("adaptrain_members") == 1

        log.write("joined", worker="w3", host="h", device="cpu")  # after the line cut short, on a line of its own
        assert len(log.events) == len(BEFORE) + 1 and log.events[-1]["worker"] == "w3"
        assert log.events[len(BEFORE) - 1:] == [BEFORE[-1] | {"ts": log.events[len(BEFORE) - 1]["ts"]},
                                                log.events[-1]]
    finally:
        log.close()
    read = read_events(path)  # the file as anyone else reads it: the cut-short line stays one bad line
    assert [b.number for b in read.bad] == [4, len(BEFORE) + 2]
    assert read.events[-1]["worker"] == "w3" and len(read.events) == len(BEFORE) + 1

    again = EventLog(path)  # a third coordinator: everything, numbered as before
    try:
        assert again.replayed.events == len(BEFORE) + 1 and again.replayed.bad == 2
        assert again.events[len(BEFORE)]["worker"] == "w3"
    finally:
        again.close()


def test_pages_of_a_long_log_are_read_back_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    n = 5000
    with path.open("w") as f:
        for i in range(1, n + 1):
            f.write(json.dumps({"ts": float(i), **_step(i)}) + "\n")
            if i % 1000 == 0:
                f.write("not json\n")
    log = EventLog(path)
    try:
        assert len(log.events) == n and log.replayed.bad == 5
        page = log.events[1990:2990]  # across a bad line
        assert [e["step"] for e in page] == list(range(1991, 2991))
        assert log.events[n:n + 1000] == [] and log.events[-1]["step"] == n
        log.write("restarted", epoch=1)
        assert log.events[n:][0]["kind"] == "restarted" and len(log.events[n - 2:]) == 3
    finally:
        log.close()


def _core(tmp_path: Path, log: EventLog, metrics: Metrics | None = None) -> Core:
    cfg = CoordinatorConfig(bind="", control="", state_dir=tmp_path, keys=None, quiet=True)
    info = JobInfo(ref="job.py:job", path="job.py", name="job", source="", sha256="0" * 64, global_batch=64,
                   num_steps=100, seed=0, num_params=10, description="")
    return Core(cfg, info, None, None, log, run_id="1", metrics=metrics)  # type: ignore[arg-type]  (no socket used)


def test_every_start_on_a_log_with_history_is_marked_restarted(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    fresh = tmp_path / "fresh"
    log = EventLog(fresh / "events.jsonl")
    _core(fresh, log)
    log.close()
    assert read_events(fresh / "events.jsonl").events == [], "a new job's first start is no restart"

    path = tmp_path / "events.jsonl"
    _write_damaged(path)
    log, metrics = open_log(path)
    try:
        _core(tmp_path, log, metrics)  # (no journal: a restart all the same)
        marked = log.events[-1]
        assert marked["kind"] == "restarted" and marked["events"] == len(BEFORE), marked
        assert marked["skipped_lines"] == 2 and marked["journal"] is None, marked
        assert metrics.value("adaptrain_events_total", kind="restarted") == 1
        assert metrics.value("adaptrain_events_total", kind="step") == 8
        err = capsys.readouterr().err  # each bad line said, with its number (even under --quiet)
        assert f"{path} line 4: not JSON" in err and f"line {len(BEFORE) + 2}: not JSON" in err, err
    finally:
        log.close()
