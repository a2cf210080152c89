"""coordinator.metrics: a recorded sequence of events gives the expected metric values, with no
socket; the metrics endpoint's host and flag; the exposition format."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

import pytest

from coordinator.cli import metrics_host, parse_args
from coordinator.guard import REASONS
from coordinator.metrics import Metrics, plan_reason_label, serve_metrics


def _plan(epoch: int, reason: str, members: list[str] | None, *, solve_s: float = 0.002,
          predicted: float | None = 0.05) -> dict[str, Any]:
    layout = None if members is None else {"dp_replicate": len(members), "dp_shard": 1, "pp": 1, "tp": 1,
                                           "members": members, "shares": [64 // len(members)] * len(members)}
    return {"epoch": epoch, "reason": reason, "status": "optimal" if layout else "infeasible", "detail": "",
            "predicted_step_s": predicted if layout else None, "solve_s": solve_s, "mode": "sync",
            "layout": layout, "standby": [], "moved_bytes": 0, "runner_up": None}


def _step(step: int, epoch: int, loss: float, step_s: float, predicted: float | None = 0.05) -> dict[str, Any]:
    return {"step": step, "epoch": epoch, "loss": loss, "samples": 64, "step_s": step_s, "predicted_s": predicted}


RECORDED: list[tuple[str, dict[str, Any]]] = [
    ("joined", {"worker": "w1", "host": "h", "device": "cpu"}),
    ("joined", {"worker": "w2", "host": "h", "device": "cpu"}),
    ("plan", _plan(1, "join", ["w1"], solve_s=0.003)),
    ("plan", _plan(2, "join", ["w1", "w2"], solve_s=0.004, predicted=0.04)),
    ("reshard", {"epoch": 2, "bytes": 1000, "seconds": 0.25}),
    ("step", _step(1, 2, 2.0, 0.5, predicted=0.04)),
    ("step", _step(2, 2, 1.5, 0.25, predicted=0.04)),
    ("failed", {"worker": "w2", "detected_by": "disconnect"}),
    ("plan", _plan(3, "failure", ["w1"], solve_s=0.001, predicted=0.08)),
    ("reshard", {"epoch": 3, "bytes": 500, "seconds": 0.5}),
    ("step", _step(3, 3, 1.25, 0.125, predicted=0.08)),
    ("plan", _plan(3, "join", None)),  # nothing fits: no new epoch, the gauges keep theirs
    ("plan", _plan(4, "w1 handed off", ["w3"], predicted=0.07)),
    ("standby", {"worker": "w4", "why": "slow"}),
    ("mystery", {"x": 1}),
]


def test_metrics_from_a_recorded_run() -> None:
    metrics = Metrics()
    for kind, fields in RECORDED:
        metrics.observe(kind, fields)
    metrics.refused("decode")
    metrics.refused("decode")
    metrics.refused("auth")
    v = metrics.value
    assert v("adaptrain_steps_committed_total") == 3
    assert v("adaptrain_step") == 3
    assert v("adaptrain_epoch") == 4
    assert v("adaptrain_members") == 1  # w3 alone
    assert v("adaptrain_loss") == 1.25
    assert v("adaptrain_step_seconds") == 0.125
    assert v("adaptrain_step_predicted_seconds") == 0.07  # the last plan's
    assert v("adaptrain_samples_per_second") == pytest.approx(3 * 64 / (0.5 + 0.25 + 0.125))
    assert v("adaptrain_reshard_bytes_total") == 1500
    assert v("adaptrain_reshard_seconds_total") == 0.75
    assert v("adaptrain_failures_total") == 1
    assert v("adaptrain_replans_total", reason="join") == 3
    assert v("adaptrain_replans_total", reason="failure") == 1
    assert v("adaptrain_replans_total", reason="handoff") == 1
    assert v("adaptrain_replans_total", reason="straggler") == 0  # known reasons exist from the start
    assert v("adaptrain_plan_solve_seconds_count") == 5
    assert v("adaptrain_plan_solve_seconds_sum") == pytest.approx(0.003 + 0.004 + 0.001 + 0.002 + 0.002)
    assert v("adaptrain_refused_total", reason="decode") == 2
    assert v("adaptrain_refused_total", reason="auth") == 1
    assert all(v("adaptrain_refused_total", reason=r) is not None for r in REASONS)
    assert v("adaptrain_events_total", kind="step") == 3
    assert v("adaptrain_events_total", kind="plan") == 5
    assert v("adaptrain_events_total", kind="other") == 1
    text = metrics.exposition().decode()
    assert "# TYPE adaptrain_steps_committed_total counter" in text
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(n.startswith("adaptrain_") for n in names)


def test_samples_per_second_uses_a_short_window() -> None:
    metrics = Metrics()
    for step in range(1, 31):
        metrics.observe("step", _step(step, 1, 1.0, 1.0 if step <= 20 else 0.5))
    assert metrics.value("adaptrain_samples_per_second") == 128  # the last 10 steps, all 0.5 s


def test_malformed_fields_do_not_raise() -> None:
    metrics = Metrics()
    metrics.observe("step", {"step": "x", "loss": None, "samples": 64, "step_s": 0})
    metrics.observe("plan", {"reason": None, "layout": {"members": "nope"}, "epoch": True})
    metrics.observe("reshard", {})
    assert metrics.value("adaptrain_steps_committed_total") == 1
    assert metrics.value("adaptrain_samples_per_second") == 0
    assert metrics.value("adaptrain_members") == 0


def test_plan_reason_label_bounds_handoffs() -> None:
    assert plan_reason_label("straggler") == "straggler"
    assert plan_reason_label("w7 handed off") == "handoff"


def test_metrics_host_follows_bind() -> None:
    assert metrics_host("tcp://127.0.0.1:0") == "127.0.0.1"
    assert metrics_host("tcp://0.0.0.0:5555") == "0.0.0.0"
    assert metrics_host("tcp://*:5555") == "0.0.0.0"
    assert metrics_host("tcp://[::1]:5555") == "::1"
    assert metrics_host("ipc:///tmp/x") == "127.0.0.1"


def test_metrics_port_flag(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--bind", "tcp://127.0.0.1:0", "--job", "x.py:job", "--insecure"]
    assert parse_args(base)[0].metrics_port is None
    cfg, _ = parse_args([*base, "--metrics-port", "0"])
    assert cfg.metrics_port == 0 and cfg.metrics_host == "127.0.0.1"
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*base, "--metrics-port", "70000"])
    assert exit_info.value.code == 2 and "--metrics-port" in capsys.readouterr().err


def test_serve_metrics_over_http_and_a_port_in_use() -> None:
    metrics = Metrics()
    metrics.observe("step", _step(1, 1, 0.5, 0.1))
    server = serve_metrics(metrics, "127.0.0.1", 0)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/metrics")
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
        assert "adaptrain_steps_committed_total 1.0" in text
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(OSError, match=f"port {port}.*in use"):
            serve_metrics(Metrics(), "127.0.0.1", port)
    finally:
        server.close()
    with socket.socket() as s:  # closed: nothing listens there any more (TIME_WAIT may remain)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_replaying_an_events_file(tmp_path: Any) -> None:
    """The same values from events.jsonl lines (what the daemon writes: ts and kind added)."""
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps({"ts": 1.0 + i, "kind": k, **f}) + "\n" for i, (k, f) in enumerate(RECORDED)))
    metrics = Metrics()
    for line in path.read_text().splitlines():
        event = json.loads(line)
        metrics.observe(event.pop("kind"), {k: v for k, v in event.items() if k != "ts"})
    assert metrics.value("adaptrain_steps_committed_total") == 3
    assert metrics.value("adaptrain_epoch") == 4


def test_a_replay_ends_where_observing_every_event_does() -> None:
    """`Metrics.replay` (a restarted coordinator seeding its metrics from the log) counts most steps
    of a long run without applying them; every value ends as observing each event leaves it."""
    long_run: list[tuple[str, dict[str, Any]]] = [
        *RECORDED[:5],
        *(("step", _step(i, 2, 3.0 - i / 100, 0.2 + (i % 7) / 100, predicted=0.04)) for i in range(1, 40)),
        ("failed", {"worker": "w2", "detected_by": "disconnect"}),
        ("step", _step(40, 2, 1.0, 0.3, predicted=None)),
        *RECORDED[8:],
        *(("step", _step(i, 4, 1.0 / i, 0.1 + (i % 3) / 100)) for i in range(41, 60)),
    ]
    observed, replayed = Metrics(), Metrics()
    for kind, fields in long_run:
        observed.observe(kind, fields)
    replay = replayed.replay()
    for kind, fields in long_run:
        replay({"ts": 1.0, "kind": kind, **fields})
    replay.finish()
    assert replayed.value("adaptrain_steps_committed_total") == sum(k == "step" for k, _ in long_run) == 60

    def samples(metrics: Metrics) -> dict[tuple[str, str], float]:
        return {(s.name, json.dumps(s.labels, sort_keys=True)): s.value for family in metrics.registry.collect()
                for s in family.samples if not s.name.endswith("_created")}  # (when each metric was made)

    assert samples(replayed) == samples(observed) and len(samples(observed)) > 50
