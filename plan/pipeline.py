"""The pipeline axis, as the planner sees it: where to cut the model's units into stages for a given
row of (possibly unlike) devices, how many micro-batches, and what such a step costs. Pure.

A stage is a contiguous run of the graph's units (`Graph.layers`, in forward order). A device's
measured speed is for the whole model (samples/s of forward + backward); a stage's share of it is
its units' share of the model's FLOPs, so stage s on a device of speed v and fixed cost c per pass
(kernel launches, Python: what makes small-model pipelines overhead-bound) computes a micro-batch of
b samples in F_s / F · (b / v + c): its units' share of the device's whole-model pass. Boundaries
send the boundary tensor forward and its gradient back, point to point.

**The step.** With m micro-batches and stage times t_s (compute plus the sends on its boundaries),
a 1F1B (or GPipe) step takes the first micro-batch's way through every stage and then the slowest
stage's pace for the rest:

    step = Σ_s t_s + (m − 1) · max_s t_s

For equal stages that is (m + p − 1) · t, the familiar bubble (p − 1) / (m + p − 1). Micro-batches
of two sizes (the batch need not divide): the smaller ones pass at the pace of their own stage times.

**The cuts** (`cut_stages`). For a fixed order of devices, the cuts that minimise the slowest stage
are found exactly by dynamic programming over (stages used, units placed): O(p · n²) for n units,
ties broken by the smaller sum; a stage whose units' state and in-flight activations do not fit its
device's memory is never formed (1F1B keeps up to p − s micro-batches' activations on stage s).
Uneven cuts fall out of it: a slow or small device gets fewer units. `best_pipeline` tries every
distinct order of the devices' classes (a slow device first or last changes which units it gets)
and every micro-batch count, and keeps the fastest prediction; a count whose floor (`step_floor`:
what no order or cut of these devices can beat) is no faster than a pipeline found is not cut.

**Micro-batches** (`micro_split`). A plan carries only each stage's largest micro-batch size b; the
worker runs a share of n samples as ceil(n / b) micro-batches of sizes differing by at most one. Not
every count c comes back from its size (16 samples in 7: b = 3, and 3 gives 6), so the planner tries
counts as the worker would run them, and predicts exactly the micro-batches that run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from plan.cost import Link, p2p_s, static_bytes
from plan.graph import Graph

MAX_ORDERS = 24  # distinct device orders tried (4 unlike devices: all of them)
MICRO_PER_STAGE = 8  # micro-batch counts tried reach this many per stage (past it the bubble is small)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageDevice:
    """One device that may hold a stage: its measured whole-model speed, its memory and its fixed
    compute cost per micro-batch."""

    name: str
    samples_per_s: float
    memory_bytes: float = math.inf
    fixed_s: float = 0.0
    state_fraction: float = 1.0  # of its stage's state it holds (FSDP over s members with copies: 2 / s)

    def __post_init__(self) -> None:
        if self.samples_per_s <= 0:
            raise ValueError(f"stage device {self.name}: samples_per_s must be positive, got {self.samples_per_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePlan:
    """Stages (unit names per stage, in order) on `devices` (one per stage, in order), `micro` samples
    in each micro-batch, and the predicted step."""

    devices: tuple[str, ...]
    stages: tuple[tuple[str, ...], ...]
    micro: tuple[int, ...]  # samples per micro-batch, contiguous slices of the batch (`micro_split`)
    stage_s: tuple[float, ...]  # per micro-batch of the largest size: compute + the sends on its boundaries
    step_s: float
    compute_s: tuple[float, ...]  # per stage: its compute over the whole step (its sends and waits are the rest)
    memory_bytes: tuple[float, ...]  # per stage: its units' state and 1F1B's in-flight activations


def micro_batches(samples: int, count: int) -> tuple[int, ...]:
    """`samples` split into `count` contiguous micro-batches, sizes differing by at most one (larger
    first): the batch needs no divisibility."""
    if samples < 1 or not 1 <= count <= samples:
        raise ValueError(f"cannot split {samples} samples into {count} micro-batches")
    base, extra = divmod(samples, count)
    return tuple(base + 1 if i < extra else base for i in range(count))


def micro_split(samples: int, most: int) -> tuple[int, ...]:
    """The micro-batches a stage runs `samples` in when its plan says `most` samples at a time:
    ceil(samples / most) of them, sizes differing by at most one. The worker's rule and the
    planner's (the module comment): a plan carries only the largest size."""
    if most < 1:
        raise ValueError(f"a micro-batch holds at least one sample, got {most}")
    return micro_batches(samples, math.ceil(samples / most))


