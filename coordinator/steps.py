"""What the coordinator learns from step reports: measured step times against the plan's prediction,
pure communication time for the link fit, and devices whose speed changed (stragglers).

Pure, like membership: `observe(tracker, report) -> (tracker, findings)`, no clock, no I/O.

* **Steps.** The reports of one step are collected until every member of the epoch sent its own;
  then the step is *measured*: its time (the slowest replica's `step_s`; in a synchronous step every
  replica sees nearly the same), and its pure communication time — the smallest `comm_s` of the
  step, that of the replica that arrived last at the all-reduce and so waited for no one. The
  plan's predicted step time is compared with every measured step (`errors`).
* **Speed changes.** In each epoch a member's first `SETTLE` steps are skipped (a switch moves state
  and changes who competes for what), and the median compute time of the next `BASELINE` becomes its
  baseline, with its noise: the relative median absolute deviation of those steps. A step counts as
  off the baseline when it is further than the *band*: `THRESHOLD`, or `NOISE_K` times the noise
  when that is wider (capped at `MAX_BAND`), so workers whose steps jitter by ±40% (three GPT
  workers sharing two cores) are not flagged for their jitter, while a 3× slowdown still is. A
  baseline whose halves lie apart (`_two_levels`: the speed changed halfway through it, where the
  median falls between the levels and the band spans their gap) starts again from the newer half.
  If that baseline is `THRESHOLD` off what the plan predicted for its share, the cost model was
  wrong, or the device changed as the epoch began (`SpeedChange(kind="calibration")`: membership
  tells the two apart as well as it can, and the planner decides whether a new plan pays) — unless the member's prediction rested on its own
  measured steps (`measured`) and the baseline is `FAR_OFF` times slower or faster: the model was
  right a moment ago, so the device changed as the epoch began (a slowdown landing on a switch), a
  `straggler` or `recovered` like any other. After that, a change is a *lasting* shift against the
  baseline, a change point over a window: at least `VOTES` of the last `WINDOW` steps beyond the
  band, slower (or faster) than the baseline. One slow step, or a burst of up to
  `VOTES - 1` noisy ones, moves nothing; a lasting 3× slowdown is found `VOTES` steps after
  it starts. Then the window's median becomes the new baseline, so one change is reported once.
  Comparing with the epoch's own measurement, not the prediction, keeps a model error from passing
  for a straggler (and from re-planning back and forth on it). Each change found starts a new
  level of the epoch's step time (`level_from`): the re-plan's pay-off rule measures the noise
  within levels (`level_noise`), never the gap between them.
* **Layout efficiency.** A member's settled steps before its baseline is set, when its prediction
  rested on its own measured steps (`measured`), divided by what the plan predicted for it, say how
  this layout kind computes against the cost model's units: of the epoch's latest `RATIO_WINDOW` such
  ratios, each member's median, and the median of those (of an even count's two middle ones, the
  one nearer 1: `common_ratio`), times the efficiency the plan was predicted with, is the kind's
  efficiency (`efficiency_of_kind`, from `RATIO_MIN` ratios on; `plan.cluster`'s layout kinds). The
  fits' own kind (`Cluster.unit_kind`) learns nothing, and a kind already known learns only from
  ratios within `FAR_OFF`: a member that far off a prediction that knew the kind changed speed
  itself (the watch reports it), and two of three members recovering at one switch are no layout
  effect, though they are the median. A
  kind's effect is common to its members: a member slower than the rest from the epoch's start (a
  straggler landing on a switch) does not move it, where a plain median of two members would take
  half its slowdown for the layout's (and fit every member faster by as much). Only the epoch's
  first steps teach it: a device that slows down later is a straggler, not a slower layout. Each
  member's predicted compute is kept for it (`planned`): a baseline replaces what the watch
  expects, not the plan.
* **Contention, not stragglers.** When the members that share a host shift together (each with at
  least `VOTES - 1` of its last `WINDOW` steps the same way), the host got busier or quieter (a
  process starting beside them, a worker importing torch before it joins): one
  `kind="contention"` change per member of that host, never a straggler.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from plan.cost import relative_error
from transport import StepReport

THRESHOLD = 0.2  # a speed 20% off the baseline is a change
STREAK = 4  # legacy (before #9): steps of a baseline, and slow steps in a row that make a straggler
BASELINE = 6  # steps whose median (and spread) is a member's baseline in an epoch
NOISE_K = 2.5  # a step is off the baseline beyond NOISE_K × its relative spread ...
MAX_BAND = 0.5  # ... capped here (a 3x slowdown is always off)
WINDOW = 6  # a change is decided over this many recent steps ...
VOTES = 5  # ... when at least this many of them are THRESHOLD off the baseline, the same way
SETTLE = 2  # steps of a new epoch not measured against anything
FAR_OFF = 2.0  # a measured member's baseline this many times off its prediction changed speed
ERROR_WINDOW = 256  # measured steps kept per epoch for the prediction error
PENDING_STEPS = 4  # a step still missing reports this far behind the newest is dropped
RATIO_MIN = 4  # ratios needed before the kind's efficiency is learned (and at least one per member, up to ...)
RATIO_WINDOW = 256  # ... the latest this many (a thousand members' baselines: a median per report stays cheap)


@dataclass(frozen=True, slots=True, kw_only=True)
class Watch:
    """One member's compute time against the plan's prediction for its share."""

    expected_s: float  # compute seconds the plan predicted, then the measured baseline
    band: float = THRESHOLD  # how far off (relative) a step must be to count as slower or faster
    baselined: bool = False  # expected_s is measured (after SETTLE + STREAK steps of this epoch)
    settled: int = 0  # steps seen of this epoch, up to SETTLE
    votes: tuple[int, ...] = ()  # the latest WINDOW steps: +1 slower, -1 faster than the baseline, 0 neither
    recent: tuple[tuple[int, float], ...] = ()  # the latest WINDOW (samples, compute seconds)


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeedChange:
    name: str
    kind: str  # "straggler", "recovered", "calibration", "contention"
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
    settled: bool = True  # past the epoch's first SETTLE steps (whose times hold the entry's stragglers)


Finding = SpeedChange | Measured


@dataclass(frozen=True, slots=True, kw_only=True)
class Tracker:
    """Step bookkeeping for one epoch's plan."""

    epoch: int
    members: tuple[str, ...]
    predicted_step_s: float | None
    hosts: dict[str, str] = field(default_factory=dict)  # member -> host (for contention)
    loads: dict[str, float] = field(default_factory=dict)  # host -> threads per core of this epoch's members
    window: int = WINDOW  # the change-point window and votes (legacy: 4 of 4, a streak)
    votes: int = VOTES
    baseline: int = BASELINE  # steps of a baseline (legacy: STREAK)
    noise_k: float = NOISE_K  # band = max(THRESHOLD, noise_k × spread) (legacy: 0, the band is THRESHOLD)
    watches: dict[str, Watch] = field(default_factory=dict)
    measured_members: frozenset[str] = frozenset()  # predicted from their own measured steps
    pending: dict[int, dict[str, StepReport]] = field(default_factory=dict)
    measured: tuple[float, ...] = ()  # step_s of measured steps, oldest first
    count: int = 0  # steps measured in all (`measured` keeps the latest ERROR_WINDOW)
    level_from: int = 0  # the measured step (of `count`) from which the step time is at its current level
    errors: tuple[float, ...] = ()  # (predicted − measured) / measured per measured step
    kind: str = "dp"  # the plan's layout kind (`plan.cluster.kind_key`)
    efficiency: float = 1.0  # the kind's efficiency the plan was predicted with
    planned: dict[str, float] = field(default_factory=dict)  # member -> its predicted compute seconds
    ratios: tuple[tuple[str, float], ...] = ()  # (member, settled compute / planned) of measured members, newest last
    learns: bool = True  # whether this epoch teaches its kind's efficiency (not the fits' own kind)
    kind_known: bool = False  # the kind's efficiency was known when the plan was predicted


