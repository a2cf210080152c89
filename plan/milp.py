"""The planner for data parallelism over device classes: who trains, and each one's share.

A binary per (sample, device) does not scale (HiGHS needs seconds to prove even a 16 × 8 placement
optimal), so the model works on device *classes*: devices of one kind and speed, of which
`available` can take part. A plan takes k_c ≤ available_c
devices of each class c (Σ k_c ≤ max_devices) and gives each an integer share of the global batch
B: at least one sample (a device with none only lengthens the ring), at most what fits in memory.

    step       = max over taking-part devices of share / speed  +  allreduce(R),   R = Σ k_c
    objective  = step + migration_s · (devices beyond previous_counts) / horizon_steps

The normal path is an exact search (plan/_dp_search.py). One ring: the all-reduce depends only on
R and the migration only on N, how many of the R are newcomers. For a pair (R, N) the best devices
are the R − N kept and N new ones holding the most at the makespan, which piecewise-linear tables
give; all pairs are bounded with continuous shares, then checked in integer shares in order of that
bound until it proves the rest no better within MIP_GAP. At 1,024 devices: up to ~260k pairs, tens
of milliseconds (scripts/bench_planner_solve.py).

Why not the MILP first: a MILP with one-hot counts y[c,k] and ring size z[r] (ring sizes pruned by
these bounds, a cut T ≥ bound(r), HiGHS) hits a 1 s limit in most scenarios from 256 devices up
(the same bench, `--engine milp`): many ring sizes lie within 0.1% of each other and branch and
bound cannot separate them. That MILP (plan/_milp_model.py, exact in integer shares, CBC if HiGHS is
missing) runs only when the search would enumerate more than _MAX_PAIRS pairs.

The reported shares are rounded from balanced continuous ones (floors first, then one sample at a
time to whichever device would finish earliest), the least integer makespan for those counts;
`predicted_step_s` is that of the rounded plan. `status` is honest: "optimal" only when proved
within MIP_GAP in integer shares; "time-limited" when the search's work budget (sized from
`time_limit_s`, no clock is read) or the MILP's time limit ran out with a feasible plan; "fallback"
when the MILP found none (the previous counts, else the usable devices, with balanced shares);
"infeasible" when no plan fits in memory (within max_devices).

The numeric backends (numpy for the search, PuLP and HiGHS for the MILP: a quarter of a second to
import) are loaded by the first solve, not with this module: a restarted coordinator must listen
within a second, and it plans only once its members are back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plan.cost import Link, allreduce_s, samples_that_fit, static_bytes
from plan.graph import Graph
from plan.shares import round_to_total

if TYPE_CHECKING:
    from plan._dp_search import Floats, Ints

# "optimal" means proved within this relative gap of the best bound: a tenth of a percent of
# step time is below what the cost model can predict.
MIP_GAP = 1e-3
# Above this many (ring size, newcomers) pairs the search would need too much memory (~100 bytes
# a pair) and time (~0.25 µs a pair, before the integer checks): the MILP takes over.
_MAX_PAIRS = 1_000_000
# Integer-share checks of the search per second of `time_limit_s`: about 180k/s on one core (chunks
# of 4096), assumed ~half that. The budget is work, not a clock: the planner stays pure.
_CHECKS_PER_S = 100_000
ENGINES = ("auto", "search", "milp")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceClass:
    """`available` interchangeable devices, each of `samples_per_s` compute throughput."""

    name: str
    available: int
    samples_per_s: float
    memory_bytes: float = math.inf

    def __post_init__(self) -> None:
        if self.available < 0:
            raise ValueError(f"class {self.name}: available must be >= 0, got {self.available}")
        if self.samples_per_s <= 0:
            raise ValueError(f"class {self.name}: samples_per_s must be positive, got {self.samples_per_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DpCosts:
    """What the data-parallel planner needs of the model: the gradient bytes all-reduced each
    step, memory that does not depend on the batch, activation bytes per sample, and the link."""

    allreduce_bytes: float
    static_bytes: float
    activation_bytes_per_sample: float
    link: Link

    @staticmethod
    def from_graph(graph: Graph, link: Link, *, optimizer_state_factor: float = 2.0) -> DpCosts:
        return DpCosts(
            allreduce_bytes=graph.param_bytes,
            static_bytes=static_bytes(graph.param_bytes, optimizer_state_factor),
            activation_bytes_per_sample=graph.activation_bytes,
            link=link,
        )

    def max_samples(self, memory_bytes: float) -> float | None:
        """Most samples per device in `memory_bytes` (inf if unbounded); None if nothing fits."""
        return samples_that_fit(memory_bytes, self.static_bytes, self.activation_bytes_per_sample)


@dataclass(frozen=True, slots=True, kw_only=True)
class MilpResult:
    counts: dict[str, int]
    shares: dict[str, tuple[int, ...]]  # per class: each device's samples (sum over all = B)
    continuous_shares: dict[str, float]  # per class: samples per device before rounding
    predicted_step_s: float | None  # compute makespan + all-reduce, of the rounded shares
    comm_s: float | None
    objective_s: float | None  # predicted step + amortised migration
    status: str  # "optimal" | "time-limited" | "fallback" | "infeasible"
    reason: str
    lower_bound_s: float | None = None  # proved: no plan has a smaller objective


def solve_dp(
    classes: Sequence[DeviceClass],
    costs: DpCosts | Graph,
    global_batch: int,
    *,
    time_limit_s: float = 1.0,
    link: Link | None = None,
    previous_counts: Mapping[str, int] | None = None,
    migration_s_per_device: float = 0.0,
    horizon_steps: int = 100,
    optimizer_state_factor: float = 2.0,
    max_devices: int | None = None,
    engine: str = "auto",
) -> MilpResult:
    """Choose how many devices of each class train and their shares of `global_batch`.

    `costs` may be a `Graph` (then `link` is required). A device added beyond `previous_counts`
    costs `migration_s_per_device` once, spread over `horizon_steps` steps. At most `max_devices`
    devices in all take part (None: no limit). `engine`: "search" (the exact search), "milp" (the
    PuLP model on HiGHS), or "auto" (the search, the MILP above _MAX_PAIRS pairs).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if isinstance(costs, Graph):
        if link is None:
            raise ValueError("solve_dp: a Graph needs a link")
        costs = DpCosts.from_graph(costs, link, optimizer_state_factor=optimizer_state_factor)
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    if len({c.name for c in classes}) != len(classes):
        raise ValueError("class names must be unique")
    if horizon_steps < 1:
        raise ValueError(f"horizon_steps must be >= 1, got {horizon_steps}")
    if max_devices is not None and max_devices < 1:
        raise ValueError(f"max_devices must be >= 1 (or None for no limit), got {max_devices}")
    B = global_batch
    caps = {c.name: costs.max_samples(c.memory_bytes) for c in classes}
    usable = [c for c in classes if c.available > 0 and (caps[c.name] or 0) >= 1]
    cap = {c.name: min(float(B), caps[c.name] or 0.0) for c in usable}
    limit = min(sum(c.available for c in usable), B, max_devices or B)
    capacity = sum(n * cap[k] for k, n in _most_capacity(usable, cap, limit).items())
    if capacity < B:
        return MilpResult(
            counts={c.name: 0 for c in classes}, shares={c.name: () for c in classes},
            continuous_shares={c.name: 0.0 for c in classes}, predicted_step_s=None, comm_s=None,
            objective_s=None, status="infeasible",
            reason=_infeasible_reason(classes, caps, costs, B, capacity, max_devices),
        )
    import numpy as np  # (loaded by the first solve: see the module's comment)

    from plan._dp_search import candidate_pairs, search

    prev = dict(previous_counts or {})
    mig = migration_s_per_device / horizon_steps if previous_counts is not None else 0.0
    speeds = np.array([c.samples_per_s for c in usable])
    cap_arr = np.array([cap[c.name] for c in usable])
    avail = np.array([c.available for c in usable], dtype=np.int64)
    kept = np.minimum(np.array([max(0, prev.get(c.name, 0)) for c in usable], dtype=np.int64), avail)
    comm = np.array([allreduce_s(costs.allreduce_bytes, r, costs.link) for r in range(limit + 1)])
    pool = kept if mig > 0 else avail  # without a migration cost every device is free to take
    lower: float | None = None
    j, n = candidate_pairs(speeds, cap_arr, pool, avail - pool, B, comm, mig, limit)
    if engine == "search" or (engine == "auto" and len(j) <= _MAX_PAIRS):
        found = search(speeds, cap_arr, pool, avail - pool, B, comm, mig, j, n, gap=MIP_GAP,
                       budget=max(1_000, int(time_limit_s * _CHECKS_PER_S)))
        assert found is not None, "the capacity check said the batch fits"
        counts = {c.name: 0 for c in classes} | {c.name: k for c, k in zip(usable, found.counts)}
        lower = found.lower_bound_s
        how = f"{found.num_pairs} (ring size, newcomers) pairs, {found.num_checked} checked in integer shares"
        status, reason = (("optimal", f"proved optimal within {MIP_GAP:.1%} over {how}") if found.complete else
                          ("time-limited", f"stopped at the work budget for the {time_limit_s:g} s limit; {how}"))
    else:
        counts, status, reason, lower = _solve_by_milp(classes, usable, cap, costs, B, prev, mig, kept, comm,
                                                       limit, time_limit_s, previous_counts is not None, speeds)
    result = _finish(classes, counts, cap, costs, B, prev, mig, status, reason, lower)
    if result is None:  # the solver's counts cannot hold B (numerical trouble): use the most capacity
        counts = {c.name: 0 for c in classes} | _most_capacity(usable, cap, limit)
        result = _finish(classes, counts, cap, costs, B, prev, mig, "fallback",
                         f"{reason}, but its counts do not hold the batch; using the devices with the most capacity")
    assert result is not None
    return result


