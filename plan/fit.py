"""Fitting the cost model's constants from measurements instead of setting them by hand.

Every constant the cost model needs beyond the graph's FLOPs and bytes is of the form

    y ≈ c0·f0 + c1·f1,   c0, c1 ≥ 0

with two known features per observation: a link's α and β (a ring all-reduce of n bytes over R
ranks: f0 = 2(R−1), f1 = 2(R−1)/R·n), or the cost of moving state (f0 = 1 for forming the group,
f1 = bytes moved). `TwoTermFit` keeps the latest `window` observations and refits on each one:

* no observation yet: the prior (documented where each fit is made; used only until the first
  measurement);
* observations that cannot tell c0 from c1 apart (f1/f0 is the same in all of them: one plan, one
  ring size): the prior's *shape* scaled to the data, so a single measured all-reduce time moves
  both α and β by the same factor;
* otherwise the non-negative least-squares solution (the 2×2 normal equations, or the best
  single-term fit when one coefficient would come out negative).

Pure and cheap (a window of 64 observations), so it runs on every step report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

WINDOW = 64
# Feature ratios within this factor of each other count as "the same shape": not enough spread to
# separate the two coefficients.
SPREAD = 1.2


@dataclass(frozen=True, slots=True)
class Observation:
    f0: float
    f1: float
    y: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoTermFit:
    """y ≈ c0·f0 + c1·f1 fitted to the latest `window` observations (see the module comment)."""

    prior: tuple[float, float]
    window: int = WINDOW
    observations: tuple[Observation, ...] = ()
    coef: tuple[float, float] = field(default=(math.nan, math.nan))

    def __post_init__(self) -> None:
        if any(c < 0 or not math.isfinite(c) for c in self.prior):
            raise ValueError(f"prior coefficients must be finite and >= 0, got {self.prior}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if math.isnan(self.coef[0]):
            object.__setattr__(self, "coef", fit_two_terms(self.observations, self.prior))

    @property
    def measured(self) -> int:
        """How many observations the coefficients rest on (0: the prior)."""
        return len(self.observations)

    def observe(self, f0: float, f1: float, y: float) -> TwoTermFit:
        """A new fit with one more observation (invalid ones are ignored)."""
        if not all(math.isfinite(v) and v >= 0 for v in (f0, f1, y)) or (f0 == 0 and f1 == 0):
            return self
        kept = (*self.observations, Observation(f0, f1, y))[-self.window:]
        return replace(self, observations=kept, coef=fit_two_terms(kept, self.prior))

    def predict(self, f0: float, f1: float) -> float:
        return self.coef[0] * f0 + self.coef[1] * f1


def fit_two_terms(obs: tuple[Observation, ...], prior: tuple[float, float]) -> tuple[float, float]:
    """Non-negative least squares for y ≈ c0·f0 + c1·f1 (see the module comment)."""
    if not obs:
        return prior
    if not _separable(obs):
        shape = [prior[0] * o.f0 + prior[1] * o.f1 for o in obs]
        den = sum(p * p for p in shape)
        if den > 0:
            scale = sum(p * o.y for p, o in zip(shape, obs)) / den
            return prior[0] * scale, prior[1] * scale
    s00 = sum(o.f0 * o.f0 for o in obs)
    s01 = sum(o.f0 * o.f1 for o in obs)
    s11 = sum(o.f1 * o.f1 for o in obs)
    s0y = sum(o.f0 * o.y for o in obs)
    s1y = sum(o.f1 * o.y for o in obs)
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        c0, c1 = (s0y * s11 - s1y * s01) / det, (s1y * s00 - s0y * s01) / det
        if c0 >= 0 and c1 >= 0:
            return c0, c1
    # One coefficient would be negative: the better of the two single-term fits.
    candidates = [(s0y / s00 if s00 > 0 else 0.0, 0.0), (0.0, s1y / s11 if s11 > 0 else 0.0)]
    return min(candidates, key=lambda c: sum((c[0] * o.f0 + c[1] * o.f1 - o.y) ** 2 for o in obs))


def _separable(obs: tuple[Observation, ...]) -> bool:
    """Whether the observations vary enough in f1/f0 to tell the two coefficients apart."""
    ratios = [o.f1 / o.f0 if o.f0 > 0 else math.inf for o in obs]
    finite = [r for r in ratios if math.isfinite(r)]
    if len(finite) != len(ratios):
        return bool(finite)  # some rows have f0 = 0 and some do not: they separate
    lo, hi = min(finite), max(finite)
    return hi > SPREAD * lo if lo > 0 else hi > 0
