"""The sharded executor: PyTorch's own FSDP2 (`fully_shard`) on the epoch's group.

`apply_fsdp` builds the job's model on the meta device (no memory for the whole model), shards every
unit of the captured graph (its blocks) and then the root on a DeviceMesh of the epoch's registered
group (`worker.parallel.mesh`): 1-D over the members for pure sharding. HSDP is FSDP2 over this
member's shard group (its replica row) with the replicas' all-reduce in FSDP2's all-reduce hook,
over the replica group: FSDP2's native HSDP (a 2-D mesh) issues that all-reduce as a blocking call
with no custom-comm hook, so a stopped peer would hold the survivors for the whole group timeout,
where the hook waits for it abortably like the gathers and reduce-scatters. Then it materialises only this member's shards (`to_empty`) and fills them, and the
optimizer's state (DTensors with the parameters' placements), from the member's `LocalState`:
exactly the slices `Layout.slice_of` gives it, which the reshard brought. `extract` gives the state
back as a LocalState for the next epoch's reshard. `FsdpExecutor` is the layout's executor: its
step, its copies' ring, and the whole model gathered for a save.

Mathematics: gradients are *summed* across members
(`set_force_sum_reduction_for_comms(True)`, divide factor 1: gloo has no PREMUL_SUM), each member's
loss is its slice's summed loss over the global batch, as in the replicated executor, so a step is
the full-batch gradient however the batch and the state are split. Optimizer state is sharded with
the parameters (DTensor); a job may ask for bf16 compute (`MixedPrecisionPolicy`, fp32 reduce).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's hook types
from torch.distributed.tensor import DTensor

from plan.graph import ROOT_UNIT
from plan.layout import Layout
from plan.placement import TensorShape, ranges_of
from transport import PlanDelta
from worker import group as groups
from worker.comm import Superseded
from worker.executor import Executor, Loop, computing, local_grad, pause, slot_samples, squared_norm, stretch
from worker.group import Group
from worker.job import Job
from worker.parallel.copies import Copies
from worker.parallel.meta import meta_model
from worker.parallel.shard_step import LocalStep
from worker.parallel.slices import PARAM, LocalState, pieces_over

Wait = Callable[[Any, torch.Tensor | None], None]  # the trainer's abortable wait (raises when superseded)

__all__ = ["AbortableAllReduce", "CommTime", "FsdpExecutor", "HoldsShards", "KeptShard", "Sharded", "apply_fsdp", "extract",
           "mixed_precision", "save_gathered", "shard_module"]


@dataclass(slots=True)
class CommTime:
    """Seconds this member spent in FSDP2's gathers and scatters since the last `take`, waiting for
    slower members included: a step's compute is its time less this (inside forward and backward,
    FSDP2 waits for every member at each unit, so the raw time is the slowest member's, whatever
    this member's share; the planner would read a small share as a slow device)."""

    seconds: float = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(slots=True)
