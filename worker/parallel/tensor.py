"""Tensor parallelism: the model's Linears split across a tp group with DTensor, replicas of that
split across the data-parallel axis (dp x tp), and pipelines whose stages are split so (pp x tp:
`TensorStageExecutor`).

Which modules are split, and how, is the job's (`Job.tp_plan`: module name patterns -> "colwise" or
"rowwise"), or a Hugging Face model's own (`config.base_model_tp_plan`, under the base model's
prefix); a job with neither never gets tp. Applied with torch's `parallelize_module`
(`ColwiseParallel` / `RowwiseParallel`: Megatron's split, as torchtitan applies it) to the model
built on the meta device, over the epoch's tp mesh (`worker.group.tp_mesh`: `AbortableGroup`s, so a
stopped peer cannot hold DTensor's all-reduces for the group timeout), then materialised and filled
with this member's boxes of every tensor (`plan.placement.box_of`: a column-wise weight's rows, a
row-wise weight's column block, the rest whole).

A step: every tp rank of a data-parallel slot computes the slot's samples (the activations are
replicated between the split modules; DTensor all-reduces the row-wise outputs and the column-wise
inputs' gradients), so the loss and the gradients of the tensors tp does not split are the same on
each: the loss and those tensors' squared norm count once (tp rank 0's), the split tensors' local
squares are summed over the tp group by the step's all-reduce. With replicas, every gradient is
summed over the replica group (one flat buffer per dtype); without, each member keeps a copy of
another's part (`worker.parallel.copies`: the ring `plan.reshard.copy_ring` gives). The optimizer
steps the local tensors (`LocalStep`: no DTensor dispatch; elementwise, so exact).

Which modules a job splits and which degrees it admits: `worker.tp_plan`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from plan.layout import Layout
from plan.placement import TensorShape, ranges_of
from plan.tensor import compute_fraction
from transport import PlanDelta
from worker import group as groups
from worker.abortable import AbortableGroup
from worker.comm import AllOf
from worker.executor import Executor, Loop, computing, local_grad, pause, slot_samples, squared_norm, stretch
from worker.group import Group
from worker.parallel.copies import Copies
from worker.parallel.fsdp import FsdpExecutor, Split, build_sharded, save_gathered
from worker.parallel.meta import meta_model
from worker.parallel.shard_step import LocalStep
from worker.parallel.slices import PARAM, LocalState, pieces_over
from worker.parallel.staged import (ShardedStageExecutor, Stage, StageExecutor, flops_fraction, gathered, sharded_stage,
                                    stage_module)
from worker.tp_plan import tp_styles

__all__ = ["ShardedTensorExecutor", "ShardedTensorStageExecutor", "TensorParallelExecutor", "TensorStageExecutor"]

def _parallel(styles: Mapping[str, str]) -> dict[str, Any]:
    return {name: ColwiseParallel() if style == "colwise" else RowwiseParallel() for name, style in styles.items()}


def _split(job: Any) -> Split:
    """FSDP x tp's split (`worker.parallel.fsdp.build_sharded`): a part of the job's model (the whole
    model, or a stage keeping its names) split over the tp mesh as the job's tp plan says."""
    def split(whole: nn.Module, module: nn.Module, mesh: Any) -> None:
        names = {n for n, _ in module.named_modules()}
        parallelize_module(module, mesh, _parallel({n: s for n, s in tp_styles(job, whole).items() if n in names}))
    return split


class TpWaits:
    """Seconds this member waited on its tp group's collectives (DTensor's all-reduces inside the
    forward and backward: for its peers, and for the wire) since the last `take`: a step reports
    them as communication, not compute, as the cost model has them (`plan.tensor.tp_comm_s`)."""

    def __init__(self, mesh: Any) -> None:
        group = mesh.get_group()
        self.group = group if isinstance(group, AbortableGroup) else None
        self.seen = self.group.waited_s if self.group is not None else 0.0

    def take(self) -> float:
        if self.group is None:
            return 0.0
        now = self.group.waited_s
        out, self.seen = now - self.seen, now
        return out


# --- the executor ------------------------------------------------------------------------------------


