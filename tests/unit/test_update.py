"""The job's optimizer applied to slices (worker.parallel.update): a copy kept current from gradient
slices, or a step rolled forward, must equal, bit for bit, what the owner's optimizer does to the
same elements of the whole parameter."""

from __future__ import annotations

import torch

from worker.parallel.slices import PARAM, LocalState, Piece
from worker.parallel.update import GRAD, apply_update


def test_an_update_on_slices_equals_the_whole_parameters_update_bit_for_bit() -> None:
    torch.manual_seed(0)
    shapes = {"w": (12, 5), "b": (12,)}
    whole = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    factory = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
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
                local.pieces[n] = [Piece(lo, hi, {PARAM: p.detach().reshape(-1)[lo:hi].clone(),
                                                  "exp_avg": state["exp_avg"].reshape(-1)[lo:hi].clone(),
                                                  "exp_avg_sq": state["exp_avg_sq"].reshape(-1)[lo:hi].clone()})]
                local.keys[n] = (PARAM, "exp_avg", "exp_avg_sq")
                local.dtypes[n] = {k: "float32" for k in local.keys[n]}
                local.scalars[n] = {"step": state["step"].clone()}
    for n, p in whole.items():
        lo, hi = (4 * 5, 8 * 5) if n == "w" else (4, 8)
        piece = local.pieces[n][0]
        assert torch.equal(piece.data[PARAM], p.detach().reshape(-1)[lo:hi]), n
        assert torch.equal(piece.data["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"].reshape(-1)[lo:hi]), n
        assert GRAD not in piece.data and float(local.scalars[n]["step"]) == 2.0
