"""Answers to ctl's control commands: a pure function of what the coordinator knows and a command.

``answer_control(view, request, now=...) -> (reply, events)``: `view` is a read-only snapshot of
the coordinator (membership state, the job, the event log so far, the refusal counters); the
membership events in the result are what the daemon applies next (`drain`, `slowdown`, `layout`
and `stop` produce them; `status`, `plan` (`plan explain`: coordinator/explain.py), `graph` and
`events` only read). No sockets and no clock here: the daemon owns both. Every reply is plain
JSON-able data (ctl prints it for people, or as JSON with --json). An unknown command or an unknown
worker gets ``ok: false`` with an error that says what would work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator import membership as m
from coordinator.explain import explain
from coordinator.phase import phase
from coordinator.state import pin_text
from plan import Graph
from plan.layout import parse_pin
from transport import CONTROL_COMMANDS, ControlReply, ControlRequest

EVENTS_PAGE = 1000  # at most this many events per `events` reply


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlView:
    """What a control command may read: the coordinator's state at the moment it is answered."""

    state: m.State
    job_ref: str
    num_steps: int
    global_batch: int
    uptime_s: float
    events: Sequence[dict[str, Any]] = ()  # the job's whole event log (across restarts), oldest first
    refused: dict[str, int] = field(default_factory=dict)  # refusal counts by reason (coordinator.guard)
    secure: bool = True  # CURVE keys on (False: --insecure)
    # `ctl save PATH`: the absolute path to write, or ValueError saying why it cannot be written
    # (the daemon passes a check of the filesystem; the default takes the path as it is)
    writable: Callable[[str], str] = str
    checkpoint_dir: str = ""  # where checkpoints go ("": none)
    min_workers: int = 1  # --min-workers: ready workers the first plan (and the one after a total loss) waits for
    max_workers: int | None = None  # --max-workers: a layout pinned to more members is refused
    tp_refuses: Callable[[int | None], str] = lambda tp: ""  # why a tp degree cannot run on the job ("": it can)


Answer = tuple[dict[str, Any], list[m.Event]]


def answer_control(view: ControlView, req: ControlRequest, *, now: float) -> tuple[ControlReply, list[m.Event]]:
    """The reply to `req`, and the membership events to apply (nothing is applied here)."""
    handler = _HANDLERS.get(req.command)
    if handler is None:
        return _error(f"unknown command {req.command!r}; commands: {', '.join(CONTROL_COMMANDS)}"), []
    try:
        data, events = handler(view, req.args, now)
    except ValueError as e:
        return _error(str(e)), []
    return ControlReply(ok=True, data=data, error=""), events


def _error(text: str) -> ControlReply:
    return ControlReply(ok=False, data={}, error=text)


def _status(view: ControlView, args: list[str], now: float) -> Answer:
    if args:
        raise ValueError(f"status takes no argument, got {args}")
    s = view.state
    plan = s.plan
    now_phase = phase(s, min_workers=view.min_workers)
    members = list(plan.members) if plan else []
    workers = []
    # Speeds as they are now: with the contention of the workers that share a host (the cluster
    # stores them uncontended).
    speeds = (s.cluster.contended(members) if members else s.cluster).speeds()
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
    return {"job": view.job_ref, "state": now_phase.name, "reason": now_phase.reason,
            "epoch": s.epoch, "step": s.last_step, "num_steps": view.num_steps,
            "global_batch": view.global_batch, "pending": s.pending, "finished": s.finished,
            "stopping": s.stopping, "uptime_s": round(view.uptime_s, 1), "workers": workers,
            "lr": s.last_lr, "grad_norm": s.last_grad_norm,
            "eval": ({"step": s.last_eval[0], "loss": s.last_eval[1], "samples": s.last_eval[2]}
                     if s.last_eval else None),
            "checkpoint": ({"step": s.checkpoints[-1].step, "path": s.checkpoints[-1].path,
                            "bytes": s.checkpoints[-1].bytes} if s.checkpoints else None),
            "resuming": {"step": s.resume.step, "path": s.resume.path} if s.resume else None,
            "secure": view.secure, "refused": dict(view.refused), "refused_total": sum(view.refused.values()),
            "layout_pin": pin_text(s.layout)}, []


def _plan(view: ControlView, args: list[str], now: float) -> Answer:
    if args not in ([], ["explain"]):
        raise ValueError(f"plan takes no argument or 'explain', got {args}")
    s = view.state
    now_phase = phase(s, min_workers=view.min_workers)
    if s.plan is None:
        # (the planner's last answer may be older than the state: the phase says why nothing trains now)
        out: dict[str, Any] = {"epoch": s.epoch, "plan": None, "state": now_phase.name,
                               "status": s.result.status if s.result else None, "detail": now_phase.reason,
                               "layout_pin": pin_text(s.layout)}
    else:
        out = {"epoch": s.epoch, "state": now_phase.name, "reason": now_phase.reason, "mode": s.plan.mode, "members": list(s.plan.members),
               "shares": list(s.plan.shares), "global_batch": s.plan.global_batch,
               "predicted_step_s": s.plan.predicted_step_s, "layout": s.plan.layout.to_dict(),
               "acknowledged": sorted(s.acked), "status": s.result.status if s.result else None,
               "layout_pin": pin_text(s.layout)}
    if args == ["explain"]:
        out["explain"] = explain(s, now_phase)
    return out, []


