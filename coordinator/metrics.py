"""Prometheus metrics of a running job, derived from the events the coordinator writes.

Design. The event log is the one record of what happened, so the metrics are a pure fold over it:
`Metrics.observe(kind, fields)` takes each event exactly as the daemon writes it to events.jsonl
(`Core._execute`: `Log` and `Planned` effects), and `Metrics.refused(reason)` each refused input
(`Core.refuse`; reasons are coordinator.guard.REASONS). Nothing here reads a clock or touches a
socket, so a recorded events.jsonl replayed through `observe` gives the values a scrape would have
shown (tests/unit/test_metrics.py). Every metric lives in the instance's own `CollectorRegistry`
(never prometheus_client's global one), so two coordinators in one process, or tests, never share
counters.

`serve_metrics(metrics, host, port)` exposes the registry over HTTP with prometheus_client's
`start_http_server` (a daemon thread; the library's metric objects take their own locks, so the
trio thread may update while a scrape reads). Port 0 picks a free port; `MetricsServer.url` has
the real one. A port that cannot be bound is an `OSError` whose message names it.

Names all start `adaptrain_`; see METRICS below for each one's meaning (also in docs/operations.md,
"Metrics").
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from coordinator.guard import REASONS

# Plan reasons the coordinator writes (docs/operations.md, "Events"); their counters exist from the
# start at 0.
PLAN_REASONS = ("join", "failure", "leave", "drained", "preempted", "straggler", "recovered", "contention",
                "calibration", "handoff", "layout", "links")
# Event kinds counted by adaptrain_events_total (others are counted as "other": bounded labels).
EVENT_KINDS = ("joined", "left", "failed", "straggler", "recovered", "contention", "kept", "slowdown", "standby",
               "layout", "plan", "abandon", "reshard", "step", "eval", "finished", "checkpoint", "resumed", "drain_deadline",
               "state_lost", "checkpoint_failed", "checkpoint_corrupt", "restarted", "recovered", "journal_damaged")
RATE_WINDOW_STEPS = 10  # adaptrain_samples_per_second: over the last this many committed steps
SOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def plan_reason_label(reason: Any) -> str:
    """The `reason` label of a plan: the event's reason, except "NAME handed off" (one per worker
    name: unbounded) which is counted as "handoff"."""
    text = str(reason)
    return "handoff" if text.endswith(" handed off") else text


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class Metrics:
    """The job's metrics, updated from its events."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.members = Gauge("adaptrain_members", "Members of the current epoch's plan (ranks training)",
                             registry=r)
        self.epoch = Gauge("adaptrain_epoch", "Current epoch (plan version)", registry=r)
        self.step = Gauge("adaptrain_step", "Last committed step", registry=r)
        self.steps = Counter("adaptrain_steps_committed", "Steps committed (step events)", registry=r)
        self.samples_per_s = Gauge("adaptrain_samples_per_second",
                                   f"Training throughput: global batch / measured step time over the last "
                                   f"{RATE_WINDOW_STEPS} committed steps", registry=r)
        self.loss = Gauge("adaptrain_loss", "Loss of the global batch of the last committed step", registry=r)
        self.step_s = Gauge("adaptrain_step_seconds", "Measured time of the last committed step", registry=r)
        self.predicted_s = Gauge("adaptrain_step_predicted_seconds",
                                 "The current plan's predicted step time", registry=r)
        self.solve_s = Histogram("adaptrain_plan_solve_seconds", "Time to make each plan (solve included)",
                                 buckets=SOLVE_BUCKETS, registry=r)
        self.reshard_bytes = Counter("adaptrain_reshard_bytes", "State bytes moved to new or lagging members "
                                     "when epochs formed", registry=r)
        self.reshard_s = Counter("adaptrain_reshard_seconds", "Seconds epochs took to form (group and state, "
                                 "the slowest member of each)", registry=r)
        self.failures = Counter("adaptrain_failures", "Workers that failed (died or went silent)", registry=r)
        self.replans = Counter("adaptrain_replans", "Plan events by reason (including a re-plan that found no "
                               "plan that fits)", ["reason"], registry=r)
        self.refusals = Counter("adaptrain_refused", "Inputs the coordinator refused, by reason", ["reason"],
                                registry=r)
        self.events = Counter("adaptrain_events", "Events written to the event log, by kind", ["kind"], registry=r)
        for reason in PLAN_REASONS:
            self.replans.labels(reason=reason)
        for reason in REASONS:
            self.refusals.labels(reason=reason)
        for kind in EVENT_KINDS:
            self.events.labels(kind=kind)
        self._window: deque[tuple[float, float]] = deque(maxlen=RATE_WINDOW_STEPS)  # (samples, step_s)

    def observe(self, kind: str, fields: Mapping[str, Any]) -> None:
        """Account for one event, as written to events.jsonl (without its ts)."""
        self.events.labels(kind=kind if kind in EVENT_KINDS else "other").inc()
        if kind == "step":
            self._step(fields)
        elif kind == "plan":
            self.replans.labels(reason=plan_reason_label(fields.get("reason"))).inc()
            if (solve_s := _number(fields.get("solve_s"))) is not None:
                self.solve_s.observe(solve_s)
            if (epoch := _number(fields.get("epoch"))) is not None:
                self.epoch.set(epoch)
            layout = fields.get("layout")
            if isinstance(layout, Mapping) and isinstance(layout.get("members"), list):
                # A plan without a layout (nothing fits) makes no new epoch: the gauges keep theirs.
                self.members.set(len(layout["members"]))
                if (predicted := _number(fields.get("predicted_step_s"))) is not None:
                    self.predicted_s.set(predicted)
        elif kind == "reshard":
            self.reshard_bytes.inc(max(0.0, _number(fields.get("bytes")) or 0.0))
            self.reshard_s.inc(max(0.0, _number(fields.get("seconds")) or 0.0))
        elif kind == "failed":
            self.failures.inc()

    def _step(self, f: Mapping[str, Any]) -> None:
        self.steps.inc()
        if (step := _number(f.get("step"))) is not None:
            self.step.set(step)
        if (loss := _number(f.get("loss"))) is not None:
            self.loss.set(loss)
        if (predicted := _number(f.get("predicted_s"))) is not None:  # refreshed without a new epoch too
            self.predicted_s.set(predicted)
        samples, step_s = _number(f.get("samples")), _number(f.get("step_s"))
        if step_s is not None:
            self.step_s.set(step_s)
        if samples is not None and step_s is not None and step_s > 0:
            self._window.append((samples, step_s))
            self.samples_per_s.set(sum(n for n, _ in self._window) / sum(s for _, s in self._window))

    def replay(self) -> Replay:
        """A fold that seeds these metrics from a recorded log, event by event (see `Replay`)."""
        return Replay(self)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's current value (e.g. "adaptrain_steps_committed_total"); None if absent."""
        return self.registry.get_sample_value(name, labels)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format, as a scrape gets it."""
        return generate_latest(self.registry)


class Replay:
    """Seeds `Metrics` from a recorded log as `observe` would, in less time: a long job's log is
    nearly all `step` events, and only the latest RATE_WINDOW_STEPS of a run of them can show in a
    gauge or the rate window, so the others are only counted (in one `inc` each). A run is applied
    before the next other event and at `finish`, so every value ends as `observe` leaves it (but for
    a gauge whose field every one of a run's latest RATE_WINDOW_STEPS steps lacks)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._tail: deque[Mapping[str, Any]] = deque(maxlen=RATE_WINDOW_STEPS)
        self._counted = 0  # steps of the run that fell out of the tail: counted, not applied

    def __call__(self, event: Mapping[str, Any]) -> None:
        kind = str(event["kind"])
        if kind == "step":
            if len(self._tail) == self._tail.maxlen:
                self._counted += 1
            self._tail.append(event)
            return
        self.finish()
        self._metrics.observe(kind, event)

    def finish(self) -> None:
        """Apply the run of steps seen since the last other event."""
        m = self._metrics
        if self._counted:
            m.steps.inc(self._counted)
            m.events.labels(kind="step").inc(self._counted)
            self._counted = 0
        while self._tail:
            m.observe("step", self._tail.popleft())


@dataclass(slots=True)
class MetricsServer:
    url: str
    _server: Any  # the wsgiref server start_http_server made

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    """Serve `metrics` at http://HOST:PORT/metrics (any path answers) from a daemon thread."""
    try:
        server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as e:
        why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise OSError(f"cannot serve metrics on {host} port {port} (--metrics-port {port}): {why}; "
                      "choose another port, or 0 for a free one") from None
    real_port = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(url=f"http://{shown}:{real_port}/metrics", _server=server)