class KeptShard:
    """Another member's reduced gradient shards (`rank`'s, in the unit's shard group), kept from
    the units' reduce-scatters where they run as all-reduces (`AbortableReduceScatter`), for the
    copy of its slices this member keeps (`worker.parallel.copies`): no exchange of gradient
    slices is then needed, every member already holds every member's.

    FSDP2 lays a unit's reduce-scatter input out as one chunk per member, each that member's dim-0
    shards of the unit's parameters, each padded to one size on every member, and makes each
    parameter's sharded gradient a view of the output at that shard's offset (`foreach_reduce`,
    torch 2.13); so `rank`'s gradient of a parameter is its chunk at the offset of this member's.
    Over a step's micro-batch passes FSDP2 adds each pass's output into the first one's views;
    the kept chunk is summed in the same order, so the copy's gradients are the owner's, bit for bit
    (an all-reduce leaves the same bits on every member). FSDP2 divides nothing here (a sum with a
    divide factor of 1), and the reduce dtype is the parameters' (`apply_fsdp` keeps none otherwise)."""

    rank: int
    units: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # a unit's hook -> (its first
    # output of the step, on this member; `rank`'s chunk, summed over the step's passes)

    def clear(self) -> None:
        """A new step: nothing reduced yet."""
        self.units.clear()

    def add(self, unit: int, output: torch.Tensor, chunks: torch.Tensor) -> None:
        """A unit's pass reduced: `chunks` is the whole all-reduced input, one row per member."""
        first = self.units.get(unit)
        if first is None:
            self.units[unit] = (output, chunks[self.rank].clone())
        else:
            first[1].add_(chunks[self.rank])

    def grad(self, local_grad: torch.Tensor, numel: int) -> torch.Tensor:
        """`rank`'s gradient (its shard, `numel` elements, flat) of the parameter whose gradient on
        this member is `local_grad`."""
        storage = local_grad.untyped_storage().data_ptr()
        for output, kept in self.units.values():
            if output.untyped_storage().data_ptr() == storage:
                at = local_grad.storage_offset() - output.storage_offset()
                return kept[at:at + numel]
        raise RuntimeError("a sharded gradient is not a view of its unit's reduce-scatter output: FSDP2's "
                           "gradient layout is not the one KeptShard reads (torch 2.13's)")


@dataclass(slots=True)
class Sharded:
    """The executor. `params`: the sharded parameters (DTensors) by name, as the optimizer holds
    them. Read the state through them, not `model.named_parameters()`: a step abandoned inside a
    unit's forward or backward leaves FSDP2's *unsharded* parameters registered on that unit
    (the root keeps them from forward to backward anyway), and those are neither this member's
    slice nor what the optimizer's state is keyed by."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    mesh: DeviceMesh
    comm: CommTime
    params: dict[str, nn.Parameter]
    stepper: LocalStep  # steps `optimizer` on the shards' local tensors (worker.parallel.shard_step)
    # Every member holds every member's reduced gradient shards once backward is done (gloo: the
    # reduce-scatters are all-reduces, in the parameters' dtype), the same on every member of the
    # layout: the copies take their gradients from `kept`, with no exchange.
    reduced_everywhere: bool = False
    kept: KeptShard | None = None  # the copy's source's gradient shards (where this member keeps a copy)
    shapes: dict[str, TensorShape] = field(default_factory=dict)  # each parameter's, by name: what it holds of it


def mixed_precision(job: Job) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for the job's `compute_dtype` (float32 gradient reduction), or None."""
    if not job.compute_dtype:
        return None
    return MixedPrecisionPolicy(param_dtype=getattr(torch, job.compute_dtype), reduce_dtype=torch.float32)


def apply_fsdp(job: Job, units: Sequence[str], layout: Layout, rank: int, mesh: DeviceMesh, local: LocalState,
               device: torch.device, *, replicate: dist.ProcessGroup | None = None,
               mp_policy: MixedPrecisionPolicy | None = None, wait: Wait | None = None,
               give_up: Callable[[], None] | None = None, keep: int | None = None,
               tensors: Sequence[TensorShape] | None = None) -> Sharded:
    """The job's model sharded (`shard_module`), built on the meta device."""
    return shard_module(job, meta_model(job), units, layout, rank, mesh, local, device, replicate=replicate,
                        mp_policy=mp_policy, wait=wait, give_up=give_up, keep=keep, tensors=tensors)


Split = Callable[[nn.Module, nn.Module, DeviceMesh], None]  # (whole meta model, its part, tp mesh): tp's split


