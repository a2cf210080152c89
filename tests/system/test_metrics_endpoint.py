"""Metrics and reports from the outside: the coordinator's Prometheus endpoint scraped over HTTP
during a real run and checked against its event log, `ctl report --plot` against the live control
endpoint and on the finished job's events.jsonl, and a metrics port in use refused at start.

The values are compared at a quiet moment: both workers are SIGSTOPped (the lease is long, so
nobody is declared failed) and the event log has stopped growing; then they are resumed and the
job runs to its end. Every process is started through scripts/localjob.LocalJob, whose `close()`
(the `with` block) kills and reaps them all.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from conftest import NUM_STEPS, PACED_JOB  # noqa: E402
from localjob import LocalJob  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

MLP_JOB = f"{SCRIPTS.parent / 'examples' / 'mlp.py'}:job"
PNG = b"\x89PNG\r\n\x1a\n"


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape, by (name, labels), parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def ctl(job: LocalJob, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/ctl.py (the shim) from another directory, with the job's keys."""
    return subprocess.run([sys.executable, str(SCRIPTS / "ctl.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=Path(SCRIPTS.anchor), env=job.env())


def _quiet(job: LocalJob, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The event log once it has not grown for 1 s."""
    deadline = time.monotonic() + timeout_s
    path = job.state_dir / "events.jsonl"
    size, since = path.stat().st_size, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return job.events()
    raise TimeoutError("the event log kept growing with every worker stopped")


@pytest.mark.timeout(300)
def test_metrics_endpoint_and_report_match_the_event_log(tmp_path: Path) -> None:
    with LocalJob(PACED_JOB, tmp_path / "state", min_workers=2, lease_s=60.0, metrics=True) as job:
        job.start()
        assert job.metrics_url.startswith("http://127.0.0.1:") and job.metrics_url.endswith("/metrics")
        before = scrape(job.metrics_url)  # serving before any worker: all zero
        assert value(before, "adaptrain_steps_committed_total") == 0
        assert value(before, "adaptrain_members") == 0
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(20, timeout_s=180)
        during = scrape(job.metrics_url)
        assert value(during, "adaptrain_steps_committed_total") >= 20
        assert value(during, "adaptrain_samples_per_second") > 0

        for name in ("w1", "w2"):
            job.signal(name, signal.SIGSTOP)
        try:
            events = _quiet(job)
            samples = scrape(job.metrics_url)
            live_png = tmp_path / "live.png"
            live = ctl(job, "--control", job.control_endpoint, "report", "--plot", str(live_png), "--json")
        finally:
            for name in ("w1", "w2"):
                job.signal(name, signal.SIGCONT)

        steps = [e for e in events if e["kind"] == "step"]
        plans = [e for e in events if e["kind"] == "plan"]
        last_plan = [p for p in plans if p["layout"]][-1]
        assert steps and plans
        assert value(samples, "adaptrain_steps_committed_total") == len(steps)
        assert value(samples, "adaptrain_step") == steps[-1]["step"]
        assert value(samples, "adaptrain_loss") == pytest.approx(steps[-1]["loss"])
        assert value(samples, "adaptrain_step_seconds") == pytest.approx(steps[-1]["step_s"])
        assert value(samples, "adaptrain_epoch") == plans[-1]["epoch"]
        assert value(samples, "adaptrain_members") == len(last_plan["layout"]["members"]) == 2
        for reason, n in Counter(p["reason"] for p in plans).items():
            assert value(samples, "adaptrain_replans_total", reason=reason) == n, reason
        assert sum(v for (name, _), v in samples.items() if name == "adaptrain_replans_total") == len(plans)
        assert value(samples, "adaptrain_plan_solve_seconds_count") == len(plans)
        reshards = [e for e in events if e["kind"] == "reshard"]
        assert value(samples, "adaptrain_reshard_bytes_total") == sum(e["bytes"] for e in reshards)
        assert value(samples, "adaptrain_failures_total") == sum(e["kind"] == "failed" for e in events) == 0
        assert value(samples, "adaptrain_refused_total", reason="decode") == 0
        window = steps[-10:]
        assert value(samples, "adaptrain_samples_per_second") == pytest.approx(
            sum(e["samples"] for e in window) / sum(e["step_s"] for e in window))

        assert live.returncode == 0, live.stderr
        summary = json.loads(live.stdout)
        assert summary["steps"] == len(steps) and summary["plot"] == str(live_png)
        assert summary["members"]["last"] == 2 and summary["marks"]["joined"] == 2
        assert live_png.read_bytes().startswith(PNG)

        assert job.wait_coordinator(240) == 0, job.tail("coordinator")
        assert job.wait_workers(60) == {"w1": 0, "w2": 0}

    finished_png = tmp_path / "finished.png"
    out = subprocess.run([sys.executable, str(SCRIPTS / "ctl.py"), "report", "--events",
                          str(tmp_path / "state" / "events.jsonl"), "--plot", str(finished_png)],
                         capture_output=True, text=True, timeout=120, cwd=Path(SCRIPTS.anchor))
    assert out.returncode == 0, out.stderr
    assert f"plot written to {finished_png}" in out.stdout and f"{NUM_STEPS} committed steps" in out.stdout
    data = finished_png.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000


@pytest.mark.timeout(180)
def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                              "--insecure", "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=150)
    assert out.returncode == 2, out.stderr
    assert f"port {port}" in out.stderr and "in use" in out.stderr
    assert "Traceback" not in out.stderr
    assert "ready" not in out.stdout