@dataclass(frozen=True, slots=True)
class _Sums:
    """Prefix sums over the units: a stage's FLOPs, parameters and activations in O(1)."""

    flops: tuple[float, ...]
    params: tuple[float, ...]
    acts: tuple[float, ...]
    boundary: tuple[float, ...]  # per unit: the bytes per sample its output sends to the next
    optimizer_state_factor: float

    @staticmethod
    def of(graph: Graph) -> _Sums:
        layers = graph.layers
        return _Sums(flops=tuple(itertools.accumulate((x.train_flops for x in layers), initial=0.0)),
                     params=tuple(itertools.accumulate((float(x.param_bytes) for x in layers), initial=0.0)),
                     acts=tuple(itertools.accumulate((float(x.activation_bytes) for x in layers), initial=0.0)),
                     boundary=tuple(float(x.boundary_bytes) for x in layers),
                     optimizer_state_factor=graph.optimizer_state_factor)

    def memory(self, lo: int, hi: int, in_flight: int, micro: int, state_fraction: float = 1.0) -> float:
        """Bytes of units [lo, hi) as one stage: parameters, gradients and optimizer state (the
        `state_fraction` of them a member holds), and the activations of `in_flight` micro-batches of
        `micro` samples."""
        params = self.params[hi] - self.params[lo]
        return (static_bytes(params, self.optimizer_state_factor) * state_fraction
                + (self.acts[hi] - self.acts[lo]) * micro * in_flight)

    def stage_s(self, lo: int, hi: int, device: StageDevice, micro: int, link: Link | None) -> float:
        """Seconds for one micro-batch of `micro` samples through units [lo, hi) on `device`, forward
        and backward, with its boundary sends (the forward output out, the gradient back in)."""
        total = self.flops[-1] or 1.0
        # (the units' FLOP share of the device's whole-model pass, its fixed cost included: a stage
        # launches its own units' kernels only)
        compute = (self.flops[hi] - self.flops[lo]) / total * (micro / device.samples_per_s + device.fixed_s)
        sends = 0.0
        if link is not None:
            if hi < len(self.boundary):
                sends += p2p_s(self.boundary[hi - 1] * micro, link)  # activations out
            if lo > 0:
                sends += p2p_s(self.boundary[lo - 1] * micro, link)  # their gradient back
        return compute + sends


def step_s(stage_s: Sequence[float], micro_count: int) -> float:
    """A pipeline step of `micro_count` micro-batches over stages of these times (module comment)."""
    if not stage_s or micro_count < 1:
        raise ValueError(f"a pipeline step needs stages and micro-batches, got {len(stage_s)}, {micro_count}")
    return sum(stage_s) + (micro_count - 1) * max(stage_s)


def cut_stages(graph: Graph, devices: Sequence[StageDevice], micro: int, *,
               link: Link | None = None) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """The unit index where each stage begins (the first is 0) and each stage's time per micro-batch,
    for `devices` in this order, one stage each, minimising the slowest stage (ties: the smaller
    sum); None when no cut fits every stage in its device's memory.

    Dynamic programming over (stages used, units placed), exact. (A greedy fill under a bound, the
    textbook check for equal devices, is not: a fast device that takes one unit more can leave a
    heavy unit to a slow one, since every stage must hold at least one unit.)"""
    return _cut(_Sums.of(graph), devices, micro, link)


