"""Answers to ctl's control commands, computed from the core's state.

`status`, `plan` (`plan explain`: coordinator/explain.py), `graph` and `events` only read; `drain`,
`slowdown` and `stop` feed membership events. Every reply is
plain JSON-able data (ctl prints it for people, or as JSON with --json). An unknown command or an
unknown worker gets ``ok: false`` with an error that says what would work.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from coordinator import membership as m
from coordinator.explain import explain
from transport import CONTROL_COMMANDS, ControlReply, ControlRequest

if TYPE_CHECKING:
    from coordinator.daemon import Core


def answer_control(core: Core, req: ControlRequest) -> ControlReply:
    try:
        handler = _HANDLERS[req.command]
    except KeyError:
        return _error(f"unknown command {req.command!r}; commands: {', '.join(CONTROL_COMMANDS)}")
    try:
        return ControlReply(ok=True, data=handler(core, req.args), error="")
    except ValueError as e:
        return _error(str(e))


def _error(text: str) -> ControlReply:
    return ControlReply(ok=False, data={}, error=text)


def _status(core: Core, args: list[str]) -> dict[str, Any]:
    s, now = core.state, time.monotonic()
    plan = s.plan
    members = list(plan.members) if plan else []
    workers = []
    speeds = s.cluster.speeds()
    for w in sorted(s.workers.values(), key=lambda w: (w.name not in members, members.index(w.name)
                                                       if w.name in members else 0, w.name)):
        rank = members.index(w.name) if w.name in members else None
        workers.append({
            "name": w.name, "host": w.host, "device": w.device, "pid": w.pid,
            "role": "leaving" if w.leaving else ("member" if rank is not None else "standby"),
            "rank": rank, "share": plan.shares[rank] if plan and rank is not None else 0,
            "epoch": w.epoch, "step": w.step, "last_seen_s": round(now - w.last_seen, 3),
            "speed": round(speeds.get(w.name, 0.0), 3),
        })
    return {"job": core.job.ref, "epoch": s.epoch, "step": s.last_step, "num_steps": core.job.num_steps,
            "global_batch": core.job.global_batch, "pending": s.pending, "finished": s.finished,
            "stopping": s.stopping, "uptime_s": round(time.time() - core.started, 1), "workers": workers}


def _plan(core: Core, args: list[str]) -> dict[str, Any]:
    if args not in ([], ["explain"]):
        raise ValueError(f"plan takes no argument or 'explain', got {args}")
    s = core.state
    if s.plan is None:
        out: dict[str, Any] = {"epoch": s.epoch, "plan": None,
                               "status": s.result.status if s.result else None,
                               "detail": s.result.reason if s.result else "waiting for enough ready workers"}
    else:
        out = {"epoch": s.epoch, "mode": s.plan.mode, "members": list(s.plan.members),
               "shares": list(s.plan.shares), "global_batch": s.plan.global_batch,
               "predicted_step_s": s.plan.predicted_step_s, "layout": s.plan.layout.to_dict(),
               "acknowledged": sorted(s.acked), "status": s.result.status if s.result else None}
    if args == ["explain"]:
        out["explain"] = explain(s)
    return out


def _graph(core: Core, args: list[str]) -> dict[str, Any]:
    g = core.graph
    if g is None:
        raise ValueError("no graph yet: the first worker to join captures the model and uploads it")
    layers = [{**layer.to_dict(), "flops": layer.train_flops} for layer in g.layers]
    return {"layers": layers, "param_bytes": g.param_bytes, "flops": g.train_flops,
            "activation_bytes": g.activation_bytes, "per": "sample (flops, activation and boundary bytes)"}


def _events(core: Core, args: list[str]) -> dict[str, Any]:
    try:
        after = int(args[0]) if args else 0
    except ValueError:
        raise ValueError(f"events takes an event index, got {args[0]!r}") from None
    events = core.log.since(max(after, 0))
    return {"events": events, "next": max(after, 0) + len(events)}


def _known_worker(core: Core, name: str) -> str:
    if name not in core.state.workers:
        known = ", ".join(sorted(core.state.workers)) or "none"
        raise ValueError(f"unknown worker {name!r} (workers: {known})")
    return name


def _drain(core: Core, args: list[str]) -> dict[str, Any]:
    if len(args) != 1:
        raise ValueError("drain takes one worker NAME")
    name = _known_worker(core, args[0])
    core.apply(m.DrainRequested(name))
    return {"draining": name}


def _slowdown(core: Core, args: list[str]) -> dict[str, Any]:
    if len(args) != 2:
        raise ValueError("slowdown takes a worker NAME and a FACTOR (1 = full speed, 3 = three times slower)")
    name, text = _known_worker(core, args[0]), args[1]
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"FACTOR must be a number, got {text!r}") from None
    if not math.isfinite(factor) or not 1.0 <= factor <= 1000.0:
        raise ValueError(f"FACTOR must be between 1 (full speed) and 1000, got {text}")
    core.apply(m.SlowdownRequested(name, factor))
    return {"worker": name, "factor": factor}


def _stop(core: Core, args: list[str]) -> dict[str, Any]:
    core.apply(m.StopRequested("stopped by ctl"))
    return {"stopping": True, "workers": sorted(core.state.workers)}


_HANDLERS = {"status": _status, "plan": _plan, "graph": _graph, "events": _events, "drain": _drain,
             "slowdown": _slowdown, "stop": _stop}
