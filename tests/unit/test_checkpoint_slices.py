"""Reading one member's slices of a DCP checkpoint (`worker.checkpoint.load_slices`), in one process.

A checkpoint of a plain model with BatchNorm buffers and AdamW state (two steps: exp_avg,
exp_avg_sq, the step scalar) is read as every rank of sharded layouts of 1 to 3 members and of a
2 x 2 HSDP layout: each rank's LocalState equals, element for element, the same ranges of the
whole state (`from_module`), with the same keys in the same order, the same optimizer scalars,
hyper-parameters and buffers, and it reads fewer bytes the more members share the layout. A
checkpoint of another model is refused with the tensor named, and a damaged one by its checksum.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from plan.layout import Layout
from plan.reshard import TensorShape
from worker import checkpoint
from worker.parallel.slices import LocalState, from_module

STEP = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


def _write(model: nn.Module, root: Path) -> tuple[str, LocalState]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEP):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    partial, final = root / ".partial", root / f"step-{STEP}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DCP says it saves in one process: it does)
        dcp.save(checkpoint.state_dict(model, optimizer, STEP), checkpoint_id=str(partial), no_dist=True)
    checkpoint._commit(partial, final, {"format": checkpoint.FORMAT, "step": STEP})
    return str(final), from_module(STEP, model, optimizer)


def _tensors(model: nn.Module) -> list[TensorShape]:
    return [TensorShape(n, p.shape[0] if p.dim() else 0, p.numel()) for n, p in model.named_parameters()]


def _layout(shards: int, replicas: int = 1) -> Layout:
    n = shards * replicas
    return Layout(members=tuple(f"m{i}" for i in range(n)), shares=(1,) * n, dp_replicate=replicas, dp_shard=shards)


@pytest.mark.parametrize("layout", [_layout(1), _layout(2), _layout(3), _layout(2, replicas=2)],
                         ids=["1", "2", "3", "2x2"])
def test_each_rank_reads_exactly_its_slices_and_the_whole_state_part(tmp_path: Path, layout: Layout) -> None:
    model = _model()
    path, whole = _write(model, tmp_path)
    tensors = _tensors(model)
    read = []
    for rank in range(layout.world):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = checkpoint.load_slices(path, tensors, layout, rank)
        local = got.local
        assert local.step == STEP and local.keys == whole.keys and local.dtypes == whole.dtypes
        for t in tensors:
            lo, hi = layout.slice_of(rank, t.rows, t.numel)
            assert local.holdings().get(t.name, []) == ([(lo, hi)] if hi > lo else [])
            for key in whole.keys[t.name]:
                if hi > lo:
                    assert torch.equal(local.read(t.name, key, lo, hi), whole.read(t.name, key, lo, hi)), (t.name, key)
            assert {k: float(v) for k, v in local.scalars[t.name].items()} == \
                   {k: float(v) for k, v in whole.scalars[t.name].items()} != {}
        assert local.hyper == whole.hyper and local.hyper[0]["lr"] == 1e-3
        assert local.buffers.keys() == whole.buffers.keys()
        assert all(torch.equal(local.buffers[k], whole.buffers[k]) for k in local.buffers)
        read.append(got.read_bytes)
        assert got.read_bytes <= got.total_bytes
    if layout.dp_shard > 1:
        assert max(read) < got.total_bytes, "a shard reads less than the whole checkpoint"
    else:
        assert read == [got.total_bytes] * layout.world


def test_another_models_checkpoint_and_a_damaged_one_are_refused(tmp_path: Path) -> None:
    path, _ = _write(_model(), tmp_path)
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    with pytest.raises(checkpoint.CheckpointError, match=r"0\.weight has shape \[7, 4\]"):
        checkpoint.load_slices(path, _tensors(other), _layout(2), 0)
    renamed = [TensorShape("head.weight", 3, 21)]
    with pytest.raises(checkpoint.CheckpointError, match="does not hold head.weight"):
        checkpoint.load_slices(path, renamed, _layout(2), 0)
    damaged = sorted(Path(path).glob("*.distcp"))[0]
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load_slices(path, _tensors(_model()), _layout(2), 1)
