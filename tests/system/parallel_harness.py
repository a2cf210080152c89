"""A process of the sharded-state tests (tests/system/test_parallel.py): real gloo groups on loopback,
one per epoch, formed over a TCPStore that process 0 serves; no coordinator. Each process walks the
same list of epochs (members, layout); in each one it is in, it reshards its state to the epoch's
layout (`plan.reshard` + `worker.parallel.slices.execute`), builds FSDP2 (or a plain model for a
replicated layout) from it, trains the epoch's steps exactly (its slice of each global batch, summed
losses over the global batch, summed gradients), and records the global loss of every step. It writes its
losses to OUT/PROCESS.json, and what it holds after each reshard and at the end of each epoch to
OUT/startE-PROCESS.pt and OUT/endE-PROCESS.pt (the test checks that a reshard changes no element;
a scenario with "dump": false, the benchmark's, writes none of them).

usage: python parallel_harness.py SCENARIO.json PROCESS OUT
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plan.graph import Graph  # noqa: E402
from plan.layout import Layout  # noqa: E402
from plan.reshard import TensorShape, holdings, plan_reshard  # noqa: E402
from worker.job import load_job, sample_ids  # noqa: E402
from worker.parallel import mesh as meshes  # noqa: E402
from worker.parallel.fsdp import Sharded, apply_fsdp, extract  # noqa: E402
from worker.parallel.replicated import Replica, apply_replicated, extract_replicated  # noqa: E402
from worker import epoch as epoch_entry  # noqa: E402
from worker.parallel.slices import LocalState, Pool, execute, expect, from_module, pack_sends, pack_whole  # noqa: E402


def _store(out: Path, names: list[str], me: str) -> Any:
    """The TCPStore process 0 serves on a port the OS picks (port 0: no race with other tests for a
    port chosen beforehand); it writes the port to OUT/store.port, where the others read it."""
    port_file = out / "store.port"
    timeout = timedelta(seconds=60)
    if names.index(me) == 0:
        store = dist.TCPStore("127.0.0.1", 0, len(names), True, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
        (out / "store.port.partial").write_text(str(store.port))
        (out / "store.port.partial").rename(port_file)
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{port_file} never appeared")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), len(names), False, timeout)  # type: ignore[attr-defined]


def main() -> None:
    from worker.heap import keep_freed_memory
    keep_freed_memory()  # as a worker does at start: a step's (and a reshard's) freed memory serves the next
    torch.set_num_threads(1)  # as a worker does by default (--threads 1)
    scenario = json.loads(Path(sys.argv[1]).read_text())
    me = sys.argv[2]
    out = Path(sys.argv[3])
    names = scenario["processes"]
    job = load_job((ROOT / scenario["job"]).read_text(), scenario["job_name"], filename=scenario["job"])
    graph = Graph.from_dict(json.loads(Path(scenario["graph"]).read_text()))
    tensors = [TensorShape(t.fqn, t.rows, t.numel) for t in graph.tensors]
    itemsize = {t.fqn: t.itemsize for t in graph.tensors}
    device = torch.device("cpu")
    store = _store(out, names, me)
    dump = scenario.get("dump", True)  # the state files the tests compare (a benchmark turns them off: GBs)

    torch.manual_seed(job.seed)  # step 0: every process can build the seeded model
    model0 = job.model()
    local: LocalState | None = from_module(0, model0, job.optimizer(model0.parameters()))
    del model0
    old_layout: Layout | None = None  # the layout the holders hold (None: everyone holds everything)
    holders = list(names)  # whose state is current: at step 0 every process's
    losses: dict[int, float] = {}
    reshard: list[dict[str, Any]] = []
    for e, epoch in enumerate(scenario["epochs"], start=1):
        layout = Layout.from_dict(epoch["layout"])
        killed = set(epoch.get("killed", []))
        holders = [n for n in holders if n not in killed]
        members = list(layout.members)
        # The reshard group: the new members, then holders that leave (they only send).
        departing = [n for n in holders if n not in members] if old_layout is not None else []
        group = members + departing
        if me not in group:
            local = None
            holders, old_layout = members, layout
            continue
        rank = group.index(me)
        pool = None  # as a worker that holds nothing makes its memory ready while the group forms
        if (local is None or me not in holders) and layout.sharded:
            pool = Pool.for_slices(holdings(layout, tensors).get(me, {}), itemsize, graph.optimizer_state_factor, device)
            pool.touch()
        prefixed = dist.PrefixStore(f"epoch{e}/", store)  # type: ignore[attr-defined]
        raw = dist.ProcessGroupGloo(prefixed, rank, len(group), timedelta(seconds=60))
        before = (holdings(old_layout, tensors) if old_layout is not None
                  else {n: {t.name: [(0, t.numel)] for t in tensors} for n in holders})
        before = {n: h for n, h in before.items() if n in holders and n in group}
        after = holdings(layout, tensors)
        plan = plan_reshard(before, after)
        assert not plan.missing, plan.describe_missing()
        senders = [n for n in group if n in before]
        mine = local if me in before else None
        # Before the descriptions, as a worker does while its group forms: a member that holds
        # nothing cuts its receives from the plan and the optimizer state the graph recorded, a
        # holder packs what it sends.
        incoming = None
        known = LocalState.recorded(graph.tensors)
        if mine is None and known is not None:
            incoming = expect(plan.for_member(me)[1], known, pool, device)
            incoming.assemble(after.get(me, {}), device)
        outgoing = pack_sends(plan, me, mine, after.get(me, {}), device) if mine is not None else None
        # The holders' whole-state skeleton, as the worker learns it (worker.epoch's description).
        packed = pack_whole(mine) if mine is not None else None
        described = epoch_entry.exchange(raw, rank, len(group), epoch_entry.describe(tensors, mine, packed),
                                         lambda work, buf: work.wait())
        whole = epoch_entry.skeleton(described[group.index(senders[0])])
        raw.allreduce([torch.zeros(1)]).wait()  # everyone formed the group: time the reshard alone
        t0 = time.perf_counter()
        local, got = execute(plan, me, {n: i for i, n in enumerate(group)}, mine, after.get(me, {}), senders, raw,
                             lambda work, buf: work.wait(), device, whole=whole, pool=pool,
                             packed_whole=packed if me == senders[0] else None, outgoing=outgoing,
                             incoming=incoming)
        seconds = time.perf_counter() - t0
        if dump:
            _dump(out / f"start{e}-{me}.pt", local)
        reshard.append({"epoch": e, "received": got, "seconds": seconds,
                        "ahead": (incoming.used if incoming is not None else outgoing.used if outgoing is not None else None),
                        "sent": plan.sent.get(me, 0), "bytes": plan.bytes_moved({t.name: 12 for t in tensors})})
        if me not in members:  # handed its slices over: gone
            local = None
            holders, old_layout = members, layout
            continue
        if departing:  # training runs on the members alone
            prefixed = dist.PrefixStore(f"epoch{e}/train/", store)  # type: ignore[attr-defined]
            raw = dist.ProcessGroupGloo(prefixed, members.index(me), len(members), timedelta(seconds=60))
        rank = members.index(me)
        pg = meshes.register(raw, prefixed, rank, len(members), e, device)
        executor: Sharded | Replica
        if layout.sharded and layout.dp_replicate > 1:  # HSDP: FSDP2 on this member's row, summed down its column
            subs = {}
            for part, ranks in (("replicate", layout.replicate_group(rank)), ("shard", layout.shard_group(rank))):
                sub_store = dist.PrefixStore(f"epoch{e}/{part}{ranks[0]}/", store)  # type: ignore[attr-defined]
                sub = dist.ProcessGroupGloo(sub_store, ranks.index(rank), len(ranks), timedelta(seconds=60))
                subs[part] = meshes.register(sub, sub_store, ranks.index(rank), len(ranks), e,
                                             device, part=f"{part}{ranks[0]}", ranks=ranks)
            executor = apply_fsdp(job, [layer.name for layer in graph.layers], layout, rank,
                                  meshes.mesh_of(subs["shard"], device, e), local, device,
                                  replicate=subs["replicate"])
        elif layout.sharded:
            executor = apply_fsdp(job, [layer.name for layer in graph.layers], layout, rank, meshes.mesh_of(pg, device, e), local, device)
        else:
            executor = apply_replicated(job, local, device)
        step = local.step
        for _ in range(epoch["steps"]):
            losses[step] = _step(job, executor, layout, rank, step)
            step += 1
        local = (extract(executor, layout, rank, step) if isinstance(executor, Sharded)
                 else extract_replicated(executor, step))
        del executor
        if dump:
            _dump(out / f"end{e}-{me}.pt", local)
        meshes.forget(pg)
        holders, old_layout = members, layout
    digest = {fqn: [[p.lo, p.hi, _hash(p.data)] for p in pieces] for fqn, pieces in (local.pieces if local else {}).items()}
    (out / f"{me}.json").write_text(json.dumps({"losses": losses, "reshard": reshard, "held": digest}))
    # Process 0 serves the store: it leaves last (one that handed its slices over and left first
    # took the store with it while the others still formed their training group on it).
    store.set(f"done/{me}", "1")
    if names.index(me) == 0:
        store.wait([f"done/{n}" for n in names], timedelta(seconds=300))


def _step(job: Any, sharded: Sharded | Replica, layout: Layout, rank: int, step: int) -> float:
    G = job.global_batch
    start, stop = layout.batch_slice(rank)
    ids = sample_ids(job.seed, step, len(job.dataset), G)[start:stop]
    sharded.optimizer.zero_grad()
    loss = torch.zeros(())
    if len(ids):
        x, y = job.dataset[ids]
        loss = job.loss(sharded.model(x), y)
        (loss / G).backward()
    else:  # an empty share still takes part in every collective of the step
        x, y = job.dataset[torch.arange(1)]
        (sharded.model(x).sum() * 0).backward()
    if not layout.sharded and layout.world > 1:  # replicas: sum the gradients
        for p in sharded.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    if isinstance(sharded, Sharded):
        sharded.stepper.step()  # as the worker steps (worker.parallel.fsdp.FsdpExecutor.step)
    else:
        sharded.optimizer.step()
    value: float = total.item() / G
    return value


def _dump(path: Path, local: LocalState) -> None:
    torch.save({fqn: [(p.lo, p.hi, {k: v.clone() for k, v in p.data.items()}) for p in pieces]
                for fqn, pieces in local.pieces.items()}, path)


def _hash(data: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(data):
        h.update(key.encode())
        h.update(data[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # (no teardown of gloo's threads: seen to abort a process at exit, after its work was done)
