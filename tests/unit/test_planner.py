"""The global planner: known optima on small clusters, memory, migration, hysteresis, fallbacks.

Every expected answer is either worked out by hand in the test or found by enumerating every subset
of devices with the same cost model (`brute`), so a planner that picks a worse plan fails.
"""

from __future__ import annotations

import itertools
import random

import pytest

from plan import Cluster, Device, Graph, Plan, PlanLimits, make_plan, predict, split_shares
from plan.cost import max_micro_batch
from plan.graph import Layer
from plan.planner import assign

MB = 1_000_000
# A model with 4 MB of parameters (gradients all-reduced each step), 1 kB of activations per sample.
GRAPH = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=4 * MB, activation_bytes=1000),),
              optimizer_state_bytes=8 * MB)


def device(name: str, speed: float | None = None, *, memory: int = 1 << 34, host: str = "h",
           flops: float = 1e9) -> Device:
    return Device(name=name, host=host, kind="cpu", flops=flops, memory_bytes=memory, samples_per_s=speed)


def cluster(*devices: Device) -> Cluster:
    c = Cluster()
    for d in devices:
        c = c.with_device(d)
    return c


def brute(c: Cluster, graph: Graph, batch: int, previous: Plan | None = None, horizon: int = 200) -> float:
    """The best objective over every subset of devices (shares balanced by `assign`)."""
    names = sorted(c.devices)
    holders = set(previous.members) & set(names) if previous else set()
    speeds = c.speeds_for(graph.train_flops)
    best = float("inf")
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            # A device that fits one sample beside the state runs any share, in micro-batches.
            caps = [float(batch) if (max_micro_batch(graph, c.devices[n].memory_bytes,
                                                     graph.optimizer_state_factor) or 0.0) >= 1 else 0.0
                    for n in subset]
            shares = assign([speeds[n] for n in subset], [c.devices[n].overhead_s for n in subset], caps, batch)
            if shares is None or 0 in shares:
                continue
            p = predict(c, graph, subset, shares)
            assert p.predicted_step_s is not None
            new = [n for n in subset if n not in holders]
            switch = 0.0 if p.same_assignment(previous) else c.switch_s() + (
                c.move_s(graph.state_bytes) * len(new) if holders else 0.0)
            best = min(best, p.predicted_step_s + switch / horizon)
    return best


def test_split_shares_sums_and_is_proportional() -> None:
    for total, weights in ((64, [1.0, 1.0, 1.0]), (64, [1.0, 2.0, 3.0]), (7, [5.0, 1.0]), (1000, [0.1, 10, 3.3])):
        shares = split_shares(total, weights)
        assert sum(shares) == total and all(s >= 1 for s in shares)
        exact = [total * w / sum(weights) for w in weights]
        assert all(abs(s - x) < 1 for s, x in zip(shares, exact))


def test_assign_balances_speed_overhead_and_memory() -> None:
    # b is twice as fast; c has 15 ms of overhead more per step; d holds at most 3 samples. By hand:
    # 37 samples left for a, b, c finish together at T = 0.09625 s: 9.625, 19.25, 8.125; floors
    # 9, 19, 8 and the last sample to whichever finishes earliest with it (a and b at 0.1 s).
    shares = assign([100.0, 200.0, 100.0, 1000.0], [0.0, 0.0, 0.015, 0.0], [1e9, 1e9, 1e9, 3.0], 40)
    assert shares == [10, 19, 8, 3]
    assert assign([1.0], [0.0], [3.0], 4) is None


@pytest.mark.parametrize("seed", range(8))
def test_matches_enumeration_on_random_small_clusters(seed: int) -> None:
    rng = random.Random(seed)
    devices = [device(f"d{i}", rng.uniform(20, 400), memory=16 * MB + 1000 * rng.choice([5, 20, 10**6]))
               for i in range(rng.randint(2, 6))]
    c = cluster(*devices)
    batch = rng.choice([24, 64, 256])
    result = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=batch))
    best = brute(c, GRAPH, batch)
    if best == float("inf"):  # no replicated plan fits: sharded, or nothing
        assert result.plan is None or result.plan.dp_shard == len(result.plan.members) > 1, result.reason
        return

    assert result.plan is not None and result.objective_s is not None, result.reason
    assert result.objective_s <= best * 1.02, (result.reason, best)  # sharded only where it beats every replicated plan
    assert sum(result.plan.shares) == batch