class TensorParallelExecutor(Executor):
    """dp x tp: the model's Linears split over this member's tp group, replicas across the rest."""

    owns_default_group = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, at: tuple[Layout, int], copies: Copies,
                 registered: list[dist.ProcessGroup], replicate: dist.ProcessGroup | None, tensors: list[TensorShape],
                 stepper: LocalStep, fraction: float, tp_waits: TpWaits) -> None:
        super().__init__(model, optimizer, at, copies)
        self.registered = registered  # the epoch's groups as registered with c10d
        self.tp_waits = tp_waits  # its waits on the tp group's collectives
        self.replicate = replicate  # the replica group the gradients are summed over (None: one replica)
        self.shapes = {t.name: t for t in tensors}
        self.stepper = stepper  # the optimizer's step on the local tensors
        self.fraction = fraction  # this member's share of the whole model's compute

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.tp > 1 and layout.pp == 1 and layout.dp_shard == 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        model, optimizer, on, registered, tensors = split_on_tp_mesh(t, g, local, lambda whole: whole)
        copies = Copies.of(g.layout, t.name, local, tensors)
        stepper = LocalStep(optimizer, [p for p in model.parameters() if p.requires_grad], t.job.optimizer)
        return cls(model, optimizer, (g.layout, g.rank), copies, registered, on.replicate, tensors, stepper,
                   compute_fraction(t.graph(), g.layout.tp), TpWaits(on.mesh))

    def close(self) -> None:
        super().close()
        groups.forget(self.registered)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def local_state(self, step: int) -> LocalState:
        assert self.at is not None
        local = split_state(self.model, self.optimizer, *self.at, self.shapes, step)
        return self._with_redundancy(local, self.model.named_parameters())

    def save(self, t: Loop, g: Group | None, directory: str, *, final: bool) -> None:
        """Every split tensor gathered whole over its tp group (every member calls it); rank 0 writes."""
        assert g is not None, "a split model is gathered over the epoch's group"
        save_gathered(t, g, self.model, self.optimizer, directory, final=final)

    def evaluate(self, t: Loop, g: Group) -> None:
        from worker.evaluate import evaluate

        evaluate(t, g, self.model, lockstep=True)

    def step(self, t: Loop, g: Group) -> PlanDelta | None:
        """One exact step: the slot's samples through the split model (every tp rank of the slot the
        same samples), the gradients summed over the replicas (or this member's sent to its copy's
        keeper), then one all-reduce of the loss (tp rank 0's), the squared gradient norm (the split
        tensors' shards from every tp rank, the others' from tp rank 0), the votes, and each member
        steps its own tensors."""
        t0 = time.perf_counter()
        job, G = t.job, t.job.global_batch
        ids = slot_samples(t, g)
        self.optimizer.zero_grad(set_to_none=True)
        buffers = self.buffers()
        buffers.begin()
        loss_sum = torch.zeros((), dtype=torch.float64, device=t.device)
        size = g.micro[g.rank] or len(ids) or 1
        self.tp_waits.take()
        with computing(t, g, "the step's tensor-parallel collectives"):
            for i in range(0, len(ids), size):
                inputs, targets = job.dataset[ids[i:i + size]]
                loss = job.loss(self.model(inputs.to(t.device)), targets.to(t.device))
                pause(t, g, "forward")
                (loss / G).backward()  # type: ignore[no-untyped-call]
                loss_sum = loss_sum + loss.detach().double()
        tp_s = self.tp_waits.take()  # (the split Linears' all-reduces: communication)
        compute_s = stretch(t, g, time.perf_counter() - t0 - tp_s, len(ids))
        pause(t, g, "backward")
        t_comm = time.perf_counter()
        if self.replicate is not None and not len(ids):
            # A replica with no samples this step (the planner may give a slow one none) has no
            # gradients: zeros, so that it takes part in the replicas' sum and applies the others'.
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [gr for p in self.params if (gr := local_grad(p)) is not None]
        if self.replicate is not None:
            self._sum_over_replicas(t, g, grads)
        t_copies = time.perf_counter()
        self.copies.exchange(((_local(p), local_grad(p)) for p in self.params), g.members, g.pg,
                             lambda work, buf: t.wait(g, work, buf), t.device)
        self.redundancy_s = time.perf_counter() - t_copies
        pause(t, g, "exchange")
        self.pending = True
        first = g.layout.coords(g.rank)[3] == 0
        squares = sum((squared_norm(gr) for gr in norm_grads(self._named(), g.layout, g.rank, self.shapes)),
                      torch.zeros((), dtype=torch.float64, device=t.device))
        buf, pending = self._votes(t, g, loss_sum if first else torch.zeros_like(loss_sum), squares)
        votes = len(buf)
        if buffers:
            buf = torch.cat([buf, buffers.deltas(len(ids), G)])
        t.wait(g, g.pg.allreduce([buf]), buf)
        if buffers:
            buffers.apply(buf[votes:])
        comm_s = time.perf_counter() - t_comm + tp_s
        grad_norm = float(buf[1].sqrt())
        pause(t, g, "optimizer")
        lr = self._apply(t, grads, grad_norm, self.stepper.step)
        # (its compute reported as the whole model's, as a pipeline stage's is: the coordinator reads
        # a member's speed in whole-model samples/s)
        whole_s = compute_s / self.fraction
        return self._end(t, g, buf, pending, len(ids), (whole_s, comm_s, time.perf_counter() - t0), lr, grad_norm)

    def _named(self) -> Iterable[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def _sum_over_replicas(self, t: Loop, g: Group, grads: list[torch.Tensor]) -> None:
        """Every local gradient summed over this member's replica group: one flat buffer per dtype."""
        assert self.replicate is not None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for gr in grads:
            by_dtype.setdefault(gr.dtype, []).append(gr)
        works = []
        flats = {}
        for dtype, tensors in by_dtype.items():
            flat = torch.cat([gr.reshape(-1) for gr in tensors])
            flats[dtype] = flat
            works.append((dist.all_reduce(flat, group=self.replicate, async_op=True), flat))
        t.wait(g, AllOf(works))
        for dtype, tensors in by_dtype.items():
            at = 0
            for gr in tensors:
                gr.view(-1).copy_(flats[dtype][at:at + gr.numel()])
                at += gr.numel()


def split_on_tp_mesh(t: Loop, g: Group, local: LocalState, part: Callable[[nn.Module], nn.Module]
                     ) -> tuple[nn.Module, torch.optim.Optimizer, groups.ShardMesh, list[dist.ProcessGroup], list[TensorShape]]:
    """The epoch's tp mesh (its groups registered first: forming them can be superseded, and then
    nothing is left registered), and `part` of the job's meta model (the whole model, or a stage of
    it) split over it and loaded (`split_module`): (module, optimizer, mesh, registered, tensors)."""
    registered: list[dist.ProcessGroup] = []
    try:
        on = groups.tp_mesh(g, t.device, registered, timeout_s=t.config.group_timeout_s,
                            superseded=lambda: t.agent.superseded(g.epoch))
        model = meta_model(t.job)
        module = part(model)
        tensors = t.tensors
        optimizer = split_module(t, module, tp_styles(t.job, model), on.mesh, g.layout, g.rank, local, tensors)
    except BaseException:
        groups.forget(registered)
        raise
    return module, optimizer, on, registered, tensors


def split_module(t: Loop, module: nn.Module, styles: Mapping[str, str], mesh: Any, layout: Layout, rank: int,
                 local: LocalState, tensors: Iterable[TensorShape]) -> torch.optim.Optimizer:
    """`module` (on the meta device) split over `mesh` as `styles` say (those of its modules), then
    materialised and filled with this member's boxes of `local`, and the job's optimizer over it
    with the state `local` carries."""
    names = {n for n, _ in module.named_modules()}
    parallelize_module(module, mesh, _parallel({n: s for n, s in styles.items() if n in names}))
    module.to_empty(device=t.device)
    by_name = {s.name: s for s in tensors}
    with torch.no_grad():
        for fqn, p in module.named_parameters():
            local.fill(fqn, PARAM, ranges_of(layout, rank, by_name[fqn]), _local(p).view(-1))
        for name, buf in module.named_buffers():
            if name in local.buffers:
                buf.copy_(local.buffers[name])
    optimizer = t.job.optimizer(module.parameters())
    _load_optimizer(optimizer, module, layout, rank, local, by_name)
    return optimizer


def split_state(module: nn.Module, optimizer: torch.optim.Optimizer, layout: Layout, rank: int,
                shapes: Mapping[str, TensorShape], step: int) -> LocalState:
    """What this member holds of a split module, as a LocalState: each tensor's boxes as pieces
    (views of the local tensors: one piece per range, a row-wise weight's one per row)."""
    local = LocalState(step=step, keys={})
    by_param = {id(p): n for n, p in module.named_parameters()}
    opt_state = {by_param[id(p)]: s for p, s in optimizer.state.items() if id(p) in by_param}
    for fqn, p in module.named_parameters():
        data = {PARAM: _local(p).detach().reshape(-1)}
        scalars: dict[str, Any] = {}
        for key, value in opt_state.get(fqn, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                data[key] = _local(value).detach().reshape(-1)
            else:
                scalars[key] = value
        local.pieces[fqn] = pieces_over(ranges_of(layout, rank, shapes[fqn]), data)
        local.keys[fqn] = tuple(data)
        local.dtypes[fqn] = {k: str(v.dtype).removeprefix("torch.") for k, v in data.items()}
        local.scalars[fqn] = scalars
    local.hyper = [{k: v for k, v in grp.items() if k != "params"} for grp in optimizer.param_groups]
    local.buffers = {n: b.detach() for n, b in module.named_buffers()}
    return local


def norm_grads(named: Iterable[tuple[str, nn.Parameter]], layout: Layout, rank: int,
               shapes: Mapping[str, TensorShape]) -> list[torch.Tensor]:
    """The local gradients a tp member's squared norm counts: its slices of the split tensors, and
    the others (the same on every tp rank of its slot; with FSDP, its shards of them) on the first
    tp rank only."""
    first = layout.coords(rank)[3] == 0
    return [gr for fqn, p in named if (gr := local_grad(p)) is not None
            and (first or shapes[fqn].tp_dim is not None and bool(shapes[fqn].shape))]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _load_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, layout: Layout, rank: int, local: LocalState,
                    shapes: Mapping[str, TensorShape]) -> None:
    """Hyper-parameters and per-parameter state from `local` (a fresh job starts with none); the
    state of a split parameter is a DTensor placed like it."""
    for group, hyper in zip(optimizer.param_groups, local.hyper):
        group.update(hyper)
    for fqn, p in model.named_parameters():
        keys = [k for k in local.keys.get(fqn, ()) if k != PARAM]
        if not keys and not local.scalars.get(fqn):
            continue
        shard = _local(p)
        state: dict[str, Any] = {}
        for key in keys:
            values = torch.empty(shard.numel(), dtype=local.dtype(fqn, key), device=shard.device)
            local.fill(fqn, key, ranges_of(layout, rank, shapes[fqn]), values)
            values = values.view(shard.shape)
            state[key] = (DTensor.from_local(values, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                             run_check=False) if isinstance(p, DTensor) else values)
        for key, value in local.scalars.get(fqn, {}).items():
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        optimizer.state[p] = state


# --- FSDP over a tensor-parallel split (FSDP x tp, HSDP x tp) ----------------------------------------


class ShardedTensorExecutor(FsdpExecutor):
    """FSDP x tp (and HSDP x tp): the model's Linears split over this member's tp group, then every
    unit sharded with FSDP2 over its shard group (torchtitan's order, on one 2-D mesh: FSDP2 shards
    the split parameters' tp-local blocks along dim 0, which is `plan.placement.box_of`'s box). The
    step is `FsdpExecutor.step` with the tp hooks: the loss and the tensors tp does not split count
    once per tp group, the compute reported as the whole model's. The copies are always exchanged
    (a member's copy may be of another tp rank's shards, which its reduce-scatters never saw)."""

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.tp > 1 and layout.pp == 1 and layout.dp_shard > 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        _, sharded, on, registered = build_sharded(t, g, local, lambda whole: whole, t.units(), split=_split(t.job))
        executor = cls(sharded, (g.layout, g.rank), Copies.of(g.layout, t.name, local, t.tensors), registered,
                       compute_fraction(t.graph(), g.layout.tp))
        executor.tp_waits = TpWaits(on.tp)
        return executor

    tp_waits: TpWaits

    def _collectives_s(self) -> float:
        return super()._collectives_s() + self.tp_waits.take()

    def _norm_grads(self, g: Group) -> list[torch.Tensor]:
        return norm_grads(((n, p) for n, p in self.sharded.params.items() if p.requires_grad), g.layout, g.rank,
                          self.sharded.shapes)

    def _counts_loss(self, g: Group) -> bool:
        return g.layout.coords(g.rank)[3] == 0


# --- pipelines of tensor-parallel stages (pp x tp) ---------------------------------------------------


class TensorStageExecutor(StageExecutor):
    """A pipeline stage split over its tp group (pp x tp, and replicas of that): the stage built on
    the meta device and split as the job's tp plan says (torchtitan's order: the pipeline split
    first, then tp within each stage), its boundary activations (the same on every tp rank) passed
    from each tp rank to the same tp rank of the next stage. The step is `StageExecutor.step` with
    the hooks below: the local tensors sent to the copy's keeper and stepped, the norm and the loss
    counted once per tp group."""

    def __init__(self, stage: Stage, at: tuple[Layout, int], copies: Copies, fraction: float, replicas: Any,
                 registered: list[dist.ProcessGroup], tensors: list[TensorShape], stepper: LocalStep,
                 tp_waits: TpWaits) -> None:
        super().__init__(stage, at, copies, fraction, replicas)
        self.registered = registered
        self.tp_waits = tp_waits
        self.shapes = {t.name: t for t in tensors}
        self.stepper = stepper

    owns_default_group = True

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.pp > 1 and layout.tp > 1 and layout.dp_shard == 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        index = g.layout.coords(g.rank)[0]
        module, optimizer, on, registered, tensors = split_on_tp_mesh(
            t, g, local, lambda model: stage_module(model, g.layout.stages[index]))
        assert isinstance(module, nn.Sequential)
        stage = Stage(module=module, optimizer=optimizer, stage=index, stages=g.layout.pp)
        fraction = flops_fraction(t, stage) * compute_fraction(t.graph(), g.layout.tp)
        stepper = LocalStep(optimizer, [p for p in module.parameters() if p.requires_grad], t.job.optimizer)
        return cls(stage, (g.layout, g.rank), Copies.of(g.layout, t.name, local, tensors), fraction, on.replicate,
                   registered, tensors, stepper, TpWaits(on.mesh))

    def close(self) -> None:
        super().close()
        groups.forget(self.registered)

    def local_state(self, step: int) -> LocalState:
        assert self.at is not None
        local = split_state(self.stage.module, self.stage.optimizer, *self.at, self.shapes, step)
        return self._with_redundancy(local, self.model.named_parameters())

    def _grads_to_copy(self) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
        return ((_local(p), local_grad(p)) for p in self.stage.module.parameters())

    def _optimizer_step(self) -> Callable[[], Any]:
        return self.stepper.step

    def _whole(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return gathered(self.stage)

    def _norm_grads(self, g: Group, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return norm_grads(self.stage.module.named_parameters(), g.layout, g.rank, self.shapes)

    def _counts_loss(self, g: Group) -> bool:
        return g.layout.coords(g.rank)[3] == 0

    def _collectives_s(self) -> float:
        return self.tp_waits.take()


# --- the full mesh: pipelines of sharded, tensor-parallel stages (pp x dp x fsdp x tp) ----------------


class ShardedTensorStageExecutor(ShardedStageExecutor):
    """A pipeline stage split over its tp group and then sharded with FSDP2 over its shard group, on
    one 2-D mesh (dp_shard, tp) as FSDP x tp builds it (`ShardedTensorExecutor`), with replicas of
    that where there are (HSDP within the stage): every degree at once. The step is
    `StageExecutor.step` with the sharded stage's hooks and tp's (the loss and the unsplit tensors
    counted once per tp group, the tp all-reduces reported as communication)."""

    tp_waits: TpWaits

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.pp > 1 and layout.dp_shard > 1 and layout.tp > 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        stage, sharded, on, registered = sharded_stage(t, g, local, split=_split(t.job))
        fraction = flops_fraction(t, stage) * compute_fraction(t.graph(), g.layout.tp)
        executor = cls(stage, (g.layout, g.rank), Copies.of(g.layout, t.name, local, t.tensors), fraction, sharded,
                       registered)
        executor.tp_waits = TpWaits(on.tp)
        return executor

    def _collectives_s(self) -> float:
        return super()._collectives_s() + self.tp_waits.take()

    def _norm_grads(self, g: Group, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return norm_grads(((n, p) for n, p in self.sharded.params.items() if p.requires_grad), g.layout, g.rank,
                          self.sharded.shapes)

    def _counts_loss(self, g: Group) -> bool:
        return g.layout.coords(g.rank)[3] == 0
