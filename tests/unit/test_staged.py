"""The pipeline executor's state (worker/parallel/staged.py) on real gloo groups, one process a stage:
a stage built from a member's `LocalState` holds exactly its units under the whole model's names,
the held-out loss passed through the stages is the whole model's, and the state gathered from the
stages is the whole model's and optimizer's, loadable into the plain model."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plan.layout import Layout
from worker.job import Job, load_job
from worker.parallel.slices import from_module
from worker.parallel.staged import apply_stage, evaluate_stage, gather_state, neighbours, whole_state

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
STAGES = (("0", "1"), ("2", "3", "4"), ("5",))


def _job() -> Job:
    path = ROOT / "examples" / "gpt.py"
    return load_job(path.read_text(), "job", filename=str(path))  # (the one with a held-out set)


def _trained(job: Job) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The whole model after one optimizer step (so the optimizer holds state to move)."""
    torch.manual_seed(job.seed)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    x, y = job.dataset[torch.arange(8)]
    job.loss(model(x), y).backward()
    optimizer.step()
    return model, optimizer


def _member(rank: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    layout = Layout(members=("a", "b", "c"), shares=(8, 8, 8), pp=3, stages=STAGES)
    store = dist.FileStore(store_path, 3)
    pg = dist.ProcessGroupGloo(store, rank, 3, timedelta(seconds=60))
    job = _job()
    model, optimizer = _trained(job)
    stage = apply_stage(job, layout, rank, from_module(1, model, optimizer), torch.device("cpu"))
    wait = lambda work, buf: work.wait()  # noqa: E731
    loss, samples = evaluate_stage(stage, layout, rank, pg, wait, job, torch.arange(40), 16, torch.device("cpu"))
    parts = gather_state(stage, 1, rank, [0, 1, 2], pg, wait, torch.device("cpu"))
    names = [n for n, _ in stage.module.named_parameters()]
    whole = whole_state(parts, [n for n, _ in model.named_parameters()]) if parts is not None else None
    original = (model.state_dict(), optimizer.state_dict()) if rank == 0 else None
    torch.save({"names": names, "loss": loss, "samples": samples, "whole": whole, "original": original},
               f"{out}.{rank}")


def test_stages_hold_their_units_evaluate_as_the_whole_model_and_gather_into_it(tmp_path: Path) -> None:
    mp.start_processes(_member, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=3, join=True,
                       start_method="spawn")
    got = [torch.load(f"{tmp_path / 'out'}.{r}", weights_only=False) for r in range(3)]
    job = _job()
    model, optimizer = _trained(job)
    for rank, units in enumerate(STAGES):
        assert got[rank]["names"] == [n for n, _ in model.named_parameters() if n.split(".")[0] in units]
    assert [g["samples"] for g in got] == [0, 0, 40], "the last stage sums the loss"
    with torch.no_grad():
        x, y = job.eval_dataset[torch.arange(40)]
        expected = float(job.loss(model(x), y))
    assert abs(got[2]["loss"] - expected) <= 1e-5 * abs(expected), (got[2]["loss"], expected)
    assert got[1]["whole"] is None and got[2]["whole"] is None
    model_state, optimizer_state = got[0]["whole"]
    fresh = job.model()
    fresh.load_state_dict(model_state)  # strict: every tensor, no other
    fresh_optimizer = job.optimizer(fresh.parameters())
    fresh_optimizer.load_state_dict(optimizer_state)
    # (against the state the members started from: computed in a process of one thread, whose
    # gradients may differ in the last bits from this one's)
    model_before, optimizer_before = got[0]["original"]
    assert all(torch.equal(model_before[n], p) for n, p in fresh.state_dict().items())
    after = fresh_optimizer.state_dict()
    assert after["param_groups"] == optimizer_before["param_groups"]
    assert sorted(after["state"]) == sorted(optimizer_before["state"]) == list(range(len(model_before)))
    for i, st in optimizer_before["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][i][key])), (i, key)


def test_neighbours_follow_the_mesh_order() -> None:
    layout = Layout(members=tuple("abcdef"), shares=(4,) * 6, pp=3, dp_replicate=2, stages=STAGES)
    # rank = pp * 2 + replica: the pipeline of replica 1 is ranks 1, 3, 5
    assert [neighbours(layout, r) for r in (1, 3, 5)] == [(None, 3), (1, 5), (3, None)]