def start(epoch: int, members: tuple[str, ...], predicted_step_s: float | None,
          compute: dict[str, float], hosts: dict[str, str] | None = None, *,
          loads: dict[str, float] | None = None, measured: frozenset[str] = frozenset(),
          legacy: bool = False, kind: str = "dp", efficiency: float = 1.0, learns: bool = True,
          kind_known: bool = False) -> Tracker:
    """A tracker for a new epoch; `compute` maps a member to its predicted compute seconds, `hosts`
    a member to its host, `loads` a host to its load in this epoch (what its members' measurements
    are taken under), `measured` the members whose prediction rests on their own measured steps,
    `kind` and `efficiency` the plan's layout kind and the efficiency it was predicted with, `learns`
    whether the epoch teaches that efficiency (not for the fits' own kind) and `kind_known` whether
    it was known already (learned, or the fits' kind).
    `legacy`: the detector before #9 (STREAK slow steps in a row, no contention), kept as a
    baseline for benchmarks."""
    watches = {n: Watch(expected_s=c) for n, c in compute.items() if c > 0}
    window, votes, baseline, noise_k = (STREAK, STREAK, STREAK, 0.0) if legacy else (WINDOW, VOTES, BASELINE, NOISE_K)
    return Tracker(epoch=epoch, members=members, predicted_step_s=predicted_step_s, watches=watches,
                   hosts={} if legacy else dict(hosts or {}), loads={} if legacy else dict(loads or {}),
                   window=window, votes=votes, baseline=baseline, noise_k=noise_k,
                   measured_members=frozenset() if legacy else measured, kind=kind, efficiency=efficiency,
                   planned={n: c for n, c in compute.items() if c > 0}, learns=learns, kind_known=kind_known)


