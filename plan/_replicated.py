"""The replicated (data-parallel) candidate: every member a replica, which devices and their shares.

1. Device classes (`Cluster.classes`: same kind and memory cap, similar speed) go to the class-level
   solver (`plan.milp.solve_dp`: an exact search over ring sizes, or the PuLP MILP on HiGHS), which
   picks how many devices of each class take part, minimising the predicted step time plus the
   cost of moving state to devices that did not hold it, amortised over `horizon_steps`. Link
   scopes are enumerated outside the solve: every device (inter-host link if they span hosts) and,
   on a multi-host cluster, each of the few strongest hosts alone (intra-host link).
2. Class counts map to concrete devices, members of the previous plan first (no state moves to
   them), and the batch is split per device by real speed and overhead (`assign`). Memory bounds
   no share: a device that holds the state and one sample runs a larger share as micro-batches of
   what fits (`micro_batched`); one that cannot hold the state is left out.
3. A few plain alternatives are scored with the same objective (keep the current members, every
   device, the r fastest): the best of all is the candidate, the others are kept for the runner-up.

Before any step is measured FLOPs are all the cost model knows, and they can be off by orders of
magnitude for small models: no device is left out on such a guess (`guessed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from plan.candidates import Alternative, Ctx
from plan.cluster import Cluster
from plan.cost import static_bytes
from plan.milp import DeviceClass, DpCosts, map_to_devices, solve_dp
from plan.prediction import repredict

HOST_CANDIDATES = 3  # single-host plans tried on a multi-host cluster
MAX_PREFIX_CANDIDATES = 64  # "the r fastest" alternatives are scored up to this many devices


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated:
    """The replicated candidate (None: none fits), the solver's status and reason, the plain
    alternatives it was compared with, and the current members re-balanced (`keep`)."""

    best: Alternative | None
    status: str
    reason: str
    alternatives: tuple[Alternative, ...] = ()
    keep: Alternative | None = None


def usable(ctx: Ctx) -> list[str]:
    """The devices that hold a replica beside one sample, fastest first."""
    return sorted((n for n in ctx.cluster.devices if (ctx.caps[n] or 0) >= 1), key=lambda n: (-ctx.speeds[n], n))


def replicated(ctx: Ctx) -> Replicated:
    fits = usable(ctx)
    keep = keep_members(ctx, fits)
    if not any(d.samples_per_s for d in ctx.cluster.devices.values()):
        return guessed(ctx, fits, keep)
    solved: list[tuple[Alternative, str, str]] = []  # (scored plan, status, reason)
    infeasible: list[str] = []
    for scope in _scopes(ctx.cluster, fits, ctx.speeds):
        outcome = _solve(ctx, scope)
        if isinstance(outcome, str):
            infeasible.append(outcome)
        else:
            solved.append(outcome)
    if not solved:
        return Replicated(best=None, status="infeasible", keep=keep,
                          reason=infeasible[0] if infeasible else nothing_fits(ctx))
    best, status, reason = min(solved, key=lambda s: s[0].objective_s)
    alternatives = [a for a, _, _ in solved if a is not best] + _alternatives(ctx, fits, keep)
    for alt in alternatives:
        if alt.objective_s < best.objective_s - 1e-12:  # a plain plan beat the class-level solve
            best, reason = alt, f"{reason}; {alt.description} scored better"
    return Replicated(best=best, status=status, reason=reason, keep=keep,
                      alternatives=tuple(a for a in alternatives if a is not best))


def guessed(ctx: Ctx, fits: list[str], keep: Alternative | None) -> Replicated:
    """No step measured yet: every usable device (up to max_workers), shares by calibrated FLOP/s
    within memory; the measured steps that follow re-plan with the real speeds."""
    plan = ctx.balanced(fits[: ctx.limits.max_workers or len(fits)])
    if plan is None:
        return Replicated(best=None, status="infeasible", reason=too_small(ctx, fits), keep=keep)
    return Replicated(best=ctx.score(plan, f"every usable device ({len(plan.members)})"), status="heuristic",
                      keep=keep, reason=f"no step measured yet: every usable device ({len(plan.members)}), shares "
                                        "by calibrated FLOP/s; re-planned once steps are measured")


def _scopes(cluster: Cluster, fits: list[str], speeds: Mapping[str, float]) -> list[list[str]]:
    """Every usable device, and on a multi-host cluster each of the strongest hosts alone."""
    scopes = [fits]
    hosts: dict[str, list[str]] = {}
    for n in fits:
        hosts.setdefault(cluster.devices[n].host, []).append(n)
    if len(hosts) > 1:
        strongest = sorted(hosts.values(), key=lambda ns: -sum(speeds[n] for n in ns))
        scopes += strongest[:HOST_CANDIDATES]
    return scopes


def _solve(ctx: Ctx, scope: list[str]) -> tuple[Alternative, str, str] | str:
    """The class-level solve over `scope`; returns the scored plan, or why nothing fits."""
    if not scope:
        return "no device can hold the model"
    g, cluster = ctx.graph, ctx.cluster
    groups = cluster.classes(ctx.speeds, ctx.caps, names=scope)
    classes = [DeviceClass(name=cname, available=len(ms),
                           samples_per_s=sum(ctx.speeds[m] for m in ms) / len(ms),
                           memory_bytes=min(cluster.devices[m].memory_bytes for m in ms)) for cname, ms in groups]
    # Every device in scope fits one sample beside its state, and runs a larger share as
    # micro-batches: memory bounds no share here (the activations per sample count as none).
    costs = replace(DpCosts.from_graph(g, cluster.link(scope), optimizer_state_factor=g.optimizer_state_factor),
                    activation_bytes_per_sample=0.0)
    previous_counts = ({cname: sum(m in ctx.holders for m in ms) for cname, ms in groups}
                       if ctx.holders else None)
    result = solve_dp(classes, costs, ctx.limits.global_batch, time_limit_s=ctx.limits.time_limit_s,
                      previous_counts=previous_counts,
                      migration_s_per_device=cluster.move_s(g.state_bytes),
                      horizon_steps=ctx.limits.horizon_steps, max_devices=ctx.limits.max_workers,
                      engine=ctx.limits.engine)
    if result.status == "infeasible":
        return result.reason
    order = {cname: ms for cname, ms in groups}  # fastest first within a class
    plan = ctx.balanced(map_to_devices(result.counts, order, ctx.ranked(list(ctx.holders))))
    if plan is None:
        return f"the solver's counts ({result.reason}) do not hold the batch per device"
    return ctx.score(plan, "the solver's plan"), result.status, result.reason


def keep_members(ctx: Ctx, fits: list[str]) -> Alternative | None:
    """The devices that hold the state now (up to max_workers), re-balanced."""
    cap = ctx.limits.max_workers or len(fits)
    kept = ctx.ranked([m for m in ctx.holders if m in fits])[:cap]
    p = ctx.balanced(kept) if kept else None
    return ctx.score(p, f"keeping the current {len(kept)} members, re-balanced") if p is not None else None


def _alternatives(ctx: Ctx, fits: list[str], keep: Alternative | None) -> list[Alternative]:
    """Plain plans scored with the same cost model (`keep` first)."""
    cap = ctx.limits.max_workers or len(fits)
    out: list[Alternative] = [keep] if keep is not None else []
    kept = list(keep.plan.members) if keep is not None else []
    everyone = kept + [n for n in fits if n not in kept]
    if (p := ctx.balanced(everyone[:cap])) is not None:
        out.append(ctx.score(p, f"every usable device ({min(cap, len(everyone))})"))
    if len(fits) <= MAX_PREFIX_CANDIDATES:
        for r in range(1, min(cap, len(fits))):
            if (p := ctx.balanced(fits[:r])) is not None:
                out.append(ctx.score(p, f"the {r} fastest devices"))
    return out


def current(ctx: Ctx, keep: Alternative | None) -> Alternative | None:
    """What "not changing" means now: the current plan (any layout) as it is when all its members
    are still here, else (after a failure or a leave) its surviving members re-balanced."""
    previous = ctx.previous
    if (previous is not None and previous.global_batch == ctx.limits.global_batch
            and set(previous.members) <= set(ctx.cluster.devices)):
        again = repredict(ctx.cluster, ctx.graph, previous)
        if again.predicted_step_s is not None:  # (none: nothing to weigh it by, as with no plan)
            return ctx.score(again, "the current plan")
    return keep


def standby_reason(ctx: Ctx, name: str, chosen: Alternative, *, kept: bool) -> str:
    """Why a replicated plan leaves `name` out."""
    cap = ctx.caps[name]
    if cap is None:
        return "its memory cannot hold the model's state"
    if cap < 1:
        return "no room for one sample's activations"
    if ctx.limits.max_workers is not None and len(chosen.plan.members) >= ctx.limits.max_workers:
        return f"--max-workers {ctx.limits.max_workers}"
    if kept:
        return "the current members are kept: a plan with it gains less than 3% of a step"
    fixed = ctx.fixed.get(name, 0.0) + ctx.cluster.devices[name].overhead_s
    per_step = f" after {fixed * 1e3:.0f} ms per step whatever its share" if fixed >= 1e-3 else ""
    return f"too slow to pay for its part of the step's communication: {ctx.speeds[name]:.3g} samples/s{per_step}"


def too_small(ctx: Ctx, fits: list[str]) -> str:
    if not fits:
        return nothing_fits(ctx)
    caps = {n: ctx.caps[n] or 0.0 for n in fits}
    total = sum(min(c, float(ctx.limits.global_batch)) for c in caps.values())
    each = "; ".join(f"{n}: {c:.0f} samples" for n, c in sorted(caps.items()))
    return (f"global batch {ctx.limits.global_batch} does not fit in memory; a global batch of at most "
            f"{total:.0f} would fit ({each})")


def no_replica(ctx: Ctx, reason: str) -> str:
    """Why the replicated candidate cannot run, in a line: `reason` (the solver's), or when no device
    holds a replica, what one needs against the largest device."""
    if usable(ctx):
        return reason
    static = static_bytes(ctx.graph.param_bytes, ctx.graph.optimizer_state_factor)
    biggest = max(d.memory_bytes for d in ctx.cluster.devices.values())
    return (f"no device holds a replica: parameters, gradients and optimizer state need {static / 2**20:.1f} MiB "
            f"plus {ctx.graph.activation_bytes / 2**10:.1f} KiB per sample; the largest device has "
            f"{biggest / 2**20:.1f} MiB")


def nothing_fits(ctx: Ctx) -> str:
    static = static_bytes(ctx.graph.param_bytes, ctx.graph.optimizer_state_factor)
    devices = sorted(ctx.cluster.devices.items())
    parts = [f"{n}: {d.memory_bytes / 2**20:.1f} MiB" for n, d in devices]
    if len(parts) > 8:  # (a thousand devices: how many of each size)
        sizes = Counter(d.memory_bytes for _, d in devices)
        parts = [f"{k} of {size / 2**20:.1f} MiB" for size, k in sorted(sizes.items(), reverse=True)]
    return (f"no device can hold the model: parameters, gradients and optimizer state need "
            f"{static / 2**20:.1f} MiB plus {ctx.graph.activation_bytes / 2**10:.1f} KiB per sample "
            f"({'; '.join(parts)})")
