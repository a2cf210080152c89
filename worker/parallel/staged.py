"""The pipeline executor: this member's stage of the model (a contiguous run of the graph's units,
`Layout.stages`) and an optimizer over its parameters only, built from a `LocalState` and given
back as one, so a pipeline epoch can follow a replicated or sharded one and the other way round;
its step runs the stage's micro-batches in 1F1B order with point-to-point boundaries
(`worker.parallel.pipeline`), and a ring of copies keeps each stage's state on a member of
another stage (`worker.parallel.copies`).

A stage is built only for a model whose units form a sequence (`Graph.sequential`: an
`nn.Sequential` whose children are its units, in order). The stage is an `nn.Sequential` of this
member's units under their own names, so its parameters' names are the whole model's ("3.mlp.0.weight"
on the stage that holds unit "3"): the reshard, the checkpoint and `from_module` see the same names
in every layout. Nothing of the other stages is ever materialised.

FSDP x pp (`dp_shard` > 1, `ShardedStageExecutor`): the stage is built on the meta device and sharded with FSDP2 over the
stage's shard group (`worker.parallel.fsdp.shard_module`, each unit and then the stage), the
pipeline's order composed as torchtitan composes it (split, then shard each part). FSDP2 gathers
and reduce-scatters at every unit of every micro-batch, so the members of a stage's shard group
(each in a pipeline of its own) run the same number of micro-batches (`_even_micro_batches`) and,
evaluating, the same number of chunks.

Also here: the held-out loss through the pipeline (`evaluate_stage`: activations passed forward
only, the last stage sums the loss), and the whole state gathered to the first stage's rank for the
final model and `ctl save` (`gather_state`: each stage packs its part, `worker.state`, and sends it
point to point).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plan.layout import Layout
from plan.pipeline import micro_batches, micro_split
from transport import PlanDelta
from worker import comm, state
from worker import group as groups
from worker.comm import AllOf
from worker.executor import Executor, Loop, local_grad, pause, sleep, slot_samples, squared_norm
from worker.group import Group, ShardMesh
from worker.job import Job
from worker.parallel.copies import Copies
from worker.parallel.fsdp import HoldsShards, Sharded, Split, build_sharded
from worker.parallel.meta import meta_model
from worker.parallel.pipeline import StageStep, one_f_one_b, recv_tensor, send_tensor
from worker.parallel.slices import LocalState, to_module

Wait = Callable[[Any, torch.Tensor | None], None]  # the trainer's abortable wait (raises when superseded)

__all__ = ["ShardedStageExecutor", "Stage", "StageExecutor", "apply_stage", "evaluate_stage", "gather_state", "gathered",
           "neighbours", "whole_state"]


@dataclass(slots=True)
class Stage:
    """This member's stage: its units as one module, their optimizer, where it sits in the pipeline."""

    module: nn.Sequential
    optimizer: torch.optim.Optimizer
    stage: int
    stages: int


def neighbours(layout: Layout, rank: int) -> tuple[int | None, int | None]:
    """The ranks of the stages before and after `rank`'s in its pipeline (same data-parallel slot
    and tensor-parallel rank); None at either end."""
    pp, rep, shard, tp = layout.coords(rank)
    before = layout.rank_of(pp - 1, rep, shard, tp) if pp > 0 else None
    after = layout.rank_of(pp + 1, rep, shard, tp) if pp < layout.pp - 1 else None
    return before, after


def apply_stage(job: Job, layout: Layout, rank: int, local: LocalState, device: torch.device) -> Stage:
    """`rank`'s stage of the job's model on `device`, loaded from `local` (which holds every element
    of the stage's tensors: `plan.placement` gives a stage's ranks its units' tensors whole)."""
    stage = layout.coords(rank)[0]
    module = stage_module(meta_model(job), layout.stages[stage])
    return Stage(module=module, optimizer=to_module(local, module, job.optimizer, device), stage=stage,
                 stages=layout.pp)


