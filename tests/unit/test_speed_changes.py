"""Speed changes in any order, through the pure membership core: the planner ends where the truth is.

Each case is a seeded schedule: 2-4 workers (one host or one each, pinned to replicas or free) whose
per-sample compute time changes 1-4 times, several workers at once or a step or two apart (a
change landing on a switch that another member's change caused, a change found in the same step
as another's). After the last change the job runs on; then the plan's step time, computed from
the true speeds, must be near the best any share split gives. Every bug this found made a plan
that stayed far off for good: a layout kind's efficiency learned from two members that recovered
at one switch (every speed then wrong by 4x, one member given the whole batch); a member's change
landing on a switch taken for the model's noise; a fit through two shares across a speed change
(an infinite speed, or a false fixed part a later rescale multiplied); a change found in the
reports of a step after another member's re-plan, thrown away with its epoch; step-time noise
measured across a kept change's two levels (a 3x straggler then needed a 60% gain). (On the code
before those fixes 15 of the 60 seeded schedules and 1 of the 24 pipelines below end past the bound.)

A second part runs pinned pipelines with the cost model as the truth, the cut re-made as speeds change.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from coordinator import membership as m
from plan import Cluster, Device, Plan, PlanLimits, make_plan
from plan.graph import Graph, Layer
from plan.layout import parse_pin
from plan.prediction import reported_compute, repredict
from transport import Ack, Join, StepReport

GRAPH = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=400_000, activation_bytes=1000),),
              optimizer_state_bytes=800_000)
BATCH = 64
FIXED_S = 0.0008  # compute per step whatever the share
PER_SAMPLE_S = 0.0015  # at full speed; stretched 1, 2, 3 or 8 times
SETTLE_STEPS = 120  # steps run after the last change
WITHIN = 1.15  # the final plan's true step time over the best split's


Reports = Callable[[Plan, dict[str, float]], dict[str, tuple[float, float]]]  # (plan, s/sample) -> member -> (compute, step)


def _train(names: list[str], *, graph: Graph, pin: str | None, per: dict[str, float],
           changes: dict[int, dict[str, float]], rnd: random.Random, one_host: bool, reports: Reports) -> Plan:
    """Workers `names` (on one host of 2 cores, or a host of 1 core each) join and train until
    SETTLE_STEPS after the last of `changes` (step -> worker -> seconds a sample, applied to `per`),
    each member reporting what `reports` says of the running plan, its compute jittered ±3%; every
    plan acknowledged by its members at once. The final plan."""
    config = m.Config(global_batch=BATCH, num_steps=1000, lease_s=1.0, min_workers=len(names))
    state = m.State(layout=parse_pin(pin) if pin else None)
    now = 100.0

    def apply(event: m.Event) -> None:
        nonlocal state
        state, effects = m.apply(state, event, config, now=now)
        for e in effects:
            if isinstance(e, m.FollowUp):
                apply(e.event)

    def ack_all() -> None:
        assert state.plan is not None
        for name in state.plan.members:
            apply(m.Acked(Ack(name=name, epoch=state.epoch, step=0, reshard_bytes=0, reshard_s=0.0)))

    apply(m.GraphReceived(graph))
    for name in names:
        apply(m.Joined(Join(name=name, host="h" if one_host else f"h{name}", pid=1, device="cpu", flops=1e9,
                            memory_bytes=2**30, threads=1, cores=2 if one_host else 1)))
    for name in names:
        apply(m.MadeReady(name))
    ack_all()
    for step in range(1, max(changes) + SETTLE_STEPS):
        per.update(changes.get(step, {}))
        now += 0.1
        plan, epoch = state.plan, state.epoch
        assert plan is not None
        said = reports(plan, per)
        for name, share in zip(plan.members, plan.shares):
            compute_s, step_s = said[name]
            apply(m.StepDone(StepReport(name=name, epoch=epoch, step=step, loss=1.0, samples=share,
                                        global_batch=BATCH, compute_s=compute_s * rnd.uniform(0.97, 1.03),
                                        comm_s=0.001, step_s=step_s, digest="")))
        if state.pending:
            ack_all()
    assert state.plan is not None
    return state.plan


def _simulate(names: list[str], *, one_host: bool, pin: str | None, per: dict[str, float],
              changes: dict[int, dict[str, float]], rnd: random.Random) -> tuple[float, str]:
    """Replicas of devices of steady speed: the final plan's true step time over the best split's,
    and what happened (for a failure's message)."""
    def reports(plan: Plan, per: dict[str, float]) -> dict[str, tuple[float, float]]:
        return {n: (FIXED_S + s * per[n], FIXED_S + s * per[n] + 0.002) for n, s in zip(plan.members, plan.shares)}

    per = dict(per)
    plan = _train(names, graph=GRAPH, pin=pin, per=per, changes=changes, rnd=rnd, one_host=one_host,
                  reports=reports)
    best = FIXED_S + BATCH / sum(1 / p for p in per.values())
    true_s = max(FIXED_S + s * per[x] for x, s in zip(plan.members, plan.shares) if s)
    what = (f"{len(names)} workers, {'one host' if one_host else 'a host each'}, pin {pin}; changes {changes}; "
            f"final plan {dict(zip(plan.members, plan.shares))} at s/sample {per}")
    return true_s / best, what


def _run(seed: int) -> tuple[float, str]:
    """A seeded schedule (see the module comment), simulated."""
    rnd = random.Random(seed)
    n = rnd.choice([2, 3, 4])
    names = [f"w{i}" for i in range(n)]
    one_host = rnd.random() < 0.5
    pin = rnd.choice([None, "fsdp=1"])
    per = {x: PER_SAMPLE_S * rnd.choice([1, 1, 2, 3, 8]) for x in names}
    changes: dict[int, dict[str, float]] = {}
    for _ in range(rnd.randint(1, 4)):
        at, factor = rnd.randint(30, 160), rnd.choice([1, 2, 3, 8])
        for w in rnd.sample(names, rnd.randint(1, n)):
            changes.setdefault(at + rnd.randint(0, 3), {})[w] = PER_SAMPLE_S * factor
    return _simulate(names, one_host=one_host, pin=pin, per=per, changes=changes, rnd=rnd)


def test_a_straggler_after_a_kept_change_is_still_planned_for() -> None:
    """Both workers slow down and recover together (the shares stay: a `kept` re-plan), then one
    slows 4x: the epoch's step times now hold two levels, and their gap is no noise for the pay-off
    rule to beat (measured around one median of both, it asked this straggler's re-plan for a 60%
    gain, and the job ran on at 2.5x the best step)."""
    x = PER_SAMPLE_S
    changes = {48: {"w0": x}, 49: {"w1": x}, 77: {"w0": 3 * x}, 79: {"w1": 3 * x}, 122: {"w0": 2 * x, "w1": 2 * x},
               137: {"w0": 8 * x}}
    ratio, what = _simulate(["w0", "w1"], one_host=False, pin="fsdp=1", per={"w0": 3 * x, "w1": x},
                            changes=changes, rnd=random.Random(0))  # (most jitter seeds fail it without)
    assert ratio <= WITHIN, f"{ratio:.2f}x the best split: {what}"


@pytest.mark.parametrize("seed", range(60))
def test_after_any_speed_changes_the_plan_ends_near_the_best_split(seed: int) -> None:
    ratio, what = _run(seed)
    assert ratio <= WITHIN, f"{ratio:.2f}x the best split: {what}"


# --- any layout: the cost model as the truth ------------------------------------------------------
#
# Each member reports what the cost model predicts for the running plan on a cluster of the true
# speeds (compute at the whole model's scale for a stage, as a stage reports it), jittered ±3%; the
# final plan, predicted on the truth, must be near the plan the planner makes when it knows the
# truth. Pipelines re-cut their stages to speeds here as replicas re-split the batch above. A re-cut
# changes a stage's micro-batches, so a change landing on it is a miss at another per-pass share,
# which re-plans only for a 20% gain (replan.EXTRAPOLATED_GAIN): up to 1 / (1 - 0.2) = 1.25 of the
# best by the planner's own prediction of the gain, a little more by the truth's.
WITHIN_PP = 1.3

SEQUENCE = Graph(tuple(Layer(name=f"b{i}", kind="block", forward_flops=2e6, param_bytes=100_000,
                             activation_bytes=4000) for i in range(6)), optimizer_state_bytes=200_000,
                 sequential=True)


def _truth(names: list[str], per: dict[str, float]) -> Cluster:
    cluster = Cluster()
    for name in names:
        cluster = cluster.with_device(Device(name=name, host=f"h{name}", kind="cpu", flops=1e9, memory_bytes=2**30,
                                             samples_per_s=1 / per[name], compute_fixed_s=FIXED_S, reports=9))
    return cluster


def _simulate_model(names: list[str], *, pin: str, per: dict[str, float], changes: dict[int, dict[str, float]],
                    rnd: random.Random) -> tuple[float, str]:
    def reports(plan: Plan, per: dict[str, float]) -> dict[str, tuple[float, float]]:
        truth = repredict(_truth(names, per), SEQUENCE, plan)
        step_s = truth.predicted_step_s or 0.01
        return {n: (c, step_s) for n, c in reported_compute(truth, SEQUENCE).items()}

    per = dict(per)
    plan = _train(names, graph=SEQUENCE, pin=pin, per=per, changes=changes, rnd=rnd, one_host=False,
                  reports=reports)
    truth = _truth(names, per)
    best = make_plan(truth, SEQUENCE, None, limits=PlanLimits(global_batch=BATCH), pin=parse_pin(pin)).plan
    assert best is not None and best.predicted_step_s
    final = repredict(truth, SEQUENCE, plan).predicted_step_s or 0.0
    what = (f"{len(names)} workers, pin {pin}; changes {changes}; final {plan.layout.describe()} "
            f"{dict(zip(plan.members, plan.shares))} stages {plan.stages}, best {best.layout.describe()} "
            f"stages {best.stages}; s/sample {per}")
    return final / best.predicted_step_s, what


@pytest.mark.parametrize("seed", range(24))
def test_after_any_speed_changes_a_pipelines_cut_ends_near_the_best(seed: int) -> None:
    rnd = random.Random(1000 + seed)
    pp = rnd.choice([2, 3])
    names = [f"w{i}" for i in range(pp)]
    per = {x: PER_SAMPLE_S * rnd.choice([1, 1, 2, 3]) for x in names}
    changes: dict[int, dict[str, float]] = {}
    for _ in range(rnd.randint(1, 3)):
        at, factor = rnd.randint(30, 120), rnd.choice([1, 2, 3])
        for w in rnd.sample(names, rnd.randint(1, pp)):
            changes.setdefault(at + rnd.randint(0, 3), {})[w] = PER_SAMPLE_S * factor
    ratio, what = _simulate_model(names, pin=f"pp={pp}", per=per, changes=changes, rnd=rnd)
    assert ratio <= WITHIN_PP, f"{ratio:.2f}x the best plan's step: {what}"
