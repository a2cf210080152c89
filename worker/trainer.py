"""The training loop of one worker: exact data parallelism across epochs that come and go.

Each epoch has its own gloo group, formed through the coordinator's store. Per step a replica
computes the summed loss of its contiguous slice of the step's global batch, divides by the global
batch size, and all-reduces (SUM) one flat buffer holding the gradients, the loss sum and a
"switch" flag. So every replica applies the full-batch gradient, and every replica learns the same
two facts at once: the global loss, and whether all of them hold the next planned delta. When all
do, they switch epochs right after that step, with no extra round trip (the agreed step boundary).

Failures: every collective is issued asynchronously on a buffer used once, and waited for by a
`comm.Waiter` that the agent wakes when an abort arrives. A superseded collective is not waited for
(gloo can block for its whole timeout): it is left to end in the background, and the step is
abandoned with no state touched. In the next epoch the survivors all-reduce their step counters; the lowest rank with
the most steps sends its state (model, optimizer, step) to every rank that is behind or new, so all
continue from one consistent step: no step is lost or applied twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from plan.layout import Layout
from plan.reshard import TensorShape
from plan.shares import split_shares
from transport import Ack, EvalReport, Leave, PlanDelta, Saved, StateLost, StepReport
from transport.security import ClientKeys
from worker import comm, epoch, state
from worker.agent import Agent
from worker.comm import Superseded
from worker.job import Job, sample_ids, share_slice
from worker.parallel import mesh as meshes
from worker.parallel.fsdp import Sharded, apply_fsdp, extract
from worker.parallel.replicated import GradBuckets, apply_replicated
from worker.parallel.copies import Copies
from worker.parallel.slices import PARAM, LocalState, from_module
from worker.parallel.update import GRAD, apply_update
from worker.save import save_model, save_state
from worker.store import CoordinatorStore

RETRY_S = 0.5  # pause before forming an epoch's group again after a failed rendezvous
EVAL_CHUNK = 256  # held-out samples evaluated at once (bounds the memory of an evaluation)


@dataclass(slots=True)
class Group:
    epoch: int
    pg: Any  # dist.ProcessGroupGloo or ProcessGroupNCCL
    store: CoordinatorStore  # kept alive as long as the group that was formed through it
    rank: int
    members: list[str]
    shares: list[int]
    layout: Layout
    micro: list[int] = dataclasses.field(default_factory=list)  # per member: samples per pass (0: the whole share)

    def __post_init__(self) -> None:
        if len(self.micro) != len(self.shares):
            self.micro = [0] * len(self.shares)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    group_timeout_s: float = 60.0
    digest_every: int = 0  # 0: never hash parameters
    log_every: int = 10
    delta_timeout_s: float = 600.0  # how long to wait for a plan before giving up
    device: str = "cpu"
    keys: ClientKeys | None = None  # CURVE keys for the store's sockets (None: --insecure coordinator)
    trace_path: str | None = None  # append every step report here as a JSON line (--trace-steps)
    pause_at: tuple[str, int] | None = None  # (phase, step): the --pause-at fault-injection knob
    final_dir: str = ""  # where rank 0 of the last step writes the trained model ("": nowhere)


class Trainer:
    def __init__(self, job: Job, agent: Agent, endpoint: str, config: TrainerConfig) -> None:
        self.job = job
        self.agent = agent
        self.endpoint = endpoint
        self.config = config
        self.name = agent.name
        self.device = torch.device(config.device)
        self._build()
        self.numel = sum(p.numel() for p in self.params)
        self.stale = False  # our state may differ from the survivors' (we were fenced): take theirs
        self.waiter = comm.Waiter(self.device)
        agent.on_interrupt = self.waiter.interrupt
        self.leave_reason: str | None = None  # set on SIGTERM
        self.epoch_tried = 0  # the newest epoch this worker entered or tried to enter
        self.final_writer = False  # rank 0 of the group that committed the last step: it writes the model
        # Sharded layouts (worker.parallel): the FSDP2 executor of the current sharded epoch, with the
        # layout and rank it was built for, and its group as registered with c10d.
        self.sharded: Sharded | None = None
        self.sharded_at: tuple[Layout, int] | None = None
        self.registered: dist.ProcessGroup | None = None
        self.sub_groups: list[dist.ProcessGroup] = []  # HSDP: this member's replica and shard groups
        self._units: list[str] | None = None
        self._buckets: GradBuckets | None = None  # the replicated step's gradient buckets
        self.largest_sender = 0  # bytes the busiest sender of the last reshard sent (for the Ack)
        # Redundancy of a sharded layout: who keeps a copy of my slices, whose slices I keep a copy
        # of (and that copy), whether this step's gradients are held but not applied, and the
        # clipping coefficient of the last step applied (for a roll forward after a failure).
        self.copies = Copies.none()
        self.pending = False
        self.coefficient = 1.0

    def _build(self) -> None:
        """The model and optimizer as at step 0, identical on every worker (seeded)."""
        torch.manual_seed(self.job.seed)
        self.model = self.job.model().to(self.device)
        self.optimizer = self.job.optimizer(self.model.parameters())
        # The schedule multiplies these; a state received from a peer carries the lr it last used,
        # so each step sets every group's lr from its base again (exact under churn).
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.tensors = [TensorShape(n, p.shape[0] if p.dim() else 0, p.numel()) for n, p in self.model.named_parameters()]
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.step = 0  # optimizer steps applied

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> str:
        """Train until the job's last step, a stop or a planned exit; returns why it ended."""
        group: Group | None = None
        while True:
            if self.agent.take_fenced():
                self._log("fenced: dropping local state, will take the survivors'")
                group, self.stale = None, True
            if self.step >= self.job.num_steps:
                if self.final_writer and self.config.final_dir and self.sharded is None:
                    self._save(self.config.final_dir, final=True)
                return self._leave("finished")
            stop = self.agent.stop_reason()
            if stop is not None:  # "drained" comes once the plan without us is in place
                reason = "drained" if stop == "drained" else "stopped"
                self.agent.say_goodbye(Leave(name=self.name, reason=reason))
                return reason if reason == "drained" else f"stopped: {stop}"
            if group is None or self.agent.superseded(group.epoch):
                delta = self.agent.next_delta(self.epoch_tried, self.config.delta_timeout_s)
            else:
                try:
                    delta = self._train_step(group)  # a planned delta all ranks agreed to switch to
                except Superseded:
                    self._log(f"epoch {group.epoch} abandoned at step {self.step}")
                    group = None
                    continue
            if delta is None:
                continue
            self.epoch_tried = delta.epoch
            if self.name in delta.members:
                group = self._enter(delta)
                continue
            if self.name in delta.senders:
                self._enter(delta)  # hand the slices over, then go as planned
            if self.leave_reason is not None:
                return self._leave(self.leave_reason)
            else:
                self._standby(delta)
                group = None

    def _save(self, directory: str, *, final: bool) -> None:
        """Write the model and optimizer state to `directory` at this step boundary (replicas are
        identical: one member writes) and tell the coordinator how it went."""
        self._write(directory, final, lambda path: save_model(self.model, self.optimizer, path))

    def _write(self, directory: str, final: bool, write: Callable[[Path], int]) -> None:
        """Write the model with `write(path) -> bytes` and tell the coordinator how it went."""
        path = Path(directory)
        try:
            size = write(path)
        except OSError as e:
            self._log(f"could not write the model to {path}: {e}")
            self.agent.send(Saved(name=self.name, step=self.step, path=str(path), bytes=0, error=str(e)[:500],
                                  final=final))
            return
        self._log(f"wrote the model after step {self.step} to {path} ({size / 1e6:.1f} MB)")
        self.agent.send(Saved(name=self.name, step=self.step, path=str(path), bytes=size, error="", final=final))

    def _standby(self, delta: PlanDelta) -> None:
        """Planned out without asking to leave (drained, or more workers than the plan uses):
        keep the process and wait for the next plan (or a Stop)."""
        self.agent.epoch = delta.epoch
        self._log(f"not in epoch {delta.epoch} ({delta.reason}): on standby")

    def _leave(self, reason: str) -> str:
        self.agent.say_goodbye(Leave(name=self.name, reason=reason))
        deadline = time.monotonic() + 2.0
        while self.agent.stop_reason() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return reason

    # --- epochs --------------------------------------------------------------------------------

    def _enter(self, delta: PlanDelta) -> Group | None:
        """Form the epoch's group and bring every member to one consistent step. A sender (a leaving
        holder of sharded state) takes part in the reshard only, and gets None."""
        t0 = time.perf_counter()
        self.largest_sender = 0
        senders = [n for n in delta.senders if n not in delta.members]
        ranks = [*delta.members, *senders]
        rank, world = ranks.index(self.name), len(ranks)
        store = CoordinatorStore(self.endpoint, is_aborted=lambda: self.agent.superseded(delta.epoch),
                                 timeout_s=self.config.group_timeout_s, keys=self.config.keys)
        superseded = lambda: self.agent.superseded(delta.epoch)  # noqa: E731
        try:
            pg = comm.form_group(store, delta.epoch, rank, world, self.device,
                                 timeout_s=self.config.group_timeout_s, superseded=superseded)
            layout = Layout.from_dict(dataclasses.asdict(delta.layout))
            group = Group(epoch=delta.epoch, pg=pg, store=store, rank=rank, members=ranks,
                          shares=list(delta.shares), layout=layout, micro=list(delta.micro_batch))
            if layout.sharded or self.sharded is not None or senders:
                # Any epoch with sharded state on either side goes through the slice reshard.
                local, received = self._reshard(group)
                if self.name not in delta.members:
                    self._drop_state()
                    self._log(f"epoch {delta.epoch}: handed over my slices ({local.nbytes()} bytes kept)")
                    return None
                if senders:  # the senders are done: the members train in a group of their own
                    pg = comm.form_group(store, delta.epoch, rank, len(delta.members), self.device,
                                         timeout_s=self.config.group_timeout_s, superseded=superseded, part="train/")
                    group = Group(epoch=delta.epoch, pg=pg, store=store, rank=rank, members=list(delta.members),
                                  shares=list(delta.shares), layout=layout, micro=list(delta.micro_batch))
                self._build_executor(group, local)
            else:  # replicated to replicated keeps the model and sends whole states (the fast path)
                received = self._reconcile(group)
        except epoch.StateLost as e:
            self._log(f"epoch {delta.epoch}: the training state is lost: {e}")
            self.agent.send(StateLost(name=self.name, epoch=delta.epoch, detail=str(e)[:1000]))
            self._drop_state()
            return None
        except Superseded:
            self._log(f"epoch {delta.epoch} superseded while forming")
            return None
        except RuntimeError as e:  # e.g. a peer never came to the rendezvous: the coordinator
            # re-sends the plan to a member that lost it, or re-plans; try again until then.
            self._log(f"could not form epoch {delta.epoch} ({str(e).splitlines()[0]}); retrying")
            self.epoch_tried = delta.epoch - 1
            time.sleep(RETRY_S)
            return None
        self.agent.epoch = delta.epoch
        self.agent.step = self.step
        seconds = time.perf_counter() - t0
        self.agent.send(Ack(name=self.name, epoch=delta.epoch, step=self.step, reshard_bytes=received,
                            reshard_largest_sender=self.largest_sender,
                            reshard_s=seconds))
        self._log(f"epoch {delta.epoch} ({delta.reason}): rank {rank}/{world}, share "
                  f"{delta.shares[rank]}/{delta.global_batch}, step {self.step}, formed in {seconds * 1e3:.0f} ms"
                  + (f", received {received / 1e6:.1f} MB" if received else ""))
        return group

    def _reconcile(self, g: Group) -> int:
        """All-reduce step counters; the lowest rank with the most steps sends its state to every
        rank that is behind (or new, or stale). Returns the bytes this rank received."""
        world = len(g.members)
        steps = torch.zeros(world, dtype=torch.float64, device=self.device)
        steps[g.rank] = -1 if self.stale else self.step
        self._wait(g, g.pg.allreduce([steps]))
        counts = [int(s) for s in steps.tolist()]
        best = max(counts)
        if best < 0:  # nobody has state: start over from the seed
            self._build()
            self.stale = False
            return 0
        source = counts.index(best)
        behind = [r for r, s in enumerate(counts) if s < best]
        if g.rank == source and behind:
            packed = state.pack(self._state(), self.device)
            size = torch.tensor([packed.skeleton.numel()], dtype=torch.int64, device=self.device)
            for r in behind:
                for tag, tensor in enumerate([size, packed.skeleton, *packed.buffers]):
                    self._wait(g, g.pg.send([tensor], r, tag))
            self.largest_sender = state.nbytes(packed) * len(behind)  # the only sender
            return 0
        if g.rank in behind:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._wait(g, g.pg.recv([size], source, 0))
            skeleton = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            self._wait(g, g.pg.recv([skeleton], source, 1))
            meta = state.read_meta(skeleton)
            buffers = state.empty_buffers(meta, self.device)
            for tag, buf in enumerate(buffers, start=2):
                self._wait(g, g.pg.recv([buf], source, tag))
            # Unpack on the CPU: optimizers keep some state (Adam's step) there.
            received = state.unpack(meta, [b.cpu() for b in buffers])
            self.model.load_state_dict(received["model"])
            self.optimizer.load_state_dict(received["optimizer"])
            self.step, self.stale = int(received["step"]), False
            return int(size.item()) + sum(b.numel() * b.element_size() for b in buffers)
        return 0

    def _reshard(self, g: Group) -> tuple[LocalState, int]:
        """Bring this member to exactly its slices of the new layout (`worker.epoch`); the new state
        and the bytes received."""
        local = None if self.stale else self._local_state()
        new, received, plan = epoch.enter(g.layout, self.tensors, self.name, g.members, local, g.pg,
                                       lambda work, buf: self._wait(g, work, buf), self.device, self._seed_state,
                                       self._roll_forward, copies=g.layout.sharded and g.layout.dp_replicate == 1)
        self.step, self.stale = new.step, False
        element_bytes = {fqn: sum(torch.empty(0, dtype=new.dtype(fqn, k)).element_size() for k in keys)
                         for fqn, keys in new.keys.items()}
        self.largest_sender = plan.largest_sender(element_bytes)
        return new, received

    def _roll_forward(self, local: LocalState, coefficient: float) -> None:
        """Apply the interrupted step to every held slice with the gradients kept for it."""
        k = local.step
        updated = apply_update(self.job.optimizer, local, local.pieces, self.shapes,
                               lambda i: self.base_lrs[i] * self.job.lr_multiplier(k), coefficient)
        local.step, local.pending, local.coefficient = k + 1, False, coefficient
        self._log(f"rolled step {k + 1} forward on {updated} slices (others applied it before the failure)")

    def _build_executor(self, g: Group, local: LocalState) -> None:
        """The layout's executor from this member's slices: FSDP2 on the group for a sharded layout,
        a plain replica otherwise."""
        self._forget_groups()
        if g.layout.sharded:
            prefixed = dist.PrefixStore(f"epoch{g.epoch}/", g.store)  # type: ignore[attr-defined]
            self.registered = meshes.register(g.pg, prefixed, g.rank, len(g.members), g.epoch, self.device)
            mesh = meshes.mesh_of(self.registered, self.device, g.epoch)
            if g.layout.dp_replicate > 1:  # HSDP: a 2-D mesh of this member's replica row and shard column
                for part, ranks in (("replicate", g.layout.replicate_group(g.rank)),
                                    ("shard", g.layout.shard_group(g.rank))):
                    name = f"{part}{ranks[0]}"
                    raw = comm.form_group(g.store, g.epoch, ranks.index(g.rank), len(ranks), self.device,
                                          timeout_s=self.config.group_timeout_s,
                                          superseded=lambda: self.agent.superseded(g.epoch), part=f"{name}/")
                    sub_store = dist.PrefixStore(f"epoch{g.epoch}/{name}/", g.store)  # type: ignore[attr-defined]
                    self.sub_groups.append(meshes.register(raw, sub_store, ranks.index(g.rank), len(ranks), g.epoch,
                                                           self.device, part=name, ranks=ranks))
                mesh = meshes.mesh_of(self.registered, self.device, g.epoch,
                                      (g.layout.dp_replicate, g.layout.dp_shard), self.sub_groups)
            mp = (MixedPrecisionPolicy(param_dtype=getattr(torch, self.job.compute_dtype), reduce_dtype=torch.float32)
                  if self.job.compute_dtype else None)
            self.sharded = apply_fsdp(self.job, self.units(), g.layout, g.rank, mesh, local, self.device,
                                      mp_policy=mp, wait=lambda work, buf: self._wait(g, work, buf))
            self.sharded_at = (g.layout, g.rank)
            self.model, self.optimizer = self.sharded.model, self.sharded.optimizer
            self.copies = Copies.of(g.layout, self.name, local, self.tensors)
            if self._buckets is not None:  # the replica they hooked is gone
                self._buckets.close()
                self._buckets = None
        else:
            replica = apply_replicated(self.job, local, self.device)
            self.model, self.optimizer = replica.model, replica.optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)

    def _forget_groups(self) -> None:
        """Unregister the last sharded epoch's groups (their backends end on their own)."""
        for pg in [self.registered, *self.sub_groups]:
            meshes.forget(pg)
        self.registered, self.sub_groups, self.sharded, self.sharded_at = None, [], None, None

    def _drop_state(self) -> None:
        """This member holds nothing current any more (it handed its slices over, or they are lost)."""
        self._forget_groups()
        self.copies, self.pending = Copies.none(), False
        self.stale = True

    def _local_state(self) -> LocalState:
        """What this member holds now, as slices (views of the executor's tensors)."""
        if self.sharded is not None and self.sharded_at is not None:
            layout, rank = self.sharded_at
            local = extract(self.sharded, layout, rank, self.step)
            local.pending, local.coefficient = self.pending, self.coefficient
            if self.pending:  # the interrupted step's gradients, kept for a roll forward
                for fqn, p in self.sharded.model.named_parameters():
                    for piece in local.pieces.get(fqn, []):
                        grad = _local_grad(p)
                        piece.data[GRAD] = (grad.reshape(-1) if grad is not None
                                            else torch.zeros_like(piece.data[PARAM]))
            for fqn, pieces in self.copies.pieces(self.pending).items():
                local.pieces[fqn] = sorted([*local.pieces.get(fqn, []), *pieces], key=lambda q: q.lo)
            return local
        return from_module(self.step, self.model, self.optimizer)

    def _seed_state(self) -> LocalState:
        """The state of step 0, seeded: the same on every worker."""
        self._build()
        return from_module(0, self.model, self.optimizer)

    def use_graph(self, graph: Any) -> None:
        """The model's graph as captured at start (`worker.graph.capture_graph`): its units."""
        self._units = [layer.name for layer in graph.layers]

    def units(self) -> list[str]:
        """The model's units (its blocks) as graph capture finds them, for FSDP2's wrapping."""
        if self._units is None:  # not captured at start (it failed there): try again, let it raise
            from worker.graph import capture_graph

            self.use_graph(capture_graph(self.job))
        assert self._units is not None
        return self._units

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _wait(self, g: Group, work: Any, buf: torch.Tensor | None = None) -> None:
        try:
            self.waiter.wait(g.pg, work, superseded=lambda: self.agent.superseded(g.epoch), buf=buf)
        except Superseded as e:
            if e.args:
                self._log(f"epoch {g.epoch}: {e.args[0]}")
            raise

    # --- one step ------------------------------------------------------------------------------

    def _train_step(self, g: Group) -> PlanDelta | None:
        """One exact data-parallel step; returns the delta to switch to when all ranks agreed."""
        if self.sharded is not None:
            return self._train_step_sharded(g, self.sharded)
        t0 = time.perf_counter()
        job, G = self.job, self.job.global_batch
        ids = sample_ids(job.seed, self.step, len(job.dataset), G)[share_slice(g.shares, g.rank)]
        for p in self.params:
            p.grad = None
        buckets = self._grad_buckets()
        buckets.start(lambda b: g.pg.allreduce([b]))  # each bucket goes as soon as the backward fills it
        loss_sum: torch.Tensor | float = 0.0
        if len(ids):
            inputs, targets = job.dataset[ids]
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            with self._autocast():
                outputs = self.model(inputs)
            loss = job.loss(outputs, targets)
            (loss / G).backward()  # type: ignore[no-untyped-call]
            loss_sum = loss.detach()  # stays on the device: no sync before the all-reduce
        compute_s = time.perf_counter() - t0
        factor = self.agent.slowdown
        if factor > 1.0 and len(ids):  # the --slowdown test knob: stretch this step's compute
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                compute_s = time.perf_counter() - t0
            time.sleep((factor - 1.0) * compute_s)
            compute_s = time.perf_counter() - t0

        # The vote and the loss: the switch to a planned delta all replicas hold, and the loss sum.
        # Asked now, not at the step's start: a delta that arrived during the compute is voted on
        # in this step (a join waits about half a step less).
        pending = self.agent.pending_planned(g.epoch)
        buf = torch.zeros(2, dtype=torch.float32, device=self.device)
        buf[0] = loss_sum
        buf[1] = 1.0 if pending is not None else 0.0
        t_comm = time.perf_counter()
        works = [*buckets.finish(), (g.pg.allreduce([buf]), buf)]
        for work, out in works:
            self._wait(g, work, out)
        comm_s = time.perf_counter() - t_comm

        summed = [out for _, out in works[:-1]]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b, dtype=torch.float64)
                                                                for b in summed])))  # every parameter
        if job.grad_clip is not None:  # as torch.nn.utils.clip_grad_norm_ does in one process
            coefficient = min(1.0, job.grad_clip / (grad_norm + 1e-6))
            for b in summed:
                b.mul_(coefficient)
        buckets.assign()
        multiplier = job.lr_multiplier(self.step)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * multiplier
        lr = self.base_lrs[0] * multiplier if self.base_lrs else 0.0
        self.optimizer.step()
        self.step += 1
        self.final_writer = self.step == job.num_steps and g.rank == 0
        self._after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm)
        requested = self.agent.take_save()
        if requested is not None:  # `ctl save PATH`: at this step boundary
            self._save(requested, final=False)
        agreed = round(float(buf[1])) == len(g.members)
        return pending if agreed and pending is not None else None

    def _grad_buckets(self) -> GradBuckets:
        """The gradient buckets of the current replica's parameters (rebuilt with the model)."""
        if self._buckets is None or self._buckets.params is not self.params:
            if self._buckets is not None:
                self._buckets.close()
            self._buckets = GradBuckets(self.params)
        return self._buckets

    def _train_step_sharded(self, g: Group, sharded: Sharded) -> PlanDelta | None:
        """One exact step with FSDP2: each member computes its slice of the batch (a member with no
        samples still takes part in every gather and reduce-scatter), gradients are summed into their
        shards by FSDP2's hooks, and one small all-reduce gives the global loss, the global gradient
        norm (over every shard) and the switch vote."""
        t0 = time.perf_counter()
        job, G = self.job, self.job.global_batch
        start, stop = g.layout.batch_slice(g.rank)
        ids = sample_ids(job.seed, self.step, len(job.dataset), G)[start:stop]
        sharded.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        # Micro-batches: every member runs as many forward/backward passes as the member that needs
        # the most (each pass gathers the units), with no samples once its own share is done.
        size = g.micro[g.rank] or len(ids) or 1
        passes = max((-(-s // (m or s)) if s else 1) for s, m in zip(g.shares, g.micro))
        try:
            for i in range(passes):
                chunk = ids[i * size:(i + 1) * size]
                if len(chunk):
                    inputs, targets = job.dataset[chunk]
                    loss = job.loss(sharded.model(inputs.to(self.device)), targets.to(self.device))
                    self._pause("forward")
                    (loss / G).backward()  # type: ignore[no-untyped-call]
                    loss_sum = loss_sum + loss.detach().double()
                else:  # no samples left: the collectives of the pass still need this member
                    inputs, targets = job.dataset[torch.arange(1)]
                    (job.loss(sharded.model(inputs.to(self.device)), targets.to(self.device)) * 0).backward()  # type: ignore[no-untyped-call]
        except Superseded:
            raise
        except Exception as e:
            if _is_comm_error(e) or self.agent.superseded(g.epoch):
                raise Superseded(f"the step's gathers failed: {str(e).splitlines()[0][:200]}") from None
            raise
        compute_s = time.perf_counter() - t0
        factor = self.agent.slowdown
        if factor > 1.0 and len(ids):  # the --slowdown test knob
            time.sleep((factor - 1.0) * compute_s)
            compute_s = time.perf_counter() - t0
        self._pause("backward")
        # Every member gets its copy's gradients: from here on the step may be rolled forward.
        self.copies.exchange(((p.to_local() if isinstance(p, DTensor) else p, _local_grad(p))
                              for _, p in sharded.model.named_parameters()),
                             g.members, g.pg, lambda work, buf: self._wait(g, work, buf), self.device)
        self._pause("exchange")
        self.pending = True
        grads = [gr for p in self.params if (gr := _local_grad(p)) is not None]
        squares = sum((gr.double().pow(2).sum() for gr in grads), torch.zeros((), dtype=torch.float64))
        # The vote: the switch to a planned delta, and a `ctl save` every member has (the gather
        # that writes it is a collective: all of them take it at the same step boundary).
        pending = self.agent.pending_planned(g.epoch)
        buf = torch.stack([loss_sum.cpu(), squares.cpu() / g.layout.dp_replicate,
                           torch.tensor(1.0 if pending is not None else 0.0, dtype=torch.float64),
                           torch.tensor(1.0 if self.agent.save_waiting() else 0.0, dtype=torch.float64)]).to(self.device)
        t_comm = time.perf_counter()
        self._wait(g, g.pg.allreduce([buf]), buf)
        comm_s = time.perf_counter() - t_comm
        grad_norm = float(buf[1].sqrt())
        self._pause("optimizer")
        if self.config.pause_at == ("abandon", self.step + 1):
            self._log(f"abandoning step {self.step + 1} after its all-reduce (--pause-at)")
            raise Superseded
        coefficient = 1.0
        if job.grad_clip is not None:
            coefficient = min(1.0, job.grad_clip / (grad_norm + 1e-6))
            for gr in grads:
                gr.mul_(coefficient)
        multiplier = job.lr_multiplier(self.step)
        for group, base in zip(sharded.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * multiplier
        lr = self.base_lrs[0] * multiplier if self.base_lrs else 0.0
        sharded.optimizer.step()
        self.copies.update(job.optimizer, self.shapes, lambda i: self.base_lrs[i] * multiplier, coefficient)
        self.pending, self.coefficient = False, coefficient
        self.step += 1
        self._after_step(g, float(buf[0]) / G, len(ids), compute_s, comm_s, time.perf_counter() - t0, lr, grad_norm)
        if self.step == job.num_steps and self.config.final_dir:  # every member gathers; rank 0 writes
            self._save_gathered(g, self.config.final_dir, final=True)
        if round(float(buf[3])) == len(g.members):
            requested = self.agent.take_save()
            if requested is not None:
                self._save_gathered(g, requested, final=False)
        agreed = round(float(buf[2])) == len(g.members)
        return pending if agreed and pending is not None else None

    def _autocast(self) -> Any:
        """The replicated forward under `Job.compute_dtype` (a no-op without one)."""
        dtype = self.job.compute_dtype
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype), enabled=dtype is not None) \
            if dtype else contextlib.nullcontext()

    def _after_step(self, g: Group, loss: float, samples: int, compute_s: float, comm_s: float, step_s: float,
                    lr: float, grad_norm: float) -> None:
        """What every step ends with, in any layout: the digest (when asked), the report to the
        coordinator (and the --trace-steps line), the log line, and the evaluation when it is due."""
        job = self.job
        self.agent.step = self.step
        digest = ""
        every = self.config.digest_every
        if every and (self.step % every == 0 or self.step == job.num_steps):
            digest = self.digest()
            self._log(f"digest step {self.step} {digest}")
        report = StepReport(name=self.name, epoch=g.epoch, step=self.step, loss=loss, samples=samples,
                            global_batch=job.global_batch, compute_s=compute_s, comm_s=comm_s, step_s=step_s,
                            digest=digest, lr=lr, grad_norm=grad_norm)
        self.agent.send(report)
        if self.config.trace_path is not None:
            with open(self.config.trace_path, "a") as trace:
                trace.write(json.dumps({"ts": time.time(), **dataclasses.asdict(report)}) + "\n")
        if self.config.log_every and self.step % self.config.log_every == 0:
            self._log(f"step {self.step}/{job.num_steps} loss {loss:.4f} ({step_s * 1e3:.0f} ms, "
                      f"epoch {g.epoch}, {g.layout.describe()})")
        if job.eval_every and (self.step % job.eval_every == 0 or self.step == job.num_steps):
            self._evaluate(g)

    def _pause(self, phase: str) -> None:
        """The --pause-at knob: sleep where a test wants to kill or stop this worker."""
        if self.config.pause_at == (phase, self.step + 1):
            self._log(f"pausing at {phase} of step {self.step + 1} (--pause-at)")
            time.sleep(60)

    def _save_gathered(self, g: Group, directory: str, *, final: bool) -> None:
        """Gather the full model and optimizer state from the shards (every member), rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        assert self.sharded is not None
        model_state = get_model_state_dict(self.sharded.model, options=options)
        by_name: dict[str, Any] = dict(get_optimizer_state_dict(self.sharded.model, self.sharded.optimizer,
                                                                options=options))
        if g.rank != 0:
            return
        # What `optimizer.state_dict()` of the plain model gives: state keyed by parameter index.
        index = {fqn: i for i, (fqn, _) in enumerate(self.sharded.model.named_parameters())}
        optimizer_state = {"state": {index[fqn]: st for fqn, st in by_name["state"].items()},
                           "param_groups": [{**grp, "params": [index[f] for f in grp["params"]]}
                                            for grp in by_name["param_groups"]]}
        self._write(directory, final, lambda path: save_state(model_state, optimizer_state, path))

    def _evaluate(self, g: Group) -> None:
        """Every member sums the loss over its contiguous part of the held-out set (split like the
        batch, by the epoch's shares), the sums are all-reduced, and rank 0 reports the mean. A
        failure in between abandons it: every member that saw it says it was skipped."""
        job = self.job
        total = len(job.eval_dataset)
        busy = [r for r, s in enumerate(g.shares) if s > 0] or [0]  # members with samples split it
        counts = [0] * len(g.shares)
        for r, n in zip(busy, split_shares(total, [float(max(g.shares[r], 1)) for r in busy])):
            counts[r] = n
        part = share_slice(counts, g.rank)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        # Sharded: every member runs as many forwards as the busiest one (each gathers the units).
        rounds = -(-max(counts) // EVAL_CHUNK) if self.sharded is not None else -(-(part.stop - part.start) // EVAL_CHUNK)
        if rounds:
            self.model.eval()
            try:
                with torch.no_grad():
                    for i in range(rounds):
                        start = part.start + i * EVAL_CHUNK
                        ids = torch.arange(start, min(start + EVAL_CHUNK, part.stop))
                        if not len(ids):  # a forward for the others' gathers, counted nowhere
                            self.model(job.eval_dataset[torch.arange(1)][0].to(self.device))
                            continue
                        inputs, targets = job.eval_dataset[ids]
                        outputs = self.model(inputs.to(self.device))
                        sums[0] += job.loss(outputs, targets.to(self.device)).double()
                        sums[1] += len(ids)
            finally:
                self.model.train()
        try:
            self._wait(g, g.pg.allreduce([sums]), sums)
        except Superseded:
            self.agent.send(EvalReport(name=self.name, step=self.step, loss=0.0, samples=0,
                                       skipped=f"a failure interrupted it (epoch {g.epoch} abandoned)"))
            raise
        if g.rank == 0:
            loss, samples = float(sums[0] / sums[1]), int(sums[1])
            self.agent.send(EvalReport(name=self.name, step=self.step, loss=loss, samples=samples, skipped=""))
            self._log(f"eval after step {self.step}: loss {loss:.4f} over {samples} held-out samples")

    def digest(self) -> str:
        """A hash of the whole model's parameters (sharded: gathered, so every member must ask)."""
        h = hashlib.sha256()
        for p in self.model.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def _log(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)


def _is_comm_error(e: BaseException) -> bool:
    """An error from the data plane (a peer gone mid-collective), not from the job's own code."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "peer", "timed out"))


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient, this member's shard of it when sharded (DTensor)."""
    grad = p.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad
