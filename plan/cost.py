"""The global cost model: predicted time and memory of a plan, from the graph, devices and links.

Communication follows the α–β model: a message of n bytes costs α (latency, seconds) + n·β
(seconds per byte). Collectives over R ranks use the ring algorithms:

    all-reduce       2(R−1)·α + 2(R−1)/R · n·β
    all-gather       (R−1)·α  + (R−1)/R · n·β       (n = the gathered, whole tensor)
    reduce-scatter   (R−1)·α  + (R−1)/R · n·β       (n = the whole tensor before scattering)
    p2p              α + n·β

and cost nothing for R = 1. Compute time per device is fitted from measured steps (`plan.cluster`:
fixed + samples / speed; FLOPs alone under-predict real kernels), and a plan's step is put together
from these parts by `plan.prediction.predict`. Memory of a data-parallel replica is parameters +
gradients + optimizer state + activations of its micro-batch.

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
from dataclasses import dataclass

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


def samples_that_fit(device_memory_bytes: float, static: float, activation_bytes: float) -> float | None:
    """The most samples a device of `device_memory_bytes` trains at once when `static` bytes
    (parameters, gradients, optimizer state) are resident: inf without activations (or unbounded
    memory); None when not even `static` fits."""
    free = device_memory_bytes - static
    if free < 0:
        return None
    if activation_bytes <= 0 or math.isinf(free):
        return math.inf
    return float(math.floor(free / activation_bytes))


def max_micro_batch(
    graph: Graph, device_memory_bytes: float, optimizer_state_factor: float = 2.0
) -> float | None:
    """The most samples an unsharded data-parallel replica of `graph` fits in `device_memory_bytes`."""
    return samples_that_fit(device_memory_bytes, static_bytes(graph.param_bytes, optimizer_state_factor),
                            graph.activation_bytes)


def sharded_static_bytes(graph: Graph, shards: int, *, copies: bool = True,
                         optimizer_state_factor: float = 2.0) -> float:
    """Resident bytes of one member of a sharded layout (FSDP2 over `shards` members): its shard of
    parameters, gradients and optimizer state; the largest unit gathered whole for compute, with
    its whole gradient before the reduce-scatter; and, with `copies`, the copy of another member's
    shard of parameters and optimizer state (the redundancy that survives one failure)."""
    p = graph.param_bytes
    largest = max((layer.param_bytes for layer in graph.layers), default=0)
    copy = p * (1.0 + optimizer_state_factor) / shards if copies and shards > 1 else 0.0
    return p * (2.0 + optimizer_state_factor) / shards + 2.0 * largest + copy


def sharded_comm_s(graph: Graph, shards: int, link: Link, *, copies: bool = True) -> float:
    """Communication of one sharded step: each unit gathered in the forward and again in the
    backward, its gradient reduce-scattered; the gradient shard sent to the copy's keeper; the
    step's small all-reduce (loss, norm, vote). Not overlapped with compute (gloo on CPU)."""
    if shards <= 1:
        return 0.0
    units = sum(2 * allgather_s(layer.param_bytes, shards, link) + reduce_scatter_s(layer.param_bytes, shards, link)
                for layer in graph.layers if layer.param_bytes > 0)
    refresh = p2p_s(graph.param_bytes / shards, link) if copies else 0.0
    return units + refresh + allreduce_s(24, shards, link)


def hsdp_comm_s(graph: Graph, replicas: int, shards: int, link: Link) -> float:
    """Communication of one HSDP step (`replicas` rows of `shards`): the sharded step within a row,
    without copies (the other rows hold every shard), plus each unit's gradient shard all-reduced
    across the rows (one all-reduce per unit, as FSDP2's all-reduce hook issues them)."""
    return (sharded_comm_s(graph, shards, link, copies=False)
            + sum(allreduce_s(layer.param_bytes / max(shards, 1), replicas, link)
                  for layer in graph.layers if layer.param_bytes > 0))


def step_comm_s(graph: Graph, members: int, dp_shard: int, link: Link) -> float:
    """The modelled communication of one step of a plan of `members` with `dp_shard` shards per
    replica: the gradients' all-reduce when every member is a replica, else the sharded step
    (`sharded_comm_s`) or HSDP's (`hsdp_comm_s`)."""
    if dp_shard <= 1:
        return allreduce_s(graph.param_bytes, members, link)
    replicas = max(members // dp_shard, 1)
    return sharded_comm_s(graph, dp_shard, link) if replicas == 1 else hsdp_comm_s(graph, replicas, dp_shard, link)


def step_comm_features(graph: Graph, members: int, dp_shard: int) -> tuple[float, float]:
    """(messages, bytes) of `step_comm_s`: its time is α·f0 + β·f1 over any link (every term is
    linear in α and β), which is what a measured step's communication fits the link by."""
    return (step_comm_s(graph, members, dp_shard, Link(alpha_s=1.0, beta_s_per_byte=0.0)),
            step_comm_s(graph, members, dp_shard, Link(alpha_s=0.0, beta_s_per_byte=1.0)))


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