def test_a_device_too_slow_to_be_worth_it_stays_on_standby() -> None:
    # 4 MB all-reduce at the prior 1 GB/s: adding a ring member costs about 2 ms; the snail would
    # take well under one sample of a 60-sample batch in the time the others need.
    c = cluster(device("a", 100.0), device("b", 100.0), device("c", 100.0), device("snail", 0.5))
    result = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=60))
    assert result.plan is not None
    assert result.plan.members == ("a", "b", "c") and result.plan.shares == (20, 20, 20)
    assert result.standby == ("snail",)
    assert "snail (too slow" in result.reason
    assert result.status == "optimal"
    assert result.runner_up is not None and result.objective_s is not None
    assert result.runner_up.objective_s > result.objective_s


def test_a_memory_limited_device_runs_its_share_in_micro_batches() -> None:
    static = 16 * MB  # 4 MB parameters + 4 MB gradients + 8 MB optimizer state
    small = device("small", 1000.0, memory=static + 5 * 1000)  # room for 5 samples' activations
    c = cluster(small, device("a", 100.0), device("b", 100.0))
    result = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=45))
    assert result.plan is not None
    shares = dict(zip(result.plan.members, result.plan.shares))
    micro = dict(zip(result.plan.members, result.plan.micro))
    assert shares["small"] > 5 and micro == {"small": 5, "a": 0, "b": 0}, (shares, micro)
    costs = {m.name: m for m in result.plan.costs}
    assert costs["small"].memory_bytes <= small.memory_bytes
    tiny = device("tiny", 1000.0, memory=static - 1)  # cannot even hold the state
    result = make_plan(cluster(tiny, device("a", 100.0)), GRAPH, None, limits=PlanLimits(global_batch=45))
    assert result.plan is not None and result.plan.members == ("a",)
    assert "tiny (its memory cannot hold" in result.reason


def test_nothing_fits_is_infeasible_and_says_what_would() -> None:
    static = 16 * MB
    c = cluster(device("a", 100.0, memory=static + 3000), device("b", 100.0, memory=static + 4000))
    result = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=64))  # 3 and 4 samples at once
    assert result.plan is not None and sum(result.plan.shares) == 64 and result.plan.micro == (3, 4), result.plan
    none = make_plan(cluster(device("a", 100.0, memory=1000)), GRAPH, None, limits=PlanLimits(global_batch=8))
    assert none.plan is None and none.status == "infeasible"


def test_a_failure_is_re_planned_moving_little_state() -> None:
    # Survivors a, b hold the state; e and f are standbys 5% faster than them. Re-planning after c
    # dies must keep a and b (nothing to move) and add only what pays for its state transfer.
    big = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=100 * MB, activation_bytes=0),),
                optimizer_state_bytes=200 * MB)
    c = cluster(device("a", 100.0), device("b", 100.0), device("e", 105.0), device("f", 105.0))
    previous = Plan(members=("a", "b", "c"), shares=(20, 20, 20))
    result = make_plan(c, big, previous, limits=PlanLimits(global_batch=60, horizon_steps=20))
    assert result.plan is not None and result.objective_s is not None
    assert {"a", "b"} <= set(result.plan.members), "survivors are kept"
    assert result.moved_bytes == (len(result.plan.members) - 2) * big.state_bytes
    assert result.objective_s <= brute(c, big, 60, previous, horizon=20) * 1.001
    # With no horizon to pay off a transfer, nobody new is taken.
    short = make_plan(c, big, previous, limits=PlanLimits(global_batch=60, horizon_steps=1))
    assert short.plan is not None and set(short.plan.members) == {"a", "b"} and short.moved_bytes == 0


def test_a_plan_that_saves_one_percent_but_moves_the_model_is_not_taken() -> None:
    devices = [device(n, 100.0) for n in "abcd"]
    previous = Plan(members=("a", "b", "c", "d"), shares=(16, 16, 16, 16))
    c = cluster(*devices, device("e", 2.0))  # e would save about 1% of the step
    result = make_plan(c, GRAPH, previous, limits=PlanLimits(global_batch=64))
    assert result.plan is not None and result.plan.same_assignment(previous), result.reason
    assert result.moved_bytes == 0 and result.standby == ("e",)


