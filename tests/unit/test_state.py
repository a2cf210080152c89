"""Packing training state into a skeleton plus flat buffers, and back, is exact."""

from __future__ import annotations

import torch

from worker import state


def test_pack_unpack_roundtrip_is_bit_identical() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    model.register_buffer("counts", torch.arange(3, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    original = {"step": 11, "model": model.state_dict(), "optimizer": opt.state_dict()}
    packed = state.pack(original, torch.device("cpu"))
    assert len(packed.buffers) == 2, "one flat buffer per dtype (float32, int64)"
    meta = state.read_meta(packed.skeleton)
    buffers = state.empty_buffers(meta, torch.device("cpu"))
    for dst, src in zip(buffers, packed.buffers):
        dst.copy_(src)  # what the wire does
    back = state.unpack(meta, buffers)
    assert back["step"] == 11
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    for key, value in original["model"].items():
        assert torch.equal(back["model"][key], value) and back["model"][key].dtype == value.dtype
    for pid, entry in original["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["optimizer"]["state"][pid][key], value)
    # And it loads into a fresh replica, which then takes the same next step.
    torch.manual_seed(1)
    replica = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))
    replica.register_buffer("counts", torch.zeros(3, dtype=torch.int64))
    replica_opt = torch.optim.AdamW(replica.parameters(), lr=1e-3)
    replica.load_state_dict(back["model"])
    replica_opt.load_state_dict(back["optimizer"])
    x = torch.randn(4, 5)
    for m, o in ((model, opt), (replica, replica_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), replica.parameters()):
        assert torch.equal(a, b)
