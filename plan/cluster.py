"""The unified cluster object: devices, hosts and links, and what has been measured of each.

* A **device** is one worker process and its device: kind, calibrated matmul FLOP/s (at join; one
  figure, the best, for the devices of one host with the same device and threads:
  `with_peer_calibration`), usable memory (`worker --memory-limit` caps it), host. Once it trains, its compute time (forward +
  backward, communication excluded) is modelled as `fixed + samples / speed`, fitted over its last
  `COMPUTE_WINDOW` steps: a part that does not grow with the share (Python and kernel-launch
  overhead, which dominates small models) and a marginal speed in samples/s. While its share never
  changed the two cannot be told apart, and the fixed part keeps its last fitted value (0 at first).
  Its per-step overhead outside compute (copying gradients, the optimizer step: step time minus
  compute minus the all-reduce) is an exponentially weighted estimate. Devices not yet measured are
  put on the same scale through the median samples-per-FLOP of the measured ones.
* **Links**: α (latency per message) and β (seconds per byte) of the links inside one host and
  between hosts, fitted (`plan.fit`) from the pure communication time of measured all-reduces. A
  collective over devices on one host uses the intra-host link, otherwise the inter-host one.
  Priors (used only until the first measurement): intra 100 µs + 1 GB/s, inter 500 µs + 100 MB/s.
* **Migration**: the cost of an epoch switch, fitted from the coordinator's `reshard` figures:
  seconds ≈ c0 (forming the group) + c1 · bytes moved. Prior: 50 ms + 1 GB/s.
* **Layout kinds.** The same device computes at another pace in another layout: a pipeline stage
  idles in the bubble (on shared cores its neighbours then run faster), a tensor-parallel member
  pays DTensor's dispatch, FSDP2 copies into and out of its flat buffers. Each kind (`kind_key`:
  "dp", "fsdp", "pp", "tp", "pp+fsdp", "fsdp+tp", ...) has an *efficiency*: its compute time over the
  fits' units (1 until the kind has run). The units are those of the first kind measured
  (`unit_kind`), whose efficiency is 1 for good: its steps *are* the fits, and an epoch of it whose
  members compute faster or slower than predicted has devices that changed speed, never a layout
  that did (two members of three recovering at one switch once taught "dp" a 4x efficiency). Measured
  compute is divided by its kind's efficiency before it is fitted (`with_measurement`,
  `with_speed_change`), so the fits stay in one unit whatever layout ran; a plan of kind K is
  predicted on `calibrated(K)`, the fits times K's efficiency. The coordinator learns a kind's
  efficiency from an epoch of it (`with_efficiency`: measured compute over what the plan predicted).
* **Device classes** (`classes`): devices of one kind, similar speed (within `SPEED_TOLERANCE`) and
  the same memory cap, which the MILP treats as interchangeable.
* **Contention** between workers that share a host's CPU cores: a device's compute time under a
  set of active members is its uncontended time × `max(1, load)^γ`, where load is the threads of the
  active members on its host over the host's cores (`Join.cores`), and γ (per host) says how much
  compute suffers from oversubscription: learned from the device's own steps at two loads (median
  per-sample time at each); until then 0 (no contention assumed: see GAMMA_PRIOR).
  Measurements are stored uncontended (divided by the factor in effect), so a join, a failure or
  a drain on a host *predicts* the mutual slowdown or speed-up of its co-located workers instead of
  reporting them as stragglers. `contended(active)` gives the cluster as it runs with `active`.

Immutable: every change returns a new Cluster. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from plan.cost import Link
from plan.fit import Observation, TwoTermFit, fit_two_terms

EWMA_WEIGHT = 0.3  # weight of the newest measurement in a device's overhead estimate
COMPUTE_WINDOW = 16  # steps the compute model of a device is fitted over
WARMUP_STEPS = 2  # a worker's first steps pay for lazy set-up (allocator, autograd): not fitted
SPEED_TOLERANCE = 0.1  # devices within 10% of a class's slowest member share its class
# Contention exponent before a host's own is measured: none. A compute-bound prior (1 for CPUs) does
# harm: for workers that do not contend (the paced job) it predicts that planning a co-located worker
# out speeds the others up 1.5x, so the planner benches one, and the next steps disprove it (a
# calibration re-plan after another).
GAMMA_PRIOR: dict[str, float] = {}
GAMMA_MAX = 1.5
LOAD_WINDOW = 32  # (load, per-sample seconds) observations kept per device to learn γ
LOAD_MIN_OBS = 3  # observations needed at each of two loads

INTRA_HOST_PRIOR = (1e-4, 1e-9)
INTER_HOST_PRIOR = (5e-4, 1e-8)
MIGRATION_PRIOR = (0.05, 1e-9)
EFFICIENCY_MAX = 4.0  # a layout kind computes at most this many times slower (or faster) than the fits' units


def _bounded(efficiency: float) -> float:
    return min(EFFICIENCY_MAX, max(1 / EFFICIENCY_MAX, efficiency))


def kind_key(pp: int = 1, dp_shard: int = 1, tp: int = 1) -> str:
    """A layout's kind, as its efficiency is learned: the axes it uses beyond replicas ("dp")."""
    return "+".join(name for name, n in (("pp", pp), ("fsdp", dp_shard), ("tp", tp)) if n > 1) or "dp"


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One worker process and its device, as the planner sees it."""

    name: str
    host: str
    kind: str  # "cpu", "cuda:0", ...
    flops: float  # calibrated matmul FLOP/s at join
    memory_bytes: int
    samples_per_s: float | None = None  # measured marginal compute speed, None until trained
    compute_fixed_s: float = 0.0  # measured compute time per step that does not grow with the share
    overhead_s: float = 0.0  # measured per-step time outside compute and the all-reduce (EWMA)
    compute_window: tuple[tuple[int, float], ...] = ()  # recent (samples, uncontended compute seconds)
    reports: int = 0  # step reports seen (the first WARMUP_STEPS are not fitted: lazy set-up)
    threads: int = 1  # cores it keeps busy while computing
    host_cores: int = 0  # cores of its host (0: unknown, no contention modelled)
    load_window: tuple[tuple[float, float], ...] = ()  # recent (host load, raw per-sample seconds)

    def __post_init__(self) -> None:
        if self.flops <= 0:
            raise ValueError(f"device {self.name}: calibrated FLOP/s must be positive, got {self.flops}")
        if self.memory_bytes < 0:
            raise ValueError(f"device {self.name}: memory must be >= 0, got {self.memory_bytes}")

    @property
    def device_kind(self) -> str:
        """"cpu" or "cuda" (the index of a GPU does not make it another kind)."""
        return self.kind.split(":", 1)[0]


def _fit(prior: tuple[float, float]) -> Callable[[], TwoTermFit]:
    return lambda: TwoTermFit(prior=prior)


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices by name, the fitted links and the fitted migration cost."""

    devices: dict[str, Device] = field(default_factory=dict)
    intra_host: TwoTermFit = field(default_factory=_fit(INTRA_HOST_PRIOR))
    inter_host: TwoTermFit = field(default_factory=_fit(INTER_HOST_PRIOR))
    migration: TwoTermFit = field(default_factory=_fit(MIGRATION_PRIOR))
    gamma: dict[str, float] = field(default_factory=dict)  # learned contention exponent per host
    efficiency: dict[str, float] = field(default_factory=dict)  # layout kind -> compute time over the fits' units
    unit_kind: str | None = None  # the layout kind the fits were first measured in (efficiency 1 for good)
    calibrated_as: str | None = field(default=None, compare=False)  # the kind a `calibrated` view is scaled for
    # speeds and fixed costs as computed once (a cluster is never changed: `replace` builds a new one,
    # with an empty memo); the planner asks for them hundreds of times at a thousand devices
    _memo: dict[str, dict[str, float]] = field(default_factory=dict, init=False, compare=False, repr=False)
    _kinds: dict[str, Cluster] = field(default_factory=dict, init=False, compare=False, repr=False)

    # --- layout kinds ----------------------------------------------------------------------------

    def efficiency_of(self, kind: str) -> float:
        return 1.0 if kind == self.unit_kind else self.efficiency.get(kind, 1.0)

    def efficiency_known(self, kind: str) -> bool:
        """Whether `kind`'s efficiency is known: the fits' own kind, or one learned from an epoch."""
        return kind == self.unit_kind or kind in self.efficiency

    def with_efficiency(self, kind: str, value: float) -> Cluster:
        """A layout kind's learned efficiency (compute time over the fits' units), within bounds;
        the fits' own kind stays at 1."""
        if kind == self.unit_kind:
            return self
        return replace(self, efficiency={**self.efficiency, kind: _bounded(value)})

    def calibrated(self, kind: str) -> Cluster:
        """This cluster as a plan of layout `kind` computes: every measured device's marginal speed
        divided by the kind's efficiency, its fixed part multiplied. A view for predictions only;
        a view already calibrated is returned as it is (the caller that knows the whole layout
        calibrates first: a pipeline of tp groups is "pp+tp", not "pp" again inside)."""
        if self.calibrated_as is not None:
            return self
        if (view := self._kinds.get(kind)) is None:
            e = self.efficiency_of(kind)
            devices = self.devices if e == 1.0 else {
                n: replace(d, samples_per_s=d.samples_per_s / e if d.samples_per_s else None,
                           compute_fixed_s=d.compute_fixed_s * e) for n, d in self.devices.items()}
            view = self._kinds[kind] = replace(self, devices=devices, calibrated_as=kind)
        return view

    # --- devices ---------------------------------------------------------------------------------

    def with_device(self, device: Device) -> Cluster:
        return replace(self, devices={**self.devices, device.name: device})

    def with_peer_calibration(self, name: str) -> Cluster:
        """One calibration per piece of hardware: devices on one host with the same device string
        and thread count compute on the same cores (or the same GPU), so join-time matmul figures
        that differ between them measured the moment's contention, not the hardware (they can
        differ twofold on a busy machine, which would plan unequal shares that the first measured
        steps undo with a re-plan). All of them take the best figure, the
        calibration's own rule: interference only ever slows a run down."""
        device = self.devices.get(name)
        if device is None:
            return self
        peers = [d for d in self.devices.values()
                 if (d.host, d.kind, d.threads) == (device.host, device.kind, device.threads)]
        best = max(d.flops for d in peers)
        return replace(self, devices={**self.devices, **{d.name: replace(d, flops=best) for d in peers}})

    def is_guess(self, name: str) -> bool:
        """Whether the planner's speed for `name` is a guess: it has not trained yet, and no device
        of the same hardware (`with_peer_calibration`) has either. A newcomer beside measured
        twins is planned at their measured speed, which its own steps only confirm."""
        device = self.devices.get(name)
        if device is None or device.samples_per_s:
            return False
        return not any(d.samples_per_s and (d.host, d.kind, d.threads) == (device.host, device.kind, device.threads)
                       for d in self.devices.values())

    def without(self, name: str) -> Cluster:
        return replace(self, devices={k: v for k, v in self.devices.items() if k != name})

    def subset(self, names: Iterable[str]) -> Cluster:
        """The same measurements, only the named devices."""
        keep = set(names)
        return replace(self, devices={k: v for k, v in self.devices.items() if k in keep})

    def with_measurement(self, name: str, samples: int, compute_s: float,
                         overhead_s: float | None = None, load: float = 0.0, kind: str | None = None,
                         efficiency: float | None = None, hold: bool = False) -> Cluster:
        """Fold one step's compute time of `samples` samples (and its overhead), measured while its
        host carried `load` (threads per core: `load`; 0 when unknown) in a layout of `kind` (whose
        efficiency is `efficiency`, default the one learned), into the estimates. `hold`: into the
        window only, the fitted speed and fixed part kept (a measured device's first steps at a new
        share, not yet checked against what the model predicted for it: should its speed have
        changed at the switch, a line through them and the older share's steps would bend into a
        false fixed part; `with_speed_change` then replaces the model, else the next step refits)."""
        device = self.devices.get(name)
        if device is None or samples <= 0 or compute_s <= 0:
            return self
        if kind is not None and kind != self.unit_kind:
            compute_s /= _bounded(efficiency) if efficiency is not None else self.efficiency_of(kind)
        if device.reports < WARMUP_STEPS and device.samples_per_s is None:
            return self.with_device(replace(device, reports=device.reports + 1))
        cluster = self
        if kind is not None and self.unit_kind is None:
            cluster = replace(self, unit_kind=kind)  # the first fitted step: its kind is the fits' unit
        loads = device.load_window
        if device.host_cores > 0 and load > 0:
            loads = (*loads, (load, compute_s / samples))[-LOAD_WINDOW:]
            gamma = _learn_gamma(loads)
            if gamma is not None:
                cluster = replace(cluster, gamma={**cluster.gamma, device.host: gamma})
        factor = cluster.factor_at(device, load)
        window = (*device.compute_window, (samples, compute_s / factor))[-COMPUTE_WINDOW:]
        if hold and device.samples_per_s:
            fixed, per_sample = device.compute_fixed_s, 1.0 / device.samples_per_s
        else:
            fixed, per_sample = fit_compute(window, device.compute_fixed_s)
        overhead = device.overhead_s
        if overhead_s is not None and overhead_s >= 0:
            first = device.samples_per_s is None
            overhead = overhead_s if first else (1 - EWMA_WEIGHT) * overhead + EWMA_WEIGHT * overhead_s
        return cluster.with_device(replace(device, samples_per_s=1.0 / per_sample, compute_fixed_s=fixed,
                                           overhead_s=overhead, compute_window=window, reports=device.reports + 1,
                                           load_window=loads))

    def with_speed_change(self, name: str, recent: tuple[tuple[int, float], ...], load: float = 0.0,
                          kind: str | None = None) -> Cluster:
        """A detected change of speed, seen in `recent` (samples, seconds) steps at one share while
        its host carried `load`: the device's compute model keeps its shape before the change (fixed
        vs per-sample part, fitted without `recent`, the newest steps of its window: fitted beside
        older steps at another share, they bend the line into a fixed part) and is scaled to match
        them; older observations are dropped (they describe the device before the change)."""
        device = self.devices.get(name)
        if device is None or device.samples_per_s is None or not recent:
            return self
        if kind is not None:
            recent = tuple((n, t / self.efficiency_of(kind)) for n, t in recent)
        contention = self.factor_at(device, load)
        samples = recent[-1][0]
        before = device.compute_window[:-len(recent)]
        # (a line through the change and the steps before it at another share can fall: more samples,
        # less time; its slope then sits at the MAX_SPEED floor and its fixed part is the change's)
        fixed_before = device.compute_fixed_s if device.samples_per_s < MAX_SPEED else 0.0
        fixed, per_sample = (fit_compute(before, fixed_before) if before
                             else (fixed_before, 1.0 / device.samples_per_s))
        factor = statistics.median(t for _, t in recent) / ((fixed + samples * per_sample) * contention)
        return self.with_device(replace(device, samples_per_s=1.0 / (per_sample * factor),
                                        compute_fixed_s=fixed * factor,
                                        compute_window=tuple((n, t / contention) for n, t in recent[-COMPUTE_WINDOW:]),
                                        load_window=()))

    # --- contention between co-located workers ---------------------------------------------------

    def load(self, host: str, active: Iterable[str]) -> float:
        """Threads of the `active` devices on `host` per core of that host (0: cores unknown)."""
        on_host = [self.devices[n] for n in active if n in self.devices and self.devices[n].host == host]
        cores = max((d.host_cores for d in on_host), default=0)
        return sum(d.threads for d in on_host) / cores if cores > 0 else 0.0

    def host_gamma(self, host: str, kind: str) -> float:
        return self.gamma.get(host, GAMMA_PRIOR.get(kind, 0.0))

    def factor(self, name: str, active: Iterable[str]) -> float:
        """How much slower `name` computes while `active` train than alone on its host (>= 1)."""
        device = self.devices.get(name)
        if device is None or device.host_cores <= 0:
            return 1.0
        return self.factor_at(device, self.load(device.host, active))

    def factor_at(self, device: Device, load: float) -> float:
        """How much slower `device` computes while its host carries `load` threads per core."""
        if device.host_cores <= 0:
            return 1.0
        return float(max(1.0, load) ** self.host_gamma(device.host, device.device_kind))

    def contended(self, active: Iterable[str]) -> Cluster:
        """This cluster as it computes while exactly `active` train: each active device's speed
        and fixed part scaled by its contention factor."""
        active = tuple(active)
        devices = dict(self.devices)
        for n in active:
            d = devices.get(n)
            f = self.factor(n, active)
            if d is not None and f != 1.0:
                devices[n] = replace(d, samples_per_s=d.samples_per_s / f if d.samples_per_s else None,
                                     compute_fixed_s=d.compute_fixed_s * f, flops=d.flops / f)
        return replace(self, devices=devices)

    def with_speed(self, name: str, samples_per_s: float) -> Cluster:
        """Set a device's marginal speed outright (tests, simulations)."""
        device = self.devices.get(name)
        if device is None or samples_per_s <= 0:
            return self
        return self.with_device(replace(device, samples_per_s=samples_per_s))

    def fixed_compute(self) -> dict[str, float]:
        """Every device's fixed compute per step; unmeasured devices get the median of the measured."""
        if (memo := self._memo.get("fixed")) is None:
            measured = [d.compute_fixed_s for d in self.devices.values() if d.samples_per_s]
            guess = statistics.median(measured) if measured else 0.0
            memo = self._memo["fixed"] = {n: d.compute_fixed_s if d.samples_per_s else guess
                                          for n, d in self.devices.items()}
        return dict(memo)

    def speeds(self) -> dict[str, float]:
        """Estimated samples/s of every device, on one scale (see the module comment). A device not
        measured yet is taken to be no faster than the slowest measured one: its speed is a guess
        from a matmul, and a guess must not displace a device that holds the state (once it has
        trained a few steps its measured speed takes over)."""
        if (memo := self._memo.get("speeds")) is None:
            measured = {n: d.samples_per_s for n, d in self.devices.items() if d.samples_per_s}
            per_flop = statistics.median(v / self.devices[n].flops for n, v in measured.items()) if measured else 1.0
            slowest = min(measured.values(), default=math.inf)
            memo = self._memo["speeds"] = {name: measured[name] if name in measured else min(d.flops * per_flop, slowest)
                                           for name, d in self.devices.items()}
        return dict(memo)

    def speeds_for(self, train_flops: float) -> dict[str, float]:
        """Like `speeds`, with unmeasured devices converted through the fitted FLOP→time factor
        when nothing is measured yet: FLOP/s ÷ FLOPs per sample (factor 1 until measured)."""
        if any(d.samples_per_s for d in self.devices.values()) or train_flops <= 0:
            return self.speeds()
        return {name: d.flops / train_flops for name, d in self.devices.items()}

    def compute_factor(self, train_flops: float) -> float | None:
        """The fitted ratio of real compute time to FLOPs ÷ calibrated FLOP/s (median over measured
        devices); None before any measurement."""
        ratios = [d.flops / (train_flops * d.samples_per_s) for d in self.devices.values()
                  if d.samples_per_s and train_flops > 0]
        return statistics.median(ratios) if ratios else None

    # --- links -----------------------------------------------------------------------------------

    def spans_hosts(self, names: Iterable[str]) -> bool:
        return len({self.devices[n].host for n in names if n in self.devices}) > 1

    def link_fit(self, names: Iterable[str]) -> tuple[str, TwoTermFit]:
        """Which link a collective over `names` is limited by ("intra-host" or "inter-host"), and its fit."""
        if self.spans_hosts(names):
            return "inter-host", self.inter_host
        return "intra-host", self.intra_host

    def link(self, names: Iterable[str]) -> Link:
        """The link a collective over `names` is limited by."""
        _, fit = self.link_fit(names)
        return Link(alpha_s=fit.coef[0], beta_s_per_byte=fit.coef[1])

    def with_allreduce(self, ranks: int, n_bytes: float, seconds: float, *, cross_host: bool) -> Cluster:
        """Fold one measured ring all-reduce (its pure communication time) into the link fit."""
        if ranks < 2:
            return self
        return self.with_comm(2.0 * (ranks - 1), 2.0 * (ranks - 1) / ranks * n_bytes, seconds, cross_host=cross_host)

    def with_comm(self, f0: float, f1: float, seconds: float, *, cross_host: bool) -> Cluster:
        """Fold one step's measured communication, modelled as α·f0 + β·f1 (`step_comm_features`),
        into the link fit."""
        if f0 <= 0 and f1 <= 0:
            return self
        if cross_host:
            return replace(self, inter_host=self.inter_host.observe(f0, f1, seconds))
        return replace(self, intra_host=self.intra_host.observe(f0, f1, seconds))

    def with_reshard(self, n_bytes: float, seconds: float) -> Cluster:
        """Fold one epoch switch (bytes moved, seconds of the slowest member) into the migration fit."""
        return replace(self, migration=self.migration.observe(1.0, n_bytes, seconds))

    def switch_s(self) -> float:
        """Fitted time of an epoch switch that moves nothing (forming the new group)."""
        return self.migration.coef[0]

    def move_s(self, n_bytes: float) -> float:
        """Fitted extra time of moving `n_bytes` of state in an epoch switch."""
        return self.migration.coef[1] * n_bytes

    # --- classes ---------------------------------------------------------------------------------

    def classes(self, speeds: Mapping[str, float], caps: Mapping[str, float | None],
                names: Iterable[str] | None = None) -> list[tuple[str, list[str]]]:
        """Devices grouped into classes: same kind and memory cap (samples per device), speeds within
        SPEED_TOLERANCE of the class's slowest. Returns (class name, members fastest first), classes
        in order of their first member's name."""
        chosen = sorted(self.devices if names is None else names)
        groups: dict[tuple[str, float], list[str]] = {}
        for n in chosen:
            cap = caps.get(n)
            groups.setdefault((self.devices[n].device_kind, -1.0 if cap is None else cap), []).append(n)
        out: list[tuple[str, list[str]]] = []
        for (kind, _), members in groups.items():
            members.sort(key=lambda n: (speeds[n], n))
            current: list[str] = []
            for n in members:
                if current and speeds[n] > (1 + SPEED_TOLERANCE) * speeds[current[0]]:
                    out.append((f"{kind}:{current[0]}", sorted(current, key=lambda m: (-speeds[m], m))))
                    current = []
                current.append(n)
            if current:
                out.append((f"{kind}:{current[0]}", sorted(current, key=lambda m: (-speeds[m], m))))
        return sorted(out, key=lambda c: min(c[1]))