def test_hysteresis_keeps_the_plan_under_noise_and_a_straggler_moves_shares() -> None:
    c = cluster(device("a", 100.0), device("b", 100.0), device("c", 100.0))
    first = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=60)).plan
    assert first is not None and first.shares == (20, 20, 20)
    noisy = c.with_speed("b", 93.0)  # re-balancing would gain about 2% of the step
    kept = make_plan(noisy, GRAPH, first, limits=PlanLimits(global_batch=60))
    assert kept.plan is not None and kept.plan.same_assignment(first)
    assert "kept the current plan" in kept.reason, kept.reason
    slow = c.with_speed("b", 100.0 / 3)
    moved = make_plan(slow, GRAPH, first, limits=PlanLimits(global_batch=60))
    assert moved.plan is not None and moved.plan.members == ("a", "b", "c")
    shares = dict(zip(moved.plan.members, moved.plan.shares))
    assert shares["b"] < 20 / 2 and shares["a"] == shares["c"] and sum(shares.values()) == 60


def test_ranks_stay_stable_and_newcomers_are_appended() -> None:
    c = cluster(device("b", 100.0), device("a", 100.0))
    first = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=64)).plan
    assert first is not None
    grown = c.with_device(device("c", 300.0))
    second = make_plan(grown, GRAPH, first, limits=PlanLimits(global_batch=64)).plan
    assert second is not None and second.members[:2] == first.members and second.members[2] == "c"


def test_max_workers_keeps_running_members() -> None:
    c = cluster(device("a", 100.0), device("b", 100.0))
    first = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=64, max_workers=2)).plan
    faster = c.with_device(device("c", 900.0))
    result = make_plan(faster, GRAPH, first, limits=PlanLimits(global_batch=64, max_workers=2))
    # c is nine times faster: with room for two, it takes one member's place, and its state moves.
    assert result.plan is not None and len(result.plan.members) == 2 and "c" in result.plan.members
    assert len(result.standby) == 1 and result.standby[0] in ("a", "b") and "--max-workers 2" in result.reason
    assert result.moved_bytes == GRAPH.state_bytes
    unmeasured = c.with_device(device("c", None, flops=9e9))  # a guess never displaces a holder
    kept = make_plan(unmeasured, GRAPH, first, limits=PlanLimits(global_batch=64, max_workers=2))
    assert kept.plan is not None and kept.plan.members == ("a", "b") and kept.standby == ("c",)
    gone = faster.without("a")
    third = make_plan(gone, GRAPH, result.plan, limits=PlanLimits(global_batch=64, max_workers=2)).plan
    assert third is not None and len(third.members) == 2 and "c" in third.members


def test_multi_host_uses_the_inter_host_link_or_one_host() -> None:
    # Two hosts of two devices; the inter-host prior is 10x slower per byte. With a big model a
    # one-host plan wins over spanning both hosts.
    big = Graph((Layer(name="l0", kind="block", forward_flops=1e6, param_bytes=500 * MB, activation_bytes=0),))
    c = cluster(device("a1", 100.0, host="A"), device("a2", 100.0, host="A"),
                device("b1", 100.0, host="B"), device("b2", 100.0, host="B"))
    result = make_plan(c, big, None, limits=PlanLimits(global_batch=64))
    assert result.plan is not None
    assert len({c.devices[n].host for n in result.plan.members}) == 1, result.reason


def test_without_a_graph_shares_follow_speed() -> None:
    c = cluster(device("a", None, flops=1e9), device("b", None, flops=3e9))
    result = make_plan(c, None, None, limits=PlanLimits(global_batch=64))
    assert result.status == "heuristic" and result.plan is not None
    assert result.plan.shares == (16, 48) and result.plan.predicted_step_s is None


def test_even_policy_splits_evenly() -> None:
    c = cluster(device("a", 100.0), device("b", 50.0), device("c", 10.0))
    result = make_plan(c, GRAPH, None, limits=PlanLimits(global_batch=60, policy="even"))
    assert result.status == "even" and result.plan is not None and result.plan.shares == (20, 20, 20)
    assert result.plan.predicted_step_s == pytest.approx(2.0, rel=0.01)  # c: 20 samples at 10/s


def test_no_device_is_infeasible() -> None:
    result = make_plan(Cluster(), GRAPH, None, limits=PlanLimits(global_batch=8))
    assert result.plan is None and result.status == "infeasible"


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        PlanLimits(global_batch=8, policy="fastest")
    with pytest.raises(ValueError, match="global batch"):
        PlanLimits(global_batch=0)


