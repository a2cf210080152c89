"""FSDP2's reduce-scatters run as all-reduces on gloo, and the copies' gradients taken from them
(`worker.parallel.fsdp.AbortableReduceScatter`, `KeptShard`), in real processes on loopback
(tests/system/kept_shard_proc.py): uneven and empty shards, two micro-batch passes.

Each member's gradient shards are the single-process gradient's rows, as with gloo's own
reduce-scatter; and the shards a member keeps of the previous rank are that rank's own, bit for
bit: a copy rebuilt after a failure is exactly the state its owner had."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plan.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kept_shard_proc import PASSES, inputs, model  # noqa: E402

PROC = Path(__file__).resolve().parent / "kept_shard_proc.py"


def _run(tmp_path: Path, world: int, mode: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    out = tmp_path / mode
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(PROC), str(r), str(world), str(out), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [torch.load(out / f"{r}-{mode}.pt") for r in range(world)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_as_all_reduce_keeps_the_previous_ranks_shards_exactly(tmp_path: Path, world: int) -> None:
    net = model()
    for rank in range(world):
        for k in range(PASSES):
            net(inputs(rank, k)).sum().backward()
    truth = {fqn: p.grad.reshape(-1) for fqn, p in net.named_parameters()}
    layout = Layout(members=tuple(f"m{i}" for i in range(world)), shares=(1,) * world, dp_shard=world)
    ours = _run(tmp_path, world, "all_reduce")
    native = _run(tmp_path, world, "native")
    for rank in range(world):
        for fqn, grad in truth.items():
            lo, hi = layout.slice_of(rank, net.get_parameter(fqn).shape[0], grad.numel())
            torch.testing.assert_close(ours[rank]["own"][fqn], grad[lo:hi], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours[rank]["own"][fqn], native[rank]["own"][fqn], rtol=1e-5, atol=1e-6)
            keeper = ours[(rank + 1) % world]["copy"][fqn]
            assert torch.equal(keeper, ours[rank]["own"][fqn]), (rank, fqn, keeper, ours[rank]["own"][fqn])
    empty = [fqn for fqn, g in truth.items()
             if layout.slice_of(world - 1, net.get_parameter(fqn).shape[0], g.numel())[1]
             == layout.slice_of(world - 1, net.get_parameter(fqn).shape[0], g.numel())[0]]
    assert world < 3 or empty, "3 members: some parameter has an empty last shard"
