"""Wall time of the whole planner (`plan.make_plan`: every candidate layout enumerated, pruned by
memory, predicted and scored) on large simulated clusters. Pure CPU, no processes.

Clusters: `--devices` devices (default 1,024) in 8 classes of speed (20-200 samples/s), 8 per host,
on a model shaped like the 10M GPT (8 units that form a sequence: pipelines are candidates too),
global batch 4,096. Scenarios, each solved once per seed:

  roomy       every device holds a replica (the replicated solve wins)
  tight       no device holds a replica, every one holds a shard (sharded layouts, pipelines)
  replan      roomy, the first plan in force, then one of its members fails (migration costs)
  tight-replan  tight, the same

Tensor parallelism is weighed too: the model carries its tensors and their tp split, and the job
admits tp 2, 3 and 6, so dp x tp and FSDP x tp of each degree are candidates beside the rest.

    .venv/bin/python scripts/bench_make_plan.py [--devices 1024] [--seeds 3]

median_s and max_s: wall time of one `make_plan` call over the seeds; cpu_s: its median CPU time
(the wall time on a loaded machine is more). The goal is under 1 s per call at 1,024 devices.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from plan import Cluster, Device, Graph, Plan, PlanLimits, make_plan
from plan.graph import Layer, TensorInfo

MIB = 2**20
SCENARIOS = ("roomy", "tight", "replan", "tight-replan")
TP_DEGREES = (2, 3, 6)  # the 10M GPT's (6 heads; every split size divisible): weighed in every scenario


def gpt_10m(*, sequential: bool = True, split: bool = False) -> Graph:
    """The 10M GPT's units as `worker.graph.capture_graph` measures them (examples/gpt.py:job_10m):
    43 MB of parameters in an embedding, 6 blocks and a head; 164.4 MiB of parameters, gradients and
    AdamW state. `split`: with its tensors and their tensor-parallel split (examples/gpt.py's
    TP_PLAN: q, k, v and the MLP's first Linear column-wise, their output Linears row-wise), so that
    tp is weighed. (The planner's unit tests use it too.)"""
    layers = [Layer(name="0", kind="Embed", forward_flops=0.0, param_bytes=351744, activation_bytes=1536,
                    boundary_bytes=196608)]
    layers += [Layer(name=str(i), kind="Block", forward_flops=478150656.0, param_bytes=7097856,
                     activation_bytes=3549184, boundary_bytes=196608) for i in range(1, 7)]
    layers.append(Layer(name="7", kind="Head", forward_flops=9928704.0, param_bytes=158208, activation_bytes=394240,
                        boundary_bytes=51712))
    tensors: list[TensorInfo] = []
    if split:
        tensors += [TensorInfo(fqn="0.weight", shape=(229, 384), dtype="float32", unit="0"),
                    TensorInfo(fqn="7.weight", shape=(103, 384), dtype="float32", unit="7")]
        for i in range(1, 7):
            for name, shape, dim in (("q", (384, 384), 0), ("k", (384, 384), 0), ("v", (384, 384), 0),
                                     ("proj", (384, 384), 1), ("fc", (1536, 384), 0), ("out", (384, 1536), 1)):
                tensors.append(TensorInfo(fqn=f"{i}.{name}.weight", shape=shape, dtype="float32", unit=str(i), tp_dim=dim))
            tensors.append(TensorInfo(fqn=f"{i}.ln.weight", shape=(384,), dtype="float32", unit=str(i)))
    return Graph(tuple(layers), optimizer_state_bytes=86194484, sequential=sequential, tensors=tuple(tensors))


def cluster(devices: int, seed: int, memory: int) -> Cluster:
    rng = random.Random(seed)
    speeds = [rng.uniform(20, 200) for _ in range(8)]
    c = Cluster()
    for i in range(devices):
        c = c.with_device(Device(name=f"d{i:04d}", host=f"h{i // 8}", kind="cpu", flops=1e9, memory_bytes=memory,
                                 samples_per_s=speeds[i % 8]))
    return c


def run(devices: int, seed: int, scenario: str) -> dict[str, object]:
    graph = gpt_10m(split=True)
    memory = 160 * MIB if scenario.startswith("tight") else 64 * 2**30
    c = cluster(devices, seed, memory)
    limits = PlanLimits(global_batch=4096, tp_degrees=TP_DEGREES)
    previous: Plan | None = None
    if scenario.endswith("replan"):
        first = make_plan(c, graph, None, limits=limits)
        assert first.plan is not None, first.reason
        previous = first.plan
        c = c.without(first.plan.members[-1])
    start, cpu = time.perf_counter(), time.process_time()
    result = make_plan(c, graph, previous, limits=limits)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    layout = result.plan.layout.describe() if result.plan else None
    return {"scenario": scenario, "seed": seed, "s": seconds, "cpu_s": cpu, "layout": layout,
            "members": len(result.plan.members) if result.plan else 0,
            "candidates": len(getattr(result, "candidates", ()))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    run(8, 0, "roomy")  # (imports and first-call costs, paid once by a running coordinator)
    print(f"{'scenario':<12} {'median_s':>9} {'max_s':>7} {'cpu_s':>7}  layout (members, candidates weighed)")
    for scenario in SCENARIOS:
        rows = [run(a.devices, seed, scenario) for seed in range(a.seeds)]
        times = [float(r["s"]) for r in rows]  # type: ignore[arg-type]
        cpu = [float(r["cpu_s"]) for r in rows]  # type: ignore[arg-type]
        last = rows[-1]
        print(f"{scenario:<12} {statistics.median(times):9.3f} {max(times):7.3f} {statistics.median(cpu):7.3f}  "
              f"{last['layout']} "
              f"({last['members']}, {last['candidates']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