def _solve_by_milp(
    classes: Sequence[DeviceClass], usable: Sequence[DeviceClass], cap: Mapping[str, float], costs: DpCosts,
    B: int, prev: Mapping[str, int], mig: float, kept: Ints, comm: Floats, limit: int,
    time_limit_s: float, has_previous: bool, speeds: Floats,
) -> tuple[dict[str, int], str, str, float]:
    """The MILP over ring sizes pruned by their lower bounds (the least of which it returns too);
    the fastest-first plan bounds it."""
    import numpy as np

    from plan._dp_search import continuous_makespans
    from plan._milp_model import solve_milp

    zero = {c.name: 0 for c in classes}
    greedy = _finish(classes, zero | _greedy_bound(usable, cap, B, comm, prev, mig, limit), cap, costs, B,
                     prev, mig, "", "")
    assert greedy is not None and greedy.objective_s is not None
    caps, avail, ranks = [cap[c.name] for c in usable], [c.available for c in usable], np.arange(1, limit + 1)
    ring, _ = continuous_makespans(speeds, np.array(caps), np.array(avail), np.zeros(len(avail), dtype=np.int64),
                                   B, ranks, np.zeros_like(ranks))
    bound = ring + comm[1:] + mig * np.maximum(0, ranks - int(kept.sum()))
    sizes = [int(r) for r in ranks[bound <= greedy.objective_s * (1 + 1e-9)]]
    lower = min(float(bound.min()), greedy.objective_s)
    counts, proved, why = solve_milp(
        list(speeds), caps, avail, [int(k) for k in kept], B, {r: float(comm[r]) for r in sizes},
        {r: float(ring[r - 1]) for r in sizes}, mig, t_max=greedy.objective_s * (1 + 1e-6),
        time_limit_s=time_limit_s, gap=MIP_GAP)
    if counts is None:
        fallback, which = _fallback_counts(classes, usable, cap, prev if has_previous else None, B, limit)
        return fallback, "fallback", f"{why}; using {which}", lower
    found = zero | {c.name: k for c, k in zip(usable, counts)}
    if proved:
        return found, "optimal", f"MILP over {len(sizes)} ring sizes: proved optimal within {MIP_GAP:.1%}", lower
    mine = _finish(classes, found, cap, costs, B, prev, mig, "", "")
    reason = f"MILP over {len(sizes)} ring sizes: stopped at the {time_limit_s:g} s limit"
    if mine is None or (mine.objective_s or math.inf) > greedy.objective_s:
        return greedy.counts, "time-limited", f"{reason}; the fastest-first plan beat the incumbent", lower
    return found, "time-limited", reason, lower


