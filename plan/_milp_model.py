"""The MILP behind `plan.milp.solve_dp` for clusters too large for the exact ring-size search.

For each class c and count k in 0..min(available_c, largest ring size) a binary y[c,k] says "k
devices of c train" (exactly one k per class). Disaggregated by k, so that no product of variables
appears (k is a constant in each term):

    t[c,k] ≤ t_max · y[c,k],   Σ_k t[c,k] ≤ T          t[c,k] = T where y[c,k] = 1, else 0
    Q[c,k] ≤ cap_c · y[c,k],   Q[c,k] ≤ speed_c · t[c,k],   q_c = Σ_k Q[c,k] integer
    k · y[c,k] ≤ x[c,k] ≤ k · Q[c,k],   Σ x = B        q_c is the largest share of a device of c
    Σ_r z[r] = 1,  Σ_r r · z[r] = Σ k · y[c,k],  T ≥ Σ_r T_lb(r) · z[r]

    minimise  T + Σ_r allreduce(r) · z[r] + migration_s · Σ y[c,k] · max(0, k − kept_c)

Integer shares of at least one and at most q_c per device summing to B exist exactly when
Σ k_c ≤ B ≤ Σ k_c q_c, so the model is exact for integer shares. The caller prunes the ring sizes r
to those whose lower bound (the continuous makespan T_lb(r) of the r best devices, plus the
all-reduce and the migration of r − kept devices at least) is below a feasible plan's objective,
and passes that objective as t_max; the cut on T makes the relaxation at least as tight as those
bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pulp


def solve_milp(
    speeds: Sequence[float], caps: Sequence[float], available: Sequence[int], kept: Sequence[int],
    batch: int, comm_s: Mapping[int, float], ring_lower_s: Mapping[int, float], mig_s: float,
    *, t_max: float, time_limit_s: float, gap: float,
) -> tuple[list[int] | None, bool, str]:
    """Counts per class (None if the solver found no solution), whether they are proved optimal
    within `gap`, and the solver's word. `comm_s` and `ring_lower_s` are keyed by the ring sizes
    allowed."""
    r_hi = max(comm_s)
    prob = pulp.LpProblem("dp_plan", pulp.LpMinimize)
    T = prob.add_variable("T", lowBound=0, upBound=t_max)
    y: dict[tuple[int, int], pulp.LpVariable] = {}
    x: list[pulp.LpVariable] = []
    for i, (speed, cap, n) in enumerate(zip(speeds, caps, available)):
        t_parts, q_parts = [], []
        for k in range(min(n, r_hi) + 1):
            y[i, k] = prob.add_variable(f"y_{i}_{k}", cat=pulp.LpBinary)
            if k:
                t = prob.add_variable(f"t_{i}_{k}", lowBound=0)
                q = prob.add_variable(f"Q_{i}_{k}", lowBound=0)
                xk = prob.add_variable(f"x_{i}_{k}", lowBound=0)
                prob += t <= t_max * y[i, k]
                prob += q <= cap * y[i, k]
                prob += q <= speed * t
                prob += xk <= k * q
                prob += xk >= k * y[i, k]
                t_parts.append(t)
                q_parts.append(q)
                x.append(xk)
        prob += pulp.lpSum(y[i, k] for k in range(min(n, r_hi) + 1)) == 1
        prob += pulp.lpSum(t_parts) <= T
        share = prob.add_variable(f"q_{i}", lowBound=0, upBound=cap, cat=pulp.LpInteger)
        prob += pulp.lpSum(q_parts) == share
    prob += pulp.lpSum(x) == batch
    z = {r: prob.add_variable(f"z_{r}", cat=pulp.LpBinary) for r in comm_s}
    prob += pulp.lpSum(z.values()) == 1
    prob += pulp.lpSum(r * v for r, v in z.items()) == pulp.lpSum(k * v for (_, k), v in y.items())
    prob += T >= pulp.lpSum(ring_lower_s[r] * v for r, v in z.items())
    moved = pulp.lpSum(max(0, k - kept[i]) * v for (i, k), v in y.items())
    prob += T + pulp.lpSum(comm_s[r] * v for r, v in z.items()) + mig_s * moved

    solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap)
    if not solver.available():
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap)
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as exc:  # a broken solver install must not stop the planner
        return None, False, f"solver error: {exc}"
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False, f"solver: {pulp.LpStatus[prob.status]}, no integer solution"
    counts = [0] * len(speeds)
    for (i, k), v in y.items():
        if (v.varValue or 0) > 0.5:
            counts[i] = k
    return counts, prob.sol_status == pulp.LpSolutionOptimal, "MILP"
