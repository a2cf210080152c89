"""The reshard executor (`worker.parallel.slices.execute`) on real gloo groups, one member a thread:
random layouts before and after (world sizes 1-5, sharded and replicated, uneven and empty shards,
copies, holders lost, newcomers with no state), random tensors of two dtypes, large and small (both
message kinds). Every member ends with exactly the ranges it needs, element for element the truth,
its pieces views of what it held or received (never a stale value), and the bytes received are
what the plan sends it. A holder's messages packed ahead are sent, and a newcomer's receives cut
ahead are taken, exactly when they are this plan's. The real-process reshard tests (tests/system/test_parallel.py) cover the
same executor across processes and its use by FSDP2."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from plan.layout import Layout
from plan.reshard import TensorShape, copy_ring, holdings, plan_reshard, row_lengths
from worker.parallel.slices import (ALIGN, PARAM, Incoming, LocalState, Outgoing, Piece, Pool, execute, expect,
                                    pack_sends, pack_whole, pieces_over)

pytestmark = pytest.mark.gloo

CPU = torch.device("cpu")

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _layout(members: list[str], rng: random.Random) -> Layout:
    shares = tuple(rng.randint(0, 3) for _ in members)
    if len(members) in (2, 4) and rng.random() < 0.4:  # tensor parallel: split tensors move in strided transfers
        rest = len(members) // 2
        shard = rng.choice([1, rest])
        slots = [rng.randint(1, 3) for _ in range(rest)]  # (the members of a tp group share their slot's samples)
        return Layout(members=tuple(members), shares=tuple(slots[r // 2] for r in range(len(members))),
                      dp_replicate=rest // shard, dp_shard=shard, tp=2)
    if rng.random() < 0.3:
        return Layout(members=tuple(members), shares=shares, dp_replicate=len(members), dp_shard=1)
    return Layout(members=tuple(members), shares=shares, dp_shard=len(members))


def _case(seed: int) -> None:
    rng = random.Random(seed)
    names = [f"m{i}" for i in range(6)]
    tensors = [TensorShape(f"t{i}", rows := rng.choice([0, 1, 2, 3, 7, 40, 300]),
                           max(1, rows) * (cols := rng.choice([1, 5, 64, 700])),
                           tp_dim=rng.choice([None, 0, 1]) if rows and cols > 1 else None)
               for i in range(rng.randint(1, 6))]
    dtypes = {t.name: rng.choice(list(DTYPES)) for t in tensors}
    truth = {t.name: {k: torch.randn(t.numel, dtype=torch.float64).to(DTYPES[dtypes[t.name]])
                      for k in (PARAM, "exp_avg")} for t in tensors}
    old = _layout(rng.sample(names, rng.randint(1, 5)), rng)
    ring = copy_ring(old)
    before_all = holdings(old, tensors, ring)
    lost = {n for n in old.members if rng.random() < 0.2} if ring else set()
    before = {n: h for n, h in before_all.items() if n not in lost}
    survivors = [n for n in old.members if n not in lost]
    pool = survivors + [n for n in names if n not in old.members]
    new = _layout(rng.sample(pool, rng.randint(1, min(5, len(pool)))), rng)
    after = holdings(new, tensors, copy_ring(new))
    plan = plan_reshard(before, after, row_length=row_lengths(tensors) if rng.random() < 0.5 else None)
    if plan.missing:  # a slice and its copy both lost: the worker stops (tested elsewhere)
        return
    group = list(new.members) + [n for n in survivors if n not in new.members]
    holders = [n for n in group if n in before]
    if not holders:
        return
    locals_: dict[str, LocalState] = {}
    for n in holders:
        local = LocalState(step=5, keys={t.name: (PARAM, "exp_avg") for t in tensors},
                           dtypes={t.name: {PARAM: dtypes[t.name], "exp_avg": dtypes[t.name]} for t in tensors},
                           scalars={t.name: {"step": torch.tensor(5.0)} for t in tensors}, hyper=[{"lr": 0.1}],
                           buffers={"b": torch.arange(3.0)})
        one_buffer = rng.random() < 0.5  # (an executor's slices are views of one local tensor)
        for fqn, ranges in before[n].items():
            if one_buffer:
                local.pieces[fqn] = pieces_over(ranges, {k: torch.cat([v[lo:hi] for lo, hi in ranges])
                                                         for k, v in truth[fqn].items()})
            else:
                local.pieces[fqn] = [Piece(lo, hi, {k: v[lo:hi].clone() for k, v in truth[fqn].items()})
                                     for lo, hi in ranges]
        locals_[n] = local
    packed = pack_whole(locals_[holders[0]])  # the sender's, as described (given to it half the time)
    whole = bytes(packed.skeleton.numpy())
    give_packed = rng.random() < 0.5
    # A member without state may have made memory ready (`Pool`): exactly what it receives (plus
    # the arenas' alignment), or too little (the rest is allocated as without one).
    pools: dict[str, Pool] = {}
    fits: set[str] = set()
    for n in group:
        if n not in holders and rng.random() < 0.7:
            need = sum((hi - lo) * 2 * DTYPES[dtypes[fqn]].itemsize for fqn, r in after.get(n, {}).items() for lo, hi in r)
            if rng.random() < 0.7:
                fits.add(n)
            pools[n] = Pool(need + 2 * len(holders) * ALIGN if n in fits else need // 2, CPU)
            pools[n].touch()
    # A holder may have packed what it sends ahead (`pack_sends`, as a worker does while its group
    # forms): from this very plan (sent as packed), from a plan foreseen with another holder gone
    # (sent only where this member's sends are the same), or at another step (never sent).
    ahead: dict[str, Outgoing] = {}
    used: dict[str, bool] = {}
    for n in holders:
        kind = rng.choice(["none", "this", "other", "step"])
        if kind == "this" or (kind == "step" and plan.for_member(n)[0]):
            ahead[n] = pack_sends(plan, n, locals_[n], after.get(n, {}) if rng.random() < 0.5 else None)
            used[n] = kind == "this"
            ahead[n].step += kind == "step"
        elif kind == "other" and len(holders) > 1:
            gone = rng.choice([h for h in holders if h != n])
            foreseen = plan_reshard({h: held for h, held in before.items() if h != gone}, after)
            ahead[n] = pack_sends(foreseen, n, locals_[n], after.get(n, {}))
            used[n] = foreseen.for_member(n)[0] == plan.for_member(n)[0]
    # A member without state may have cut its receives ahead (`expect`, as a worker does while its
    # group forms, from the keys and dtypes its graph recorded): for this very plan (taken), or for
    # a plan foreseen with a holder gone (taken only where its receives are the same; else the
    # arenas go back to its pool, and everything it receives still lands there when it fits).
    made: dict[str, Incoming] = {}
    known = LocalState(step=0, keys={t.name: (PARAM, "exp_avg") for t in tensors},
                       dtypes={t.name: {PARAM: dtypes[t.name], "exp_avg": dtypes[t.name]} for t in tensors})
    for n in group:
        if n in holders or rng.random() < 0.4:
            continue
        foreseen = plan
        if rng.random() < 0.5 and len(holders) > 1:
            gone = rng.choice(holders)
            foreseen = plan_reshard({h: held for h, held in before.items() if h != gone}, after)
            if foreseen.missing:  # (nothing is made ready for a plan that cannot run)
                continue
        made[n] = expect(foreseen.for_member(n)[1], known, pools.get(n), CPU)
        made[n].assemble(after.get(n, {}), CPU)
        used[n] = foreseen.for_member(n)[1] == plan.for_member(n)[1]
    store = dist.HashStore()
    results: dict[str, Any] = {}

    def member(rank: int, name: str) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"case{seed}/", store), rank, len(group), timedelta(seconds=30))  # type: ignore[attr-defined]
            results[name] = execute(plan, name, {n: i for i, n in enumerate(group)}, locals_.get(name),
                                    after.get(name, {}), holders, pg, lambda work, buf: work.wait(), CPU, whole=whole,
                                    pool=pools.get(name), packed_whole=packed if give_packed and name == holders[0] else None,
                                    outgoing=ahead.get(name), incoming=made.get(name))
        except BaseException as e:  # noqa: BLE001 (reported below)
            results[name] = e

    threads = [threading.Thread(target=member, args=(r, n)) for r, n in enumerate(group)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    failed = {name: r for name, r in results.items() if isinstance(r, BaseException)}
    stuck = [t.name for t in threads if t.is_alive()]
    if failed or stuck:  # (every member's error: the first one raised may only echo another's)
        raise AssertionError(f"seed {seed}: members failed {failed}, still running {stuck}") from next(
            iter(failed.values()), None)
    for name in group:
        state, received = results[name]
        if name in ahead:
            assert ahead[name].used == used[name], (seed, name)
        if name in made:
            assert made[name].used == used[name], (seed, name)
        assert state.step == 5 and torch.equal(state.buffers["b"], torch.arange(3.0)), name
        expected_bytes = sum(t.elements * 2 * DTYPES[dtypes[t.tensor]].itemsize for t in plan.transfers if t.dst == name)
        if name in holders:
            assert received == expected_bytes, name
        else:
            assert received > expected_bytes, name  # (plus the whole-state part)
        for fqn, ranges in after.get(name, {}).items():
            covered = [(p.lo, p.hi) for p in state.pieces[fqn]]
            # exactly the needed ranges: pieces tile them (cut where the source changes), in order
            assert sum(hi - lo for lo, hi in covered) == sum(hi - lo for lo, hi in ranges), (name, fqn)
            if name in fits:  # everything received landed in the memory made ready for it
                block = pools[name].block.untyped_storage().data_ptr()
                assert all(v.untyped_storage().data_ptr() == block for p in state.pieces[fqn] for v in p.data.values()), \
                    (seed, name, fqn)
            for lo, hi in ranges:
                for key, full in truth[fqn].items():
                    assert torch.equal(state.read(fqn, key, lo, hi), full[lo:hi]), (seed, name, fqn, key, lo, hi)
                    out = torch.full((hi - lo,), -1.0, dtype=full.dtype)
                    assert torch.equal(state.copy_to(fqn, key, lo, hi, out), full[lo:hi])
            for key, full in truth[fqn].items():  # (a tp box's rows at once: `fill`)
                out = torch.full((sum(hi - lo for lo, hi in ranges),), -1.0, dtype=full.dtype)
                assert torch.equal(state.fill(fqn, key, ranges, out), torch.cat([full[lo:hi] for lo, hi in ranges]))


@pytest.mark.parametrize("block", range(4))
def test_random_reshards_give_every_member_exactly_its_slices(block: int) -> None:
    for seed in range(block * 25, block * 25 + 25):
        _case(seed)