def observe(t: Tracker, r: StepReport) -> tuple[Tracker, list[Finding]]:
    """Fold one member's report of one step into the tracker."""
    if r.epoch != t.epoch or r.name not in t.members:
        return t, []
    findings: list[Finding] = []
    watch = t.watches.get(r.name)
    if watch is not None and r.samples > 0 and r.compute_s > 0:
        watch, change = _watch(watch, r.name, r.samples, r.compute_s, t)
        t = replace(t, watches={**t.watches, r.name: watch})
        if change is not None and change.kind in ("straggler", "recovered"):
            t, changes = _host_wide(t, change)
            findings += changes
            # (the member's shifted steps began a new level of the step time: `level_noise`)
            t = replace(t, level_from=max(t.level_from, t.count + 1 - len(change.recent)))
        elif change is not None:
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
    settled = len(t.measured) >= SETTLE
    t = replace(t, pending=pending, measured=measured, errors=errors, count=t.count + 1)
    return t, [*findings, Measured(step=r.step, step_s=step_s, comm_s=comm_s, ranks=len(t.members), settled=settled)]


def baselining(t: Tracker | None, r: StepReport) -> bool:
    """Whether `r` is a settled step of its member before its baseline is set (ask before `observe`
    counts it): what a layout kind's efficiency is learned from."""
    if t is None or r.epoch != t.epoch:
        return False
    w = t.watches.get(r.name)
    return w is not None and w.settled >= SETTLE and not w.baselined


def efficiency_of_kind(t: Tracker, r: StepReport) -> tuple[Tracker, float | None, bool]:
    """Fold `r` (a `baselining` report) into the epoch's ratios of measured to planned compute: the
    plan's layout kind's efficiency they give so far (None: `r` says nothing of it), and whether
    they are enough to learn it (see the module comment)."""
    planned = t.planned.get(r.name, 0.0)
    if (not t.learns or r.epoch != t.epoch or r.name not in t.measured_members or planned <= 0 or r.samples <= 0
            or r.compute_s <= 0):
        return t, None, False
    ratio = r.compute_s / planned
    if t.kind_known and not 1 / FAR_OFF < ratio < FAR_OFF:
        return t, None, False  # (this member changed speed: its watch says so)
    t = replace(t, ratios=(*t.ratios, (r.name, ratio))[-RATIO_WINDOW:])
    enough = len(t.ratios) >= min(RATIO_WINDOW, max(RATIO_MIN, len(t.measured_members)))
    return t, t.efficiency * common_ratio(t.ratios), enough


def common_ratio(ratios: tuple[tuple[str, float], ...]) -> float:
    """The part of `(member, ratio)` the members share: the median of the members' own medians (a
    minority off the rest is its own, not the layout's), and where the count is even, of the two
    middle ones the one nearer 1, the smaller change (of two members, a straggler's ratio or one
    mis-fitted never moves the kind: the other's does, and the odd one is the straggler watch's)."""
    by_member: dict[str, list[float]] = {}
    for name, ratio in ratios:
        by_member.setdefault(name, []).append(ratio)
    own = [statistics.median(rs) for rs in by_member.values()]
    low, high = statistics.median_low(own), statistics.median_high(own)
    return min((low, high), key=lambda r: abs(math.log(r)))


def settling(t: Tracker | None, r: StepReport) -> bool:
    """Whether `r` is one of its member's first SETTLE steps of the tracker's epoch: times that hold
    the epoch's entry (a survivor released from an abandoned step, a reshard, a peer still
    loading), which no fit of speed, overhead or contention may learn from."""
    if t is None or r.epoch != t.epoch:
        return False
    w = t.watches.get(r.name)
    return w is not None and w.settled < SETTLE