def _graph(view: ControlView, args: list[str], now: float) -> Answer:
    if args:
        raise ValueError(f"graph takes no argument, got {args}")
    g: Graph | None = view.state.graph
    if g is None:
        raise ValueError("no graph yet: the first worker to join captures the model and uploads it")
    layers = [{**layer.to_dict(), "flops": layer.train_flops} for layer in g.layers]
    return {"layers": layers, "param_bytes": g.param_bytes, "flops": g.train_flops,
            "activation_bytes": g.activation_bytes, "per": "sample (flops, activation and boundary bytes)"}, []


def _events(view: ControlView, args: list[str], now: float) -> Answer:
    if len(args) > 1:
        raise ValueError(f"events takes at most one event index, got {args}")
    try:
        after = max(int(args[0]), 0) if args else 0
    except ValueError:
        raise ValueError(f"events takes an event index, got {args[0][:40]!r}") from None
    after = min(after, len(view.events))  # (so `next` says where the log ends)
    events = list(view.events[after:after + EVENTS_PAGE])
    return {"events": events, "next": after + len(events)}, []


def _known_worker(view: ControlView, name: str) -> str:
    if name not in view.state.workers:
        known = ", ".join(sorted(view.state.workers)) or "none"
        raise ValueError(f"unknown worker {name[:80]!r} (workers: {known})")
    return name


def _drain(view: ControlView, args: list[str], now: float) -> Answer:
    if len(args) != 1:
        raise ValueError("drain takes one worker NAME")
    name = _known_worker(view, args[0])
    return {"draining": name}, [m.DrainRequested(name)]


def _slowdown(view: ControlView, args: list[str], now: float) -> Answer:
    if len(args) != 2:
        raise ValueError("slowdown takes a worker NAME and a FACTOR (1 = full speed, 3 = three times slower)")
    name, text = _known_worker(view, args[0]), args[1]
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"FACTOR must be a number, got {text[:40]!r}") from None
    if not math.isfinite(factor) or not 1.0 <= factor <= 1000.0:
        raise ValueError(f"FACTOR must be between 1 (full speed) and 1000, got {text[:40]}")
    return {"worker": name, "factor": factor}, [m.SlowdownRequested(name, factor)]


def _save(view: ControlView, args: list[str], now: float) -> Answer:
    if len(args) != 1 or not args[0]:
        raise ValueError("save takes one PATH: the directory to write model.pt and optimizer.pt into")
    if view.state.plan is None or view.state.finished:
        raise ValueError("nothing is training now: there is no model to save (the job writes STATE_DIR/final "
                         "when it finishes)")
    path = view.writable(args[0])
    return {"saving": path, "worker": view.state.plan.members[0], "at": "the next step boundary"}, \
        [m.SaveRequested(path)]


def _checkpoint(view: ControlView, args: list[str], now: float) -> Answer:
    if args:
        raise ValueError(f"checkpoint takes no argument, got {args}")
    if not view.checkpoint_dir:
        raise ValueError("this coordinator has no --checkpoint-dir")
    if view.state.plan is None or view.state.finished:
        raise ValueError("nothing is training now: there is no state to checkpoint")
    return {"dir": view.checkpoint_dir, "members": list(view.state.plan.members), "after_step": view.state.last_step,
            "at": "the next step boundary all members agree on"}, [m.CheckpointRequested("ctl checkpoint")]


def _layout(view: ControlView, args: list[str], now: float) -> Answer:
    """`layout SPEC`: what `coordinator --layout` takes, or `auto`. Checked here as at the start (the
    same parser, and --max-workers), so a bad one changes nothing."""
    if len(args) != 1:
        raise ValueError("layout takes one SPEC: the degrees to pin as --layout takes them (dp=2, fsdp=2, "
                         "dp=2,fsdp=2, pp=2, ...) or auto (no pin: the planner chooses)")
    text = args[0].strip()
    pin = None if text == "auto" else parse_pin(text, source="layout")
    if pin is not None and pin.members is not None and view.max_workers is not None and pin.members > view.max_workers:
        raise ValueError(f"layout {pin.describe()} needs {pin.members} members, but --max-workers is {view.max_workers}")
    if pin is not None and (why := view.tp_refuses(pin.tp)):
        raise ValueError(f"layout {pin.describe()}: {why}")
    if view.state.finished or view.state.stopping:
        raise ValueError("the job is " + ("finished" if view.state.finished else "stopping") + ": nothing to re-plan")
    return {"layout": pin_text(pin)}, [m.LayoutRequested(pin)]


def _stop(view: ControlView, args: list[str], now: float) -> Answer:
    if args:
        raise ValueError(f"stop takes no argument, got {args}")
    return {"stopping": True, "workers": sorted(view.state.workers)}, [m.StopRequested("stopped by ctl")]


_HANDLERS: dict[str, Callable[[ControlView, list[str], float], Answer]] = {
    "status": _status, "plan": _plan, "graph": _graph, "events": _events, "drain": _drain, "slowdown": _slowdown,
    "save": _save, "checkpoint": _checkpoint, "layout": _layout, "stop": _stop}
