"""Step bookkeeping: measured steps against the prediction, pure communication time, stragglers."""

from __future__ import annotations

import pytest

from coordinator import steps
from transport import StepReport


def report(name: str, step: int, *, samples: int = 20, compute_s: float = 0.1, comm_s: float = 0.01,
           step_s: float = 0.12, epoch: int = 1) -> StepReport:
    return StepReport(name=name, epoch=epoch, step=step, loss=1.0, samples=samples, global_batch=60,
                      compute_s=compute_s, comm_s=comm_s, step_s=step_s, digest="")


def tracker() -> steps.Tracker:
    return steps.start(1, ("a", "b", "c"), 0.11, {n: 0.1 for n in "abc"})  # 20 samples in 0.1 s


def test_a_step_is_measured_once_every_member_reported() -> None:
    t = tracker()
    t, f = steps.observe(t, report("a", 1, comm_s=0.05, step_s=0.12))
    t, g = steps.observe(t, report("b", 1, comm_s=0.01, step_s=0.13))
    assert f == g == []
    t, h = steps.observe(t, report("c", 1, comm_s=0.03, step_s=0.12))
    assert h == [steps.Measured(step=1, step_s=0.13, comm_s=0.01, ranks=3, settled=False)]
    assert t.errors == ((0.11 - 0.13) / 0.13,) and not t.pending
    assert steps.median_error(t) == t.errors[0]


def test_an_epochs_first_steps_are_not_settled_for_the_link_fit() -> None:
    """The first SETTLE steps of an epoch may hold a member still entering it (a survivor released
    late from an abandoned collective): the comm fit must not learn from them."""
    t = tracker()
    settled = []
    for step in range(1, steps.SETTLE + 3):
        for name in ("a", "b", "c"):
            t, found = steps.observe(t, report(name, step))
        settled += [f.settled for f in found if isinstance(f, steps.Measured)]
    assert settled == [False] * steps.SETTLE + [True, True]


def test_reports_of_other_epochs_and_strangers_are_ignored() -> None:
    t = tracker()
    assert steps.observe(t, report("a", 1, epoch=2)) == (t, [])
    assert steps.observe(t, report("z", 1)) == (t, [])


def test_a_straggler_is_a_lasting_shift_found_after_votes_steps_and_reported_once() -> None:
    t = tracker()
    found = []
    for step in range(1, 14):
        slow = step >= 8  # after SETTLE + STREAK steps of baseline
        t, fs = steps.observe(t, report("b", step, compute_s=0.3 if slow else 0.1))
        found += [f for f in fs if isinstance(f, steps.SpeedChange)]
    assert len(found) == 1
    change = found[0]
    assert (change.name, change.kind) == ("b", "straggler")
    assert change.speed == 20 / 0.3 and change.expected == 200.0 and change.factor == pytest.approx(3.0)
    assert change.recent == ((20, 0.3),) * steps.VOTES
    assert t.watches["b"].expected_s == 0.3


def test_a_burst_of_noise_is_no_straggler_but_a_slow_step_inside_a_lasting_shift_does_not_hide_it() -> None:
    t = tracker()
    changes = []
    for step in range(1, 40):
        burst = 10 <= step < 10 + steps.VOTES - 1  # four slow steps in a row, then normal again
        lasting = step >= 25 and step != 27  # a real slowdown, with one normal-looking step inside
        t, fs = steps.observe(t, report("b", step, compute_s=0.3 if burst or lasting else 0.1))
        changes += [(step, f.kind) for f in fs if isinstance(f, steps.SpeedChange)]
    assert changes == [(25 + steps.VOTES, "straggler")], "found VOTES+1 steps in (one vote was lost)"


def test_co_located_members_that_slow_down_together_are_contention_not_stragglers() -> None:
    t = steps.start(1, ("a", "b", "c"), 0.11, {n: 0.1 for n in "abc"}, hosts={"a": "h1", "b": "h1", "c": "h2"})
    kinds: list[tuple[str, str]] = []
    for step in range(1, 16):
        busy = step >= 8  # something else started on h1
        for n in "abc":
            slow = busy and n in "ab"
            t, fs = steps.observe(t, report(n, step, compute_s=0.25 if slow else 0.1))
            kinds += [(f.name, f.kind) for f in fs if isinstance(f, steps.SpeedChange)]
    assert sorted(kinds) == [("a", "contention"), ("b", "contention")], "c on another host is untouched"
    assert t.watches["a"].expected_s == t.watches["b"].expected_s == 0.25


