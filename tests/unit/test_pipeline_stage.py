"""The hand-written 1F1B stage step (worker/parallel/pipeline.py) on real gloo groups, one process a
stage: the small GPT cut into 2 and 3 stages, even and uneven cuts, micro-batches of unequal sizes;
every stage's gradients and the loss equal one process's on the whole batch."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from released import run_until_aborted
from worker.abortable import AbortableGroup
from worker.job import Job, load_job
from worker.parallel.pipeline import StageStep, one_f_one_b, stage_of_sequence

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 16


def _job() -> Job:
    path = ROOT / "examples" / "gpt.py"
    return load_job(path.read_text(), "job_short", filename=str(path))


def _stage(rank: int, cuts: list[list[str]], sizes: list[int], store_path: str, out: str,
           abortable: bool = False, hand_back: bool = False) -> None:
    torch.set_num_threads(1)
    stages = len(cuts)
    store = dist.FileStore(store_path, stages)
    backend = dist.ProcessGroupGloo(store, rank, stages, timedelta(seconds=60))
    pg = AbortableGroup(backend) if abortable else backend
    job = _job()
    torch.manual_seed(job.seed)
    model = job.model()
    module = stage_of_sequence(model, cuts[rank])
    inputs, targets = job.dataset[torch.arange(GLOBAL_BATCH)]
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    step = StageStep(module=module, stage=rank, stages=stages, prev_rank=rank - 1 if rank else None,
                     next_rank=rank + 1 if rank < stages - 1 else None,
                     send=lambda t, dst, tag: pg.send([t], dst, tag), recv=lambda t, src, tag: pg.recv([t], src, tag),
                     wait=lambda work, buf: work.wait(), sizes=sizes, device=torch.device("cpu"),
                     inputs=[inputs[a:b] for a, b in zip(bounds, bounds[1:])],
                     targets=[targets[a:b] for a, b in zip(bounds, bounds[1:])],
                     loss=job.loss, global_batch=GLOBAL_BATCH)
    in_flight: list[tuple[Any, torch.Tensor]] | None = [] if hand_back else None
    loss_sum = one_f_one_b(step, in_flight)
    if in_flight is not None:  # the step's sends, handed back: the caller waits for them (a header and a tensor each)
        first, last = rank == 0, rank == stages - 1
        assert len(in_flight) == 2 * len(sizes) * ((not first) + (not last)), len(in_flight)
        for work, _ in in_flight:
            work.wait()
    grads = {f"{u}.{n}": p.grad for u in cuts[rank] for n, p in model.get_submodule(u).named_parameters()}
    torch.save({"grads": grads, "loss_sum": float(loss_sum)}, f"{out}.{rank}")
    # It leaves as the worker does (`worker.cli._exit`): gloo's threads torn down beside a live
    # abortable group abort the process now and then ("terminate called without an active exception").
    os._exit(0)


@pytest.mark.parametrize("cuts, sizes, abortable, hand_back", [
    ([["0", "1", "2"], ["3", "4", "5"]], [4, 4, 4, 4], False, False),
    ([["0", "1", "2"], ["3", "4", "5"]], [4, 4, 4, 4], True, False),  # over the abortable group's point-to-point ops
    ([["0"], ["1", "2", "3"], ["4", "5"]], [6, 5, 5], True, True),  # uneven cuts, micro-batches of two sizes
    ([["0", "1"], ["2", "3", "4"], ["5"]], [16], False, False),  # one micro-batch
    ([["0", "1"], ["2"], ["3", "4", "5"]], [3, 3, 3, 3, 2, 2], True, True),  # more micro-batches than stages
])
def test_a_pipelined_step_has_the_whole_batchs_gradients_and_loss(tmp_path: Path, cuts: list[list[str]],
                                                                   sizes: list[int], abortable: bool,
                                                                   hand_back: bool) -> None:
    """(`hand_back`: the step's sends left in flight for the caller, as the pipeline executor does)"""
    out = str(tmp_path / "stage")
    mp.start_processes(_stage, args=(cuts, sizes, str(tmp_path / "store"), out, abortable, hand_back),
                       nprocs=len(cuts), join=True, start_method="spawn")
    job = _job()
    torch.manual_seed(job.seed)
    model = job.model()
    inputs, targets = job.dataset[torch.arange(GLOBAL_BATCH)]
    loss = job.loss(model(inputs), targets)
    (loss / GLOBAL_BATCH).backward()  # type: ignore[no-untyped-call]
    got: dict[str, torch.Tensor] = {}
    for rank in range(len(cuts)):
        saved = torch.load(f"{out}.{rank}")
        got.update(saved["grads"])
        if rank == len(cuts) - 1:
            assert saved["loss_sum"] == pytest.approx(float(loss.detach()), rel=1e-5)
    want = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want), "every parameter's gradient comes from exactly one stage"
    for name, grad in want.items():
        assert grad is not None
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_whose_units_form_a_sequence_is_cut_into_modules_that_share_its_parameters() -> None:
    model = _job().model()
    stage = stage_of_sequence(model, ["1", "2"])
    assert stage[0] is model.get_submodule("1") and len(list(stage.parameters())) == \
        len(list(model.get_submodule("1").parameters())) + len(list(model.get_submodule("2").parameters()))


def _stalled(rank: int, tmp: str) -> None:
    """Stage 1 of 2 stops after the warm-up: stage 0 waits for a gradient that never comes, until its
    group is aborted."""
    torch.set_num_threads(1)
    store = dist.FileStore(f"{tmp}/store", 2)
    group = AbortableGroup(dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=120)))
    released = Path(f"{tmp}/released")
    if rank == 1:
        while not released.exists():
            time.sleep(0.05)
        return
    job = _job()
    torch.manual_seed(job.seed)
    inputs, _ = job.dataset[torch.arange(8)]
    step = StageStep(module=stage_of_sequence(job.model(), ["0", "1", "2"]), stage=0, stages=2, prev_rank=None,
                     next_rank=1, send=lambda t, dst, tag: group.send([t], dst, tag),
                     recv=lambda t, src, tag: group.recv([t], src, tag), wait=lambda work, buf: work.wait(),
                     sizes=[4, 4], device=torch.device("cpu"), inputs=[inputs[:4], inputs[4:]], global_batch=8)
    run_until_aborted(lambda: one_f_one_b(step), group.abort, "stage 1 failed", released)


def test_a_stage_waiting_on_a_stopped_neighbour_is_released_by_the_abort(tmp_path: Path) -> None:
    mp.start_processes(_stalled, args=(str(tmp_path),), nprocs=2, join=True, start_method="spawn")
    assert (tmp_path / "released").read_text() == "superseded: stage 1 failed"
