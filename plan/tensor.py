"""Tensor parallel layouts (dp x tp, FSDP x tp, pp x tp) as the planner weighs them: members, shares,
the prediction. Pure.

A tp group of T members splits the model's split tensors (the job's tp plan: `TensorInfo.tp_dim`)
and computes every sample of its data-parallel slot together: each member computes its 1/T of the
split Linears and the whole of the rest (layer norms, embeddings, an unsplit head), so its compute
is the whole model's times `compute_fraction` (the split share of the parameters, as the Linears'
FLOPs follow their parameters). Per step, each row-wise Linear all-reduces its output in the forward
and each column-wise one its input's gradient in the backward, over the tp group: one block's
boundary activation per sample each (`tp_comm_s`); the replicas then all-reduce each member's part
of the gradients.

Pinned (`--layout tp=T`, with `dp=R` or R filled from the ready devices, and `fsdp=S`: each tp
member's part sharded over S; `--layout pp=P,tp=T`: pipelines of split stages), its degree checked
at start against those the job admits (`worker.tp_plan.tp_degrees`); unpinned, the planner weighs
dp x tp and FSDP x tp for each admitted degree (`PlanLimits.tp_degrees`) beside the other layouts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from plan.cluster import Cluster, kind_key
from plan.cost import allreduce_s, samples_that_fit, sharded_static_bytes, static_bytes, step_comm_s
from plan.graph import Graph
from plan.layout import Layout, LayoutPin
from plan.prediction import MemberCost, Plan, micro_sizes
from plan.shares import assign

if TYPE_CHECKING:
    from plan.candidates import Ctx, Weighed

__all__ = ["compute_fraction", "pinned_pipeline_tensor", "pinned_tensor_parallel", "predict_tensor", "tensor_parallel",
           "tp_comm_s"]


def split_fraction(graph: Graph) -> float:
    """The share of the parameters tensor parallelism splits (0 without a plan)."""
    total = sum(t.numel for t in graph.tensors)
    return sum(t.numel for t in graph.tensors if t.tp_dim is not None) / total if total else 0.0


def compute_fraction(graph: Graph, tp: int) -> float:
    """The share of the whole model's compute one member of a tp group of `tp` does."""
    return 1.0 - split_fraction(graph) * (1.0 - 1.0 / tp)


def tp_comm_s(graph: Graph, samples: int, tp: int, cluster: Cluster, members: Sequence[str]) -> float:
    """The tp group's all-reduces of one step over `samples`: one per row-wise weight (forward) and
    per column-wise weight (backward), each of a block's boundary activation per sample."""
    if tp <= 1:
        return 0.0
    matrices = [t for t in graph.tensors if t.tp_dim is not None and len(t.shape) == 2]
    units = {t.unit for t in matrices}
    boundary = [layer.boundary_bytes for layer in graph.layers if layer.name in units and layer.boundary_bytes]
    per_sample = sum(boundary) / len(boundary) if boundary else 0.0
    return len(matrices) * allreduce_s(per_sample * samples, tp, cluster.link(members))


def predict_tensor(cluster: Cluster, graph: Graph, slots: Sequence[Sequence[str]], shares: Sequence[int], *,
                   shards: int = 1) -> Plan:
    """`slots` (each a tp group, in tp order; one per data-parallel slot, in rank order) with
    `shares[r]` samples of slot r: members in rank order, each computing its slot's samples at its
    fraction of the model, the slot waiting for its slowest member; then the tp all-reduces, and the
    data-parallel communication of each member's part of the model: the replicas' all-reduce, or
    with `shards` > 1 (FSDP x tp: consecutive slots shard their part between them) FSDP2's gathers
    and reduce-scatters of it (and the all-reduce across the replicas of the shards, HSDP)."""
    tp = len(slots[0])
    cluster = cluster.calibrated(kind_key(dp_shard=shards, tp=tp))
    speeds = cluster.speeds_for(graph.train_flops)
    fixed = cluster.fixed_compute()
    fraction = compute_fraction(graph, tp)
    members = [m for slot in slots for m in slot]
    part_bytes = graph.param_bytes * fraction
    link = cluster.link(members)
    if shards > 1:  # (FSDP2 over a tp split gathers each unit's tp part: the unit's bytes times the fraction)
        data_parallel = step_comm_s(graph, len(slots), shards, link) * fraction
        static = sharded_static_bytes(graph, shards, copies=len(slots) == shards,
                                      optimizer_state_factor=graph.optimizer_state_factor) * fraction
    else:
        data_parallel = allreduce_s(part_bytes, len(slots), link)
        static = static_bytes(part_bytes, graph.optimizer_state_factor)
    tp_comm = max(tp_comm_s(graph, share, tp, cluster, slot) for slot, share in zip(slots, shares))
    computes = {m: (fixed[m] + share / speeds[m]) * fraction if share > 0 else 0.0
                for slot, share in zip(slots, shares) for m in slot}
    overheads = {m: cluster.devices[m].overhead_s * fraction for m in members}
    busiest = max((computes[m] + overheads[m] for m in members), default=0.0)
    costs = tuple(MemberCost(name=m, samples=share, speed=speeds[m], compute_s=computes[m], overhead_s=overheads[m],
                             wait_s=busiest - computes[m] - overheads[m],
                             memory_bytes=static + graph.activation_bytes * share)
                  for slot, share in zip(slots, shares) for m in slot)
    comm = tp_comm + data_parallel
    return Plan(members=tuple(members), shares=tuple(s for s, slot in zip(shares, slots) for _ in slot),
                predicted_step_s=busiest + comm, comm_s=comm, costs=costs, tp=tp, dp_shard=shards)


def holds_its_part(ctx: Ctx, tp: int, shards: int = 1) -> list[str]:
    """The ready devices, fastest first, whose memory holds a tp member's part (its fraction of the
    parameters, their gradients and optimizer state; with `shards` > 1 its shard of that, and a
    copy of another's) beside one sample: tp also runs a model no device can hold whole."""
    g = ctx.graph
    static = _static(g, tp, shards)
    return [m for m in ctx.fastest()
            if (samples_that_fit(ctx.cluster.devices[m].memory_bytes, static, g.activation_bytes) or 0) >= 1]


def _static(graph: Graph, tp: int, shards: int) -> float:
    """A member's parameters, gradients and optimizer state under tp (and FSDP over `shards`)."""
    if shards > 1:
        return sharded_static_bytes(graph, shards, optimizer_state_factor=graph.optimizer_state_factor) * \
            compute_fraction(graph, tp)
    return static_bytes(graph.param_bytes * compute_fraction(graph, tp), graph.optimizer_state_factor)


def pinned_tensor_parallel(ctx: Ctx, pin: LayoutPin) -> list[Weighed]:
    """The pinned dp x tp (and FSDP x tp, HSDP x tp) over the fastest ready devices that hold a
    member's part: `dp=R` replicas where pinned, else as many whole groups (tp x fsdp members) as
    the devices fill; or why it cannot run."""
    return [_tensor_parallel(ctx, pin.tp or 1, pin.dp_shard or 1, pin.dp_replicate, f"--layout {pin.describe()}")]


