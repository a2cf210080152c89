"""What the coordinator learns from step reports: measured step times against the plan's prediction,
pure communication time for the link fit, and devices whose speed changed (stragglers).

Pure, like membership: `observe(tracker, report) -> (tracker, findings)`, no clock, no I/O.

* **Steps.** The reports of one step are collected until every member of the epoch sent its own;
  then the step is *measured*: its time (the slowest replica's `step_s`; in a synchronous step every
  replica sees nearly the same), and its pure communication time — the smallest `comm_s` of the
  step, that of the replica that arrived last at the all-reduce and so waited for no one. The
  plan's predicted step time is compared with every measured step (`errors`).
* **Speed changes.** In each epoch a member's first `SETTLE` steps are skipped (a switch moves state
  and changes who competes for what), and the median compute time of the next `STREAK` becomes its
  baseline. If that baseline is `THRESHOLD` off what the plan predicted for its share, the cost
  model was wrong (`SpeedChange(kind="calibration")`: the measurements already correct it; the
  planner decides whether a new plan pays). Then `STREAK` consecutive steps whose speed (samples /
  compute time) is at least `THRESHOLD` below the baseline make `kind="straggler"`, as many at least
  as far above `kind="recovered"`, and the streak's median becomes the new baseline, so one change
  is reported once. Comparing with the epoch's own measurement, not the prediction, keeps a model
  error from passing for a straggler (and from re-planning back and forth on it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from plan.cost import relative_error
from transport import StepReport

THRESHOLD = 0.2  # a speed 20% off the baseline is a change
STREAK = 4  # ... when it lasts this many consecutive steps
SETTLE = 2  # steps of a new epoch not measured against anything
ERROR_WINDOW = 256  # measured steps kept per epoch for the prediction error
PENDING_STEPS = 4  # a step still missing reports this far behind the newest is dropped


@dataclass(frozen=True, slots=True, kw_only=True)
class Watch:
    """One member's compute time against the plan's prediction for its share."""

    expected_s: float  # compute seconds the plan predicted, then the measured baseline
    baselined: bool = False  # expected_s is measured (after SETTLE + STREAK steps of this epoch)
    settled: int = 0  # steps seen of this epoch, up to SETTLE
    slow: int = 0
    fast: int = 0
    recent: tuple[tuple[int, float], ...] = ()  # the latest STREAK (samples, compute seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedChange:
    name: str
    kind: str  # "straggler", "recovered", "calibration"
    factor: float  # measured compute time / predicted (median of the streak)
    speed: float  # measured samples/s of compute at its share
    expected: float  # samples/s the plan assumed
    recent: tuple[tuple[int, float], ...]  # the streak's (samples, compute seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """A step every member reported."""

    step: int
    step_s: float
    comm_s: float
    ranks: int


Finding = SpeedChange | Measured


@dataclass(frozen=True, slots=True, kw_only=True)
class Tracker:
    """Step bookkeeping for one epoch's plan."""

    epoch: int
    members: tuple[str, ...]
    predicted_step_s: float | None
    watches: dict[str, Watch] = field(default_factory=dict)
    pending: dict[int, dict[str, StepReport]] = field(default_factory=dict)
    measured: tuple[float, ...] = ()  # step_s of measured steps, oldest first
    errors: tuple[float, ...] = ()  # (predicted − measured) / measured per measured step


def start(epoch: int, members: tuple[str, ...], predicted_step_s: float | None,
          compute: dict[str, float]) -> Tracker:
    """A tracker for a new epoch; `compute` maps a member to its predicted compute seconds."""
    watches = {n: Watch(expected_s=c) for n, c in compute.items() if c > 0}
    return Tracker(epoch=epoch, members=members, predicted_step_s=predicted_step_s, watches=watches)


def observe(t: Tracker, r: StepReport) -> tuple[Tracker, list[Finding]]:
    """Fold one member's report of one step into the tracker."""
    if r.epoch != t.epoch or r.name not in t.members:
        return t, []
    findings: list[Finding] = []
    watch = t.watches.get(r.name)
    if watch is not None and r.samples > 0 and r.compute_s > 0:
        watch, change = _watch(watch, r.name, r.samples, r.compute_s)
        t = replace(t, watches={**t.watches, r.name: watch})
        if change is not None:
            findings.append(change)
    reports = {**t.pending.get(r.step, {}), r.name: r}
    pending = {s: rs for s, rs in t.pending.items() if s > r.step - PENDING_STEPS}
    if len(reports) < len(t.members):
        return replace(t, pending={**pending, r.step: reports}), findings
    pending.pop(r.step, None)
    step_s = max(x.step_s for x in reports.values())
    comm_s = min(x.comm_s for x in reports.values())
    measured = (*t.measured, step_s)[-ERROR_WINDOW:]
    errors = t.errors
    if t.predicted_step_s is not None and step_s > 0:
        errors = (*errors, relative_error(t.predicted_step_s, step_s))[-ERROR_WINDOW:]
    t = replace(t, pending=pending, measured=measured, errors=errors)
    return t, [*findings, Measured(step=r.step, step_s=step_s, comm_s=comm_s, ranks=len(t.members))]


def _watch(w: Watch, name: str, samples: int, compute_s: float) -> tuple[Watch, SpeedChange | None]:
    if w.settled < SETTLE:
        return replace(w, settled=w.settled + 1), None
    recent = (*w.recent, (samples, compute_s))[-STREAK:]
    if not w.baselined:
        if len(recent) < STREAK:
            return replace(w, recent=recent), None
        change = _change(w, name, "calibration", recent) if _off(_median(recent), w.expected_s) else None
        return Watch(expected_s=_median(recent), baselined=True, settled=SETTLE), change
    slow = w.slow + 1 if _slower(compute_s, w.expected_s) else 0
    fast = w.fast + 1 if _faster(compute_s, w.expected_s) else 0
    w = replace(w, slow=slow, fast=fast, recent=recent)
    if slow >= STREAK or fast >= STREAK:
        change = _change(w, name, "straggler" if slow >= STREAK else "recovered", recent)
        return Watch(expected_s=_median(recent), baselined=True, settled=SETTLE), change
    return w, None


def _median(recent: tuple[tuple[int, float], ...]) -> float:
    return statistics.median(t for _, t in recent)


def _change(w: Watch, name: str, kind: str, recent: tuple[tuple[int, float], ...]) -> SpeedChange:
    measured = _median(recent)
    samples = recent[-1][0]
    return SpeedChange(name=name, kind=kind, factor=measured / w.expected_s, speed=samples / measured,
                       expected=samples / w.expected_s, recent=recent)


def _slower(measured_s: float, expected_s: float) -> bool:
    """Speed (samples / time) at least THRESHOLD below the expected."""
    return measured_s * (1 - THRESHOLD) > expected_s


def _faster(measured_s: float, expected_s: float) -> bool:
    """Speed at least as far above: time below (1 − THRESHOLD) of the expected."""
    return measured_s < (1 - THRESHOLD) * expected_s


def _off(measured_s: float, expected_s: float) -> bool:
    return _slower(measured_s, expected_s) or _faster(measured_s, expected_s)


def median_error(t: Tracker) -> float | None:
    """Median relative error of the prediction over this epoch's measured steps."""
    return statistics.median(t.errors) if t.errors else None
