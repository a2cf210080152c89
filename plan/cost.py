"""The global cost model: predicted time and memory of a plan, from the graph, devices and links.

Communication follows the α–β model: a message of n bytes costs α (latency, seconds) + n·β
(seconds per byte). Collectives over R ranks use the ring algorithms:

    all-reduce       2(R−1)·α + 2(R−1)/R · n·β
    all-gather       (R−1)·α  + (R−1)/R · n·β       (n = the gathered, whole tensor)
    reduce-scatter   (R−1)·α  + (R−1)/R · n·β       (n = the whole tensor before scattering)
    p2p              α + n·β

and cost nothing for R = 1. Compute of a device is samples × (forward + backward FLOPs) / FLOP/s,
times a calibration factor fitted from measured steps (FLOPs alone under-predict real kernels).
Memory of a data-parallel replica is parameters + gradients + optimizer state + activations of
its micro-batch.

A synchronous data-parallel step of replicas with compute c_i and per-step overhead o_i (copying
gradients, the optimizer step) repeats every max_i(c_i + o_i) + all-reduce: each replica starts
its next step after its own overhead, and the all-reduce ends when the last one arrives. A pipeline
of p stages running m micro-batches (1F1B) takes (m + p − 1) × the slowest stage's time per
micro-batch, plus a p2p of the boundary tensor per stage crossing; the bubble is the (p − 1) part.
Every function is pure; times are in seconds and sizes in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from plan.graph import Graph


@dataclass(frozen=True, slots=True)
class Link:
    """α (latency per message, s) and β (s per byte) of the slowest link a collective crosses."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.beta_s_per_byte < 0:
            raise ValueError(f"link α and β must be >= 0, got {self.alpha_s}, {self.beta_s_per_byte}")