def _cut(sums: _Sums, devices: Sequence[StageDevice], micro: int,
         link: Link | None) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """`cut_stages` over the units' prefix sums (taken once per `best_pipeline`)."""
    n, p = len(sums.boundary), len(devices)
    if p < 1 or p > n:
        return None
    inf = (math.inf, math.inf)
    # best[s][j]: (slowest, sum) over stages 0..s-1 holding units [0, j); back[s][j]: where stage s-1 began
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    back = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, p + 1):
        device, in_flight = devices[s - 1], p - s + 1  # (1F1B: stage s-1 holds up to p-s+1 micro-batches)
        row, prev_row = best[s], best[s - 1]
        for j in range(s, n - (p - s) + 1):  # leave at least one unit to every later stage
            for i in range(s - 1, j):
                prev = prev_row[i]
                if prev[0] == math.inf or sums.memory(i, j, in_flight, micro, device.state_fraction) > device.memory_bytes:
                    continue
                t = sums.stage_s(i, j, device, micro, link)
                cand = (prev[0] if prev[0] > t else t, prev[1] + t)
                if cand < row[j]:
                    row[j], back[s][j] = cand, i
    if best[p][n][0] == math.inf:
        return None
    starts, j = [], n
    for s in range(p, 0, -1):
        j = back[s][j]
        starts.append(j)
    starts.reverse()
    bounds = [*starts, n]
    times = tuple(sums.stage_s(a, b, d, micro, link) for a, b, d in zip(bounds, bounds[1:], devices))
    return tuple(starts), times


def best_pipeline(graph: Graph, devices: Sequence[StageDevice], samples: int, *,
                  link: Link | None = None, max_micro: int | None = None) -> PipelinePlan | None:
    """The fastest pipeline of `samples` per step over `devices` (one stage each, in the best order
    of their classes), the micro-batches chosen with it; None when none fits in memory."""
    found: PipelinePlan | None = None
    sums = _Sums.of(graph)
    splits = _splits(samples, len(devices), max_micro)
    floors = [step_floor(graph, devices, samples, splits=[sizes]) for sizes in splits]  # (no order beats them)
    for order in _orders(devices):
        for sizes, floor in zip(splits, floors):
            if found is not None and floor >= found.step_s:
                continue
            cut = _cut(sums, order, sizes[0], link)
            if cut is None:
                continue
            plan = _timed(sums, graph, order, [*cut[0], len(graph.layers)], sizes, link)
            if found is None or plan.step_s < found.step_s:
                found = plan
    return found


def step_floor(graph: Graph, devices: Sequence[StageDevice], samples: int, *, max_micro: int | None = None,
               splits: Sequence[tuple[int, ...]] = ()) -> float:
    """A lower bound on `best_pipeline`'s step over `devices`, whatever the order and the cut. A
    stage of FLOPs share a on device d takes a · x_d(b) for a micro-batch of b samples, x_d(b) =
    b / v_d + c_d; the shares sum to one, and the largest is at least A, the least largest share of
    any cut of the units into that many stages. So the slowest stage takes at least
    max(1 / Σ_d 1 / x_d(b), A · min_d x_d(b)), and the first micro-batch at least min_d x_d(b)
    through every stage; the least over the micro-batch splits `best_pipeline` tries (or `splits`).
    Sends only add."""
    sums = _Sums.of(graph)
    if sums.flops[-1] <= 0:  # (no FLOPs: every stage's compute counts as none)
        return 0.0
    least = _least_largest_share(sums, len(devices))
    floor = math.inf
    for sizes in splits or _splits(samples, len(devices), max_micro):
        first = min(sizes[0] / d.samples_per_s + d.fixed_s for d in devices)
        pace = {b: max(1.0 / sum(1.0 / (b / d.samples_per_s + d.fixed_s) for d in devices),
                       least * min(b / d.samples_per_s + d.fixed_s for d in devices)) for b in set(sizes[1:])}
        floor = min(floor, first + sum(pace[b] for b in sizes[1:]))
    return floor


def _least_largest_share(sums: _Sums, stages: int) -> float:
    """The least, over the cuts of the units into `stages` contiguous runs of at least one, of the
    largest run's share of the FLOPs (the linear partition problem; 1 when they cannot be cut so)."""
    n, total = len(sums.boundary), sums.flops[-1]
    if not 1 <= stages <= n:
        return math.inf if stages > n else 1.0
    # best[s][j]: the least largest run over cuts of units [0, j) into s runs
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], sums.flops[j] - sums.flops[i]) for i in range(s - 1, j))
    return best[stages][n] / total


def _splits(samples: int, stages: int, max_micro: int | None) -> list[tuple[int, ...]]:
    """The micro-batch splits `best_pipeline` tries (fewest micro-batches first)."""
    most = min(samples, max_micro or MICRO_PER_STAGE * stages)
    return sorted({micro_split(samples, math.ceil(samples / count)) for count in _counts(samples, most)}, key=len)


