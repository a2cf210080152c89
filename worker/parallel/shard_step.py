"""The sharded executor's optimizer step, taken on each shard's local tensor instead of its DTensor.

FSDP2 leaves the job's optimizer over DTensor parameters with DTensor state, which is what torch's
state-dict functions read (`FsdpExecutor.save`, `worker.checkpoint`) and what `extract` hands to
the next epoch. Stepping it sends every op through DTensor's dispatch, which on the 10M GPT (77
tensors, AdamW, one thread) costs about 13 ms a step beside 21 ms of arithmetic, and does not shrink
with the shard.

`LocalStep` keeps a second optimizer, from the job's own factory, over plain Parameters that share
storage with the shards' local tensors, its state the local tensors of the DTensor optimizer's state
(the very same scalar tensors: Adam's `step` advances in place), so one step updates the one memory
both optimizers see, and the DTensor optimizer stays current for whatever reads it. This is exact
for optimizers whose arithmetic is element-wise, the same assumption the redundancy copies rest on
(`worker.parallel.update`); it is taken only for torch's element-wise optimizers and when every
state tensor is shaped like its parameter, and otherwise (and for a fresh job's first step, which
creates the state) the DTensor optimizer steps itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# torch optimizers whose update of an element reads only that element's parameter, gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD)


class LocalStep:
    """Steps `optimizer` (over the DTensor parameters `params`) through a plain twin sharing its
    memory; `factory` is the job's optimizer factory."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
                 factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self._factory = factory
        self._twin: torch.optim.Optimizer | None = None
        self._locals: list[torch.nn.Parameter] = []
        self._states: list[tuple[Any, ...]] = []  # the DTensor optimizer's state values the twin was built on
        self.local = type(optimizer) in ELEMENTWISE  # (not a subclass: it may do anything)

    def step(self) -> None:
        if not self.local or not self._current() and not self._build():
            self.optimizer.step()
            return
        twin = self._twin
        assert twin is not None
        for group, mine in zip(self.optimizer.param_groups, twin.param_groups):  # lr (the schedule), any other
            for key, value in group.items():
                if key != "params":
                    mine[key] = value
        for p, lp in zip(self.params, self._locals):
            grad = p.grad
            lp.grad = grad.to_local() if isinstance(grad, DTensor) else grad
        try:
            twin.step()
        finally:
            for lp in self._locals:
                lp.grad = None  # (the next step's gradients are fresh tensors)

    def _current(self) -> bool:
        """The twin exists and still shares the DTensor optimizer's state and the shards' memory."""
        if self._twin is None:
            return False
        state = self.optimizer.state
        for p, lp, values in zip(self.params, self._locals, self._states):
            held = state.get(p)
            if held is None or len(held) != len(values) or _local(p).data_ptr() != lp.data_ptr():
                return False
            if any(a is not b for a, b in zip(held.values(), values)):  # (load_state_dict replaced it)
                return False
        return True

    def _build(self) -> bool:
        """(Re)build the twin over the current state; False when it cannot mirror it: no state yet (a
        fresh job's first step: tried again next step), or state it never mirrors (a tensor not
        shaped like its parameter, other parameter groups: `local` turns False for good)."""
        self._twin = None
        locals_: list[torch.nn.Parameter] = []
        states: list[dict[str, Any]] = []
        for p in self.params:
            held = self.optimizer.state.get(p)
            if not held:
                return False
            shard = _local(p)
            mine: dict[str, Any] = {}
            for key, value in held.items():
                if isinstance(value, DTensor) and value.shape == p.shape and value.placements == getattr(p, "placements", None):
                    mine[key] = value.to_local()
                elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() == 0:
                    mine[key] = value  # the same object: advanced in place by either optimizer
                elif not isinstance(value, torch.Tensor):
                    mine[key] = value
                else:  # (state not shaped like its parameter: never mirrored, the DTensor optimizer steps)
                    self.local = False
                    return False
            locals_.append(torch.nn.Parameter(shard.detach()))
            states.append(mine)
        twin = self._factory(locals_)
        if len(twin.param_groups) != len(self.optimizer.param_groups):
            self.local = False
            return False
        for lp, mine in zip(locals_, states):
            twin.state[lp] = mine
        self._twin, self._locals = twin, locals_
        self._states = [tuple(self.optimizer.state[p].values()) for p in self.params]
        return True


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p  # (the shard itself, no autograd view)
