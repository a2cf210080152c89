"""The loop of one worker: train the current epoch step by step, and enter each epoch the
coordinator plans so that every member continues from one consistent state.

`Trainer.run` takes one event through each package once. The agent (`worker.agent`) delivers a
planned delta (a join, a leave, a failure, a re-plan); `_enter` forms the epoch's group
(`worker.group`), brings every member to one consistent step (`worker.epoch`: the replicated fast
path sends whole states, an epoch with sharded state or stages on either side reshards slices),
builds the layout's executor from this member's `LocalState` (`worker.executor`: one per layout
kind, found in the table `worker.parallel.table`) and acks; then the executor's steps run until
all members vote, in a step's all-reduce, to switch to the next delta at that step boundary. What
every step ends with stays here: the step report, the digest, checkpoints, and the evaluation when
it is due. The loop never branches on the layout's kind: what differs is the executor's.

Failures: every collective is issued asynchronously on a buffer used once, and waited for by a
`comm.Waiter` that the agent wakes when an abort arrives. A superseded collective is not waited for
(gloo can block for its whole timeout): it is left to end in the background, and the step is
abandoned (`Superseded`). The next epoch's entry starts from what each member holds, so that all
continue from one consistent step: no step is lost or applied twice. A failed rendezvous is tried
again after `RETRY_S`; a fenced worker drops its state and takes the survivors'; a planned-out
holder of sharded state hands its slices over before it goes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from plan.graph import Graph
from plan.layout import Layout
from plan.placement import unit_of
from plan.reshard import ReshardPlan, TensorShape, copy_ring, holdings
from transport import Ack, Checkpointed, Leave, PlanDelta, ResumeFailed, Saved, StateLost, StepReport
from worker import checkpoint, collector, comm, epoch, sequence
from worker import group as groups
from worker.agent import Agent, FatalError
from worker.comm import Superseded
from worker.config import TrainerConfig
from worker.executor import Executor, is_comm_error
from worker.group import Group
from worker.job import Job
from worker.parallel import mesh as meshes
from worker.parallel.meta import meta_model
from worker.parallel.replicated import ReplicaExecutor
from worker.parallel.slices import Incoming, LocalState, Outgoing, Pool, expect, from_module, pack_sends
from worker.parallel.table import executor_for
from worker.tp_plan import tp_dims, tp_styles
from worker.parallel.update import apply_update
from worker.save import save_state
from worker.store import CoordinatorStore

__all__ = ["Trainer", "TrainerConfig"]

T = TypeVar("T")

RETRY_S = 0.5  # pause before forming an epoch's group again after a failed rendezvous
GONE_CHECK_S = 1.0  # while waiting for a plan, how often to ask whether the coordinator is still reachable


class Trainer:
    def __init__(self, job: Job, agent: Agent, endpoint: str, config: TrainerConfig) -> None:
        self.job = job
        self.agent = agent
        self.endpoint = endpoint
        self.config = config
        self.name = agent.name
        self.device = torch.device(config.device)
        self.executor: Executor = ReplicaExecutor(*self._fresh(meta=True))
        self.stale = False  # our state may differ from the survivors' (we were fenced): take theirs
        self.waiter = comm.Waiter(self.device)
        agent.on_interrupt = self.waiter.interrupt
        self.leave_reason: str | None = None  # set on SIGTERM
        self.epoch_tried = 0  # the newest epoch this worker entered or tried to enter
        self.final_writer = False  # rank 0 of the group that committed the last step: it writes the model
        self._graph: Graph | None = None
        self._tensors: tuple[bool, list[TensorShape]] | None = None  # (`tensors`: whether units were known, them)
        self.computing = 0  # the epoch of the step whose compute is in flight (its abandon points ask)
        self.largest_sender = 0  # bytes the busiest sender of the last reshard sent (for the Ack)
        self.paused_reshard = False  # the --pause-at reshard knob fires once
        self.paused_step = False  # and so do its phases of a step (`worker.executor.pause`)
        # What this member held when it entered the current epoch, kept until the epoch's first step
        # commits: a member that finished its reshard while another died before finishing its own
        # must not have thrown away the only other copy of the dead member's slices.
        self.before_reshard: LocalState | None = None
        # Durable checkpoints (`worker.checkpoint`): the writes in flight, and each epoch's group for
        # their collectives (formed at the epoch's first checkpoint; forgotten once no write uses it).
        self.checkpoints = checkpoint.Writer(self.log)
        self.resumed: LocalState | None = None  # this member's slices read from a checkpoint, for the entry
        self.checkpoint_groups: list[tuple[int, dist.ProcessGroup]] = []

    def _fresh(self, *, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The model and optimizer as at step 0, identical on every worker (seeded). `meta`: only
        their structure (names, shapes, learning rates), no memory: a worker starts so, and
        materialises the whole model only when a layout needs it (a replica, or the seeded state
        of a job nobody holds yet); a newcomer to a sharded job never holds it whole."""
        if meta:
            model = meta_model(self.job)
        else:
            torch.manual_seed(self.job.seed)
            model = sequence.build(self.job).to(self.device)
        optimizer = self.job.optimizer(model.parameters())
        # The schedule multiplies these; a state received from a peer carries the lr it last used,
        # so each step sets every group's lr from its base again (exact under churn).
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.tp_dims = tp_dims(model, tp_styles(self.job, model))  # (which dim tensor parallelism splits)
        self.step = 0  # optimizer steps applied
        return model, optimizer

    def _build(self) -> None:
        """A replica of the seeded model (`_fresh`) becomes the executor."""
        self._use(ReplicaExecutor(*self._fresh()))

    def _use(self, executor: Executor) -> None:
        """`executor` runs from now on; the one it replaces lets go of its groups and hooks."""
        old, self.executor = self.executor, executor
        if old is not executor:
            old.close()

    @property
    def model(self) -> torch.nn.Module:
        return self.executor.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.executor.optimizer

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> str:
        """Train until the job's last step, a stop or a planned exit; returns why it ended."""
        group: Group | None = None
        while True:
            if self.agent.take_fenced():
                self.log("fenced: dropping local state, will take the survivors'")
                group, self.stale = None, True
            if self.step >= self.job.num_steps:
                if self.final_writer and self.config.final_dir:  # (a replica's last step: the others wrote in it)
                    self.executor.save(self, None, self.config.final_dir, final=True)
                return self._leave("finished")
            stop = self.agent.stop_reason()
            if stop is not None:  # "drained" comes once the plan without us is in place
                reason = "drained" if stop == "drained" else "stopped"
                self.agent.say_goodbye(Leave(name=self.name, reason=reason))
                return reason if reason == "drained" else f"stopped: {stop}"
            if group is None or self.agent.superseded(group.epoch):
                delta = self.agent.next_delta(self.epoch_tried, GONE_CHECK_S)
            else:
                try:
                    delta = self._train_step(group)  # a planned delta all ranks agreed to switch to
                except Superseded:
                    self.log(f"epoch {group.epoch} abandoned at step {self.step}")
                    group = None
                    continue
            if delta is None:
                gone = self.agent.coordinator_gone_for()
                if gone >= self.config.delta_timeout_s:
                    raise FatalError(f"the coordinator at {self.endpoint} has been unreachable for {gone:.0f} s while this "
                                     f"worker waited for a plan (--coordinator-timeout {self.config.delta_timeout_s:g}): "
                                     f"giving up at step {self.step}; start the coordinator again with its --state-dir "
                                     "and then the workers")
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

    def write(self, directory: str, final: bool, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        """Write the whole model's state dicts (under the model's own names: `worker.sequence`) and
        tell the coordinator how it went."""
        path = Path(directory)
        try:
            size = save_state(*sequence.as_model_names(sequence.model_names(self.job), model_state, optimizer_state), path)
        except OSError as e:
            self.log(f"could not write the model to {path}: {e}")
            self.agent.send(Saved(name=self.name, step=self.step, path=str(path), bytes=0, error=str(e)[:500],
                                  final=final))
            return
        self.log(f"wrote the model after step {self.step} to {path} ({size / 1e6:.1f} MB)")
        self.agent.send(Saved(name=self.name, step=self.step, path=str(path), bytes=size, error="", final=final))

    def save_interrupted(self, directory: str) -> None:
        """A `ctl save` whose gather a failure cut short: say so (the coordinator answers the
        request once), so that it is asked again rather than waited for."""
        self.log(f"the save to {directory} was interrupted by a failure")
        self.agent.send(Saved(name=self.name, step=self.step, path=str(Path(directory)), bytes=0, final=False,
                              error="interrupted: a member failed while the model was gathered; ask again"))

    def _standby(self, delta: PlanDelta) -> None:
        """Planned out without asking to leave (drained, or more workers than the plan uses):
        keep the process and wait for the next plan (or a Stop)."""
        self.agent.epoch = delta.epoch
        self.log(f"not in epoch {delta.epoch} ({delta.reason}): on standby")

    def _leave(self, reason: str) -> str:
        if self.checkpoints.busy():  # a checkpoint being written (the last step's): finish it first
            self.log("waiting for the checkpoint being written")
            self.checkpoints.wait(self.config.group_timeout_s)
        self.agent.say_goodbye(Leave(name=self.name, reason=reason))
        return reason

    # --- epochs --------------------------------------------------------------------------------

    def _enter(self, delta: PlanDelta) -> Group | None:
        """Form the epoch's group and bring every member to one consistent step. A sender (a leaving
        holder of sharded state) takes part in the reshard only, and gets None. No cyclic garbage
        collection meanwhile (`worker.collector.quiet`)."""
        with collector.quiet():
            return self._form(delta)

    def _form(self, delta: PlanDelta) -> Group | None:
        t0 = time.perf_counter()
        self.largest_sender = 0
        senders = [n for n in delta.senders if n not in delta.members]
        ranks = [*delta.members, *senders]
        rank, world = ranks.index(self.name), len(ranks)
        store = CoordinatorStore(self.endpoint, is_aborted=lambda: self.agent.superseded(delta.epoch),
                                 timeout_s=self.config.group_timeout_s, keys=self.config.keys)
        superseded = lambda: self.agent.superseded(delta.epoch)  # noqa: E731
        if self.checkpoints.busy() and not delta.abort:
            # A checkpoint of the epoch being left is being written: DCP resolves its ranks through
            # the default group, which the new epoch replaces. It finishes first (about a second).
            self.log(f"epoch {delta.epoch}: waiting for the checkpoint being written")
            self.checkpoints.wait(self.config.group_timeout_s)
        if delta.resume_path and not self._resume(delta):
            return None
        packing: Callable[[], Outgoing | None] = lambda: None  # noqa: E731
        try:
            # While the group forms (the members may still be finishing a step): a member that
            # holds nothing makes its memory and its receives ready, a holder packs what it sends.
            pool = self._pool(delta)
            receiving = self._expect_ahead(delta, ranks, pool)
            packing = self._pack_ahead(delta, ranks)
            group = groups.form(store, delta, ranks, rank, self.device, timeout_s=self.config.group_timeout_s,
                                superseded=superseded)
            incoming, outgoing = receiving(), packing()
            phases: dict[str, float] = {}  # where the entry's time went, for the log line

            def lap(name: str) -> None:
                phases[name] = time.perf_counter() - t0 - sum(phases.values())
            lap("group")
            if not group.layout.whole_replicas or delta.from_sharded or senders:
                # Any epoch with sharded state or stages on either side goes through the slice reshard.
                local, received = self._reshard(group, pool, outgoing, incoming)
                lap("reshard")
                if self.name not in delta.members:
                    self._drop_state()
                    self.log(f"epoch {delta.epoch}: handed over my slices ({local.nbytes()} bytes kept)")
                    return None
                if senders:  # the senders are done: the members train in a group of their own
                    group = groups.without_senders(group, delta, self.device, timeout_s=self.config.group_timeout_s,
                                                   superseded=superseded)
                self._build_executor(group, local)
                lap("executor")
            else:  # replicated to replicated keeps the model and sends whole states (the fast path)
                if self.stale and not self.executor.whole:  # it handed its part over or was fenced:
                    self._build()  # a plain model to receive the state into
                    self.stale = True
                elif self.executor.on_meta():  # a replica holds the whole model: the seeded one of step 0
                    self._build()
                received, self.largest_sender = epoch.reconcile(
                    group.pg, group.rank, len(group.members), -1 if self.stale else self.step, self._state,
                    lambda work, buf: self.wait(group, work, buf), self.device, restart=self._restart, load=self._load)
                lap("state")
        except epoch.StateLost as e:
            self.log(f"epoch {delta.epoch}: the training state is lost: {e}")
            self.agent.send(StateLost(name=self.name, epoch=delta.epoch, detail=str(e)[:1000]))
            self._drop_state()
            return None
        except Superseded:
            self.log(f"epoch {delta.epoch} superseded while forming")
            return None
        except RuntimeError as e:  # e.g. a peer never came to the rendezvous: the coordinator
            # re-sends the plan to a member that lost it, or re-plans; try again until then.
            self.log(f"could not form epoch {delta.epoch} ({str(e).splitlines()[0]}); retrying")
            self.epoch_tried = delta.epoch - 1
            time.sleep(RETRY_S)
            return None
        finally:
            # The packing thread reads the held state (a deferred copy update applied first): it
            # ends before anything else may read or change that state, the next entry's packing
            # included (an entry given up once left it running, and the next one packed a copy
            # half way through that update: a replacement started from a wrong copy).
            packing()
        self.agent.epoch = delta.epoch
        self.agent.step = self.step
        seconds = time.perf_counter() - t0
        self._say_if_stalled(f"epoch {delta.epoch}: its entry", seconds)
        self.agent.send(Ack(name=self.name, epoch=delta.epoch, step=self.step, reshard_bytes=received,
                            reshard_largest_sender=self.largest_sender,
                            reshard_s=seconds))
        self.log(f"epoch {delta.epoch} ({delta.reason}): rank {rank}/{world}, share "
                 f"{delta.shares[rank]}/{delta.global_batch}, step {self.step}, formed in {seconds * 1e3:.0f} ms ("
                 + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items()) + ")"
                 + (f", received {received / 1e6:.1f} MB" if received else "")
                 + (f", sent {sum(m.numel() * m.element_size() for _, _, m in outgoing.messages) / 1e6:.1f} MB packed "
                    "while the group formed" if outgoing is not None and outgoing.used else "")
                 + (f" ({pool.used / 1e6:.1f} of {pool.block.numel() / 1e6:.1f} MB into memory made ready while "
                    "the group formed" + (", its receives foreseen" if incoming is not None and incoming.used else "")
                    + ")" if pool is not None else ""))
        return group

    def _resume(self, delta: PlanDelta) -> bool:
        """The state is lost and the plan resumes from a checkpoint: drop what this member holds and
        load it. Into a sharded layout each member reads only its own slices (and the small
        whole-state part), so a model no member could hold whole resumes too; the epoch's entry
        brings the copies. Into a replicated one each reads the whole of it. False, said to the
        coordinator, when it cannot be loaded."""
        self._drop_state()  # (a checkpoint write in flight is left to end on its own)
        layout = Layout.from_dict(dataclasses.asdict(delta.layout))
        t0 = time.perf_counter()
        try:
            if not layout.whole_replicas:  # (a stage's member reads every tensor whole: its stage's are used)
                slices = checkpoint.load_slices(delta.resume_path, self.tensors, layout,
                                                list(layout.members).index(self.name))
                self.resumed, self.step = slices.local, slices.local.step
                read = f"its slices, {slices.read_bytes / 1e6:.1f} of {slices.total_bytes / 1e6:.1f} MB"
            else:
                self._build()
                self.step = checkpoint.load(delta.resume_path, self.model, self.optimizer)
                read = "whole"
        except checkpoint.CheckpointError as e:
            self.log(f"epoch {delta.epoch}: cannot resume from {delta.resume_path}: {e}")
            self.agent.send(ResumeFailed(name=self.name, epoch=delta.epoch, path=delta.resume_path,
                                         detail=str(e)[:1000]))
            return False
        self.stale = False
        self.log(f"epoch {delta.epoch}: loaded checkpoint {delta.resume_path} (step {self.step}, {read}) in "
                 f"{time.perf_counter() - t0:.2f} s")
        return True

    def _restart(self) -> None:
        """Nobody has state: start over from the seed."""
        self._build()
        self.stale = False

    def _load(self, received: dict[str, Any]) -> None:
        """Take the whole state (`_state`) that the lowest rank with the most steps sent."""
        self.model.load_state_dict(received["model"])
        self.optimizer.load_state_dict(received["optimizer"])
        self.step, self.stale = int(received["step"]), False

    def _pool(self, delta: PlanDelta) -> Pool | None:
        """Memory for what this worker will receive, when it holds nothing yet (a newcomer to a
        sharded job): its slices of the new layout, parameters and optimizer state (see `Pool`)."""
        holds_nothing = self.resumed is None and (self.stale or self.executor.on_meta())
        if not holds_nothing or self.device.type != "cpu" or self.name not in delta.members:
            return None
        if delta.epoch <= 1:  # the job's first epoch: nobody holds state, every member seeds it whole
            return None  # (a pool would sit unused beside the seeded model, at the job's memory peak)
        layout = Layout.from_dict(dataclasses.asdict(delta.layout))
        if layout.whole_replicas:
            return None
        return Pool.for_slices(holdings(layout, self.tensors, copy_ring(layout)).get(self.name, {}),
                               {n: p.element_size() for n, p in self.model.named_parameters()},
                               self.graph().optimizer_state_factor, self.device)

    def _expect_ahead(self, delta: PlanDelta, ranks: list[str], pool: Pool | None) -> Callable[[], Incoming | None]:
        """In a thread: fault `pool` in (a member that holds nothing: `_pool`), then cut the arenas
        and messages of what this member will receive, and its new state's pieces, from the plan it
        foresees (`epoch.foresee`, from the layout being left, `delta.previous`) and the optimizer
        state the graph recorded per tensor; returns the call that waits for it (None: nothing
        foreseen). `execute` takes it where the plan is the one foreseen."""
        if pool is None:
            return lambda: None
        known = LocalState.recorded(self.graph().tensors)

        def ready() -> Incoming | None:
            pool.touch()
            if delta.previous is None or known is None:
                return None
            after, plan = epoch.foresee(Layout.from_dict(dataclasses.asdict(delta.previous)),
                                        Layout.from_dict(dataclasses.asdict(delta.layout)), self.tensors, ranks)
            if plan.missing:  # (a holder gone: the entry finds out who holds what)
                return None
            incoming = expect(plan.for_member(self.name)[1], known, pool, self.device)
            incoming.assemble(after.get(self.name, {}), self.device)
            return incoming
        return self._meanwhile("pool", ready, f"epoch {delta.epoch}: could not make the receives ready ahead")

    def _pack_ahead(self, delta: PlanDelta, ranks: list[str]) -> Callable[[], Outgoing | None]:
        """Start packing, in a thread, what this holder of sharded slices will send in the entry's
        reshard, from the plan it foresees (`epoch.foresee`: every member of its layout in the group
        still holds its slices); returns the call that waits for it (None: nothing to send, or no
        plan foreseen). A step rolled forward in the entry changes what is held, and its step: the
        packed messages are then not sent (`Outgoing.serves`). A member with state to load packs
        nothing ahead."""
        held_at = self.executor.at
        if (held_at is None or self.stale or self.resumed is not None
                or delta.resume_path or self.device.type != "cpu"):
            return lambda: None
        old = held_at[0]
        layout = Layout.from_dict(dataclasses.asdict(delta.layout))

        def pack() -> Outgoing | None:
            local = self._local_state()  # (views of what is held: nothing changes it before the reshard)
            after, plan = epoch.foresee(old, layout, self.tensors, ranks)
            if not plan.for_member(self.name)[0] or plan.missing:
                return None
            return pack_sends(plan, self.name, local, after.get(self.name, {}), self.device)
        return self._meanwhile("pack-ahead", pack, f"epoch {delta.epoch}: could not pack ahead")

    def _meanwhile(self, name: str, work: Callable[[], T | None], failed: str) -> Callable[[], T | None]:
        """Run `work` in a thread of its own (while the group forms); returns the call that waits for
        its result. Work made ahead is an optimisation: where it fails, the reshard does it itself,
        and the log says why (`failed`)."""
        box: list[T | None] = [None]

        def run() -> None:
            try:
                box[0] = work()
            except Exception as e:  # noqa: BLE001 (see above)
                self.log(f"{failed} ({e}); the reshard does it")

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()

        def result() -> T | None:
            thread.join()
            return box[0]
        return result

    def _reshard(self, g: Group, pool: Pool | None = None, outgoing: Outgoing | None = None,
                 incoming: Incoming | None = None) -> tuple[LocalState, int]:
        """Bring this member to exactly its slices of the new layout (`worker.epoch`); the new state
        and the bytes received (into `pool` first, when there is one). `outgoing`: what this member
        sends, packed ahead (`_pack_ahead`); `incoming`: its receives, made ready ahead (`_expect_ahead`)."""
        # (a worker that never materialised its model holds nothing: if nobody does, all seed it)
        local = (self.resumed if self.resumed is not None
                 else None if self.stale or self.executor.on_meta() else self._local_state())
        self.resumed = None
        self.before_reshard = local
        new, received, plan = epoch.enter(g.layout, self.tensors, self.name, g.members, local, g.pg,
                                       lambda work, buf: self.wait(g, work, buf), self.device, self._seed_state,
                                       self._roll_forward, before_transfers=self._pause_reshard, pool=pool,
                                       outgoing=outgoing, incoming=incoming)
        self.step, self.stale = new.step, False
        element_bytes = {fqn: sum(torch.empty(0, dtype=new.dtype(fqn, k)).element_size() for k in keys)
                         for fqn, keys in new.keys.items()}
        self.largest_sender = plan.largest_sender(element_bytes)
        return new, received

    def _pause_reshard(self, plan: ReshardPlan) -> None:
        """The --pause-at reshard@STEP knob: sleep before the transfers of the first epoch entered
        at or after STEP in which this member sends slices (a test kills or drains a source there)."""
        at = self.config.pause_at
        if (at is not None and at[0] == "reshard" and self.step + 1 >= at[1] and not self.paused_reshard
                and plan.for_member(self.name)[0]):
            self.paused_reshard = True
            self.log(f"pausing at the reshard before step {self.step + 1} (--pause-at)")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not self.agent.superseded(self.epoch_tried):
                time.sleep(0.05)  # (an abort of this epoch ends the pause: the transfers give up)

    def _roll_forward(self, local: LocalState, coefficient: float) -> None:
        """Apply the interrupted step to every held slice with the gradients kept for it."""
        k = local.step
        updated = apply_update(self.job.optimizer, local, local.pieces, self.shapes,
                               lambda i: self.base_lrs[i] * self.job.lr_multiplier(k), coefficient)
        local.step, local.pending, local.coefficient = k + 1, False, coefficient
        self.log(f"rolled step {k + 1} forward on {updated} slices (others applied it before the failure)")

    def _build_executor(self, g: Group, local: LocalState) -> None:
        """The layout's executor (`worker.parallel.table`) from this member's slices. Until the new
        one is built, the last one stays what this member holds: building can be superseded (a peer
        stopped while a sharded layout's groups formed), and the next epoch's entry then describes
        the old executor's state, as held before this epoch's reshard."""
        self._use(executor_for(g.layout).build(self, g, local))

    def _drop_state(self) -> None:
        """This member holds nothing current any more (it handed its slices over, or they are lost)."""
        self.executor.close()
        self.stale, self.before_reshard, self.resumed = True, None, None

    def _local_state(self) -> LocalState:
        """What this member holds now, as slices (views of the executor's tensors)."""
        local = self.executor.local_state(self.step)
        before = self.before_reshard
        if not self.executor.whole and before is not None and before.step == self.step and not local.pending:
            # The epoch was entered but no step of it has been taken: what was held before its
            # reshard still counts (another member may have died before it had its new slices).
            local.adopt(before)
        return local

    def _seed_state(self) -> LocalState:
        """The state of step 0, seeded: the same on every worker."""
        self._build()
        return from_module(0, self.model, self.optimizer)

    @property
    def tensors(self) -> list[TensorShape]:
        """Every parameter as placement sees it: rows, elements and the graph unit it belongs to
        (which pipeline stage holds it; every tensor is in the root unit until the graph is known)."""
        known = self._graph is not None
        if self._tensors is None or self._tensors[0] != known:
            units = self.units() if known else []
            self._tensors = (known, [TensorShape(n, shape[0] if shape else 0, math.prod(shape), unit_of(n, units),
                                                 tp_dim=self.tp_dims.get(n)) for n, shape in self.shapes.items()])
        return self._tensors[1]

    def use_graph(self, graph: Graph) -> None:
        """The model's graph as captured at start (`worker.graph.capture_graph`)."""
        self._graph = graph

    def graph(self) -> Graph:
        """The model's graph: its units (blocks, for FSDP2's wrapping) and optimizer-state size.
        Captured here if it was not at start; a model that cannot be captured gets the coarse
        one-unit graph and one warning line (`worker.graph`), never an error. What still raises is
        the job's mistake (`JobError`) or this machine running out of memory: this worker cannot
        then wrap the model as the others do, and leaves with the error."""
        if self._graph is None:
            from worker.graph import capture_graph

            self._graph = capture_graph(self.job, warn=self.log)
        return self._graph

    def units(self) -> list[str]:
        """The model's units (its blocks) as graph capture finds them, for FSDP2's wrapping."""
        return [layer.name for layer in self.graph().layers]

    def _state(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def wait(self, g: Group, work: Any, buf: torch.Tensor | None = None) -> None:
        try:
            self.waiter.wait(g.pg, work, superseded=lambda: self.agent.superseded(g.epoch), buf=buf)
        except Superseded as e:
            if e.args:
                self.log(f"epoch {g.epoch}: {e.args[0]}")
            raise

    # --- one step (the executor's) ---------------------------------------------------------------

    def _train_step(self, g: Group) -> PlanDelta | None:
        """One exact step of the executor; returns the delta to switch to when all ranks agreed."""
        try:
            return self.executor.step(self, g)
        except Superseded:
            self.executor.restore_buffers()
            raise
        except Exception as e:
            # A peer gone can surface as an error when an op is issued (gloo: "Connection closed by
            # peer"), before the coordinator's abort: the epoch is over either way, not the job.
            if is_comm_error(e) or self.agent.superseded(g.epoch):
                self.executor.restore_buffers()
                raise Superseded(f"the step's communication failed: {str(e).splitlines()[0][:200]}") from None
            raise
        finally:
            self.computing = 0

    def give_up_if_superseded(self, *_: Any) -> None:
        """An abandon point inside a step's compute (replicated: a unit's forward, a gradient's
        arrival; sharded: each FSDP2 gather and reduce-scatter, before it is issued): the step in
        flight is given up once its epoch is superseded (a failure, or a join that abandons it),
        not at a collective's wait after the whole backward (which, when every member is alive and
        the abort lands during compute, completes: the step was finished, not abandoned)."""
        if self.computing and self.agent.superseded(self.computing):
            raise Superseded(f"the step in flight is given up in its compute (epoch {self.computing} superseded)")

    def after_step(self, g: Group, loss: float, samples: int, compute_s: float, comm_s: float, step_s: float,
                   lr: float, grad_norm: float, *, switching: bool = False) -> None:
        """What every step ends with, in any layout: the digest (when asked), the report to the
        coordinator (and the --trace-steps line), the log line, and the evaluation when it is due.
        `switching`: the members agreed in this step to switch to the planned delta (the report says
        so: one that missed the vote may make the coordinator abandon the next step for a join)."""
        job = self.job
        self._say_if_stalled(f"step {self.step}", step_s)
        self.agent.step = self.step
        self.before_reshard = None  # a step of this epoch is committed: its holdings are complete
        digest = ""
        every = self.config.digest_every
        if every and (self.step % every == 0 or self.step == job.num_steps):
            digest = self.digest()
            self.log(f"digest step {self.step} {digest}")
        report = StepReport(name=self.name, epoch=g.epoch, step=self.step, loss=loss, samples=samples,
                            global_batch=job.global_batch, compute_s=compute_s, comm_s=comm_s, step_s=step_s,
                            digest=digest, lr=lr, grad_norm=grad_norm, switching=switching)
        self.agent.send(report)
        if self.config.trace_path is not None:
            with open(self.config.trace_path, "a") as trace:
                trace.write(json.dumps({"ts": time.time(), **dataclasses.asdict(report),
                                        "redundancy_s": self.executor.redundancy_s}) + "\n")
        if self.config.log_every and self.step % self.config.log_every == 0:
            self.log(f"step {self.step}/{job.num_steps} loss {loss:.4f} ({step_s * 1e3:.0f} ms, "
                     f"epoch {g.epoch}, {g.layout.describe()})")
        if job.eval_every and (self.step % job.eval_every == 0 or self.step == job.num_steps):
            self.executor.evaluate(self, g)

    def checkpoint_if_due(self, g: Group, *, asked: bool) -> None:
        """At a committed step boundary that every member reached: write a durable checkpoint when
        one is due (every `checkpoint_every` steps) or was asked for by every member (`asked`)."""
        cfg = self.config
        every = cfg.checkpoint_every
        if asked:
            self.agent.take_checkpoint()
        if not cfg.checkpoint_dir or not (asked or (every and self.step % every == 0)):
            return
        t0 = time.perf_counter()
        try:
            pg = self._checkpoint_group(g)
        except RuntimeError as e:  # a member never came (it failed: the coordinator re-plans)
            self.log(f"checkpoint of step {self.step} skipped: {str(e).splitlines()[0]}")
            if g.rank == 0:
                self.agent.send(Checkpointed(name=self.name, step=self.step, path="", seconds=0.0, bytes=0,
                                             error=f"the checkpoint group did not form: {str(e).splitlines()[0][:300]}"))
            return
        state = checkpoint.state_dict(self.model, self.optimizer, self.step)

        def report(w: checkpoint.Written) -> None:
            if w.error:
                self.log(f"checkpoint of step {w.step} failed: {w.error}")
            else:
                self.log(f"checkpoint of step {w.step} complete: {w.path} ({w.bytes / 1e6:.1f} MB, {w.seconds:.2f} s)")
            self.agent.send(Checkpointed(name=self.name, step=w.step, path=w.path, seconds=w.seconds, bytes=w.bytes,
                                         error=w.error))

        self.checkpoints.start(state, directory=cfg.checkpoint_dir, step=self.step, epoch=g.epoch, rank=g.rank,
                               world=len(g.members), layout=g.layout.to_dict(), job_sha256=cfg.job_sha256,
                               keep=cfg.checkpoint_keep, pg=pg, report=report)
        self.log(f"checkpoint of step {self.step}: the step waited {(time.perf_counter() - t0) * 1e3:.0f} ms "
                 "(group, state dict, staging)")

    def _checkpoint_group(self, g: Group) -> dist.ProcessGroup:
        """The epoch's group for checkpoint collectives (gloo, even beside NCCL: DCP's async save
        wants a CPU backend), registered with c10d; older epochs' ones are forgotten once unused."""
        if self.checkpoint_groups and self.checkpoint_groups[-1][0] == g.epoch:
            return self.checkpoint_groups[-1][1]
        for old_epoch, old in list(self.checkpoint_groups):
            if not self.checkpoints.in_use(old):
                meshes.forget(old)
                self.checkpoint_groups.remove((old_epoch, old))
        cpu = torch.device("cpu")
        raw = comm.form_group(g.store, g.epoch, g.rank, len(g.members), cpu, timeout_s=self.config.group_timeout_s,
                              superseded=lambda: self.agent.superseded(g.epoch), part="ckpt/")
        store = dist.PrefixStore(f"epoch{g.epoch}/ckpt/", g.store)  # type: ignore[attr-defined]
        # DCP resolves ranks through the default group: a sharded epoch's whole group is it (same
        # members, same ranks); a replicated epoch registers none, so this group becomes it (an older
        # epoch's write still running after an abort is left to fail with its dead member).
        pg = meshes.register(raw, store, g.rank, len(g.members), g.epoch, cpu,
                             part="ckpt" if self.executor.owns_default_group else "", ranks=list(range(len(g.members))))
        self.checkpoint_groups.append((g.epoch, pg))
        return pg

    def digest(self) -> str:
        """A hash of the model's parameters and buffers (sharded: gathered, so every member must ask; a
        pipeline stage: its own units')."""
        h = hashlib.sha256()
        for p in [*self.model.parameters(), *self.model.buffers()]:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def _say_if_stalled(self, what: str, seconds: float) -> None:
        """Say so when something took over half of the group timeout: only a wait for a peer that
        never came takes that long, and no survivor may sit out a timeout (the liveness checks and
        the soak benchmark look for this line)."""
        if seconds > 0.5 * self.config.group_timeout_s:
            self.log(f"{what} took {seconds:.2f} s, over half of the group timeout "
                     f"({self.config.group_timeout_s:.0f} s)")

    def log(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)