def tensor_parallel(ctx: Ctx, above: float = math.inf) -> list[Weighed]:
    """The tp candidates the planner weighs unpinned: for each degree the job admits
    (`PlanLimits.tp_degrees`) that at most --max-workers devices hold, dp x tp over as many whole
    tp groups as the devices fill, and FSDP x tp with each tp member's part sharded over all of
    those groups (the least memory a member needs). One whose predicted step is no less than
    `above` (the best objective found) is not scored (`plan.candidates._loses`)."""
    out: list[Weighed] = []
    cap = ctx.limits.max_workers or len(ctx.cluster.devices)
    for tp in ctx.limits.tp_degrees:
        if tp > cap:
            continue
        what = f"tp={tp}"
        for weighed in (_tensor_parallel(ctx, tp, 1, None, what, above),
                        *((_tensor_parallel(ctx, tp, groups, 1, f"fsdp={groups},{what}", above),)
                          if (groups := min(len(holds_its_part(ctx, tp, 2)), cap) // tp) >= 2 else ())):
            out.append(weighed)
            if weighed.scored is not None:
                above = min(above, weighed.scored.objective_s)
    return out


def _tensor_parallel(ctx: Ctx, tp: int, shards: int, replicas_wanted: int | None, what: str,
                     above: float = math.inf) -> Weighed:
    """dp x tp over the fastest ready devices that hold a member's part (with `shards` > 1, each
    tp member's part sharded over that many data-parallel slots: FSDP x tp, or HSDP x tp with
    replicas): `replicas_wanted` replicas, or as many as the devices fill; or why it cannot run."""
    from plan.candidates import Alternative, Weighed, _loses

    layout = (f"dp_replicate={replicas_wanted or '*'} x " + (f"dp_shard={shards} x " if shards > 1 else "")
              + f"tp={tp}")
    if not split_fraction(ctx.graph):
        return Weighed(layout, (1, replicas_wanted, shards), why_not=f"{what}: the job has no tensor-parallel plan")
    devices = ctx.ranked(holds_its_part(ctx, tp, shards))
    group = tp * shards  # (the members of one replica)
    replicas = replicas_wanted or min(len(devices), ctx.limits.max_workers or len(devices)) // group
    if replicas < 1 or replicas * group > len(devices):
        return Weighed(layout, (1, replicas_wanted, shards),
                       why_not=f"{what}: needs {max(replicas, 1) * group} members; {len(devices)} can train now")
    previous = ctx.previous
    same = previous is not None and (previous.tp, previous.dp_shard) == (tp, shards)
    members = _keeping_positions(previous.members if same and previous is not None else (), devices[:replicas * group])
    slots = [members[r * tp:(r + 1) * tp] for r in range(replicas * shards)]
    speeds = [min(ctx.speeds[m] for m in slot) for slot in slots]
    overheads = [max(ctx.cluster.devices[m].overhead_s + ctx.fixed[m] for m in slot) for slot in slots]
    static = _static(ctx.graph, tp, shards)
    caps = [min(samples_that_fit(ctx.cluster.devices[m].memory_bytes, static, ctx.graph.activation_bytes) or 0.0,
                float(ctx.limits.global_batch)) for m in members[::tp]]  # (a slot's share runs in micro-batches)
    shares = assign(speeds, overheads, [float(ctx.limits.global_batch)] * len(slots), ctx.limits.global_batch)
    if shares is None or ctx.limits.global_batch < len(slots):
        return Weighed(layout, (1, replicas, shards),
                       why_not=f"{what}: the batch does not split over {len(slots)} data-parallel slots")
    shares = _every_slot_trains(list(shares))
    micro = micro_sizes(shares, caps)  # (a share larger than a member's memory holds at once: micro-batches)
    plan = replace(predict_tensor(ctx.cluster, ctx.graph, slots, shares, shards=shards),
                   micro=tuple(m for m in micro for _ in range(tp)) if any(micro) else ())
    if (lost := _loses(plan, above)):
        return Weighed(plan.layout.describe(), (1, replicas, shards), why_not=lost,
                       unscored=Alternative(description=what, plan=plan, objective_s=plan.predicted_step_s or 0.0,
                                            moved_bytes=0))
    return Weighed(plan.layout.describe(), (1, replicas, shards), scored=ctx.score(plan, what))


def _every_slot_trains(shares: list[int]) -> list[int]:
    """`shares` with at least one sample in every slot, taken from the largest: a tp group the
    balance would leave idle (much slower than the others) still computes, rather than holding
    its part of the model for nothing."""
    while 0 in shares and max(shares) > 1:
        shares[shares.index(max(shares))] -= 1
        shares[shares.index(0)] += 1
    return shares


def _keeping_positions(before: Sequence[str], chosen: Sequence[str]) -> list[str]:
    """`chosen` in rank order, each member that held a rank of a layout of the same tp degree
    (`before`, in rank order) at that rank where it still exists: its (replica, tp) coordinates and so
    its slices stay, and a newcomer takes a departed member's place (a failure then moves only what
    the dead member held, to its replacement). The rest fill the free ranks in `chosen`'s order."""
    out: list[str | None] = [None] * len(chosen)
    wanted = set(chosen)
    for rank, name in enumerate(before[:len(chosen)]):
        if name in wanted:
            out[rank] = name
    rest = iter([m for m in chosen if m not in set(out)])
    return [m if m is not None else next(rest) for m in out]


def pinned_pipeline_tensor(ctx: Ctx, pin: LayoutPin) -> list[Weighed]:
    """The pinned pp x tp (with replicas, with shards, or both: the full mesh): the pipeline cut over
    one device of each tp group (`plan._pipeline_pin.pipeline_plan`, the group's first rank standing
    for it), each position then filled with its tp group, every member computing its fraction of its
    stage; or why it cannot run."""
    from plan._pipeline_pin import pipeline_plan
    from plan.candidates import Weighed

    tp, stages, replicas, shards = pin.tp or 1, pin.pp or 1, pin.dp_replicate or 1, pin.dp_shard or 1
    what = f"--layout {pin.describe()}"
    shape = (stages, replicas, shards)
    if not split_fraction(ctx.graph):
        return [Weighed(pin.describe(), shape, why_not=f"{what}: the job has no tensor-parallel plan")]
    devices = ctx.ranked([m for m in ctx.fastest() if (ctx.caps[m] or 0) >= 1])
    need = stages * replicas * shards * tp
    if len(devices) < need:
        return [Weighed(pin.describe(), shape, why_not=f"{what}: needs {need} members; {len(devices)} can train now")]
    previous = ctx.previous
    same = previous is not None and (previous.tp, previous.pp, previous.dp_shard) == (tp, stages, shards)
    chosen = _keeping_positions(previous.members if same and previous is not None else (), devices[:need])
    groups = {chosen[i]: chosen[i:i + tp] for i in range(0, need, tp)}  # a tp group, by its first rank
    # (the pipeline the groups' first ranks ran, so that each group keeps its stage where it can)
    was = ctx.before
    before = (Layout(members=was.members[::tp], shares=was.shares[::tp], pp=stages, dp_replicate=was.dp_replicate,
                     dp_shard=was.dp_shard, stages=was.stages) if same and was is not None else None)
    cluster = ctx.cluster.calibrated(kind_key(stages, shards, tp))
    cut = pipeline_plan(cluster, ctx.graph, list(groups), before, stages, global_batch=ctx.limits.global_batch,
                        what=what, replicas=replicas, shards=shards)
    if isinstance(cut, str):
        return [Weighed(pin.describe(), shape, why_not=cut)]
    plan = _split_stages(cluster, ctx.graph, cut, groups, tp)
    return [Weighed(plan.layout.describe(), shape, scored=ctx.score(plan, what))]


def _split_stages(cluster: Cluster, graph: Graph, cut: Plan, groups: Mapping[str, Sequence[str]], tp: int) -> Plan:
    """The pipeline `cut` over the tp groups' first ranks (`groups`: each one's tp group, in tp
    order), each position filled with its group: every member computes its fraction of its stage's
    compute, and the step gains the tp all-reduces."""
    fraction = compute_fraction(graph, tp)
    costs = {c.name: c for c in cut.costs}
    members = [m for lead in cut.members for m in groups[lead]]
    lead_of = {m: lead for lead in cut.members for m in groups[lead]}
    comm = tp_comm_s(graph, max(cut.shares), tp, cluster, members)
    assert cut.predicted_step_s is not None
    step = cut.predicted_step_s * fraction + comm
    return Plan(members=tuple(members), shares=tuple(cut.shares[cut.members.index(lead_of[m])] for m in members),
                predicted_step_s=step, comm_s=(cut.comm_s or 0.0) + comm,
                costs=tuple(replace(costs[lead_of[m]], name=m, compute_s=costs[lead_of[m]].compute_s * fraction,
                                    wait_s=step - costs[lead_of[m]].compute_s * fraction - costs[lead_of[m]].overhead_s)
                            for m in members),
                micro=tuple(cut.micro[cut.members.index(lead_of[m])] for m in members) if cut.micro else (),
                pp=cut.pp, stages=cut.stages, tp=tp, dp_shard=cut.dp_shard)


def repredict_tensor(cluster: Cluster, graph: Graph, plan: Plan) -> Plan:
    """A tp plan's members, shares and layout predicted again (new speeds, fitted constants); a
    pipeline of tp stages keeps its cut (its first ranks' pipeline predicted again, then split)."""
    from plan.prediction import repredict

    tp = plan.tp
    if plan.pp == 1:
        slots = [list(plan.members[i:i + tp]) for i in range(0, len(plan.members), tp)]
        return replace(predict_tensor(cluster, graph, slots, plan.shares[::tp], shards=plan.dp_shard),
                       micro=plan.micro)
    cluster = cluster.calibrated(kind_key(plan.pp, plan.dp_shard, tp))
    leads = replace(plan, members=plan.members[::tp], shares=plan.shares[::tp], micro=plan.micro[::tp], tp=1,
                    costs=())
    cut = repredict(cluster, graph, leads)
    return _split_stages(cluster, graph, cut, {m: plan.members[i:i + tp] for i, m in enumerate(plan.members)
                                               if i % tp == 0}, tp)