def stage_module(model: nn.Module, units: Sequence[str]) -> nn.Sequential:
    """The stage of `model` made of `units` (module paths), as a Sequential that keeps the whole
    model's parameter names (the units are its children, under their own names)."""
    return nn.Sequential(OrderedDict((unit, model.get_submodule(unit)) for unit in units))


def evaluate_stage(stage: Stage, layout: Layout, rank: int, pg: Any, wait: Wait, job: Job, ids: torch.Tensor,
                   chunk: int, device: torch.device, *, passes: int = 0) -> tuple[float, int]:
    """This stage's part of the held-out loss over samples `ids` (its data-parallel slot's part), in
    chunks of `chunk`: the first stage reads the inputs, every stage passes its output on, and the
    last one sums the loss; (loss sum, samples) on the last stage, (0, 0) elsewhere. `passes`: at
    least this many chunks (a sharded stage's members gather together at every chunk): those past
    the slot's samples carry one held-out sample whose loss is not counted."""
    before, after = neighbours(layout, rank)
    send = lambda t, dst, tag: pg.send([t], dst, tag)  # noqa: E731
    recv = lambda t, src, tag: pg.recv([t], src, tag)  # noqa: E731
    total, count = 0.0, 0
    real = -(-len(ids) // chunk)
    stage.module.eval()
    try:
        with torch.no_grad():
            for k in range(max(real, passes)):
                part = ids[k * chunk:(k + 1) * chunk] if k < real else torch.arange(1)
                inputs, targets = job.eval_dataset[part]
                x = inputs.to(device) if before is None else recv_tensor(recv, wait, before, k, device)
                out = stage.module(x)
                if after is not None:
                    sent: list[tuple[Any, torch.Tensor]] = []
                    send_tensor(send, out, after, k, device, sent)
                    wait(AllOf(sent), None)
                elif k < real:
                    total += float(job.loss(out, targets.to(device)))
                    count += len(part)
    finally:
        stage.module.train()
    return total, count


def gather_state(stage: Stage, step: int, rank: int, ranks: Sequence[int], pg: Any, wait: Wait,
                 device: torch.device, *, whole: tuple[dict[str, Any], dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]] | None:
    """Every stage's whole state (`{"model": state_dict, "optimizer": {fqn: state}, "hyper": [...]}`),
    gathered to `ranks[0]` (the first stage of one pipeline), in stage order; None on the others.
    For the final model and `ctl save`: the file holds the whole model, as in every layout. `whole`:
    this stage's (model state dict, optimizer state by name), where it is sharded and gathered first."""
    model, by_name = whole if whole is not None else (stage.module.state_dict(), _optimizer_by_name(stage))
    mine = {"step": step, "model": model, "optimizer": by_name,
            "hyper": [{k: v for k, v in g.items() if k != "params"} for g in stage.optimizer.param_groups]}
    if rank != ranks[0]:
        packed = state.pack(mine, device)
        size = torch.tensor([packed.skeleton.numel()], dtype=torch.int64, device=device)
        for tag, tensor in enumerate([size, packed.skeleton, *packed.buffers]):
            wait(pg.send([tensor], ranks[0], tag), None)
        return None
    parts = [mine]
    for src in ranks[1:]:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        wait(pg.recv([size], src, 0), None)
        skeleton = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        wait(pg.recv([skeleton], src, 1), None)
        meta = state.read_meta(skeleton)
        buffers = state.empty_buffers(meta, device)
        for tag, buf in enumerate(buffers, start=2):
            wait(pg.recv([buf], src, tag), None)
        parts.append(state.unpack(meta, [b.cpu() for b in buffers]))
    return parts


def whole_state(parts: Sequence[dict[str, Any]], model_names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model's state dict and its optimizer's (`optimizer.state_dict()`'s form: state keyed
    by the parameter's index in `model_names`, the whole model's `named_parameters()` order) from
    every stage's part (`gather_state`)."""
    model: dict[str, Any] = {}
    by_name: dict[str, Any] = {}
    for part in parts:
        model.update(part["model"])
        by_name.update(part["optimizer"])
    index = {fqn: i for i, fqn in enumerate(model_names)}
    hyper = parts[0]["hyper"]
    if len(hyper) != 1:  # (which parameter went to which group is the job's optimizer's own rule)
        raise ValueError(f"the whole optimizer state of a pipeline needs one parameter group, the job's optimizer "
                         f"has {len(hyper)}")
    optimizer = {"state": {index[fqn]: st for fqn, st in by_name.items()},
                 "param_groups": [{**hyper[0], "params": list(range(len(model_names)))}]}
    return model, optimizer


def _optimizer_by_name(stage: Stage) -> dict[str, Any]:
    names = {id(p): n for n, p in stage.module.named_parameters()}
    return {names[id(p)]: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in stage.optimizer.state.items() if id(p) in names}


# --- the executor ------------------------------------------------------------------------------------


class StageExecutor(Executor):
    """A stage of a pipeline, whole on this member, and of replicated pipelines (dp x pp: the
    replicas of a stage sum its gradients over their own group, the stage's replica group formed
    with the epoch, before the step's all-reduce; a replica is then every stage's redundancy, and no
    copies are kept). Sharded stages are `ShardedStageExecutor`'s: the step is this one, with the
    hooks it overrides (`_sizes`, `_collectives_s`, `_grads_to_copy`, `_optimizer_step`, `_whole`)."""

    defer_copy_update = True  # (to its next step's bubble: `worker.parallel.copies`)

    def __init__(self, stage: Stage, at: tuple[Layout, int], copies: Copies, fraction: float,
                 replicas: Any = None) -> None:
        super().__init__(stage.module, stage.optimizer, at, copies)
        self.stage = stage
        self.fraction = fraction  # the stage's units' share of the model's training FLOPs
        self.replicas = replicas  # the raw group of this stage's replicas (None: one pipeline)

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.pp > 1 and layout.dp_shard == 1 and layout.tp == 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        stage = apply_stage(t.job, g.layout, g.rank, local, t.device)
        replicas = None
        if g.layout.dp_replicate > 1:
            ranks = g.layout.replicate_group(g.rank)
            replicas = comm.form_group(g.store, g.epoch, ranks.index(g.rank), len(ranks), t.device,
                                       timeout_s=t.config.group_timeout_s,
                                       superseded=lambda: t.agent.superseded(g.epoch), part=f"stage{stage.stage}/")
        return cls(stage, (g.layout, g.rank), Copies.of(g.layout, t.name, local, t.tensors),
                   flops_fraction(t, stage), replicas)

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters this member steps: its stage's."""
        return [p for p in self.stage.module.parameters() if p.requires_grad]

    # --- what a sharded stage does its way (`ShardedStageExecutor`) ---------------------------------

    def _sizes(self, g: Group, samples: int) -> tuple[int, ...]:
        """This member's micro-batch sizes: its share as the planner predicted it (`Group.micro`)."""
        return micro_split(samples, g.micro[g.rank] or samples) if samples else ()

    def _collectives_s(self) -> float:
        """Seconds of collectives inside the compute since last asked (none: the stage is whole)."""
        return 0.0

    def _grads_to_copy(self) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
        """(this member's part of each parameter, its gradient) for the copy's keeper."""
        return ((p, p.grad) for p in self.stage.module.parameters())

    def _optimizer_step(self) -> Callable[[], Any]:
        return self.stage.optimizer.step

    def _whole(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The stage's whole state where it must be gathered first (None: it is whole here)."""
        return None

    def _norm_grads(self, g: Group, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients this member's squared norm counts: every element once over the members of
        one replica (a stage's, or a shard's: all of them)."""
        return grads

    def _counts_loss(self, g: Group) -> bool:
        """Whether this member's loss sum counts (a last stage's, once per data-parallel slot)."""
        return True

    def _sum_over_replicas(self, t: Loop, g: Group) -> None:
        """The stage's gradients summed over its replicas (every pipeline computed its own slice of
        the batch), in one buffer; abandoned with the epoch like every wait."""
        params = list(self.stage.module.parameters())
        flat = torch.cat([p.grad.reshape(-1).float() if p.grad is not None
                          else torch.zeros(p.numel(), dtype=torch.float32, device=t.device) for p in params])
        t.wait(dataclasses.replace(g, pg=self.replicas), self.replicas.allreduce([flat]), flat)
        at = 0
        for p in params:
            p.grad = flat[at:at + p.numel()].view_as(p).to(p.dtype)
            at += p.numel()

    def local_state(self, step: int) -> LocalState:
        return self._with_redundancy(super().local_state(step), self.model.named_parameters())

    def evaluate(self, t: Loop, g: Group) -> None:
        from worker.evaluate import evaluate_pipeline

        evaluate_pipeline(t, g, self.stage)

    def save(self, t: Loop, g: Group | None, directory: str, *, final: bool) -> None:
        """Gather every stage's state to the pipeline's first rank (every member), which writes the
        whole model (`gather_state`)."""
        assert g is not None, "the stages are gathered over the epoch's group"
        whole = self._whole()  # (a sharded stage: every shard of it takes part)
        ranks = [g.layout.rank_of(p, 0, 0, 0) for p in range(g.layout.pp)]
        if g.rank not in ranks:  # (another replica or shard of the pipeline: the first one writes)
            return
        parts = gather_state(self.stage, t.step, g.rank, ranks, g.pg, lambda work, buf: t.wait(g, work, buf), t.device,
                             whole=whole)
        if parts is None:
            return
        model_state, optimizer_state = whole_state(parts, list(t.shapes))
        t.write(directory, final, model_state, optimizer_state)

    def step(self, t: Loop, g: Group) -> PlanDelta | None:
        """One exact step of a pipeline stage: its data-parallel slot's samples as contiguous
        micro-batches (`Group.micro`: the largest micro-batch's size; sizes differ by at most one:
        `plan.pipeline.micro_split`), run through the stages in 1F1B order, the last stage summing the
        loss over the global batch; the copies' gradient exchange (from then on the step may be rolled
        forward); then one all-reduce of the loss, the squared gradient norm (every stage's parameters
        once), the vote, a pending `ctl save` and a pending checkpoint, and each stage steps its own
        optimizer. Every wait for a neighbour is the loop's abortable one: a stage whose neighbour
        died gives the step up (Superseded) as soon as the epoch is superseded."""
        stage = self.stage
        t0 = time.perf_counter()
        job, G = t.job, t.job.global_batch
        ids = slot_samples(t, g)
        stage.optimizer.zero_grad(set_to_none=True)
        sizes = self._sizes(g, len(ids))
        self._collectives_s()  # (a sharded stage: FSDP2's gathers and scatters of this step from here on)
        bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        # (a micro-batch of no samples, where a shard's slot has fewer than its group's count: one
        # sample whose loss weighs nothing, so that its gathers still run)
        chunks = [ids[a:b] if b > a else ids[:1] if len(ids) else torch.arange(1) for a, b in zip(bounds, bounds[1:])]
        before, after = neighbours(g.layout, g.rank)
        waited = [0.0]  # seconds spent waiting for the neighbours (the bubble, their sends): not compute
        chores = [0.0]  # seconds of the last step's deferred copy update, run in this step's first idle wait
        chores_cpu = [0.0]  # (its CPU time)
        self.copies.receive(g.members, g.pg, t.device)  # (the source's gradients land while this stage computes)

        def wait(work: Any, buf: torch.Tensor | None) -> None:
            if self.copies.deferred is not None:  # (its first wait for a neighbour: the bubble, where
                c0 = time.thread_time()  # it would idle; a gloo p2p op completes only in a wait)
                chores[0] += self.copies.flush()
                chores_cpu[0] += time.thread_time() - c0
            w0 = time.perf_counter()
            try:
                t.wait(g, work, buf)
            finally:
                waited[0] += time.perf_counter() - w0
        run = StageStep(module=stage.module, stage=stage.stage, stages=stage.stages, prev_rank=before, next_rank=after,
                        send=lambda x, dst, tag: g.pg.send([x], dst, tag),
                        recv=lambda x, src, tag: g.pg.recv([x], src, tag), wait=wait, sizes=sizes, device=t.device,
                        inputs=[job.dataset[c][0] for c in chunks] if before is None else (),
                        targets=[job.dataset[c][1] for c in chunks] if after is None else (),
                        loss=job.loss, global_batch=G, weights=[1.0 if n else 0.0 for n in sizes])
        sends: list[tuple[Any, torch.Tensor]] = []  # the 1F1B's sends in flight: waited for with the copies' exchange
        try:
            t.computing = g.epoch  # (a send that fails with its peer is the loop's Superseded: `Trainer._train_step`)
            cpu0 = time.thread_time()
            try:
                pause(t, g, "forward")  # (before its first forward: its neighbours wait for it point to point)
                loss_sum = one_f_one_b(run, sends)
            finally:
                t.computing = 0
            # This stage's compute, reported as the whole model's for these samples (the coordinator reads
            # a member's speed in whole-model samples/s): the stage's time less its waits, over its units'
            # share of the model's FLOPs.
            waited[0] += self._collectives_s()  # (FSDP2's, where it also waited for its slowest shard: communication)
            busy = time.perf_counter() - t0 - waited[0] - chores[0]
            compute_s = busy / self.fraction
            factor = t.agent.slowdown
            if factor > 1.0 and len(ids):  # the --slowdown test knob: this stage's compute stretched (the
                # pipeline waits for it at its next step's boundaries, as for a slow device). On the CPU
                # its compute is its thread's CPU time, which other processes on the same cores do not
                # inflate (the wall time less waits does), so the stretch is the same on a loaded machine.
                own = busy if t.device.type == "cuda" else time.thread_time() - cpu0 - chores_cpu[0]
                sleep(t, g, (factor - 1.0) * own)
                compute_s += (factor - 1.0) * own / self.fraction
            pause(t, g, "backward")
            if self.replicas is not None:
                t_sum = time.perf_counter()
                self._sum_over_replicas(t, g)
                waited[0] += time.perf_counter() - t_sum
        except BaseException:
            comm.outlive(g.pg, sends)  # (the step given up before their wait: held till they end, never waited for)
            raise
        # Every member gets its copy's gradients (its source's stage): from here on the step may be
        # rolled forward. (The 1F1B's last sends complete in the same wait.)
        t_copies = time.perf_counter()
        self.copies.finish(self._grads_to_copy(), g.members, g.pg, wait, t.device, also=sends)
        self.redundancy_s = time.perf_counter() - t_copies + chores[0]
        pause(t, g, "exchange")
        self.pending = True
        grads = [gr for p in self.params if (gr := local_grad(p)) is not None]
        squares = sum((squared_norm(gr) for gr in self._norm_grads(g, grads)),
                      torch.zeros((), dtype=torch.float64, device=t.device))
        buf, pending = self._votes(t, g, loss_sum if self._counts_loss(g) else torch.zeros_like(loss_sum), squares)
        t_comm = time.perf_counter()
        t.wait(g, g.pg.allreduce([buf]), buf)
        comm_s = time.perf_counter() - t_comm + waited[0]
        grad_norm = float(buf[1].sqrt())
        pause(t, g, "optimizer")
        lr = self._apply(t, grads, grad_norm, self._optimizer_step())
        return self._end(t, g, buf, pending, len(ids), (compute_s, comm_s, time.perf_counter() - t0), lr, grad_norm)


class ShardedStageExecutor(HoldsShards, StageExecutor):
    """A stage of sharded pipelines (FSDP x pp): the stage built on the meta device and sharded with
    FSDP2 over its shard group (torchtitan's order: split, then shard each part), a ring of copies of
    the shards; with replicas too (pp, dp, fsdp), HSDP within the stage, the replicas its redundancy.
    Its step is `StageExecutor.step` with the hooks below; what it holds, `HoldsShards`."""

    def __init__(self, stage: Stage, at: tuple[Layout, int], copies: Copies, fraction: float, sharded: Sharded,
                 registered: list[dist.ProcessGroup]) -> None:
        super().__init__(stage, at, copies, fraction)
        self.sharded = sharded  # the stage's FSDP2 state
        self.registered = registered  # its groups as registered with c10d

    @staticmethod
    def fits(layout: Layout) -> bool:
        return layout.pp > 1 and layout.dp_shard > 1 and layout.tp == 1

    @classmethod
    def build(cls, t: Loop, g: Group, local: LocalState) -> Executor:
        """The stage on the meta device, sharded with FSDP2 over its shard group (registered first,
        as `FsdpExecutor.build` does: forming it can be superseded, and then nothing is left
        registered)."""
        stage, sharded, _, registered = sharded_stage(t, g, local)
        return cls(stage, (g.layout, g.rank), Copies.of(g.layout, t.name, local, t.tensors),
                   flops_fraction(t, stage), sharded, registered)

    def _sizes(self, g: Group, samples: int) -> tuple[int, ...]:
        return _even_micro_batches(g, samples)

    def _collectives_s(self) -> float:
        return self.sharded.comm.take()

    def _grads_to_copy(self) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
        return ((p.to_local() if isinstance(p, DTensor) else p, local_grad(p)) for p in self.sharded.params.values())

    def _optimizer_step(self) -> Callable[[], Any]:
        return self.sharded.stepper.step

    def _whole(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return self._gathered()

    def _gathered(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return gathered(self.stage)


def sharded_stage(t: Loop, g: Group, local: LocalState, split: Split | None = None
                  ) -> tuple[Stage, Sharded, ShardMesh, list[dist.ProcessGroup]]:
    """This member's stage built on the meta device and sharded with FSDP2 over its shard group
    (`build_sharded`; with `split`, split over its tp group first): (stage, shards, mesh, groups)."""
    index = g.layout.coords(g.rank)[0]
    units = g.layout.stages[index]
    module, sharded, on, registered = build_sharded(t, g, local, lambda whole: stage_module(whole, units), units,
                                                    split=split)
    assert isinstance(module, nn.Sequential)
    return Stage(module=module, optimizer=sharded.optimizer, stage=index, stages=g.layout.pp), sharded, on, registered


def gathered(stage: Stage) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stage's whole model and optimizer state (by parameter name), gathered from its DTensors
    (FSDP2's shards, tensor parallelism's slices): a collective of the groups they are split over."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    # (no cpu_offload: with it only the default group's rank 0 gets the state, and every stage's
    # first shard needs its own)
    options = StateDictOptions(full_state_dict=True)
    model = get_model_state_dict(stage.module, options=options)
    by_name: dict[str, Any] = dict(get_optimizer_state_dict(stage.module, stage.optimizer, options=options))

    def cpu(v: Any) -> Any:
        return v.detach().cpu() if isinstance(v, torch.Tensor) else v

    return ({k: cpu(v) for k, v in model.items()},
            {fqn: {k: cpu(v) for k, v in st.items()} for fqn, st in by_name["state"].items()})


def _even_micro_batches(g: Group, samples: int) -> tuple[int, ...]:
    """This member's `samples` as as many micro-batches as the member of its stage that runs the
    most (`micro_split` of each one's share by its micro-batch size): FSDP2 gathers each unit for
    every micro-batch (and, with replicas, all-reduces its gradient shards across them), so every
    member of a stage runs the same count. Sizes differ by at most one; a slot with fewer samples
    than the count gets empty micro-batches at the end."""
    stage = g.layout.coords(g.rank)[0]
    peers = [r for r in range(len(g.layout.members)) if g.layout.coords(r)[0] == stage]
    count = max(len(micro_split(share, micro or share)) if share else 1
                for share, micro in ((g.shares[r], g.micro[r]) for r in peers))
    return micro_batches(samples, count) if samples >= count else (1,) * samples + (0,) * (count - samples)


def flops_fraction(t: Loop, stage: Stage) -> float:
    """The stage's units' share of the model's training FLOPs (1 when the graph does not say)."""
    layers = t.graph().layers
    total = sum(layer.train_flops for layer in layers)
    units = {name for name, _ in stage.module.named_children()}
    mine = sum(layer.train_flops for layer in layers if layer.name in units)
    return mine / total if total > 0 and mine > 0 else 1.0
