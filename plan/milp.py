"""The MILP planner for data parallelism over device classes.

A binary per (sample, device) does not scale (DESIGN.md), so the model works on device *classes*:
devices of one kind and speed, of which `available` can take part. For each class c and each
possible count k in 0..available_c a binary y[c,k] says "k devices of c train" (exactly one k per
class), and x[c,k] ≥ 0 is the total samples those k devices take (0 unless y[c,k] = 1). Then

    x[c,k] ≤ k · speed_c · T                   T is the compute makespan (linear: k is a constant)
    x[c,k] ≤ min(B, k · max_samples_c) · y[c,k]     memory cap per device, and the y link
    Σ x = B                                    the whole global batch is trained
    R = Σ k · y[c,k] = Σ_r r · z[r],  Σ z = 1  the ring size, selected by binaries z[r]

    minimise  T + Σ_r allreduce(r) · z[r] + migration_s · Σ y[c,k] · max(0, k − previous_c) / horizon

This disaggregated form needs no bilinear term and no big-M on T; classes are few, so the
y[c,k] and z[r] are about twice the number of devices. The all-reduce cost grows with R, so a
class slow enough that adding it costs more in communication than it saves in compute is left
out (count 0), which is a legal answer.

The continuous per-device shares are rounded to integers summing to B (each device first gets the
floor of its share, the rest go one by one to whichever device would finish earliest), and the
reported `predicted_step_s` is that of the rounded plan. `status` is honest: "optimal" only when
the solver proved it (within MIP_GAP), "time-limited" when it stopped at the time limit
with a feasible solution, "fallback" when it found none (the previous counts, else every usable
device, with balanced shares), "infeasible" when no plan fits in memory.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulp

from plan.cost import Link, allreduce_s, static_bytes
from plan.graph import Graph

# "optimal" means proved within this relative gap of the best bound: a tenth of a percent of
# step time is below what the cost model can predict, and a tighter gap costs seconds at 1000
# devices.
MIP_GAP = 1e-3


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
        free = memory_bytes - self.static_bytes
        if free < 0:
            return None
        if self.activation_bytes_per_sample <= 0 or math.isinf(free):
            return math.inf
        return float(math.floor(free / self.activation_bytes_per_sample))


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
) -> MilpResult:
    """Choose how many devices of each class train and their shares of `global_batch`.

    `costs` may be a `Graph` (then `link` is required). A device added beyond `previous_counts`
    costs `migration_s_per_device` once, spread over `horizon_steps` steps.
    """
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
    B = global_batch
    caps = {c.name: costs.max_samples(c.memory_bytes) for c in classes}
    usable = [c for c in classes if c.available > 0 and (caps[c.name] or 0) >= 1]
    zero = {c.name: 0 for c in classes}
    capacity = sum(c.available * min(float(B), caps[c.name] or 0.0) for c in usable)
    if capacity < B:
        return MilpResult(
            counts=zero, shares={c.name: () for c in classes}, continuous_shares={c.name: 0.0 for c in classes},
            predicted_step_s=None, comm_s=None, objective_s=None, status="infeasible",
            reason=_infeasible_reason(classes, caps, costs, B, capacity),
        )
    cap = {c.name: min(float(B), caps[c.name] or 0.0) for c in usable}
    prev = dict(previous_counts or {})
    mig = migration_s_per_device / horizon_steps if previous_counts is not None else 0.0

    # An upper bound on the optimal makespan, from the plan with every usable device.
    greedy_obj, greedy_counts = _greedy_bound(usable, cap, costs, B, prev, mig)
    t_max = greedy_obj * 1.001 + 1e-9
    # The all-reduce latency alone, 2α(R−1), must stay under that bound: it caps the ring size,
    # which shrinks the model a lot when α is large.
    n_max = sum(c.available for c in usable)
    alpha = costs.link.alpha_s
    if alpha > 0:
        n_max = max(1, min(n_max, math.floor(1 + t_max / (2 * alpha))))
    prob = pulp.LpProblem("dp_plan", pulp.LpMinimize)
    T = prob.add_variable("T", lowBound=0, upBound=t_max)
    y: dict[tuple[int, int], pulp.LpVariable] = {}
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    for i, c in enumerate(usable):
        t_parts = []
        for k in range(min(c.available, n_max) + 1):
            y[i, k] = prob.add_variable(f"y_{i}_{k}", cat=pulp.LpBinary)
            if k:
                # t = T when y[i,k] = 1, else 0 (the disjunctive hull: a much tighter relaxation
                # than x <= k·speed·T alone)
                t = prob.add_variable(f"t_{i}_{k}", lowBound=0)
                t_parts.append(t)
                prob += t <= t_max * y[i, k]
                x[i, k] = prob.add_variable(f"x_{i}_{k}", lowBound=0)
                prob += x[i, k] <= min(float(B), k * cap[c.name]) * y[i, k]
                prob += x[i, k] <= k * c.samples_per_s * t
        prob += pulp.lpSum(y[i, k] for k in range(min(c.available, n_max) + 1)) == 1
        prob += pulp.lpSum(t_parts) <= T
    prob += pulp.lpSum(x.values()) == B
    z = {r: prob.add_variable(f"z_{r}", cat=pulp.LpBinary) for r in range(1, n_max + 1)}
    prob += pulp.lpSum(z.values()) == 1
    prob += pulp.lpSum(r * v for r, v in z.items()) == pulp.lpSum(k * v for (_, k), v in y.items())
    comm = pulp.lpSum(allreduce_s(costs.allreduce_bytes, r, costs.link) * v for r, v in z.items())
    moved = pulp.lpSum(max(0, k - prev.get(usable[i].name, 0)) * v for (i, k), v in y.items())
    prob += T + comm + mig * moved

    solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=MIP_GAP)
    if not solver.available():
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=MIP_GAP)
    try:
        prob.solve(solver)
        sol_status = prob.sol_status
    except pulp.PulpSolverError as exc:  # a broken solver install must not stop the planner
        sol_status, why = pulp.LpSolutionNoSolutionFound, f"solver error: {exc}"
    else:
        why = f"solver: {pulp.LpStatus[prob.status]}, no integer solution"

    if sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        counts = {c.name: 0 for c in classes}
        for (i, k), v in y.items():
            if (v.varValue or 0) > 0.5:
                counts[usable[i].name] = k
        status = "optimal" if sol_status == pulp.LpSolutionOptimal else "time-limited"
        reason = f"proved optimal within {MIP_GAP:.1%}" if status == "optimal" else f"stopped at the {time_limit_s:g} s limit"
    else:
        counts, which = _fallback_counts(classes, usable, cap, prev if previous_counts is not None else None, B)
        status, reason = "fallback", f"{why}; using {which}"
    result = _finish(classes, counts, cap, costs, B, prev, mig, status, reason)
    if result is None:  # the solver's counts cannot hold B (numerical trouble): use every device
        counts, _ = _fallback_counts(classes, usable, cap, None, B)
        result = _finish(classes, counts, cap, costs, B, prev, mig, "fallback",
                         f"{reason}, but its counts do not hold the batch; using every usable device")
    assert result is not None
    if status == "time-limited":  # an early incumbent can be worse than the fastest-first plan
        greedy = _finish(classes, {c.name: greedy_counts.get(c.name, 0) for c in classes}, cap, costs, B,
                         prev, mig, status, f"{reason}; the fastest-first plan beat the incumbent")
        if greedy is not None and (greedy.objective_s or 0) < (result.objective_s or math.inf):
            result = greedy
    return result


def _greedy_bound(
    usable: Sequence[DeviceClass], cap: Mapping[str, float], costs: DpCosts, B: int,
    prev: Mapping[str, int], mig: float,
) -> tuple[float, dict[str, int]]:
    """The best objective (and counts) among plans that take the r fastest devices, for every r: a cheap
    feasible upper bound that keeps the MILP's t_max and ring size small."""
    speeds = {c.name: c.samples_per_s for c in usable}
    counts = dict.fromkeys(speeds, 0)
    best, best_counts = math.inf, dict(counts)
    for c in sorted(usable, key=lambda c: -c.samples_per_s):
        for _ in range(c.available):
            counts[c.name] += 1
            balanced = balance(counts, speeds, cap, B)
            if balanced is None:
                continue
            moved = sum(max(0, n - prev.get(k, 0)) for k, n in counts.items())
            ranks = sum(counts.values())
            obj = balanced[0] + allreduce_s(costs.allreduce_bytes, ranks, costs.link) + mig * moved
            if obj < best:
                best, best_counts = obj, dict(counts)
    return best, best_counts


def _infeasible_reason(
    classes: Sequence[DeviceClass], caps: Mapping[str, float | None], costs: DpCosts, B: int, capacity: float
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
    return f"global batch {B} does not fit in memory; {fits} ({'; '.join(parts)})"


def _fallback_counts(
    classes: Sequence[DeviceClass], usable: Sequence[DeviceClass], cap: Mapping[str, float],
    prev: Mapping[str, int] | None, B: int,
) -> tuple[dict[str, int], str]:
    """The previous counts less what is gone, if they still hold the batch; else every device."""
    if prev is not None:
        counts = {c.name: min(prev.get(c.name, 0), c.available) if c in usable else 0 for c in classes}
        if sum(counts[c.name] * cap[c.name] for c in usable) >= B:
            return counts, "the previous counts"
    return {c.name: c.available if c in usable else 0 for c in classes}, "every usable device"


def balance(
    counts: Mapping[str, int], speeds: Mapping[str, float], caps: Mapping[str, float], B: float
) -> tuple[float, dict[str, float]] | None:
    """Continuous shares minimising the compute makespan for fixed counts (water-filling):
    returns (makespan, samples per device of each class), or None if the caps cannot hold B."""
    used = [c for c, n in counts.items() if n > 0]
    order = sorted(used, key=lambda c: caps[c] / speeds[c])
    rate = sum(counts[c] * speeds[c] for c in used)
    capped = 0.0
    per_device = dict.fromkeys(counts, 0.0)
    for j, c in enumerate(order):
        t = (B - capped) / rate
        if t <= caps[c] / speeds[c]:
            for d in order[j:]:
                per_device[d] = speeds[d] * t
            for d in order[:j]:
                per_device[d] = caps[d]
            return max([t, *(caps[d] / speeds[d] for d in order[:j])]), per_device
        capped += counts[c] * caps[c]
        rate -= counts[c] * speeds[c]
    return None


def round_shares(
    counts: Mapping[str, int], speeds: Mapping[str, float], caps: Mapping[str, float],
    per_device: Mapping[str, float], B: int,
) -> dict[str, tuple[int, ...]]:
    """Integer shares summing to B: floors first, then one sample at a time to the device that
    would finish earliest with it (within its memory cap)."""
    shares = {c: [math.floor(per_device[c] + 1e-9)] * n for c, n in counts.items()}
    left = B - sum(sum(s) for s in shares.values())
    while left < 0:  # floating-point slack rounded a share up: take back from the slowest finisher
        c, i = max(((c, i) for c, ss in shares.items() for i, s in enumerate(ss) if s > 0),
                   key=lambda ci: shares[ci[0]][ci[1]] / speeds[ci[0]])
        shares[c][i] -= 1
        left += 1
    heap = [((s + 1) / speeds[c], c, i) for c, ss in shares.items() for i, s in enumerate(ss) if s + 1 <= caps[c]]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, c, i = heapq.heappop(heap)
        shares[c][i] += 1
        left -= 1
        if shares[c][i] + 1 <= caps[c]:
            heapq.heappush(heap, ((shares[c][i] + 1) / speeds[c], c, i))
    assert left == 0, "rounding ran out of room under the memory caps"
    return {c: tuple(sorted(ss, reverse=True)) for c, ss in shares.items()}


def _finish(
    classes: Sequence[DeviceClass], counts: dict[str, int], cap: Mapping[str, float], costs: DpCosts,
    B: int, prev: Mapping[str, int], mig: float, status: str, reason: str,
) -> MilpResult | None:
    speeds = {c.name: c.samples_per_s for c in classes}
    caps = {c.name: cap.get(c.name, 0.0) for c in classes}
    balanced = balance(counts, speeds, caps, B)
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
        status=status, reason=f"{reason}; {ranks} devices ({used}), moved {moved}",
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
