"""What a sharded member says it holds after a step abandoned inside a unit (`worker.parallel.fsdp.extract`).

FSDP2 registers a unit's *unsharded* parameters on it from its all-gather until its reshard: a step
abandoned in between (a peer stopped, the coordinator's abort) leaves them there. The state read
for the next epoch's reshard must still be this member's sharded parameters and the optimizer's
state keyed by them: read through the module instead, a unit's tensors came without their
optimizer state (members then numbered their reshard messages differently and gloo aborted the
process), and with the wrong rows. Real FSDP2 on a real one-member gloo group, in this process.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plan.layout import Layout
from worker.parallel import mesh as meshes
from worker.parallel.fsdp import apply_fsdp, extract
from worker.parallel.slices import from_module

pytestmark = pytest.mark.gloo

CPU = torch.device("cpu")


class _Boom(nn.Module):
    """Raises in the forward when armed: the step abandoned inside the unit that holds it."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("abandoned")
        return x


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), _Boom()), nn.Linear(6, 2))


def test_a_step_abandoned_inside_a_unit_still_extracts_the_sharded_state() -> None:
    store = dist.HashStore()
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    pg = meshes.register(backend, store, 0, 1, 9001, CPU)
    try:
        job = SimpleNamespace(seed=0, model=_model, sequence=None, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        torch.manual_seed(0)
        plain = _model()
        local = from_module(0, plain, job.optimizer(plain.parameters()))
        layout = Layout(members=("m0",), shares=(4,), dp_shard=1)
        sharded = apply_fsdp(job, ["0", "1", "2"], layout, 0, meshes.mesh_of(pg, CPU, 9001), local, CPU)  # type: ignore[arg-type]
        x = torch.randn(4, 4)
        sharded.model(x).sum().backward()
        sharded.optimizer.step()
        before = extract(sharded, layout, 0, 1)
        expected = {fqn: {k: v.clone() for k, v in pieces[0].data.items()} for fqn, pieces in before.pieces.items()}
        assert all(set(v) == {"param", "exp_avg", "exp_avg_sq"} for v in expected.values())

        _Boom.armed = True
        with pytest.raises(RuntimeError, match="abandoned"):
            sharded.model(x)
        # The hazard is real: unit "1" now carries FSDP2's unsharded parameters.
        assert not isinstance(dict(sharded.model.named_parameters())["1.0.weight"], DTensor)

        after = extract(sharded, layout, 0, 1)
        assert set(after.pieces) == set(expected)
        for fqn, pieces in after.pieces.items():
            assert len(pieces) == 1 and after.keys[fqn] == tuple(expected[fqn]), fqn
            for key, value in pieces[0].data.items():
                assert torch.equal(value, expected[fqn][key]), (fqn, key)
    finally:
        _Boom.armed = False
        meshes.forget(pg)
