"""worker.schedules: the shipped learning-rate schedules are the recipe they document, pure, exported
from the package's public API, and refuse arguments that make no sense with a clear message."""

from __future__ import annotations

import math

import pytest

import worker
from worker import Job
from worker.schedules import warmup_cosine


def test_warmup_rises_linearly_to_the_full_rate() -> None:
    f = warmup_cosine(10, 110)
    assert [f(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f(9) == 1.0 and f(10) == 1.0  # the last warmup step and the cosine's start: the full rate


def test_cosine_falls_to_the_floor_at_total_and_stays() -> None:
    f = warmup_cosine(10, 110, floor=0.2)
    assert f(60) == pytest.approx(0.2 + 0.8 * 0.5)  # half way down the cosine
    assert f(110) == pytest.approx(0.2)
    assert f(10_000) == pytest.approx(0.2)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:])), "monotone after the warmup"


def test_no_warmup_starts_at_the_full_rate() -> None:
    f = warmup_cosine(0, 100, floor=0.0)
    assert f(0) == 1.0 and f(100) == pytest.approx(0.0, abs=1e-12)
    assert f(50) == pytest.approx(0.5)


def test_it_is_a_pure_function_of_the_step() -> None:
    f = warmup_cosine(5, 50)
    forward = [f(s) for s in range(60)]
    backward = [f(s) for s in reversed(range(60))][::-1]
    assert forward == backward == [warmup_cosine(5, 50)(s) for s in range(60)]
    assert all(math.isfinite(v) and v > 0 for v in forward)


def test_exported_from_the_worker_package_and_accepted_by_job() -> None:
    assert worker.warmup_cosine is warmup_cosine and "warmup_cosine" in worker.__all__
    job = Job(model=lambda: None, optimizer=lambda p: None, dataset=[0, 1], loss=lambda o, t: o,  # type: ignore[arg-type,return-value]
              global_batch=2, num_steps=40, lr_schedule=warmup_cosine(4, 40))
    assert job.lr_multiplier(0) == pytest.approx(0.25)
    assert job.lr_multiplier(39) == pytest.approx(warmup_cosine(4, 40)(39))


@pytest.mark.parametrize(("args", "needle"), [
    ((-1, 10), "warmup must be a whole number of steps >= 0"),
    ((2.5, 10), "warmup must be a whole number"),
    ((0, 0), "total must be a positive number of steps"),
    ((20, 10), "warmup (20) must not exceed total (10)"),
    ((1, 10, 1.5), "floor must be a fraction between 0 and 1"),
    ((1, 10, -0.1), "floor must be a fraction between 0 and 1"),
])
def test_bad_arguments_are_refused_with_what_to_fix(args: tuple[float, ...], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        warmup_cosine(*args)  # type: ignore[arg-type]
    assert needle in str(info.value)