def allreduce_s(n_bytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce of an n-byte buffer over `ranks` ranks."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link.alpha_s + 2 * (ranks - 1) / ranks * n_bytes * link.beta_s_per_byte


def allgather_s(n_bytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather producing an n-byte tensor on every rank."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.alpha_s + (ranks - 1) / ranks * n_bytes * link.beta_s_per_byte


def reduce_scatter_s(n_bytes: float, ranks: int, link: Link) -> float:
    """Ring reduce-scatter of an n-byte tensor (each rank keeps n/R bytes of the sum)."""
    return allgather_s(n_bytes, ranks, link)


def p2p_s(n_bytes: float, link: Link) -> float:
    """One point-to-point message."""
    return link.alpha_s + n_bytes * link.beta_s_per_byte


def compute_s(samples: float, train_flops: float, effective_flops: float, factor: float = 1.0) -> float:
    """Forward + backward time of `samples` samples on a device of `effective_flops` FLOP/s."""
    if effective_flops <= 0:
        raise ValueError(f"effective FLOP/s must be positive, got {effective_flops}")
    return samples * train_flops * factor / effective_flops


def samples_per_s(train_flops: float, effective_flops: float, factor: float = 1.0) -> float:
    """The compute throughput `compute_s` implies (samples per second)."""
    return effective_flops / (train_flops * factor)


def fit_factor(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The factor f minimising Σ (f·predicted − measured)², over pairs with both sides positive.

    1.0 when there is nothing to fit. A least-squares fit through the origin: the longest steps
    weigh most, which is what matters for a makespan.
    """
    if len(predicted) != len(measured):
        raise ValueError(f"fit_factor: {len(predicted)} predictions but {len(measured)} measurements")
    pairs = [(p, m) for p, m in zip(predicted, measured) if p > 0 and m > 0 and math.isfinite(p * m)]
    den = sum(p * p for p, _ in pairs)
    if den == 0:
        return 1.0
    return sum(p * m for p, m in pairs) / den


def relative_error(predicted: float, measured: float) -> float:
    """Signed relative error (predicted − measured) / measured; positive means over-predicted."""
    if measured <= 0:
        raise ValueError(f"relative_error: measured must be positive, got {measured}")
    return (predicted - measured) / measured


def static_bytes(param_bytes: float, optimizer_state_factor: float = 2.0) -> float:
    """Parameters + gradients + optimizer state (`optimizer_state_factor` × params; Adam ≈ 2)."""
    return param_bytes * (2.0 + optimizer_state_factor)


def memory_bytes(graph: Graph, micro_batch: float, optimizer_state_factor: float = 2.0) -> float:
    """Memory of one unsharded data-parallel replica training `micro_batch` samples at once."""
    return static_bytes(graph.param_bytes, optimizer_state_factor) + graph.activation_bytes * micro_batch


def max_micro_batch(
    graph: Graph, device_memory_bytes: float, optimizer_state_factor: float = 2.0
) -> float | None:
    """The most samples a replica fits in `device_memory_bytes` (inf without activations);
    None when even the parameters, gradients and optimizer state do not fit."""
    free = device_memory_bytes - static_bytes(graph.param_bytes, optimizer_state_factor)
    if free < 0:
        return None
    if graph.activation_bytes == 0:
        return math.inf
    return math.floor(free / graph.activation_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    """One data-parallel replica: its device's FLOP/s, calibration factor and share of the batch."""

    name: str
    effective_flops: float
    samples: int
    factor: float = 1.0
    overhead_s: float = 0.0  # per-step time outside compute and the all-reduce


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Predicted step of a plan; per-device values are keyed by replica name."""

    step_s: float
    compute_s: dict[str, float]
    comm_s: float
    wait_s: dict[str, float]  # idle time in a step: step − all-reduce − own compute − own overhead
    memory_bytes: dict[str, float]
    overhead_s: dict[str, float] = field(default_factory=dict)


def predict_dp(
    graph: Graph, replicas: Sequence[Replica], link: Link, *, optimizer_state_factor: float = 2.0
) -> Prediction:
    """A synchronous data-parallel step: every replica computes its share, then one ring
    all-reduce of the gradients (the size of the parameters), then its overhead (see the module
    comment). No overlap is assumed."""
    compute = {
        r.name: compute_s(r.samples, graph.train_flops, r.effective_flops, r.factor) for r in replicas
    }
    overhead = {r.name: r.overhead_s for r in replicas}
    busiest = max((compute[r.name] + r.overhead_s for r in replicas), default=0.0)
    comm = allreduce_s(graph.param_bytes, len(replicas), link)
    return Prediction(
        step_s=busiest + comm,
        compute_s=compute,
        comm_s=comm,
        wait_s={name: busiest - c - overhead[name] for name, c in compute.items()},
        memory_bytes={r.name: memory_bytes(graph, r.samples, optimizer_state_factor) for r in replicas},
        overhead_s=overhead,
    )


def pipeline_step_s(stage_s_per_micro_batch: Sequence[float], micro_batches: int,
                    boundary_bytes: Sequence[float] = (), link: Link | None = None) -> float:
    """One 1F1B pipeline step: (m + p − 1) × the slowest stage's forward + backward time per
    micro-batch, plus, per micro-batch, a p2p of each boundary tensor (forward) and of its gradient
    (backward) on the critical path."""
    p = len(stage_s_per_micro_batch)
    if p == 0 or micro_batches < 1:
        raise ValueError(f"a pipeline needs stages and micro_batches >= 1, got {p} stages, {micro_batches}")
    if len(boundary_bytes) not in (0, p - 1):
        raise ValueError(f"{p} stages have {p - 1} boundaries, got {len(boundary_bytes)}")
    transfer = sum(2 * p2p_s(n, link) for n in boundary_bytes) if link is not None else 0.0
    return (micro_batches + p - 1) * max(stage_s_per_micro_batch) + micro_batches * transfer


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a 1F1B pipeline step: (p − 1) / (m + p − 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