def _most_capacity(usable: Sequence[DeviceClass], cap: Mapping[str, float], limit: int) -> dict[str, int]:
    """Counts of the `limit` devices that hold the most samples (ties: the faster)."""
    counts, left = {}, limit
    for c in sorted(usable, key=lambda c: (-cap[c.name], -c.samples_per_s)):
        counts[c.name] = min(left, c.available)
        left -= counts[c.name]
    return counts


def _greedy_bound(
    usable: Sequence[DeviceClass], cap: Mapping[str, float], B: int, comm: Floats,
    prev: Mapping[str, int], mig: float, limit: int,
) -> dict[str, int]:
    """The counts of the best plan (continuous shares) among those that take the r fastest devices,
    r ≤ limit: a cheap feasible plan that bounds the MILP's makespan and ring sizes."""
    speeds = {c.name: c.samples_per_s for c in usable}
    counts = dict.fromkeys(speeds, 0)
    best, best_counts = math.inf, _most_capacity(usable, cap, limit)
    ranks = 0
    for c in sorted(usable, key=lambda c: -c.samples_per_s):
        for _ in range(c.available):
            if ranks == limit:
                return best_counts
            counts[c.name] += 1
            ranks += 1
            balanced = balance(counts, speeds, cap, B, min_share=1.0)
            if balanced is None:
                continue
            moved = sum(max(0, n - prev.get(k, 0)) for k, n in counts.items())
            obj = balanced[0] + comm[ranks] + mig * moved
            if obj < best:
                best, best_counts = obj, dict(counts)
    return best_counts


