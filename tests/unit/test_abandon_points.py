"""A replicated step's compute is given up the moment its epoch is superseded (`ReplicaExecutor`'s
abandon points): at the next unit's forward, or at the next gradient's arrival in the backward,
not after the whole backward at the collectives' wait.

Real parts: a `Trainer` of the small GPT (examples/gpt.py:job_short, its units found by graph
capture), a real `Agent` that is told of the abort by the coordinator's own encoded messages (`Abort`,
a `PlanDelta` that aborts) through its message handler, and the gradient buckets all-reduced on a
real gloo group. Only the socket is absent: no coordinator process is needed to say "superseded"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from transport import Abort, MeshLayout, PlanDelta, encode
from worker import comm
from worker.agent import Agent
from worker.calibrate import Calibration
from worker.comm import Superseded
from worker.job import load_job, resolve_job_ref
from worker.parallel.replicated import GradBuckets, ReplicaExecutor
from worker.trainer import Trainer, TrainerConfig

JOB = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gpt.py'}:job_short"


def _trainer() -> Trainer:
    src = resolve_job_ref(JOB)
    job = load_job(src.source, src.name, filename=src.ref)
    calibration = Calibration(flops=1e9, memory_bytes=1 << 30, host="here", device="cpu", threads=1)
    agent = Agent("tcp://127.0.0.1:9", "w1", calibration)  # never started: its handler is fed directly
    t = Trainer(job, agent, "tcp://127.0.0.1:9", TrainerConfig())
    t._build()  # the replica itself, not only its structure
    return t


def _abandon_points(t: Trainer) -> None:
    executor = t.executor
    assert isinstance(executor, ReplicaExecutor)
    executor.abandon_points(t)


def _tell(agent: Agent, message: object) -> None:
    """What the agent's thread does with a frame from the coordinator."""
    agent._handle(None, encode(message))  # type: ignore[arg-type]


def _batch(t: Trainer) -> torch.Tensor:
    inputs, _ = t.job.dataset[torch.arange(2)]
    return inputs


def _counting(t: Trainer) -> dict[str, int]:
    """How often each unit's forward ran, counted by forward hooks after the abandon points."""
    ran = dict.fromkeys(t.units(), 0)
    for u in ran:
        t.model.get_submodule(u).register_forward_hook(lambda *_, u=u: ran.__setitem__(u, ran[u] + 1))
    return ran


@pytest.fixture(scope="module")
def group() -> object:
    return comm.form_group(dist.HashStore(), 1, 0, 1, torch.device("cpu"), timeout_s=30, superseded=lambda: False)


def test_a_superseded_epoch_gives_the_forward_up_at_the_next_unit() -> None:
    t = _trainer()
    units = t.units()
    assert len(units) >= 3, units  # the GPT's blocks, as graph capture names them
    _abandon_points(t)
    ran = _counting(t)
    t.computing = 1
    t.model(_batch(t))  # not superseded: the whole forward runs
    assert set(ran.values()) == {1}
    first = t.model.get_submodule(units[0])
    first.register_forward_hook(lambda *_: _tell(t.agent, Abort(epoch=1, reason="w2 failed")))  # the abort arrives mid-forward
    with pytest.raises(Superseded):
        t.model(_batch(t))
    assert ran[units[0]] == 2 and ran[units[1]] == 1, f"given up at the start of the next unit: {ran}"


@pytest.mark.gloo
def test_a_superseded_epoch_gives_the_backward_up_at_the_next_gradient(group: object) -> None:
    t = _trainer()
    buckets = GradBuckets(t.executor.params, bucket_bytes=1)  # a bucket per parameter: one launch per gradient
    launched: list[torch.Tensor] = []

    def launch(b: torch.Tensor) -> object:
        launched.append(b)
        return group.allreduce([b])  # type: ignore[attr-defined]

    t.computing = 1
    buckets.start(launch, t.give_up_if_superseded)
    inputs, targets = t.job.dataset[torch.arange(2)]
    loss = t.job.loss(t.model(inputs), targets)
    # A later plan that aborts this epoch (a failure re-planned), as the coordinator encodes it.
    delta = PlanDelta(epoch=2, reason="failure", layout=MeshLayout(dp_replicate=1, dp_shard=1, pp=1, tp=1, members=["w1"], shares=[16]),
                      global_batch=16, abort=True)
    _tell(t.agent, delta)
    with pytest.raises(Superseded):
        loss.backward()  # type: ignore[no-untyped-call]
    assert not launched, "no bucket went out after the abort"


def test_nothing_is_given_up_outside_a_step_or_in_a_live_epoch() -> None:
    t = _trainer()
    _abandon_points(t)
    ran = _counting(t)
    _tell(t.agent, Abort(epoch=1, reason="w2 failed"))
    t.model(_batch(t))  # computing == 0: an evaluation's forward, say
    t.computing = 2  # a newer epoch than the one aborted
    t.model(_batch(t))
    assert set(ran.values()) == {2}


def test_the_hooks_follow_the_replica_and_do_not_keep_the_old_one() -> None:
    t = _trainer()
    _abandon_points(t)
    old = t.model
    t._build()  # a new replica (the state received at an epoch's entry, say)
    new = t.model
    _abandon_points(t)
    executor = t.executor
    assert isinstance(executor, ReplicaExecutor) and executor.hooks is not None and executor.hooks[0]() is new
    _tell(t.agent, Abort(epoch=1, reason="w2 failed"))
    t.computing = 1
    old(_batch(t))  # the old replica's hooks are gone
    with pytest.raises(Superseded):
        new(_batch(t))