def time_pipeline(graph: Graph, devices: Sequence[StageDevice], stages: Sequence[Sequence[str]],
                  micro: Sequence[int], *, link: Link | None = None) -> PipelinePlan:
    """The prediction of a pipeline already cut: `stages` (unit names, in order) on `devices` (one
    each, in order) running micro-batches `micro` (a plan in force, under new speeds)."""
    if [u for stage in stages for u in stage] != [layer.name for layer in graph.layers] or len(stages) != len(devices):
        raise ValueError(f"stages {[list(s) for s in stages]} on {len(devices)} devices do not cut the graph's "
                         "units in order, one stage per device")
    bounds = list(itertools.accumulate((len(stage) for stage in stages), initial=0))
    return _timed(_Sums.of(graph), graph, devices, bounds, tuple(micro), link)


def _timed(sums: _Sums, graph: Graph, devices: Sequence[StageDevice], bounds: Sequence[int],
           sizes: tuple[int, ...], link: Link | None) -> PipelinePlan:
    """Units cut at `bounds` on `devices`, running micro-batches of `sizes`: the step of the module
    comment, each micro-batch at the pace of its own size (a stage's time is affine in it)."""
    spans = list(zip(bounds, bounds[1:]))

    def per_stage(n: int, with_link: Link | None) -> tuple[float, ...]:
        return tuple(sums.stage_s(a, b, d, n, with_link) for (a, b), d in zip(spans, devices))

    timed = {n: per_stage(n, link) for n in set(sizes)}  # (at most two sizes: each timed once)
    computed = {n: per_stage(n, None) for n in set(sizes)}
    times = [timed[n] for n in sizes]
    computes = [computed[n] for n in sizes]
    p = len(devices)
    return PipelinePlan(devices=tuple(d.name for d in devices),
                        stages=tuple(tuple(layer.name for layer in graph.layers[a:b]) for a, b in spans),
                        micro=sizes, stage_s=times[0], step_s=sum(times[0]) + sum(max(t) for t in times[1:]),
                        compute_s=tuple(sum(t[s] for t in computes) for s in range(p)),
                        memory_bytes=tuple(sums.memory(a, b, p - s, sizes[0], d.state_fraction)
                                          for s, ((a, b), d) in enumerate(zip(spans, devices))))


def _counts(samples: int, most: int) -> list[int]:
    """Micro-batch counts worth trying up to `most`: every count to 8, then about 25% apart (the
    predicted step is flat there: the bubble shrinks slowly, the fixed costs grow slowly), and every
    count that splits `samples` evenly."""
    out, c = set(), 1
    while c <= most:
        out.add(c)
        c = c + 1 if c < 8 else max(c + 1, round(c * 1.25))
    out |= {d for d in range(1, most + 1) if samples % d == 0}
    return sorted(out | {most})


def _orders(devices: Sequence[StageDevice]) -> list[tuple[StageDevice, ...]]:
    """Distinct orders of the devices up to swapping identical ones (same speed, memory and fixed
    cost), at most MAX_ORDERS, the given order first: the permutations of a multiset of classes."""
    classes: dict[tuple[float, float, float], list[StageDevice]] = {}
    for d in devices:
        classes.setdefault((d.samples_per_s, d.memory_bytes, d.fixed_s), []).append(d)
    keys = list(classes)
    first = [keys.index((d.samples_per_s, d.memory_bytes, d.fixed_s)) for d in devices]
    out: list[tuple[StageDevice, ...]] = []

    def extend(prefix: list[int], left: list[int]) -> None:
        if len(out) == MAX_ORDERS:
            return
        if len(prefix) == len(devices):
            taken = [0] * len(keys)
            order = []
            for k in prefix:
                order.append(classes[keys[k]][taken[k]])
                taken[k] += 1
            out.append(tuple(order))
            return
        # the given order's class first at each position, then the others
        want = first[len(prefix)]
        for k in [want, *(k for k in range(len(keys)) if k != want)]:
            if left[k]:
                left[k] -= 1
                extend([*prefix, k], left)
                left[k] += 1

    extend([], [len(classes[k]) for k in keys])
    return out
