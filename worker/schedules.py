"""Learning-rate schedules for `Job.lr_schedule`, shipped with the package so an installed job file can
use them (examples/ is not installed).

A schedule here is a pure function `step -> multiplier` of the optimizer's base learning rate, as
`Job.lr_schedule` wants it: no state, no clock, so a worker that joins at step k, a survivor after a
failure and a job resumed from a checkpoint all use the rate an undisturbed run uses at step k.
Arguments are checked when the schedule is made, with a message that says what to fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["warmup_cosine"]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """The usual recipe: the learning rate rises linearly over the first `warmup` steps (step 0 uses
    1/warmup of it, step warmup-1 all of it), then follows half a cosine from the full rate down to
    `floor` of it at step `total`, and stays at `floor` after. `warmup=0`: no warmup.

        Job(..., num_steps=300, lr_schedule=warmup_cosine(30, 300))
    """
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup_cosine: warmup must be a whole number of steps >= 0, got {warmup!r}")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        raise ValueError(f"warmup_cosine: total must be a positive number of steps, got {total!r}")
    if warmup > total:
        raise ValueError(f"warmup_cosine: warmup ({warmup}) must not exceed total ({total})")
    if not isinstance(floor, (int, float)) or isinstance(floor, bool) or not 0.0 <= floor <= 1.0:
        raise ValueError(f"warmup_cosine: floor must be a fraction between 0 and 1, got {floor!r}")

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