def test_a_previous_plan_of_another_batch_is_never_kept_as_it_is() -> None:
    c = cluster(device("a", 100.0), device("b", 100.0))
    previous = Plan(members=("a", "b"), shares=(1, 1))  # e.g. survivors waiting: no real shares
    result = make_plan(c, GRAPH, previous, limits=PlanLimits(global_batch=64))
    assert result.plan is not None and sum(result.plan.shares) == 64


def test_sharded_when_no_replica_fits_and_replicated_when_it_is_faster() -> None:
    """A model whose parameters, gradients and Adam state do not fit any one device is sharded over
    the members: fully (each holds a quarter, two units gathered, a copy of another's quarter: 64
    MB) when HSDP's halves do not fit (72 MB), HSDP 2 x 2 when both fit and the cost model predicts
    it faster (no copy to refresh, gathers among two); with memory to spare the same devices stay
    replicated, sharding's gathers only cost time."""
    from plan.cost import hsdp_comm_s, sharded_comm_s
    from plan.graph import Layer
    blocks = tuple(Layer(name=f"b{i}", kind="block", forward_flops=1e6, param_bytes=4 * MB, activation_bytes=1000)
                   for i in range(8))
    graph = Graph(blocks, optimizer_state_bytes=64 * MB)  # 32 MB of parameters: 128 MB of state
    limits = PlanLimits(global_batch=32)
    tight = cluster(*(device(f"d{i}", 100.0, memory=70 * MB) for i in range(4)))
    result = make_plan(tight, graph, None, limits=limits)
    assert result.plan is not None and result.plan.layout.describe() == "dp_shard=4", result.reason
    assert "no replica fits" in result.reason and "with a copy of another's shard" in result.reason
    assert all(c.memory_bytes <= 70 * MB for c in result.plan.costs)

    both = cluster(*(device(f"d{i}", 100.0, memory=80 * MB) for i in range(4)))
    link = both.link(["d0", "d1", "d2", "d3"])
    assert hsdp_comm_s(graph, 2, 2, link) < sharded_comm_s(graph, 4, link)
    result = make_plan(both, graph, None, limits=limits)
    assert result.plan is not None and result.plan.layout.describe() == "dp_replicate=2 x dp_shard=2", result.reason
    assert result.reason.startswith("HSDP: 2 replicas of 2 shards: no replica fits"), result.reason
    assert result.runner_up is not None and result.runner_up.plan.layout.describe() == "dp_shard=4"
    assert result.objective_s is not None and result.runner_up.objective_s > result.objective_s
    assert all(c.memory_bytes <= 80 * MB for c in result.plan.costs)

    roomy = cluster(*(device(f"d{i}", 100.0, memory=1 << 34) for i in range(4)))
    result = make_plan(roomy, graph, None, limits=limits)
    assert result.plan is not None and result.plan.dp_shard == 1, result.reason
    assert "replicated: HSDP: 2 replicas of 2 shards would take" in result.reason, result.reason


def test_a_pin_that_leaves_the_replicas_free_gives_the_real_reason_a_worker_is_left_out() -> None:
    """`--layout fsdp=1` fixes no member count: a worker the planner leaves out is left out for its
    speed, and says so (not "not in the pinned layout"); `dp=2` does fix it."""
    from plan.layout import parse_pin
    c = cluster(device("a", 1000.0), device("b", 1000.0), device("snail", 1.0))
    limits = PlanLimits(global_batch=64)
    free = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("fsdp=1"))
    assert free.plan is not None and set(free.plan.members) == {"a", "b"}, free.reason
    assert free.standby == ("snail",) and free.standby_why[0].startswith("too slow"), free.standby_why
    two = make_plan(c.with_speed("snail", 1000.0), GRAPH, None, limits=limits, pin=parse_pin("dp=2,fsdp=1"))
    assert two.plan is not None and len(two.plan.members) == 2
    assert two.standby_why == ("not in the pinned layout",), two.standby_why


