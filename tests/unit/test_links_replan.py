"""The `links` re-plan: the steps of a plan that spans hosts measure the links between them, and
when the plan's step, re-predicted with those links, is more than a quarter off the step it was
planned for, the layouts are weighed again, once per plan. Pure: `links_moved` on a state."""

from __future__ import annotations

from dataclasses import replace

from coordinator.membership import LINKS_MOVED, links_moved
from coordinator.state import State
from plan import Cluster, Device, Graph, predict
from plan.cost import step_comm_features
from plan.graph import Layer


GRAPH = Graph(tuple(Layer(name=str(i), kind="block", forward_flops=1e6, param_bytes=4_000_000, activation_bytes=1000,
                          boundary_bytes=100) for i in range(4)), optimizer_state_bytes=32_000_000, sequential=True)


def _state(hosts: tuple[str, str]) -> tuple[State, Cluster]:
    c = Cluster()
    for name, host in zip(("a", "b"), hosts):
        c = c.with_device(Device(name=name, host=host, kind="cpu", flops=1e9, memory_bytes=1 << 32, samples_per_s=100.0))
    plan = predict(c, GRAPH, ["a", "b"], [8, 8])
    return State(cluster=c, graph=GRAPH, epoch=3, plan=plan), c


def _measured(c: Cluster, seconds: float, n: int = 8) -> Cluster:
    """`n` steps' all-reduces over the two hosts, each taking `seconds`."""
    f0, f1 = step_comm_features(GRAPH, 2, 1)
    for _ in range(n):
        c = c.with_comm(f0, f1, seconds, cross_host=True)
    return c


def test_a_slow_link_measured_between_hosts_re_plans_once() -> None:
    state, c = _state(("h1", "h2"))
    assert state.plan is not None and state.plan.predicted_step_s is not None
    planned = state.plan.predicted_step_s
    slow = _measured(c, 20 * planned)  # (an all-reduce twenty steps long: a link far slower than the prior)
    assert links_moved(state, slow, 3)
    assert not links_moved(replace(state, links_checked=True), slow, 3), "once per plan"
    assert not links_moved(state, slow, 2), "a report of an older epoch says nothing of this plan"


def test_links_that_match_the_prediction_do_not() -> None:
    state, c = _state(("h1", "h2"))
    assert state.plan is not None and state.plan.comm_s is not None
    same = _measured(c, state.plan.comm_s)
    assert not links_moved(state, same, 3)
    assert LINKS_MOVED == 0.25
