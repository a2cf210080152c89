"""The job's optimizer applied to slices (worker.parallel.update): a copy kept current from gradient
slices, or a step rolled forward, must equal, bit for bit, what the owner's optimizer does to the
same elements of the whole parameter."""

from __future__ import annotations

import pytest
import torch

from worker.parallel.slices import PARAM, LocalState, Piece
from worker.parallel.update import GRAD, apply_update


FACTORIES = {  # the owner's optimizer as jobs build it (per-tensor on the CPU); the copy's takes the
    # multi-tensor step where `SAME_ARITHMETIC_FOREACH` says it is the same arithmetic
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "Adam, L2 and amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, amsgrad=True),
    "SGD, momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", FACTORIES)
def test_an_update_on_slices_equals_the_whole_parameters_update_bit_for_bit(name: str) -> None:
    torch.manual_seed(0)
    shapes = {"w": (12, 5), "b": (12,)}
    whole = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    factory = FACTORIES[name]
    optimizer = factory(list(whole.values()))
    # Two steps on the whole parameters, keeping a copy of rows [4, 8) as slices after the first.
    local = LocalState(step=0, keys={}, hyper=[{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}])
    for step in range(2):
        grads = {n: torch.randn(s) for n, s in shapes.items()}
        for n, p in whole.items():
            p.grad = grads[n].clone()
        if step == 1:  # the slices get the same gradient rows, scaled by a clipping coefficient of 0.5
            for n in shapes:
                lo, hi = (4 * 5, 8 * 5) if n == "w" else (4, 8)
                local.pieces[n][0].data[GRAD] = grads[n].reshape(-1)[lo:hi].clone()
            for p in whole.values():
                assert p.grad is not None
                p.grad.mul_(0.5)
            updated = apply_update(factory, local, local.pieces, shapes, lambda i: 1e-2, 0.5)
            assert updated == 2
        optimizer.step()
        if step == 0:  # take the copy: parameter and optimizer state rows [4, 8)
            for n, p in whole.items():
                lo, hi = (4 * 5, 8 * 5) if n == "w" else (4, 8)
                state = optimizer.state[p]
                rows = {k: v.reshape(-1)[lo:hi].clone() for k, v in state.items() if v.shape == p.shape}
                local.pieces[n] = [Piece(lo, hi, {PARAM: p.detach().reshape(-1)[lo:hi].clone(), **rows})]
                local.keys[n] = (PARAM, *rows)
                local.dtypes[n] = {k: "float32" for k in local.keys[n]}
                local.scalars[n] = {k: v.clone() for k, v in state.items() if k not in rows}
    for n, p in whole.items():
        lo, hi = (4 * 5, 8 * 5) if n == "w" else (4, 8)
        piece = local.pieces[n][0]
        assert torch.equal(piece.data[PARAM], p.detach().reshape(-1)[lo:hi]), n
        for key, value in optimizer.state[p].items():
            if value.shape == p.shape:
                assert torch.equal(piece.data[key], value.reshape(-1)[lo:hi]), (n, key)
        assert GRAD not in piece.data
        if "step" in local.scalars[n]:
            assert float(local.scalars[n]["step"]) == 2.0


def test_a_row_wise_copy_of_one_piece_per_row_is_updated_as_one_tensor_bit_for_bit() -> None:
    """The copy of a row-wise tp slice (columns [3, 6) of a 4 x 6 weight: one piece per row, the
    pieces consecutive views of one buffer, as `Copies.of` lays them out) is stepped as one tensor
    and equals the whole parameter's update on those elements, over three steps (the first creates
    Adam's state, split back over the pieces)."""
    torch.manual_seed(1)
    whole = torch.nn.Parameter(torch.randn(4, 6))
    factory = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    optimizer = factory([whole])
    ranges = [(r * 6 + 3, r * 6 + 6) for r in range(4)]
    buf = torch.cat([whole.detach().reshape(-1)[lo:hi] for lo, hi in ranges])
    pieces = [Piece(lo, hi, {PARAM: buf[3 * i:3 * i + 3]}) for i, (lo, hi) in enumerate(ranges)]
    local = LocalState(step=0, keys={"w": (PARAM,)}, dtypes={"w": {PARAM: "float32"}}, pieces={"w": pieces},
                       hyper=[{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}])
    for _ in range(3):
        grad = torch.randn(4, 6)
        whole.grad = grad.clone()
        grads = torch.cat([grad.reshape(-1)[lo:hi] for lo, hi in ranges])
        for i, piece in enumerate(pieces):
            piece.data[GRAD] = grads[3 * i:3 * i + 3]
        assert apply_update(factory, local, local.pieces, {"w": (4, 6)}, lambda i: 1e-2, 1.0) == 4
        optimizer.step()
    state = optimizer.state[whole]
    for piece in pieces:
        assert torch.equal(piece.data[PARAM], whole.detach().reshape(-1)[piece.lo:piece.hi])
        assert torch.equal(piece.data["exp_avg_sq"], state["exp_avg_sq"].reshape(-1)[piece.lo:piece.hi])
    assert pieces[1].data["exp_avg"].storage_offset() == pieces[0].data["exp_avg"].storage_offset() + 3, \
        "the state created on the first step is split back as consecutive views (joined again next step)"