def _infeasible_reason(
    classes: Sequence[DeviceClass], caps: Mapping[str, float | None], costs: DpCosts, B: int, capacity: float,
    max_devices: int | None,
) -> str:
    parts = []
    for c in classes:
        cap = caps[c.name]
        if c.available == 0:
            parts.append(f"{c.name}: none available")
        elif cap is None:
            parts.append(f"{c.name}: {c.memory_bytes:.0f} B per device cannot hold parameters, gradients "
                         f"and optimizer state ({costs.static_bytes:.0f} B)")
        elif cap < 1:
            parts.append(f"{c.name}: not even one sample's activations fit")
        else:
            cap_s = "unbounded" if math.isinf(cap) else f"{cap:.0f}"
            parts.append(f"{c.name}: {c.available} devices x {cap_s} samples")
    fits = f"a global batch of at most {capacity:.0f} would fit" if capacity >= 1 else "no global batch fits"
    if max_devices is not None:
        fits += f" on at most {max_devices} devices (max_devices)"
    return f"global batch {B} does not fit in memory; {fits} ({'; '.join(parts)})"


def _fallback_counts(
    classes: Sequence[DeviceClass], usable: Sequence[DeviceClass], cap: Mapping[str, float],
    prev: Mapping[str, int] | None, B: int, limit: int,
) -> tuple[dict[str, int], str]:
    """The previous counts less what is gone, if they still hold the batch within `limit` devices;
    else every usable device if that is within the limit, else the devices with the most capacity."""
    zero = {c.name: 0 for c in classes}
    if prev is not None:
        counts = {c.name: max(0, min(prev.get(c.name, 0), c.available)) for c in usable}
        if sum(counts[k] * cap[k] for k in counts) >= B and 0 < sum(counts.values()) <= limit:
            return zero | counts, "the previous counts"
    if sum(c.available for c in usable) <= limit:
        return zero | {c.name: c.available for c in usable}, "every usable device"
    return zero | _most_capacity(usable, cap, limit), f"the {limit} devices with the most capacity"


