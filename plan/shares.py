"""Share arithmetic: turning speeds (and memory caps) into integer samples per device that sum to
the global batch. Used by the class-level solver (plan.milp) and by the planner's per-device step.
Pure functions of plain numbers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def round_to_total(exact: Sequence[float], speeds: Sequence[float], overheads: Sequence[float],
                   caps: Sequence[float], total: int, *, min_share: int = 0) -> list[int] | None:
    """Integer shares summing to `total` from continuous ones: floors first (a share already above
    `min_share` gives one back first if floating point rounded them over the total), then one
    sample at a time to whichever device would finish earliest with it (overhead + samples /
    speed; ties to the lower index), within its cap. None if the caps run out of room."""
    n = len(exact)
    shares = [min(math.floor(x + 1e-9), int(min(c, total))) for x, c in zip(exact, caps)]

    def finish(i: int, samples: int) -> float:
        return overheads[i] + samples / speeds[i]

    while sum(shares) > total:  # take back from the latest finisher
        spare = [i for i in range(n) if shares[i] > min_share] or [i for i in range(n) if shares[i] > 0]
        shares[max(spare, key=lambda i: finish(i, shares[i]))] -= 1
    heap = [(finish(i, shares[i] + 1), i) for i in range(n) if shares[i] + 1 <= caps[i]]
    heapq.heapify(heap)
    left = total - sum(shares)
    while left > 0 and heap:
        _, i = heapq.heappop(heap)
        shares[i] += 1
        left -= 1
        if shares[i] + 1 <= caps[i]:
            heapq.heappush(heap, (finish(i, shares[i] + 1), i))
    return shares if left == 0 else None


def assign(speeds: Sequence[float], overheads: Sequence[float], caps: Sequence[float], total: int) -> list[int] | None:
    """Integer shares summing to `total` that let every device finish compute + overhead together
    (water-filling on T: share_i = min(cap_i, speed_i·(T − overhead_i))), then rounded one sample at
    a time to whichever device would finish earliest. None if the caps cannot hold `total`."""
    n = len(speeds)
    if n == 0 or sum(min(c, float(total)) for c in caps) < total:
        return None

    # Devices alike in speed, overhead and cap count once, times how many they are: a thousand
    # devices of a few classes cost a few terms per step of the search.
    alike: dict[tuple[float, float, float], int] = {}
    for device in zip(speeds, overheads, caps):
        alike[device] = alike.get(device, 0) + 1
    terms = list(alike.items())

    def held(t: float) -> float:
        return sum(k * min(c, max(0.0, s * (t - o))) for (s, o, c), k in terms)

    lo, hi = 0.0, max(overheads) + total / min(speeds)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if held(mid) >= total else (mid, hi)
    exact = [min(c, max(0.0, s * (hi - o))) for s, o, c in zip(speeds, overheads, caps)]
    return round_to_total(exact, speeds, overheads, caps, total)


def split_shares(total: int, weights: list[float]) -> list[int]:
    """Split `total` in proportion to `weights` (largest remainder, ties to the lower index), every
    weight getting at least one sample while there are enough to go round."""
    n = len(weights)
    if n == 0:
        return []
    assert all(w > 0 for w in weights), "weights must be positive"
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    if total >= n:
        for i in range(n):
            if shares[i] == 0:
                shares[max(range(n), key=lambda k: (shares[k], -k))] -= 1
                shares[i] = 1
    return shares