def build_sharded(t: Loop, g: Group, local: LocalState, part: Callable[[nn.Module], nn.Module], units: Sequence[str],
                  *, split: Split | None = None, keep: int | None = None
                  ) -> tuple[nn.Module, Sharded, groups.ShardMesh, list[dist.ProcessGroup]]:
    """`part` of the job's model built on the meta device (the whole model, or a pipeline stage)
    and sharded with FSDP2 (`shard_module`, over `units`) on the epoch's mesh, its groups
    registered first (forming them can be superseded, a peer stopped, and then nothing of it is
    left registered); with `split` (tensor parallelism's), first split over the tp dim of the 2-D
    mesh (dp_shard, tp), whose dp_shard dim FSDP2 then shards over. (module, its shards, the mesh,
    the groups registered.)"""
    registered: list[dist.ProcessGroup] = []
    try:
        form = groups.shard_tp_mesh if split is not None else groups.mesh
        on = form(g, t.device, registered, timeout_s=t.config.group_timeout_s,
                  superseded=lambda: t.agent.superseded(g.epoch))
        whole = meta_model(t.job)
        module = part(whole)
        if split is not None:
            assert on.tp is not None
            split(whole, module, on.tp)
        sharded = shard_module(t.job, module, units, g.layout, g.rank, on.mesh, local, t.device,
                               replicate=on.replicate, mp_policy=mixed_precision(t.job),
                               wait=lambda work, buf: t.wait(g, work, buf), give_up=t.give_up_if_superseded,
                               keep=keep, tensors=t.tensors)
    except BaseException:
        groups.forget(registered)
        raise
    return module, sharded, on, registered


def shard_module(job: Job, model: nn.Module, units: Sequence[str], layout: Layout, rank: int, mesh: DeviceMesh,
                 local: LocalState, device: torch.device, *, replicate: dist.ProcessGroup | None = None,
                 mp_policy: MixedPrecisionPolicy | None = None, wait: Wait | None = None,
                 give_up: Callable[[], None] | None = None, keep: int | None = None,
                 tensors: Sequence[TensorShape] | None = None) -> Sharded:
    """`model` (on the meta device: the job's whole model, or a pipeline stage of it whose parameters
    keep the whole model's names; with tensor parallelism, already split over its tp mesh), each of
    `units` (module paths: the graph's layers but the root) sharded on its own and then the root,
    over `mesh`, and loaded with this member's boxes of `local` (`plan.placement.ranges_of` of
    `tensors`, the graph's tensors: needed for a stage or a tp split; without them each parameter
    is taken as the whole model's, dim 0 sharded), with the job's optimizer over the shards. HSDP:
    `mesh` is this member's shard group and `replicate` its replica group, over which every reduced
    gradient shard is summed. `wait` (the trainer's abortable wait) waits for every collective;
    without it they are waited for plainly. `give_up` is called before each collective is issued
    and raises to give the step up (an abort arrived during the compute): the units' gathers and
    reduce-scatters are the sharded step's abandon points, as a replica's forward hooks are.
    On gloo each reduce-scatter runs as an all-reduce (`AbortableReduceScatter`); `keep`: the rank
    (in the shard group) whose gradient shards this member keeps from them (`Sharded.kept`: the
    copy's; None where the backend reduce-scatters natively or the reduce dtype differs from the
    parameters', and the copies exchange their gradients instead: `Sharded.reduced_everywhere`; and
    with tensor parallelism, whose copies may be of another tp rank's slices)."""
    if (replicate is not None) != (layout.dp_replicate > 1):
        raise ValueError(f"{layout.describe()}: a replica group is needed exactly when dp_replicate > 1")
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in units:
        if unit == ROOT_UNIT:
            continue
        try:
            module = model.get_submodule(unit)
        except AttributeError:  # the whole model as one unit (named after its class): the root covers it
            continue
        if any(True for _ in module.parameters()):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    comm = CommTime()
    by_all_reduce = dist.get_backend(mesh.get_group()) == "gloo"
    reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
    everywhere = (by_all_reduce and wait is not None and layout.tp == 1
                  and all(reduce_dtype in (None, p.dtype) for p in model.parameters()))
    shapes = ({t.name: t for t in tensors} if tensors is not None else
              {fqn: TensorShape(fqn, p.shape[0] if p.dim() else 0, p.numel()) for fqn, p in model.named_parameters()})
    kept = KeptShard(keep) if everywhere and keep is not None else None
    for module in model.modules():
        if isinstance(module, FSDPModule):  # exact sums on gloo (no PREMUL_SUM)
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            if wait is not None:
                module.set_custom_all_gather(AbortableAllGather(wait, comm, give_up))
                module.set_custom_reduce_scatter(AbortableReduceScatter(wait, comm, give_up,
                                                                        by_all_reduce=by_all_reduce, kept=kept))
            if replicate is not None:
                module.set_all_reduce_hook(AbortableAllReduce(wait or _plain_wait, comm, replicate, give_up))
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            local.fill(fqn, PARAM, ranges_of(layout, rank, shapes[fqn]), _local(p).view(-1))
        for name, buf in model.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    params = dict(model.named_parameters())  # (all sharded now: nothing has run)
    optimizer = job.optimizer(params.values())
    _load_optimizer(optimizer, params, layout, rank, local, shapes)
    return Sharded(model=model, optimizer=optimizer, mesh=mesh, comm=comm, params=params,
                   stepper=LocalStep(optimizer, list(params.values()), job.optimizer),
                   reduced_everywhere=everywhere, kept=kept, shapes=shapes)


