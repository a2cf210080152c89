"""The liveness invariants of a job, checked from its event log and its workers' logs after the fact.

Pure (a list of events and the text of each worker's log in, a list of problems out), so that every
fault test, the demo and the soak benchmark apply the same rules (docs/architecture.md,
"Invariants"):

- every worker that joined is later planned in, put on standby with a reason, or leaves or fails
  (unless the job ended within JOIN_GRACE_STEPS committed steps of its join);
- every failure of a member is followed by a plan and a committed step of that plan's epoch or a
  later one, and where members survive, they train again within RECOVERY_BOUND_S plus two steps;
- every straggler is followed by a plan or a `kept` event within STRAGGLER_STEPS committed steps;
- no member of the plan in force is put on standby (a standby event names a worker the plan leaves out);
- every step is committed once (a step redone after a resume from a checkpoint is the exception the
  `resumed` event announces);
- no worker sat out a group timeout (it logs STALL_MARK when an epoch entry or a step took over half
  of its group timeout).

The recovery bound is a liveness bound, not a speed figure: a stall is a whole group timeout
(60 s by default); recovery takes a fraction of a second (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from typing import Any

JOIN_GRACE_STEPS = 20
STRAGGLER_STEPS = 30
RECOVERY_BOUND_S = 5.0
STALL_MARK = "over half of the group timeout"


def problems(events: list[dict[str, Any]], logs: Mapping[str, str] | None = None) -> list[str]:
    """Every liveness invariant the run broke, one sentence each (empty: none)."""
    out: list[str] = []
    steps = [e for e in events if e["kind"] == "step"]
    finished = any(e["kind"] == "finished" for e in events)
    step_s = statistics.median(e["step_s"] for e in steps) if steps else 0.0

    def committed_after(i: int) -> list[dict[str, Any]]:
        return [e for e in events[i + 1:] if e["kind"] == "step"]

    members: set[str] = set()  # of the latest plan
    for i, e in enumerate(events):
        later = events[i + 1:]
        if e["kind"] == "plan" and e.get("layout"):
            members = set(e["layout"]["members"])
        if e["kind"] == "joined":
            name = e["worker"]
            handled = any((x["kind"] == "plan" and x.get("layout") and name in x["layout"]["members"])
                          or (x["kind"] == "standby" and x.get("worker") == name and x.get("why"))
                          or (x["kind"] in ("left", "failed") and x.get("worker") == name) for x in later)
            if not handled and not (finished and len(committed_after(i)) < JOIN_GRACE_STEPS):
                out.append(f"{name} joined at {e['ts']:.3f} and was never planned in, put on standby or let go")
        elif e["kind"] == "failed" and e["worker"] in members:
            plan = next((x for x in later if x["kind"] == "plan" and x.get("layout")), None)
            if plan is None:
                if not finished:
                    out.append(f"{e['worker']} failed at {e['ts']:.3f} and no plan followed")
                continue
            step = next((x for x in later if x["kind"] == "step" and x["epoch"] >= plan["epoch"]), None)
            # The bound is the survivors': a total loss (the state lost, or nobody of the plan left in
            # the next one) waits for new workers to start and load a checkpoint.
            until = later.index(step) if step is not None else len(later)
            survivors = bool(set(plan["layout"]["members"]) & (members - {e["worker"]}))
            total = not survivors or any(x["kind"] in ("state_lost", "resumed") for x in later[:until])
            if step is None:
                if not finished:
                    out.append(f"{e['worker']} failed at {e['ts']:.3f}; epoch {plan['epoch']} never committed a step")
            elif not total and step["ts"] - e["ts"] > RECOVERY_BOUND_S + 2 * step_s:
                out.append(f"{e['worker']} failed at {e['ts']:.3f}; the survivors trained again only "
                           f"{step['ts'] - e['ts']:.2f} s later (bound {RECOVERY_BOUND_S} s + 2 steps)")
        elif e["kind"] == "standby" and e.get("worker") in members:
            out.append(f"{e['worker']} was put on standby at {e['ts']:.3f} while a member of the running plan")
        elif e["kind"] == "straggler":
            window = committed_after(i)[:STRAGGLER_STEPS]
            deadline = float(window[-1]["ts"]) if len(window) == STRAGGLER_STEPS else float("inf")
            answered = any(x["kind"] in ("plan", "kept") and x["ts"] <= deadline for x in later)
            if not answered and not (finished and len(window) < STRAGGLER_STEPS):
                out.append(f"{e['worker']} was found a straggler at {e['ts']:.3f} and got neither a plan nor "
                           f"a kept event within {STRAGGLER_STEPS} steps")
    out += _doubled(events)
    for name, text in (logs or {}).items():
        for line in text.splitlines():
            if STALL_MARK in line:
                out.append(f"{name} stalled: {line.strip()[:200]}")
    return out


def _doubled(events: list[dict[str, Any]]) -> list[str]:
    """Steps committed more than once, less those a resume announced it would redo."""
    counts = Counter(e["step"] for e in events if e["kind"] == "step")
    redo: Counter[int] = Counter()
    for e in events:
        if e["kind"] == "resumed":
            redo.update(range(e["step"] + 1, e["step"] + 1 + e.get("redone", 0)))
    return [f"step {s} was committed {n} times" for s, n in sorted(counts.items()) if n > 1 + redo[s]]