def test_a_pinned_layout_cuts_members_to_its_degrees() -> None:
    from plan.layout import parse_pin
    c = cluster(*(device(f"d{i}", 100.0 + i) for i in range(5)))
    limits = PlanLimits(global_batch=40)
    every = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("dp=1"))
    assert every.plan is not None and every.plan.layout.describe() == "dp_shard=5"
    three = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("fsdp=3"))
    assert three.plan is not None and three.plan.dp_shard == 3 and set(three.plan.members) == {"d2", "d3", "d4"}
    assert "not in the pinned layout" in three.standby_why and sum(three.plan.shares) == 40
    hybrid = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("fsdp=2"))  # 2 replicas of 2 shards
    assert hybrid.plan is not None and hybrid.plan.layout.describe() == "dp_replicate=2 x dp_shard=2"
    replicas = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("fsdp=1"))
    assert replicas.plan is not None and replicas.plan.dp_shard == 1 and len(replicas.plan.members) == 5
    too_many = make_plan(c, GRAPH, None, limits=limits, pin=parse_pin("fsdp=6"))
    assert too_many.plan is None and "needs 6 members" in too_many.reason


def test_a_pinned_sharded_layout_is_predicted_as_sharded_and_refused_when_it_does_not_fit() -> None:
    """A pinned layout is predicted by its own cost (gathers and reduce-scatters; HSDP without the
    copies, with the all-reduce across replicas) and holds its members' memory to account: a pin
    whose shard does not fit is refused with the reason; one that fits only sharded is planned
    even though no replica fits."""
    from plan.cost import hsdp_comm_s, sharded_comm_s, sharded_static_bytes
    from plan.layout import parse_pin
    blocks = tuple(Layer(name=f"b{i}", kind="block", forward_flops=1e6, param_bytes=4 * MB, activation_bytes=1000)
                   for i in range(8))
    graph = Graph(blocks, optimizer_state_bytes=64 * MB)  # 128 MB of state: no replica fits 70 MB
    limits = PlanLimits(global_batch=32)
    # Fully sharded over 4 a member holds 64 MB (its quarter, two units gathered, a copy of another's
    # quarter); HSDP 2 x 2 would need 72 MB (its half, two units).
    tight = cluster(*(device(f"d{i}", 100.0, memory=70 * MB) for i in range(4)))
    full = make_plan(tight, graph, None, limits=limits, pin=parse_pin("dp=1"))
    assert full.plan is not None and full.plan.dp_shard == 4, full.reason
    link = tight.link(full.plan.members)
    assert full.plan.comm_s == pytest.approx(sharded_comm_s(graph, 4, link))
    assert all(c.memory_bytes >= sharded_static_bytes(graph, 4) for c in full.plan.costs)
    hybrid = make_plan(tight, graph, None, limits=limits, pin=parse_pin("dp=2,fsdp=2"))
    assert hybrid.plan is None and "does not fit" in hybrid.reason and "d0 has 66.8 MiB" in hybrid.reason
    roomy = cluster(*(device(f"d{i}", 100.0, memory=1 << 34) for i in range(4)))
    hybrid = make_plan(roomy, graph, None, limits=limits, pin=parse_pin("dp=2,fsdp=2"))
    assert hybrid.plan is not None and hybrid.plan.layout.describe() == "dp_replicate=2 x dp_shard=2"
    assert hybrid.plan.comm_s == pytest.approx(hsdp_comm_s(graph, 2, 2, roomy.link(hybrid.plan.members)))
    assert all(c.memory_bytes >= sharded_static_bytes(graph, 2, copies=False) for c in hybrid.plan.costs)


def test_a_sharded_join_is_ranked_where_it_moves_least() -> None:
    """The planner hands a sharded plan whose members changed to `least_moving_order`: a fourth
    member joining three shard holders is placed third (half the state moves, not 7/12), keeps
    its share, and the plan's moved bytes say what moves."""
    from plan.layout import parse_pin
    from plan.prediction import predict_sharded
    c = cluster(*(device(n, 100.0) for n in ("a", "b", "c", "d")))
    limits = PlanLimits(global_batch=40)
    previous = predict_sharded(cluster(*(device(n, 100.0) for n in "abc")), GRAPH, ["a", "b", "c"], [14, 13, 13], ())
    result = make_plan(c, GRAPH, previous, limits=limits, pin=parse_pin("dp=1"))
    assert result.plan is not None and result.plan.dp_shard == 4, result.reason
    assert result.plan.members == ("a", "b", "d", "c"), result.plan.members
    assert result.moved_bytes == round(0.5 * GRAPH.state_bytes)
    assert [c.name for c in result.plan.costs] == list(result.plan.members)
    assert sum(result.plan.shares) == 40