def balance(
    counts: Mapping[str, int], speeds: Mapping[str, float], caps: Mapping[str, float], B: float,
    *, min_share: float = 0.0,
) -> tuple[float, dict[str, float]] | None:
    """Continuous shares minimising the compute makespan for fixed counts (water-filling), each
    device's share within [min_share, cap]: returns (makespan, samples per device of each class),
    or None if the caps cannot hold B or the minimum shares exceed it."""
    used = [c for c, n in counts.items() if n > 0]
    low = {c: min(min_share, caps[c]) for c in used}

    def share(c: str, t: float) -> float:  # compared as the kinks are, so a cap is met exactly
        return caps[c] if t >= caps[c] / speeds[c] else low[c] if t <= low[c] / speeds[c] else speeds[c] * t

    def total(t: float) -> float:
        return sum(counts[c] * share(c, t) for c in used)

    if sum(counts[c] * caps[c] for c in used) < B or sum(counts[c] * low[c] for c in used) > B:
        return None
    # total(t) is piecewise linear and nondecreasing, with kinks where a class meets a bound
    kinks = sorted({x / speeds[c] for c in used for x in (low[c], caps[c]) if math.isfinite(x)})
    t, held = 0.0, total(0.0)
    for k in kinks + [math.inf]:
        if held >= B:
            break
        at_k = total(k) if math.isfinite(k) else math.inf
        if at_k >= B:
            mid = (t + k) / 2 if math.isfinite(k) else t + 1.0
            slope = sum(counts[c] * speeds[c] for c in used if low[c] < speeds[c] * mid < caps[c])
            t, held = t + (B - held) / slope, B
            break
        t, held = k, at_k
    per_device = dict.fromkeys(counts, 0.0)
    for c in used:
        per_device[c] = share(c, t)
    return max(per_device[c] / speeds[c] for c in used), per_device


def round_shares(
    counts: Mapping[str, int], speeds: Mapping[str, float], caps: Mapping[str, float],
    per_device: Mapping[str, float], B: int,
) -> dict[str, tuple[int, ...]]:
    """Integer shares summing to B (`plan.shares.round_to_total` over every device, classes in
    name order), each device keeping at least one sample where it can."""
    order = sorted(c for c, n in counts.items() for _ in range(n))
    rounded = round_to_total([per_device[c] for c in order], [speeds[c] for c in order], [0.0] * len(order),
                             [caps[c] for c in order], B, min_share=1)
    assert rounded is not None, "rounding ran out of room under the memory caps"
    shares: dict[str, list[int]] = {c: [] for c in counts}
    for c, s in zip(order, rounded):
        shares[c].append(s)
    return {c: tuple(sorted(ss, reverse=True)) for c, ss in shares.items()}


def _finish(
    classes: Sequence[DeviceClass], counts: dict[str, int], cap: Mapping[str, float], costs: DpCosts,
    B: int, prev: Mapping[str, int], mig: float, status: str, reason: str, lower: float | None = None,
) -> MilpResult | None:
    speeds = {c.name: c.samples_per_s for c in classes}
    caps = {c.name: cap.get(c.name, 0.0) for c in classes}
    balanced = balance(counts, speeds, caps, B, min_share=1.0)
    if balanced is None:
        return None
    _, per_device = balanced
    shares = round_shares(counts, speeds, caps, per_device, B)
    compute = max((ss[0] / speeds[c] for c, ss in shares.items() if ss), default=0.0)
    ranks = sum(counts.values())
    comm = allreduce_s(costs.allreduce_bytes, ranks, costs.link)
    moved = sum(max(0, n - prev.get(c, 0)) for c, n in counts.items())
    used = ", ".join(f"{c}={n}" for c, n in counts.items())
    return MilpResult(
        counts=counts, shares=shares, continuous_shares=per_device,
        predicted_step_s=compute + comm, comm_s=comm, objective_s=compute + comm + mig * moved,
        status=status, reason=f"{reason}; {ranks} devices ({used}), moved {moved}", lower_bound_s=lower,
    )


def map_to_devices(
    counts: Mapping[str, int], members: Mapping[str, Sequence[str]], previous_members: Sequence[str]
) -> list[str]:
    """Concrete devices for class counts, moving the least state: in each class, devices of the
    previous plan are kept first (in their previous rank order), newcomers are taken in the order
    `members` lists them. The result puts kept devices in their previous order, then newcomers."""
    previous_rank = {name: i for i, name in enumerate(previous_members)}
    kept: list[str] = []
    new: list[str] = []
    for cls, n in counts.items():
        pool = members.get(cls, ())
        if n > len(pool):
            raise ValueError(f"class {cls}: {n} devices asked, {len(pool)} known")
        old = sorted((d for d in pool if d in previous_rank), key=previous_rank.__getitem__)
        fresh = [d for d in pool if d not in previous_rank]
        chosen = (old + fresh)[:n]
        kept += [d for d in chosen if d in previous_rank]
        new += [d for d in chosen if d not in previous_rank]
    return sorted(kept, key=previous_rank.__getitem__) + new
