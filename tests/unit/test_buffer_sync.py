"""The buffer sync's arithmetic (worker.parallel.buffers): members that each ran their share of a
batch end with the same buffers, a running mean equal to one process's on the whole batch, constant
buffers bit-identical, and a given-up step leaves nothing behind."""

from __future__ import annotations

import copy

import torch
from torch import nn

from worker.parallel.buffers import BufferSync


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(5, momentum=0.3)
        self.register_buffer("table", torch.randn(7) / 3)  # a constant: no forward changes it
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))


def test_members_end_with_the_single_process_running_mean_and_identical_buffers() -> None:
    torch.manual_seed(0)
    whole = Net()
    with torch.no_grad():
        whole.bn.running_mean.normal_()
    members = [copy.deepcopy(whole) for _ in range(3)]
    batch = torch.randn(11, 5) * 2 + 1
    shares = [slice(0, 3), slice(3, 3), slice(3, 11)]  # uneven, one empty share

    syncs = [BufferSync(m) for m in members]
    for sync in syncs:
        sync.begin()
    for m, part in zip(members, shares):
        if part.stop > part.start:
            m.bn(batch[part])
    summed = sum(s.deltas(p.stop - p.start, 11) for s, p in zip(syncs, shares))
    for sync in syncs:
        sync.apply(summed)
    whole.bn(batch)

    first = dict(members[0].named_buffers())
    for m in members[1:]:
        for name, b in m.named_buffers():
            assert torch.equal(b, first[name]), name
    assert torch.allclose(first["bn.running_mean"], whole.bn.running_mean, rtol=0, atol=1e-6)
    assert int(first["bn.num_batches_tracked"]) == 1
    assert torch.equal(first["table"], whole.table), "a constant buffer stays bit-identical"
    # The variance is the shares' weighted mean: not the whole batch's (it misses the between-share spread).
    assert not torch.allclose(first["bn.running_var"], whole.bn.running_var, atol=1e-3)


def test_a_step_given_up_puts_the_buffers_back() -> None:
    net = Net()
    before = {n: b.clone() for n, b in net.named_buffers()}
    sync = BufferSync(net)
    sync.begin()
    net.bn(torch.randn(4, 5))
    assert not torch.equal(net.bn.running_mean, before["bn.running_mean"])
    sync.restore()
    for name, b in net.named_buffers():
        assert torch.equal(b, before[name]), name


def test_a_model_without_buffers_has_nothing_to_sync() -> None:
    assert not BufferSync(nn.Linear(3, 2))