SHARE_SPREAD = 1.5  # share sizes this far apart can tell the fixed part from the per-sample part
MAX_SPEED = 1e12  # samples/s: a compute time that does not grow with the share at all


def fit_compute(window: tuple[tuple[int, float], ...], fixed_before: float) -> tuple[float, float]:
    """(fixed seconds, seconds per sample) of compute from recent (samples, seconds) observations.
    Once the window holds share sizes at least SHARE_SPREAD apart, seen twice each: a non-negative
    least-squares line through each size's median (medians, not every point: one slow step must
    not tilt the line), weighted by how often each was seen, when both its parts are positive.
    (Sizes closer together than that give a slope that noise decides, and a plan that extrapolates
    it far.) Else the previous fixed part, and the rest per sample, of the newest size's steps
    where no such line exists, of all steps where the sizes are too close."""
    groups: dict[int, list[float]] = {}
    for n, t in window:
        groups.setdefault(n, []).append(t)
    seen = {n: ts for n, ts in groups.items() if len(ts) >= 2}
    if len(seen) >= 2 and max(seen) >= SHARE_SPREAD * min(seen):
        obs = tuple(Observation(1.0, float(n), statistics.median(ts)) for n, ts in seen.items() for _ in ts)
        fixed, per_sample = fit_two_terms(obs, (0.0, 0.0))
        if fixed > 0 and per_sample > 0:
            return fixed, per_sample
        # A part clipped at 0: no line with a fixed part and a speed goes through the sizes. The
        # device changed speed between them (a change not found as one: a re-plan for another
        # member came first), or noise hides the slope; its newest size's steps say what it does
        # now. (The line itself could fall: more samples in less time, an infinite speed.)
        window = tuple(x for x in window if x[0] == window[-1][0])
    fixed = min(fixed_before, min(t for _, t in window))
    per_sample = statistics.median((t - fixed) / n for n, t in window)
    return fixed, max(per_sample, 1.0 / MAX_SPEED)


def _learn_gamma(loads: tuple[tuple[float, float], ...]) -> float | None:
    """The contention exponent from (load, per-sample seconds) at the two most distant loads seen
    at least LOAD_MIN_OBS times each: log(time ratio) / log(load ratio), loads floored at 1 (below
    one thread per core nothing contends). None until two such loads exist."""
    by_load: dict[float, list[float]] = {}
    for load, t in loads:
        by_load.setdefault(round(max(load, 1.0), 3), []).append(t)
    seen = sorted(load for load, ts in by_load.items() if len(ts) >= LOAD_MIN_OBS)
    if len(seen) < 2 or seen[-1] / seen[0] < 1.2:
        return None
    lo, hi = seen[0], seen[-1]
    ratio = statistics.median(by_load[hi]) / statistics.median(by_load[lo])
    return min(GAMMA_MAX, max(0.0, math.log(max(ratio, 1e-9)) / math.log(hi / lo)))
