"""A pipeline of P stages (pp=P): the one the planner runs when the operator pins `--layout pp=P`,
and each depth it weighs as a candidate without a pin. Pure.

The P fastest ready devices (by measured whole-model speed; ties keep the planner's rank order)
are cut into stages by `plan.pipeline.best_pipeline`, which also chooses their order and the
micro-batches. The plan lists its members in that order, because rank r holds stage r (the mesh
order of `plan.layout`), and gives every member the whole batch: the stages of a pipeline compute
on the same samples, one after the other. The order offered first keeps every member of the current
pipeline on its stage where it can, and best_pipeline keeps the first of equal orders, so the
members that stay already hold their stages.

A pipeline needs a model whose units are a sequence (`Graph.sequential`: an nn.Sequential of its
units), at least one unit per stage, P ready devices and a cut whose every stage fits its device's
memory; otherwise `pipeline_plan` says which of these is missing. The planner asks for the pinned
depth, and, with no pin, for every depth it weighs (`plan.candidates`).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import replace

from plan.cluster import Cluster, kind_key
from plan.cost import Link, static_bytes
from plan.graph import Graph
from plan.layout import Layout
from plan.pipeline import PipelinePlan, StageDevice, best_pipeline, micro_split
from plan.placement import TensorShape
from plan.prediction import Plan, pipelined, stage_devices
from plan.reshard import ORDER_ROWS, Holdings, copy_ring, holdings, subtract, survivors
from plan.shares import split_shares


# The best pipeline found for (each stage's slowest device, one pipeline's samples, the link): one
# make_plan's cluster and graph
Cuts = dict[tuple[tuple[StageDevice, ...], int, Link], PipelinePlan | None]

NOT_A_SEQUENCE = ("the model's units do not form a sequence (it is not an nn.Sequential of its units), so it "
                  "cannot be cut into pipeline stages; a job gives its model as one with Job.sequence")


def pipeline_plan(cluster: Cluster, graph: Graph | None, ranked: Sequence[str], before: Layout | None,
                  stages: int, *, global_batch: int, what: str, replicas: int = 1, shards: int = 1,
                  cuts: Cuts | None = None) -> Plan | str:
    """The pipeline of `stages` stages over the fastest of `ranked` (the ready devices in rank
    order; `before`: the layout in force), or why there is none (`what` opens the reason: the
    operator's "--layout pp=2", or the candidate's "pp=2"). `replicas` > 1: that many pipelines
    (dp x pp); `shards` > 1: each stage sharded over that many members (FSDP x pp): both
    `_data_parallel_pipelines`. `cuts`: the cuts found for other shapes of this cluster and graph,
    reused where a shape's stages, samples and memory are the same (FSDP x pp over 4 and HSDP x pp
    of 2 x 2 are cut alike)."""
    if graph is None or not graph.sequential:
        return f"{what}: {NOT_A_SEQUENCE}"
    if stages > len(graph.layers):
        return f"{what} needs {stages} stages of at least one unit, but the model has {len(graph.layers)} units"
    size = stages * replicas * shards
    if len(ranked) < size:
        return f"{what} needs {size} members; {len(ranked)} can train now"
    speeds = cluster.speeds_for(graph.train_flops)
    rank = {m: i for i, m in enumerate(ranked)}
    fastest = sorted(ranked, key=lambda m: (-speeds[m], rank[m]))[:size]
    if replicas * shards > 1:
        return _data_parallel_pipelines(cluster, graph, fastest, stages, replicas, shards, global_batch, what,
                                        {} if cuts is None else cuts)
    members = _on_their_stages([m for m in ranked if m in fastest], before)
    found = best_pipeline(graph, stage_devices(cluster, graph, members), global_batch, link=cluster.link(members))
    if found is None:
        each = ", ".join(f"{m} has {cluster.devices[m].memory_bytes / 2**20:.1f} MiB" for m in members)
        return (f"{what} does not fit: no cut of the model's {len(graph.layers)} units into {stages} stages "
                f"fits the members' memory (a stage holds its units' parameters, gradients and optimizer state, "
                f"{static_bytes(graph.param_bytes, graph.optimizer_state_factor) / 2**20:.1f} MiB for the whole "
                f"model, and the activations of up to {stages} micro-batches, "
                f"{graph.activation_bytes / 2**10:.1f} KiB per sample for the whole model; {each})")
    return pipelined(cluster, graph, found)


def _data_parallel_pipelines(cluster: Cluster, graph: Graph, fastest: list[str], stages: int, replicas: int,
                             shards: int, global_batch: int, what: str, cuts: Cuts) -> Plan | str:
    """`replicas` x `shards` pipelines of `stages` stages over `fastest` (fastest first): dp x pp,
    FSDP x pp, or both. Each stage position gets replicas x shards devices of like speed (the
    fastest R·S, the next R·S, ...); a stage's shards split its units' state (each member also
    keeping a copy of another's shard where there is one replica); the cut is the best for the
    slowest device of each position, at the largest share (the pipelines wait for each other at
    every step's end, and a stage's shards at each of its units). The batch is split evenly
    between the data-parallel slots. Members are in mesh order: stage-major, then replica, then
    shard."""
    width = replicas * shards
    groups = [fastest[i * width:(i + 1) * width] for i in range(stages)]
    devices = stage_devices(cluster, graph, fastest, kind_key(stages, shards))
    by_name = {d.name: d for d in devices}
    held = 1.0 if shards == 1 else (2.0 if replicas == 1 else 1.0) / shards  # (a shard and its copy, or a shard)
    slowest = [StageDevice(name=str(i), samples_per_s=min(by_name[m].samples_per_s for m in g),
                           memory_bytes=min(by_name[m].memory_bytes for m in g),
                           fixed_s=max(by_name[m].fixed_s for m in g), state_fraction=held) for i, g in enumerate(groups)]
    shares = split_shares(global_batch, [1.0] * width)
    link = cluster.link(fastest)
    key = (tuple(slowest), max(shares), link)
    if key not in cuts:
        cuts[key] = best_pipeline(graph, slowest, max(shares), link=link)
    found = cuts[key]
    if found is None:
        return (f"{what} does not fit: no cut of the model's {len(graph.layers)} units into {stages} stages fits "
                "the members' memory")
    ordered = [groups[int(name)] for name in found.devices]
    return pipelined(cluster, graph, found, replicas=ordered, shares=shares, shards=shards)


def _on_their_stages(members: list[str], before: Layout | None) -> list[str]:
    """`members` (in rank order) as the devices of stages 0, 1, ...: each one that holds a stage
    of the pipeline `before` on that stage where it is free, the others in the gaps, in rank order."""
    if before is None or before.pp == 1:
        return members
    slots: list[str | None] = [None] * len(members)
    for m in members:
        if m in before.members and (s := before.coords(before.members.index(m))[0]) < len(slots) and slots[s] is None:
            slots[s] = m
    rest = iter(m for m in members if m not in slots)
    return [m if m is not None else next(rest) for m in slots]


def describe(plan: Plan, speeds: dict[str, float]) -> str:
    """e.g. "pp=2, stages [0 1 2 3] on w1 (210 samples/s), [4 5] on w2 (98 samples/s), 4 micro-batches
    of 4, predicted 120.0 ms/step"."""
    r = len(plan.members) // plan.pp  # (dp x pp, FSDP x pp: a stage's members are consecutive ranks)
    on = ", ".join(f"[{' '.join(stage)}] on " + " and ".join(f"{m} ({speeds[m]:.3g} samples/s)"
                                                             for m in plan.members[s * r:(s + 1) * r])
                   for s, stage in enumerate(plan.stages))
    sizes = micro_split(plan.shares[0], plan.micro[0])  # (as the worker splits its share)
    of = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]} or {sizes[-1]}"
    step = f", predicted {plan.predicted_step_s * 1e3:.1f} ms/step" if plan.predicted_step_s is not None else ""
    shards = plan.dp_shard
    copies = (f"{r // shards} pipelines, " if r // shards > 1 else "") + (f"each stage sharded over {shards}, "
                                                                           if shards > 1 else "")
    return (f"pp={plan.pp}, {copies}stages {on}, {len(sizes)} micro-batch{'es' if len(sizes) > 1 else ''} of "
            f"{of}{step}")