class _FreshBuffers:
    """Every call's output in a buffer of its own: an abandoned op that completes late writes into
    memory nobody reads. Each call's time is added to `comm`; `give_up` (may raise) comes first."""

    def __init__(self, wait: Wait, comm: CommTime, give_up: Callable[[], None] | None = None) -> None:
        self._wait = wait
        self._comm = comm
        self._give_up = give_up or _never

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AbortableAllGather(_FreshBuffers, AllGather):
    """FSDP2's all-gather, waited for by the trainer's abortable wait: a member stopped mid-step
    (SIGSTOP) would otherwise hold every other member in gloo for the whole group timeout. Each
    call gathers into a fresh buffer (`_FreshBuffers`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self._give_up()
        t0 = time.perf_counter()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
        self._wait(work, output_tensor)
        self._comm.seconds += time.perf_counter() - t0
        return None


class AbortableReduceScatter(_FreshBuffers, ReduceScatter):
    """FSDP2's reduce-scatter, waited for like `AbortableAllGather`. `by_all_reduce` (gloo): an
    all-reduce of the whole input in place (a fresh buffer of FSDP2's, `_FreshBuffers.allocate`),
    then this member's chunk copied out. gloo's reduce-scatter is slower than its all-reduce at
    these sizes (a 10M GPT block's 1.77M float32 elements: 14.7 against 9.6 ms on 3 members, the
    copy-out included); and every member then holds every member's reduced shard: `kept` keeps one
    (`KeptShard`)."""

    def __init__(self, wait: Wait, comm: CommTime, give_up: Callable[[], None] | None = None, *,
                 by_all_reduce: bool = False, kept: KeptShard | None = None) -> None:
        super().__init__(wait, comm, give_up)
        self._by_all_reduce = by_all_reduce
        self._kept = kept

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        self._give_up()
        t0 = time.perf_counter()
        if self._by_all_reduce:
            work = dist.all_reduce(input_tensor, op=op, group=group, async_op=True)
            self._wait(work, input_tensor)
            chunks = input_tensor.view(group.size(), -1)
            output_tensor.copy_(chunks[group.rank()])
            if self._kept is not None:
                self._kept.add(id(self), output_tensor, chunks)
        else:
            work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=True)
            self._wait(work, output_tensor)
        self._comm.seconds += time.perf_counter() - t0
        return None


class AbortableAllReduce:
    """HSDP's sum of a reduced gradient shard over the replica group, as FSDP2's all-reduce hook
    (called on each unit's reduce-scatter output, a fresh buffer of `AbortableReduceScatter`'s, so
    an abandoned sum writes only into the abandoned step's gradients), waited for abortably."""

    def __init__(self, wait: Wait, comm: CommTime, group: dist.ProcessGroup,
                 give_up: Callable[[], None] | None = None) -> None:
        self._wait = wait
        self._comm = comm
        self._group = group
        self._give_up = give_up or _never

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self._give_up()
        t0 = time.perf_counter()
        work = dist.all_reduce(reduce_output, group=self._group, async_op=True)
        self._wait(work, reduce_output)
        self._comm.seconds += time.perf_counter() - t0


def _plain_wait(work: Any, _buf: torch.Tensor | None) -> None:
    work.wait()


def _never() -> None:
    pass


def extract(sharded: Sharded, layout: Layout, rank: int, step: int) -> LocalState:
    """This member's slices of the model and optimizer as a LocalState (views, not copies)."""
    model, optimizer = sharded.model, sharded.optimizer
    local = LocalState(step=step, keys={})
    by_param = {id(p): n for n, p in sharded.params.items()}
    opt_state = {by_param[id(p)]: s for p, s in optimizer.state.items() if id(p) in by_param}
    for fqn, p in sharded.params.items():
        data = {PARAM: _local(p).detach().reshape(-1)}
        scalars: dict[str, Any] = {}
        for key, value in opt_state.get(fqn, {}).items():
            if isinstance(value, DTensor):
                data[key] = value.to_local().detach().reshape(-1)
            else:
                scalars[key] = value
        local.pieces[fqn] = pieces_over(ranges_of(layout, rank, sharded.shapes[fqn]), data)
        local.keys[fqn] = tuple(data)
        local.dtypes[fqn] = {k: str(v.dtype).removeprefix("torch.") for k, v in data.items()}
        local.scalars[fqn] = scalars
    local.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    local.buffers = {n: b.detach() for n, b in model.named_buffers()}
    return local


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _load_optimizer(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], layout: Layout, rank: int,
                    local: LocalState, shapes: dict[str, TensorShape]) -> None:
    """Hyper-parameters and per-parameter state from `local` (a fresh job starts with none)."""
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in params.items():
        keys = [k for k in local.keys.get(fqn, ()) if k != PARAM]
        if not keys and not local.scalars.get(fqn):
            continue
        shard = _local(p)
        state: dict[str, Any] = {}
        for key in keys:
            values = local.fill(fqn, key, ranges_of(layout, rank, shapes[fqn]),
                                torch.empty(shard.numel(), dtype=local.dtype(fqn, key), device=shard.device)
                                ).view(shard.shape)
            if isinstance(p, DTensor):
                state[key] = DTensor.from_local(values, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                                run_check=False)
            else:
                state[key] = values
        for key, value in local.scalars.get(fqn, {}).items():
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        optimizer.state[p] = state


def save_gathered(t: Loop, g: Group, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, *,
                  final: bool) -> None:
    """The whole model and optimizer state of a model whose parameters are DTensors (FSDP2's shards,
    tensor parallelism's slices), gathered by every member; rank 0 writes it, the optimizer's state
    keyed by parameter index as `optimizer.state_dict()` of the plain model gives it."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # (FSDP x tp gathers a column-wise weight's strided shards in two all-gathers, and DTensor warns
    # of it at every save: a once-a-job cost, not a problem to report)
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model_state = get_model_state_dict(model, options=options)
        by_name: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))
    finally:
        quiet.setLevel(level)
    if g.rank != 0:
        return
    index = {fqn: i for i, (fqn, _) in enumerate(model.named_parameters())}
    optimizer_state = {"state": {index[fqn]: st for fqn, st in by_name["state"].items()},
                       "param_groups": [{**grp, "params": [index[f] for f in grp["params"]]}
                                        for grp in by_name["param_groups"]]}
    t.write(directory, final, model_state, optimizer_state)


# --- the executor ------------------------------------------------------------------------------------


class HoldsShards(Executor):
    """What every executor that holds FSDP2 shards shares (the whole model's, `FsdpExecutor`; a
    pipeline stage's, `worker.parallel.staged.ShardedStageExecutor`): the shards it steps, what it
    holds as slices, and the groups it registered, let go of when it is closed. Subclasses set
    `sharded` and `registered` when built."""

    owns_default_group = True
    sharded: Sharded  # its FSDP2 state
    registered: list[dist.ProcessGroup]  # its groups as registered with c10d (`worker.group.mesh`)

    def close(self) -> None:
        super().close()
        groups.forget(self.registered)  # (their backends end on their own)

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters this member steps: its shards."""
        return [p for p in self.sharded.params.values() if p.requires_grad]

    def local_state(self, step: int) -> LocalState:
        assert self.at is not None
        layout, rank = self.at
        return self._with_redundancy(extract(self.sharded, layout, rank, step), self.sharded.params.items())


class FsdpExecutor(HoldsShards):
    """FSDP2 (and HSDP) on the epoch's registered groups: every layout whose state is sharded."""

    def __init__(self, sharded: Sharded, at: tuple[Layout, int], copies: Copies,
                 registered: list[dist.ProcessGroup], fraction: float = 1.0) -> None:
        super().__init__(sharded.model, sharded.optimizer, at, copies)
        self.sharded = sharded
        self.registered = registered
        self.fraction = fraction  # this member's share of the compute of its samples (1/tp's, split by tp)

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.sharded and layout.pp == 1 and layout.tp == 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        """FSDP2 over the epoch's mesh (`build_sharded`)."""
        copies = Copies.of(g.layout, t.name, local, t.tensors)
        _, sharded, _, registered = build_sharded(
            t, g, local, lambda whole: whole, t.units(),
            keep=g.members.index(copies.source) if copies.source is not None else None)
        return cls(sharded, (g.layout, g.rank), copies, registered)

    def save(self, t: Loop, g: Group | None, directory: str, *, final: bool) -> None:
        """Gather the full model and optimizer state from the shards (every member), rank 0 writes."""
        assert g is not None, "a sharded model is gathered over the epoch's group"
        save_gathered(t, g, self.model, self.optimizer, directory, final=final)

    def step(self, t: Loop, g: Group) -> PlanDelta | None:
        """One exact step with FSDP2: each member computes its slice of the batch (a member with no
        samples still takes part in every gather and reduce-scatter), gradients are summed into their
        shards by FSDP2's hooks, the copies' gradient exchange follows (from then on the step may be
        rolled forward: `pending`), and one small all-reduce gives the global loss, the global
        gradient norm (over every shard), the switch vote, a pending `ctl save` and a pending
        checkpoint."""
        sharded = self.sharded
        t0 = time.perf_counter()
        job, G = t.job, t.job.global_batch
        ids = slot_samples(t, g)
        sharded.optimizer.zero_grad(set_to_none=True)
        buffers = self.buffers()
        buffers.begin()
        self._collectives_s()  # (FSDP2's gathers and scatters of this step from here on)
        if sharded.kept is not None:
            sharded.kept.clear()
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        # Micro-batches: every member runs as many forward/backward passes as the member that needs
        # the most (each pass gathers the units), with no samples once its own share is done.
        size = g.micro[g.rank] or len(ids) or 1
        passes = max((-(-s // (m or s)) if s else 1) for s, m in zip(g.shares, g.micro))
        with computing(t, g, "the step's gathers"):  # (FSDP2's collectives may give the step up)
            for i in range(passes):
                chunk = ids[i * size:(i + 1) * size]
                if len(chunk):
                    inputs, targets = job.dataset[chunk]
                    loss = job.loss(sharded.model(inputs.to(t.device)), targets.to(t.device))
                    pause(t, g, "forward")
                    (loss / G).backward()  # type: ignore[no-untyped-call]
                    loss_sum = loss_sum + loss.detach().double()
                else:  # no samples left: the collectives of the pass still need this member
                    inputs, targets = job.dataset[torch.arange(1)]
                    (job.loss(sharded.model(inputs.to(t.device)), targets.to(t.device)) * 0).backward()  # type: ignore[no-untyped-call]
        # (`computing` ends with the compute: evaluation and the final gather run FSDP2's hooks too,
        # and are never given up.) This member's own compute: the step so far less FSDP2's
        # collectives (where it also waited for the slowest member), which count as communication,
        # as the cost model has them.
        collectives_s = self._collectives_s()
        compute_s = stretch(t, g, time.perf_counter() - t0 - collectives_s, len(ids))
        # (reported as the whole model's for these samples: the coordinator reads a member's speed
        # in whole-model samples/s)
        compute_s /= self.fraction
        pause(t, g, "backward")
        # Every member gets its copy's gradients: from here on the step may be rolled forward.
        t_copies = time.perf_counter()
        if sharded.reduced_everywhere:  # (gloo: the reduce-scatters were all-reduces; no message needed)
            self.copies.take(((fqn, local_grad(p)) for fqn, p in sharded.params.items()), sharded.kept)
        else:
            self.copies.exchange(((p.to_local() if isinstance(p, DTensor) else p, local_grad(p))
                                  for p in sharded.params.values()),
                                 g.members, g.pg, lambda work, buf: t.wait(g, work, buf), t.device)
        self.redundancy_s = time.perf_counter() - t_copies  # (what the copies cost this step: --trace-steps)
        collectives_s += self.redundancy_s  # (the copies' exchange: communication too)
        pause(t, g, "exchange")
        self.pending = True
        grads = [gr for p in self.params if (gr := local_grad(p)) is not None]
        squares = sum((squared_norm(gr) for gr in self._norm_grads(g)),
                      torch.zeros((), dtype=torch.float64, device=t.device))
        # The vote: the switch to a planned delta, and a `ctl save` and a checkpoint every member has
        # (writing either is a collective: all of them take it at the same step boundary).
        buf, pending = self._votes(t, g, loss_sum if self._counts_loss(g) else torch.zeros_like(loss_sum), squares)
        votes = len(buf)
        if buffers:  # (the members' updates of the model's buffers this step, weighted by their shares)
            buf = torch.cat([buf, buffers.deltas(len(ids), G)])
        t_comm = time.perf_counter()
        t.wait(g, g.pg.allreduce([buf]), buf)
        if buffers:
            buffers.apply(buf[votes:])
        comm_s = time.perf_counter() - t_comm + collectives_s
        grad_norm = float(buf[1].sqrt())
        pause(t, g, "optimizer")
        if t.config.pause_at == ("abandon", t.step + 1):
            t.log(f"abandoning step {t.step + 1} after its all-reduce (--pause-at)")
            raise Superseded
        lr = self._apply(t, grads, grad_norm, sharded.stepper.step)  # (the shards' local tensors: no DTensor dispatch)
        return self._end(t, g, buf, pending, len(ids), (compute_s, comm_s, time.perf_counter() - t0), lr, grad_norm)

    # --- hooks (tensor parallelism's: `worker.parallel.tensor.ShardedTensorExecutor`) ----------------

    def _collectives_s(self) -> float:
        """Seconds in the step's collectives since the last call (FSDP2's gathers and scatters)."""
        return self.sharded.comm.take()

    def _norm_grads(self, g: Group) -> list[torch.Tensor]:
        """The local gradients this member's squared norm counts: every shard's."""
        return [gr for p in self.params if (gr := local_grad(p)) is not None]

    def _counts_loss(self, g: Group) -> bool:
        """Whether this member's loss counts in the step's (every member computes its own samples)."""
        return True
