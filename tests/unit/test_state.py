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


def test_the_skeleton_keeps_tuples_and_refuses_what_cannot_travel() -> None:
    """The skeleton is msgpack with a tuple type (Adam's betas stay a tuple, a list stays a list) and
    never executes anything it reads; a state holding an object it cannot carry is refused by name."""
    import pytest
    packed = state.pack({"betas": (0.9, 0.99), "params": [0, 1], "nested": {3: (1, [2, (3,)])},
                         "t": torch.ones(2)}, torch.device("cpu"))
    back = state.unpack(state.read_meta(packed.skeleton), packed.buffers)
    assert back["betas"] == (0.9, 0.99) and isinstance(back["betas"], tuple)
    assert back["params"] == [0, 1] and isinstance(back["params"], list)
    assert back["nested"] == {3: (1, [2, (3,)])} and torch.equal(back["t"], torch.ones(2))
    with pytest.raises(TypeError, match="holds a object"):
        state.pack({"x": object()}, torch.device("cpu"))