def moved_bytes(graph: Graph, before: Layout | None, holders: Collection[str], plan: Plan) -> int:
    """The state bytes (parameters and optimizer state) the reshard sends to take what `holders`
    hold under `before` (their parts and the copies they keep) to what `plan` gives each member
    (its part and the copy it keeps of another's: `plan.reshard.copy_ring`): what each member needs
    and does not hold, where some holder has it (as `plan.reshard.plan_reshard` counts it, without
    choosing the senders). One stand-in tensor per unit, split as that unit's tensors are; one for
    the whole state when neither layout is a pipeline (every unit is then split alike). An
    estimate: the rings are taken in rank order (as on one host), since the hosts of members that
    left are not known here. Nothing moves before anyone holds state."""
    if before is None or not holders:
        return 0
    after = plan.layout
    per_unit = {layer.name: layer.param_bytes * (1.0 + graph.optimizer_state_factor) for layer in graph.layers}
    if before.pp == 1 and after.pp == 1:
        per_unit = {"state": sum(per_unit.values())}
        shapes = [TensorShape("state", ORDER_ROWS, ORDER_ROWS)]
    else:
        shapes = [TensorShape(layer.name, ORDER_ROWS, ORDER_ROWS, unit=layer.name) for layer in graph.layers]
    if before.tp > 1 or after.tp > 1:  # (each stand-in in two: the part tp splits, and the rest)
        per_unit, shapes = _split_stand_ins(graph, per_unit, shapes)
    need = holdings(after, shapes, copy_ring(after))
    if before.whole_replicas:  # every holder holds it all: the others receive all they need
        return round(sum((hi - lo) * per_unit[t] for m, parts in need.items() if m not in holders
                         for t, ranges in parts.items() for lo, hi in ranges) / ORDER_ROWS)
    held = _held(before, tuple(shapes), frozenset(holders))
    moved = 0.0
    for shape in shapes:
        t = shape.name
        # (what no holder has is missing, not moved: the caller resumes from a checkpoint)
        missing = subtract([(0, shape.numel)], [r for h in held.values() for r in h.get(t, [])])
        # (ranges are shared by the members of one stage and shard, `holdings`: what a pair of them
        # lacks is counted once; every list is alive through the loop, so its id names it)
        counted: dict[tuple[int, int], int] = {}
        for member, parts in need.items():
            wanted, had = parts.get(t, _NONE), held.get(member, {}).get(t, _NONE)
            n = counted.get((id(wanted), id(had)))
            if n is None:
                n = counted[(id(wanted), id(had))] = sum(hi - lo for lo, hi in subtract(subtract(wanted, had), missing))
            moved += n * per_unit[t]
    return round(moved / ORDER_ROWS)


