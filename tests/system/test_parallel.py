"""Sharded state that reshards live, in real processes on loopback (tests/system/parallel_harness.py:
one gloo group per epoch, FSDP2 for sharded layouts, `plan.reshard` + `worker.parallel.slices` between
epochs; the coordinator is not involved here):

- sharded training of the MLP and the GPT examples on 2 and 3 members with uneven shares (an empty
  one too) gives the single-process loss curve within 1e-4 relative;
- a chain of layout changes (replicated -> sharded 2 -> sharded 3 with a newcomer -> sharded 2 by a
  drain -> replicated 1) keeps the loss curve and changes no element: the state each epoch starts
  with equals, tensor by tensor, the state the previous epoch ended with; a newcomer receives only
  its slices.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.graph import capture_graph
from worker.job import Job, load_job, sample_ids

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent / "parallel_harness.py"


def _job(ref: str) -> Job:
    path, name = ref.split(":")
    return load_job((ROOT / path).read_text(), name, filename=path)


def _reference(job: Job, steps: int) -> list[float]:
    """The single-process loss curve."""
    torch.manual_seed(job.seed)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    out = []
    for step in range(steps):
        ids = sample_ids(job.seed, step, len(job.dataset), job.global_batch)
        optimizer.zero_grad()
        x, y = job.dataset[ids]
        loss = job.loss(model(x), y)
        (loss / job.global_batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        out.append(float(loss.detach()) / job.global_batch)
    return out


def _layout(members: list[str], shares: list[int], *, shard: bool, replicas: int = 1) -> dict[str, Any]:
    n = len(members)
    if shard:
        return {"dp_replicate": replicas, "dp_shard": n // replicas, "pp": 1, "tp": 1, "members": members,
                "shares": shares}
    return {"dp_replicate": n, "dp_shard": 1, "pp": 1, "tp": 1, "members": members, "shares": shares}


def _run(tmp_path: Path, ref: str, processes: list[str], epochs: list[dict[str, Any]]) -> dict[str, Any]:
    job_path, job_name = ref.split(":")
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(capture_graph(_job(ref)).to_dict()))
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps({"processes": processes, "job": job_path, "job_name": job_name,
                                    "graph": str(graph), "epochs": epochs}))
    (tmp_path / "store.port").unlink(missing_ok=True)  # (process 0 writes its store's port there)
    procs = [subprocess.Popen([sys.executable, str(HARNESS), str(scenario), name, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for name in processes]
    outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for name, p, text in zip(processes, procs, outputs):
        assert p.returncode == 0, f"{name} failed:\n{text[-3000:]}"
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in processes}


def _curve(results: dict[str, Any]) -> dict[int, float]:
    curve: dict[int, float] = {}
    for r in results.values():
        for step, loss in r["losses"].items():
            assert curve.setdefault(int(step), loss) == pytest.approx(loss, rel=1e-6), "members agree on the loss"
    return curve


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ref,shares", [("examples/mlp.py:job", [20, 12]), ("examples/gpt.py:job", [9, 7, 0])],
                         ids=["mlp-2", "gpt-3"])
def test_sharded_training_gives_the_single_process_loss_curve(tmp_path: Path, ref: str, shares: list[int]) -> None:
    job = _job(ref)
    total = sum(shares)
    shares = [s * job.global_batch // total for s in shares]
    shares[0] += job.global_batch - sum(shares)
    members = [f"m{i}" for i in range(len(shares))]
    results = _run(tmp_path, ref, members, [{"layout": _layout(members, shares, shard=True), "steps": 12}])
    curve = _curve(results)
    reference = _reference(job, 12)
    assert [curve[s] for s in range(12)] == pytest.approx(reference, rel=1e-4)


@pytest.mark.timeout(600)
def test_hsdp_2x2_gives_the_single_process_loss_curve_and_reshards_from_and_to_it(tmp_path: Path) -> None:
    """Replicas of shard groups (dp_replicate 2 x dp_shard 2, FSDP2 on a 2-D mesh of each member's
    row and column groups), entered from a replicated epoch and left for a fully sharded one."""
    ref = "examples/gpt.py:job"
    job = _job(ref)
    G = job.global_batch
    members = ["a", "b", "c", "d"]
    epochs: list[dict[str, Any]] = [
        {"layout": _layout(members, [4] * 4, shard=False), "steps": 2},
        {"layout": _layout(members, [5, 3, 6, G - 14], shard=True, replicas=2), "steps": 6},
        {"layout": _layout(members, [4] * 4, shard=True), "steps": 2},
    ]
    results = _run(tmp_path, ref, members, epochs)
    curve = _curve(results)
    assert [curve[s] for s in range(10)] == pytest.approx(_reference(job, 10), rel=1e-4)


@pytest.mark.timeout(600)
def test_a_chain_of_layout_changes_keeps_every_element_and_the_loss_curve(tmp_path: Path) -> None:
    ref = "examples/gpt.py:job"
    job = _job(ref)
    G = job.global_batch
    epochs: list[dict[str, Any]] = [
        {"layout": _layout(["a"], [G], shard=False), "steps": 3},                       # replicated, 1
        {"layout": _layout(["a", "b"], [G - 5, 5], shard=True), "steps": 3},             # -> sharded 2
        {"layout": _layout(["a", "b", "c"], [6, 5, G - 11], shard=True), "steps": 3},    # c joins
        {"layout": _layout(["c", "a"], [G - 7, 7], shard=True), "steps": 3},             # b drained
        {"layout": _layout(["c", "b"], [G // 2, G - G // 2], shard=False), "steps": 3},  # -> replicated 2
        {"layout": _layout(["b"], [G], shard=False), "steps": 2},                        # c drained
    ]
    results = _run(tmp_path, ref, ["a", "b", "c"], epochs)
    curve = _curve(results)
    steps = sum(int(e["steps"]) for e in epochs)
    assert [curve[s] for s in range(steps)] == pytest.approx(_reference(job, steps), rel=1e-4)

    def assemble(kind: str, epoch: int) -> dict[str, dict[str, torch.Tensor]]:
        full: dict[str, dict[str, torch.Tensor]] = {}
        covered: dict[str, torch.Tensor] = {}
        for f in tmp_path.glob(f"{kind}{epoch}-*.pt"):
            for fqn, pieces in torch.load(f, weights_only=True).items():
                for lo, hi, data in pieces:
                    for key, values in data.items():
                        size = max(hi, len(full.get(fqn, {}).get(key, [])))
                        t = full.setdefault(fqn, {}).setdefault(key, torch.full((size,), float("nan")))
                        if size > len(t):
                            t = full[fqn][key] = torch.cat([t, torch.full((size - len(t),), float("nan"))])
                        t[lo:hi] = values
                    mark = covered.setdefault(fqn, torch.zeros(0, dtype=torch.bool))
                    if len(mark) < hi:
                        mark = covered[fqn] = torch.cat([mark, torch.zeros(hi - len(mark), dtype=torch.bool)])
                    mark[lo:hi] = True
        return full

    shapes = {t.fqn: t.numel for t in capture_graph(job).tensors}
    for e in range(2, len(epochs) + 1):
        before, after = assemble("end", e - 1), assemble("start", e)
        assert set(before) == set(after) == set(shapes)
        for fqn, keys in before.items():
            for key, values in keys.items():
                assert len(values) == shapes[fqn] and not values.isnan().any(), f"epoch {e - 1} ends holding all of {fqn}"
                assert torch.equal(values, after[fqn][key]), f"the reshard into epoch {e} changed {fqn} ({key})"
    # Every member foresaw its part before the group formed (the harness's plans are the ones the
    # layouts give): the holders' messages went out as packed ahead, the newcomers' receives landed
    # where they were cut ahead (`slices.Outgoing`, `slices.Incoming`), and the state above is exact.
    for name, r in results.items():
        for entry in r["reshard"]:
            if entry["received"] or entry["sent"]:
                assert entry["ahead"] is not False, (name, entry)
    assert any(entry["ahead"] for r in results.values() for entry in r["reshard"])
    c = results["c"]["reshard"][0]
    state_bytes = sum(n * 12 for n in shapes.values())  # fp32 parameters + Adam's two moments
    assert c["received"] < state_bytes / 3 + 65536, "the newcomer of a 3-way shard receives about a third"