def test_one_slow_step_is_noise_and_recovery_is_found() -> None:
    t = tracker()
    for step in range(1, 20):
        t, fs = steps.observe(t, report("a", step, compute_s=0.3 if step % 5 == 0 else 0.1))
        assert not [f for f in fs if isinstance(f, steps.SpeedChange)]
    t = steps.start(1, ("a",), None, {"a": 0.1})
    kinds = []
    for step in range(1, 14):
        t, fs = steps.observe(t, report("a", step, compute_s=0.1 if step < 8 else 0.025))
        kinds += [f.kind for f in fs if isinstance(f, steps.SpeedChange)]
    assert kinds == ["recovered"]


def test_a_wrong_prediction_is_a_calibration_not_a_straggler() -> None:
    t = tracker()
    kinds = []
    for step in range(1, 10):
        t, fs = steps.observe(t, report("a", step, compute_s=0.2))  # 100 samples/s, guess was 200
        kinds += [f.kind for f in fs if isinstance(f, steps.SpeedChange)]
    assert kinds == ["calibration"]
    assert t.watches["a"].expected_s == 0.2 and t.watches["a"].baselined


def test_a_measured_member_far_off_its_prediction_changed_speed_as_the_epoch_began() -> None:
    """A slowdown that lands as an epoch begins is in the member's baseline: against its own earlier
    measurement (what the prediction rests on) it is a straggler, not the model's noise."""
    for measured, expected in ((frozenset({"a"}), ["straggler"]), (frozenset(), ["calibration"])):
        t = steps.start(1, ("a",), 0.1, {"a": 0.1}, measured=measured)
        kinds = []
        for step in range(1, 10):
            t, fs = steps.observe(t, report("a", step, compute_s=0.3))
            kinds += [f.kind for f in fs if isinstance(f, steps.SpeedChange)]
        assert kinds == expected, measured
    t = steps.start(1, ("a",), 0.1, {"a": 0.1}, measured=frozenset({"a"}))
    kinds = []
    for step in range(1, 10):  # 1.5x off: within what a re-plan's model may miss, still a calibration
        t, fs = steps.observe(t, report("a", step, compute_s=0.15))
        kinds += [f.kind for f in fs if isinstance(f, steps.SpeedChange)]
    assert kinds == ["calibration"]


def test_a_layout_kinds_ratio_is_what_its_members_share_never_a_minoritys() -> None:
    """`common_ratio`: each member's median, then their median; of two middle ones the nearer 1."""
    def of(**by_member: list[float]) -> tuple[tuple[str, float], ...]:
        return tuple((name, r) for name, rs in by_member.items() for r in rs)

    assert steps.common_ratio(of(a=[0.5, 0.52, 0.51], b=[0.49, 0.5], c=[0.5])) == pytest.approx(0.5, rel=0.03)
    assert steps.common_ratio(of(a=[1.6, 1.6], b=[1.6], c=[4.8, 4.8, 4.8, 4.8])) == pytest.approx(1.6), \
        "one straggler among three, however many steps it reported"
    assert steps.common_ratio(of(a=[3.0] * 4, b=[1.0] * 4)) == pytest.approx(1.0), "of two, the smaller change"
    assert steps.common_ratio(of(a=[0.6] * 4, b=[0.5] * 4)) == pytest.approx(0.6), "both faster: the one nearer 1"


def test_a_known_kind_learns_nothing_from_members_that_changed_speed() -> None:
    """Of a kind already known, a member FAR_OFF its prediction changed speed itself (its watch reports
    it): two of three recovering at one switch are not the layout, though they are the median. A
    kind run for the first time takes every ratio; the fits' own kind learns nothing at all."""
    def learned(**kw: bool) -> float | None:
        t = steps.start(1, ("a", "b", "c"), 0.11, {n: 0.1 for n in "abc"}, measured=frozenset("abc"), **kw)
        efficiency = None
        for name, compute_s in (("a", 0.1), ("b", 0.012), ("c", 0.013)) * 2:
            t, now, _ = steps.efficiency_of_kind(t, report(name, 3, compute_s=compute_s))
            efficiency = efficiency if now is None else now
        return efficiency

    assert learned(kind_known=True) == pytest.approx(1.0), "only a's ratio counts"
    assert learned(kind_known=False) == pytest.approx(0.13), "a new kind: the members' common ratio"
    assert learned(learns=False) is None