def _watch(w: Watch, name: str, samples: int, compute_s: float, t: Tracker) -> tuple[Watch, SpeedChange | None]:
    if w.settled < SETTLE:
        return replace(w, settled=w.settled + 1), None
    if not w.baselined:
        recent = (*w.recent, (samples, compute_s))[-t.baseline:]
        if len(recent) < t.baseline:
            return replace(w, recent=recent), None
        if _two_levels(recent):
            # The speed changed halfway through: the median would fall between the two levels and
            # the band (their gap) would hide the rest of the change. The baseline starts again
            # from the newer level.
            return replace(w, recent=recent[len(recent) // 2:]), None
        mid = _median(recent)
        if not _off(mid, w.expected_s):
            return _baseline(recent, t), None
        kind = "calibration"
        if name in t.measured_members and not 1 / FAR_OFF < mid / w.expected_s < FAR_OFF:
            kind = "straggler" if mid > w.expected_s else "recovered"
        return _baseline(recent, t), _change(w, name, kind, recent)
    recent = (*w.recent, (samples, compute_s))[-t.window:]
    vote = 1 if _slower(compute_s, w.expected_s, w.band) else -1 if _faster(compute_s, w.expected_s, w.band) else 0
    w = replace(w, recent=recent, votes=(*w.votes, vote)[-t.window:])
    for direction, kind in ((1, "straggler"), (-1, "recovered")):
        if w.votes.count(direction) >= t.votes:
            shifted = tuple(x for x, v in zip(recent, w.votes) if v == direction)
            change = _change(w, name, kind, shifted)
            return _baseline(shifted, t), change
    return w, None


def _baseline(recent: tuple[tuple[int, float], ...], t: Tracker) -> Watch:
    """A member's new baseline from `recent` steps: their median, and a band that covers their noise."""
    mid = _median(recent)
    spread = statistics.median(abs(x - mid) for _, x in recent) / mid if mid > 0 else 0.0
    band = min(MAX_BAND, max(THRESHOLD, t.noise_k * spread))
    return Watch(expected_s=mid, band=band, baselined=True, settled=SETTLE)


def _two_levels(recent: tuple[tuple[int, float], ...]) -> bool:
    """Whether the halves of `recent` lie apart: every step of one half above every step of the
    other, their medians THRESHOLD apart (with a change in the first or last third the median is
    one level's, and the band that level's noise: only a change halfway leaves neither)."""
    times = [x for _, x in recent]
    half = len(times) // 2
    older, newer = times[:half], times[half:]
    apart = max(older) < min(newer) or max(newer) < min(older)
    return apart and _off(statistics.median(newer), statistics.median(older))


def _host_wide(t: Tracker, change: SpeedChange) -> tuple[Tracker, list[Finding]]:
    """`change` as found, or, when every other member on its host has shifted the same way too,
    one "contention" change per member of the host (each re-baselined)."""
    host = t.hosts.get(change.name)
    peers = [n for n in t.members if n != change.name and host is not None and t.hosts.get(n) == host]
    direction = 1 if change.kind == "straggler" else -1
    watches = {n: t.watches[n] for n in peers if n in t.watches and t.watches[n].baselined}
    if not peers or len(watches) < len(peers) or not all(
            w.votes.count(direction) >= t.votes - 1 for w in watches.values()):
        return t, [change]
    out: list[Finding] = [replace(change, kind="contention")]
    updated = dict(t.watches)
    for n, w in watches.items():
        shifted = tuple(x for x, v in zip(w.recent, w.votes) if v == direction)
        out.append(replace(_change(w, n, "contention", shifted)))
        updated[n] = _baseline(shifted, t)
    return replace(t, watches=updated), out


def _median(recent: tuple[tuple[int, float], ...]) -> float:
    return statistics.median(t for _, t in recent)


def _change(w: Watch, name: str, kind: str, recent: tuple[tuple[int, float], ...]) -> SpeedChange:
    measured = _median(recent)
    samples = recent[-1][0]
    return SpeedChange(name=name, kind=kind, factor=measured / w.expected_s, speed=samples / measured,
                       expected=samples / w.expected_s, recent=recent)


def _slower(measured_s: float, expected_s: float, band: float = THRESHOLD) -> bool:
    """Speed (samples / time) at least `band` below the expected."""
    return measured_s * (1 - band) > expected_s


def _faster(measured_s: float, expected_s: float, band: float = THRESHOLD) -> bool:
    """Speed at least as far above: time below (1 − band) of the expected."""
    return measured_s < (1 - band) * expected_s


def _off(measured_s: float, expected_s: float) -> bool:
    return _slower(measured_s, expected_s) or _faster(measured_s, expected_s)


def level_noise(t: Tracker, window: int) -> float:
    """Relative spread of the latest `window` measured steps (median absolute deviation over the
    median), each step measured against the median of its own level: a speed change found in the
    epoch (a straggler kept, a recovery) starts a new one, and the gap between two levels is not
    noise (around one median of both, a kept 3x straggler once made a second one need a 60% gain).
    A level of fewer than 3 steps in the window counts for nothing; 0 before any level has 3."""
    recent = t.measured[-window:]
    first = t.count - len(recent)  # the count of recent[0]
    cut = min(max(t.level_from - first, 0), len(recent))
    deviations: list[float] = []
    for level in (recent[:cut], recent[cut:]):
        mid = statistics.median(level) if len(level) >= 3 else 0.0
        deviations += [abs(x - mid) / mid for x in level] if mid > 0 else []
    return statistics.median(deviations) if deviations else 0.0


def median_error(t: Tracker) -> float | None:
    """Median relative error of the prediction over this epoch's measured steps."""
    return statistics.median(t.errors) if t.errors else None
