"""The ring of copies of a pipeline (worker/parallel/copies.py) on a real gloo pair, one member a
thread: each stage posts the receive of its source's gradients before its own step's compute,
defers the copy's update to its next step (applied in that step's first wait, or when the copy is
read), and after every step the copy each member keeps equals, bit for bit, the state its source
holds (parameters and Adam's moments). The receive posted while a deferred update still reads the
last gradients lands in the other buffer: the test would see the copy diverge if it did not."""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plan.layout import Layout
from plan.placement import TensorShape, unit_of
from worker.parallel.copies import Copies
from worker.parallel.slices import PARAM, from_module

pytestmark = pytest.mark.gloo

CPU = torch.device("cpu")
STEPS = 5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))


def _member(rank: int, store: dist.Store, layout: Layout, seen: dict[str, object], errors: list[BaseException],
            whole: nn.Sequential) -> None:
    try:
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        optimizer = torch.optim.AdamW(whole.parameters(), lr=0.05)
        tensors = [TensorShape(n, p.shape[0], p.numel(), unit_of(n, ["0", "1"])) for n, p in whole.named_parameters()]
        me = layout.members[rank]
        copies = Copies.of(layout, me, from_module(0, whole, optimizer), tensors)
        mine = [p for n, p in whole.named_parameters() if n.startswith(f"{rank}.")]
        stage_opt = torch.optim.AdamW(mine, lr=0.05)
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
        for step in range(STEPS):
            copies.receive(list(layout.members), pg, CPU)  # (as a stage's step starts)
            if step % 2:  # every other step, the deferred update runs in the step (the bubble) ...
                copies.flush()
            else:  # ... else the source's gradients land first, while this member "computes"
                time.sleep(0.05)
            g = torch.Generator().manual_seed(100 * step + rank)
            for p in mine:
                p.grad = torch.randn(p.shape, generator=g)
            copies.finish(((p, p.grad) for p in mine), list(layout.members), pg, lambda w, _b: w.wait(), CPU)
            stage_opt.step()
            copies.update(lambda ps: torch.optim.AdamW(ps, lr=0.05), shapes, lambda _i: 0.05, 1.0, defer=True)
        # ... else at the next exchange; reading the copy applies the last one.
        pieces = copies.pieces(pending=False)
        seen[f"copy{rank}"] = {n: {k: v.clone() for k, v in ps[0].data.items()} for n, ps in pieces.items() if ps}
        by_param = {id(p): n for n, p in whole.named_parameters()}
        seen[f"state{rank}"] = {by_param[id(p)]: {PARAM: p.detach().reshape(-1).clone(),
                                                  **{k: v.reshape(-1).clone() for k, v in stage_opt.state[p].items()
                                                     if k != "step"}} for p in mine}
    except BaseException as e:  # noqa: BLE001 (reported by the test)
        errors.append(e)


def test_a_deferred_copy_update_keeps_the_copy_bit_for_bit_the_sources_state() -> None:
    layout = Layout(members=("a", "b"), shares=(4, 4), pp=2, stages=(("0",), ("1",)))
    store = dist.HashStore()
    seen: dict[str, object] = {}
    errors: list[BaseException] = []
    model = _model()  # (built once: the threads share the global RNG)
    threads = [threading.Thread(target=_member, args=(r, store, layout, seen, errors, copy.deepcopy(model)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for keeper, source in ((0, 1), (1, 0)):
        kept, state = seen[f"copy{keeper}"], seen[f"state{source}"]
        assert isinstance(kept, dict) and isinstance(state, dict)
        assert set(kept) == set(state) and all(n.startswith(f"{source}.") for n in kept)
        for name in state:
            assert set(kept[name]) == {PARAM, "exp_avg", "exp_avg_sq"}, kept[name].keys()
            for key, value in state[name].items():
                assert torch.equal(kept[name][key], value), (name, key)


def test_a_copy_read_while_another_thread_applies_its_deferred_update_waits_for_it() -> None:
    """An epoch's entry reads the copy (flushing a deferred update) in a thread while its group
    forms; a reader at the same time (the next entry's) must see the copy updated, not half way:
    its flush returns once the update is applied, and the update is applied once."""
    copies = Copies.none()
    applied: list[int] = []
    started = threading.Event()

    def update() -> None:
        started.set()
        time.sleep(0.05)  # (long enough for the other reader to ask meanwhile)
        applied.append(1)
    copies.deferred = update
    other = threading.Thread(target=copies.flush)
    other.start()
    started.wait(5)
    copies.flush()
    seen = list(applied)
    other.join()
    assert seen == [1], "the second reader returned before the update was applied"
    assert applied == [1] and copies.deferred is None