_NONE: list[tuple[int, int]] = []  # (no ranges: one shared list, never changed)


def _split_stand_ins(graph: Graph, per_unit: dict[str, float], shapes: list[TensorShape]
                     ) -> tuple[dict[str, float], list[TensorShape]]:
    """Each stand-in as two: its units' tensors that tensor parallelism splits (a stand-in split
    along its rows) and the rest, their bytes in the proportion of the tensors' elements."""
    split: dict[str, float] = {}
    total: dict[str, float] = {}
    for t in graph.tensors:
        unit = t.unit if len(shapes) > 1 else "state"
        total[unit] = total.get(unit, 0.0) + t.numel
        if t.tp_dim is not None:
            split[unit] = split.get(unit, 0.0) + t.numel
    bytes_out: dict[str, float] = {}
    out: list[TensorShape] = []
    for shape in shapes:
        share = split.get(shape.name, 0.0) / total[shape.name] if total.get(shape.name) else 0.0
        bytes_out[f"{shape.name}/split"] = per_unit[shape.name] * share
        bytes_out[shape.name] = per_unit[shape.name] * (1.0 - share)
        out += [replace(shape, name=f"{shape.name}/split", tp_dim=0), shape]
    return bytes_out, out


@functools.lru_cache(maxsize=4)
def _held(before: Layout, shapes: tuple[TensorShape, ...], holders: frozenset[str]) -> Holdings:
    """What `holders` hold under `before` (read only): the same for every candidate of one re-plan."""
    return survivors(holdings(before, shapes, copy_ring(before)), holders)
