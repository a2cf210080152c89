"""Exact search over ring sizes for the data-parallel plan (the engine behind `plan.milp.solve_dp`).

There is one ring, so the all-reduce cost depends only on the ring size R = j + n, and migration
only on n, how many of the R devices are newcomers (j are kept from the previous plan). For a fixed
pair (j, n) the best plan is easy: at makespan T a device of class c holds v_c(T) = min(speed_c·T,
cap_c) samples, so the most the pair can hold is the sum of the j largest v over the kept devices
plus the n largest over the newcomers, and the least T at which that reaches B is its makespan.

0. `candidate_pairs`: with a migration cost, n newcomers cost at least mig·n, so n above what a
   kept-only plan costs in all cannot win and is not enumerated.
1. Continuous shares, exactly. Between breakpoints T = cap_c/speed_d the order of the v_c does not
   change, so each "top-j" sum is linear in T there; tables of the top-j sums at every breakpoint
   (two pools, at most C + C² breakpoints) and a vectorised bisection over breakpoints give every
   pair's makespan by linear interpolation. A taking-part device trains at least one sample (else
   it only lengthens the ring), so T ≥ 1/speed of the slowest chosen device and R ≤ B.
2. Integer shares, which are what trains: a device holds floor(v_c(T)) samples. The continuous
   makespan is a lower bound and T + 1/min speed always holds, so each pair's integer makespan is
   found in that bracket (`_IntegerShares.makespan`, exact). Pairs are checked in increasing order
   of their continuous objective until the next one is within `gap` of the best integer objective
   found: every pair left is proved no better (within the gap).

Stage 2 has a budget of pair checks; when it runs out the result is still feasible but not proved
(`complete` is False). Pure numpy; no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

_EPS = 1e-9  # samples: floor(v + _EPS) so that v = 3 − 1e-15 from floating point still holds 3


@dataclass(frozen=True, slots=True)
class Search:
    """The best pair found: per-class counts, integer-share makespan and objective, and a proved
    lower bound on the objective of every plan (continuous shares relax integer ones)."""

    counts: tuple[int, ...]
    makespan_s: float
    objective_s: float
    lower_bound_s: float
    num_pairs: int  # (ring size, newcomers) pairs enumerated
    num_checked: int  # pairs whose integer makespan was computed
    complete: bool  # every pair was either checked or proved no better


def candidate_pairs(
    speeds: Floats, caps: Floats, kept: Ints, new: Ints, batch: int, comm_s: Floats, mig_s: float, r_max: int
) -> tuple[Ints, Ints]:
    """The (kept, new) count pairs worth enumerating. With a migration cost, n newcomers cost at
    least mig_s·n + B / (total speed); a plan of kept devices only costs at most its continuous
    objective + 1/min speed (that much longer always holds in integer shares), so larger n go."""
    num_kept, num_new = int(kept.sum()), int(new.sum())
    if mig_s > 0 and num_kept and num_new:
        j = np.arange(1, min(num_kept, r_max) + 1)
        t, _ = continuous_makespans(speeds, caps, kept, new, batch, j, np.zeros_like(j))
        upper = float(np.min(t + comm_s[j])) + 1.0 / float(speeds.min())
        floor_s = batch / float(np.sum(speeds * (kept + new)))
        if math.isfinite(upper):
            num_new = min(num_new, max(0, math.floor((upper - floor_s) / mig_s)))
    return pairs(num_kept, num_new, r_max)


def search(
    speeds: Floats, caps: Floats, kept: Ints, new: Ints, batch: int, comm_s: Floats, mig_s: float,
    j: Ints, n: Ints, *, gap: float, budget: int,
) -> Search | None:
    """Best plan over the pairs (j kept, n new devices) from `candidate_pairs`: per-class `kept`
    devices are free, `new` ones cost `mig_s` each; `caps` are integer samples per device
    (≤ batch), `comm_s[R]` the all-reduce time over R ranks. None if no pair holds the batch."""
    t, bps = continuous_makespans(speeds, caps, kept, new, batch, j, n)
    ok = np.isfinite(t)
    j, n, t = j[ok], n[ok], t[ok]
    if len(j) == 0:
        return None
    cont = t + comm_s[j + n] + mig_s * n

    ints = _IntegerShares(speeds, caps, kept, new, batch, bps)
    order = np.argsort(cont, kind="stable")
    best, best_t, best_i = np.inf, 0.0, -1
    pos, chunk, checked, complete = 0, 8, 0, True
    while pos < len(order):
        idx = order[pos:pos + chunk]
        idx = idx[cont[idx] < best * (1 - gap)]
        if len(idx) == 0:
            break
        if checked and checked + len(idx) > budget:
            complete = False
            break
        t_int = ints.makespan(t[idx], j[idx], n[idx])
        obj = t_int + comm_s[j[idx] + n[idx]] + mig_s * n[idx]
        k = int(np.argmin(obj))
        if obj[k] < best:
            best, best_t, best_i = float(obj[k]), float(t_int[k]), int(idx[k])
        checked += len(idx)
        pos += len(idx)
        chunk = min(4 * chunk, 4096)  # re-prune often: each check costs about 5 µs
    lower = min(best, float(cont[order[pos]])) if pos < len(order) else best
    counts = _select(best_t, int(j[best_i]), speeds, caps, kept) + _select(best_t, int(n[best_i]), speeds, caps, new)
    return Search(counts=tuple(int(c) for c in counts), makespan_s=best_t, objective_s=best,
                  lower_bound_s=lower, num_pairs=len(order), num_checked=checked, complete=complete)


def pairs(num_kept: int, num_new: int, r_max: int) -> tuple[Ints, Ints]:
    """Every (kept, new) count pair with 1 ≤ kept + new ≤ r_max, kept ≤ num_kept, new ≤ num_new."""
    n_vals = np.arange(min(num_new, r_max) + 1)
    j_lo = (n_vals == 0).astype(np.int64)
    sizes = np.maximum(np.minimum(num_kept, r_max - n_vals) - j_lo + 1, 0)
    starts = np.cumsum(sizes) - sizes
    n = np.repeat(n_vals, sizes)
    j = np.arange(int(sizes.sum())) - np.repeat(starts - j_lo, sizes)
    return j, n


def continuous_makespans(
    speeds: Floats, caps: Floats, kept: Ints, new: Ints, batch: int, j: Ints, n: Ints
) -> tuple[Floats, Floats]:
    """Least makespan (continuous shares, one sample at least per device) of the j best kept and n
    best new devices, for each pair (inf where they cannot hold the batch); and the breakpoints."""
    bps = np.unique(np.concatenate([[0.0], (caps[None, :] / speeds[:, None]).ravel()]))
    full = bps[:, None] >= (caps / speeds)[None, :]  # exactly at the cap, despite rounding
    v = np.where(full, caps[None, :], np.minimum(speeds[None, :] * bps[:, None], caps[None, :]))
    top_k, top_n = _table(v, kept), _table(v, new)
    last = len(bps) - 1
    feasible = (top_k[last, j] + top_n[last, n] >= batch) & (j + n <= batch)
    lo, hi = np.ones_like(j), np.full_like(j, last)
    for _ in range(last.bit_length()):
        mid = (lo + hi) // 2
        holds = top_k[mid, j] + top_n[mid, n] >= batch
        hi, lo = np.where(holds, mid, hi), np.where(holds, lo, np.minimum(mid + 1, last))
    c0, c1 = top_k[lo - 1, j] + top_n[lo - 1, n], top_k[lo, j] + top_n[lo, n]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = bps[lo - 1] + (batch - c0) / (c1 - c0) * (bps[lo] - bps[lo - 1])
    t = np.maximum(t, np.maximum(_slowest(speeds, kept)[j], _slowest(speeds, new)[n]))
    return np.where(feasible, t, np.inf), bps


def _table(v: Floats, counts: Ints) -> Floats:
    """top[b, i]: the sum of the i largest per-device values at breakpoint b, over a pool."""
    out = np.zeros((v.shape[0], int(counts.sum()) + 1))
    for b in range(v.shape[0]):
        order = np.argsort(-v[b], kind="stable")
        out[b, 1:] = np.cumsum(np.repeat(v[b, order], counts[order]))
    return out


def _slowest(speeds: Floats, counts: Ints) -> Floats:
    """[i]: the least makespan at which the i fastest devices of a pool each hold one sample."""
    by_speed = np.argsort(-speeds, kind="stable")
    return np.concatenate([[0.0], 1.0 / np.repeat(speeds[by_speed], counts[by_speed])])


class _IntegerShares:
    """Integer capacity of (kept, newcomer) pairs at given makespans, vectorised over pairs.

    Between breakpoints the classes keep their order by v (and floor keeps a weak order), so the
    order is looked up per breakpoint interval instead of sorted per pair."""

    def __init__(self, speeds: Floats, caps: Floats, kept: Ints, new: Ints, batch: int, bps: Floats):
        self.speeds, self.caps, self.kept, self.new, self.batch, self.bps = speeds, caps, kept, new, batch, bps
        mids = np.concatenate([(bps[:-1] + bps[1:]) / 2, [bps[-1] + 1.0]])
        self.orders = np.argsort(-np.minimum(speeds[None, :] * mids[:, None], caps[None, :]), axis=1, kind="stable")

    def holds(self, t: Floats, j: Ints, n: Ints) -> npt.NDArray[np.bool_]:
        """Whether the j best kept and n best new devices hold the batch in integer shares at t."""
        order = self.orders[np.clip(np.searchsorted(self.bps, t, side="right") - 1, 0, len(self.bps) - 1)]
        sp, cp = self.speeds[order], self.caps[order]
        v = np.minimum(np.floor(sp * t[:, None] + _EPS), cp)
        total = np.zeros(len(t))
        for pool, take in ((self.kept, j), (self.new, n)):
            ns = pool[order]
            before = np.cumsum(ns, axis=1) - ns
            total += (np.clip(take[:, None] - before, 0, ns) * v).sum(axis=1)
        return np.asarray(total >= self.batch)

    def makespan(self, lo: Floats, j: Ints, n: Ints) -> Floats:
        """Least makespan at which each pair's integer shares hold the batch, given its continuous
        makespan `lo`. Capacity is a step function that steps at T = q/speed_c; halving the bracket
        [lo, lo + 1/min speed] (which always holds) until it is narrower than 1/max speed leaves at
        most one step per class in it, and the answer is the first step at which the pair holds."""
        start, at_start = lo, self.holds(lo, j, n)
        hi = lo + 1.0 / float(self.speeds.min())
        for _ in range(int(np.ceil(np.log2(float(self.speeds.max() / self.speeds.min())))) + 1):
            mid = (lo + hi) / 2
            ok = self.holds(mid, j, n)
            hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
        q = np.minimum(np.floor(self.speeds[None, :] * hi[:, None] + _EPS), self.caps[None, :])
        steps = q / self.speeds[None, :]
        steps = np.sort(np.where(steps > lo[:, None], steps, hi[:, None]), axis=1)
        width = steps.shape[1]
        ok = self.holds(steps.ravel(), np.repeat(j, width), np.repeat(n, width)).reshape(steps.shape)
        first = np.take_along_axis(steps, np.argmax(ok, axis=1)[:, None], axis=1)[:, 0]
        return np.where(at_start, start, first)


def _select(t: float, take: int, speeds: Floats, caps: Floats, counts: Ints) -> Ints:
    """Per-class counts of the `take` devices of a pool that hold the most at makespan t (ties:
    the faster class)."""
    v = np.floor(np.minimum(speeds * t, caps) + _EPS)
    out = np.zeros_like(counts)
    for c in np.lexsort((-speeds, -v)):
        out[c] = min(take, int(counts[c]))
        take -= int(out[c])
    return out
