"""Quality of the whole planner (`plan.make_plan`: device classes, the MILP, mapping to devices,
per-device shares) against an enumeration of every subset of devices on small clusters, scored with
the same cost model (`plan.planner.score_members`). Used by bench_planner.py's quality section.

Cases: 3–7 devices of random speeds (20–400 samples/s), a third of them memory-limited, global
batches of 24–256, models of 1–400 MB of gradients, some re-plans after a failure (the previous
plan's survivors hold the state, so moving it to others costs), on one or two hosts.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from plan import Cluster, Device, Graph, Plan, PlanLimits, make_plan
from plan.graph import Layer
from plan.planner import score_members

MB = 1_000_000


def _case(rng: random.Random) -> tuple[Cluster, Graph, Plan | None, int]:
    param = rng.choice([1, 20, 400]) * MB
    graph = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=param,
                         activation_bytes=rng.choice([0, 10_000])),), optimizer_state_bytes=2 * param)
    n = rng.randint(3, 7)
    cluster = Cluster()
    for i in range(n):
        memory = 1 << 40 if rng.random() > 0.33 else 4 * param + 10_000 * rng.randint(2, 30)
        cluster = cluster.with_device(Device(name=f"d{i}", host=f"h{i % rng.choice([1, 2])}", kind="cpu",
                                             flops=1e9, memory_bytes=memory, samples_per_s=rng.uniform(20, 400)))
    previous = None
    if rng.random() < 0.4:  # a re-plan after d0 failed: some survivors hold the state
        holders = [f"d{i}" for i in range(1, n) if rng.random() < 0.6]
        previous = Plan(members=("d0", *holders), shares=(1,) * (len(holders) + 1))
    return cluster, graph, previous, rng.choice([24, 64, 256])


def bench_planner_quality(*, quick: bool = False, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    cases: list[dict[str, Any]] = []
    for _ in range(15 if quick else 60):
        cluster, graph, previous, batch = _case(rng)
        limits = PlanLimits(global_batch=batch)
        result = make_plan(cluster, graph, previous, limits=limits)
        names = sorted(cluster.devices)
        best = None
        for r in range(1, len(names) + 1):
            for subset in itertools.combinations(names, r):
                scored = score_members(cluster, graph, previous, subset, limits=limits)
                if scored is not None and (best is None or scored.objective_s < best):
                    best = scored.objective_s
        if best is None or result.objective_s is None:
            cases.append({"feasible": False, "status": result.status, "enumerated": best})
            continue
        cases.append({"devices": len(names), "batch": batch, "replan": previous is not None,
                      "planner_s": result.objective_s, "best_s": best, "status": result.status,
                      "gap": result.objective_s / best - 1})
    gaps: list[float] = [float(c["gap"]) for c in cases if "gap" in c]
    return {"planner_cases": len(gaps), "planner_worst_gap": max(gaps) if gaps else None,
            "planner_within_2pct": sum(g <= 0.02 for g in gaps), "planner_case_list": cases}
