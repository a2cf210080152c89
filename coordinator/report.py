"""`ctl report`: a job's progress over steps, from its events, as numbers and as a picture.

Design. Three small pure steps and one drawing:

* `parse_lines` / `read_events` turn events.jsonl into event dicts, keeping going past a bad line
  (a line cut short by a crash, or edited by hand): each bad line is returned with its 1-based
  number and why, and the rest is used.
* `build_series` turns events (from a file, or paged from a live coordinator: the whole job's log,
  across coordinator restarts) into `Series`: per committed step its loss and samples/s (global
  batch / measured step_s); the members of each plan, step-wise; and a `Mark` for every join,
  leave, failure, straggler, recovery, host contention, plan (epoch), re-plan kept without a
  switch, reshard, checkpoint, lost state, resume and coordinator restart. A mark is placed at the
  latest step committed when it happened, except a checkpoint and a resume, placed at their own
  step (the state after it; where the curve goes on from). The log is written in time order, so
  that step is the last `step` line before the event's own line (file order is used rather than
  `ts`, which a wall-clock adjustment could disorder).
* `segments` cuts the steps where they go backwards (a resume redoing steps from a checkpoint),
  so the curves are drawn a segment at a time and no line joins a rewind.
* `summarize` gives the counts `ctl report --json` prints: step numbers committed, each once, and
  the steps redone after rewinds.
* `plot` draws panels sharing the step axis (samples/s, loss, members) with the marks as thin
  vertical lines, and below them a strip with one row of markers per kind of mark (marks of
  different kinds at one step stay visible), and writes a PNG with matplotlib's non-interactive
  Agg canvas. matplotlib (and numpy under it) is imported only there, so ctl stays fast for every
  other command.

Nothing here talks to the coordinator; coordinator.ctl fetches events and calls these.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.events import BadLine, parse_event

# Event kinds drawn as marks, with how they look (colour, line style) and their legend label.
MARK_STYLE: dict[str, tuple[str, str, str]] = {
    "joined": ("tab:green", "-", "join"),
    "left": ("tab:olive", ":", "leave"),
    "failed": ("tab:red", "-", "failure"),
    "straggler": ("tab:orange", "--", "straggler"),
    "recovered": ("tab:cyan", "--", "recovered"),
    "contention": ("tab:pink", "--", "contention"),
    "kept": ("tab:brown", ":", "kept (no switch)"),
    "plan": ("tab:gray", ":", "plan (epoch)"),
    "reshard": ("tab:purple", "-.", "reshard"),
    "checkpoint": ("tab:blue", ":", "checkpoint"),
    "state_lost": ("black", "-", "state lost"),
    "resumed": ("darkgreen", "--", "resumed (from checkpoint)"),
    "restarted": ("darkred", "-.", "coordinator restarted"),
}
# Marks placed at the step their event names rather than at the latest committed one: a checkpoint
# holds the state after its `step`, and a resume rewinds the curve to its `step`.
AT_OWN_STEP = ("checkpoint", "resumed")
# Marks named in a legend on the loss panel too: what the curve's breaks and rewinds come from.
LEGEND_KINDS = ("checkpoint", "state_lost", "resumed", "restarted")


@dataclass(frozen=True, slots=True)
class EventsRead:
    events: list[dict[str, Any]]
    bad: list[BadLine]


@dataclass(frozen=True, slots=True)
class Mark:
    kind: str  # a key of MARK_STYLE
    step: int  # the latest step committed when it happened (0: before the first)
    label: str  # the worker's name, or "e<epoch>"


@dataclass(slots=True)
class Series:
    steps: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    samples_per_s: list[float | None] = field(default_factory=list)  # global batch / step_s
    members: list[tuple[int, int]] = field(default_factory=list)  # (step, members) of each plan with one
    marks: list[Mark] = field(default_factory=list)
    num_events: int = 0


def parse_lines(lines: Iterable[str]) -> EventsRead:
    """Events from JSON lines; blank lines are skipped, a line that is not a JSON object with a
    string "kind" is reported (number and why) and left out."""
    events: list[dict[str, Any]] = []
    bad: list[BadLine] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        event = parse_event(line)
        if isinstance(event, str):
            bad.append(BadLine(number, event))
            continue
        events.append(event)
    return EventsRead(events, bad)


def read_events(path: Path) -> EventsRead:
    """The events of an events.jsonl; OSError (e.g. FileNotFoundError) when it cannot be read."""
    with path.open(encoding="utf-8", errors="replace") as f:
        return parse_lines(f)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _label(e: dict[str, Any]) -> str:
    kind = e.get("kind")
    if kind in ("plan", "reshard", "state_lost", "restarted"):
        return f"e{e.get('epoch')}"
    if kind in AT_OWN_STEP:
        return f"s{e.get('step')}"
    return str(e.get("reason", "?")) if kind == "kept" else str(e.get("worker", "?"))


def build_series(events: Iterable[dict[str, Any]]) -> Series:
    s = Series()
    step = 0  # the latest committed step so far
    for e in events:
        s.num_events += 1
        kind = e.get("kind")
        if kind == "step":
            number = _int(e.get("step"))
            if number is None:
                continue
            step = number
            samples, step_s = _number(e.get("samples")), _number(e.get("step_s"))
            s.steps.append(number)
            s.loss.append(_number(e.get("loss")))
            s.samples_per_s.append(samples / step_s if samples is not None and step_s else None)
        elif kind in MARK_STYLE:
            own = _int(e.get("step")) if kind in AT_OWN_STEP else None
            if kind == "resumed" and own is not None:
                step = own  # the curve goes on from there: later marks are placed on the redone steps
            s.marks.append(Mark(kind, step if own is None else own, _label(e)))
            layout = e.get("layout")
            if kind == "plan" and isinstance(layout, dict) and isinstance(layout.get("members"), list):
                s.members.append((step, len(layout["members"])))
    return s


def segments(steps: Sequence[int], *, repeats: bool = False) -> list[tuple[int, int]]:
    """Index ranges [start, stop) of `steps` that go forward: a step not after the one before it (a
    resume rewound to a checkpoint) begins a new segment, so no line joins a rewind. `repeats`: a
    step equal to the one before continues the segment (plans made at one step)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(steps)):
        if steps[i] < steps[i - 1] or (steps[i] == steps[i - 1] and not repeats):
            out.append((start, i))
            start = i
    if steps:
        out.append((start, len(steps)))
    return out


def summarize(s: Series) -> dict[str, Any]:
    """What `ctl report --json` prints: counts and a few landmarks of each series. `steps` counts
    the step numbers committed (each once), `redone` the step events again after a rewind."""
    losses = [x for x in s.loss if x is not None]
    rates = [x for x in s.samples_per_s if x is not None]
    members = [n for _, n in s.members]
    distinct = len(set(s.steps))
    return {
        "events": s.num_events,
        "steps": distinct,
        "step_events": len(s.steps),
        "redone": len(s.steps) - distinct,
        "rewinds": max(0, len(segments(s.steps)) - 1),
        "first_step": s.steps[0] if s.steps else None,
        "last_step": s.steps[-1] if s.steps else None,
        "loss": {"points": len(losses), "first": losses[0] if losses else None,
                 "last": losses[-1] if losses else None, "min": min(losses, default=None)},
        "samples_per_s": {"points": len(rates), "median": statistics.median(rates) if rates else None,
                          "last": rates[-1] if rates else None},
        "members": {"plans": len(members), "min": min(members, default=None), "max": max(members, default=None),
                    "last": members[-1] if members else None},
        "marks": dict(Counter(m.kind for m in s.marks)),
    }


def format_summary(d: dict[str, Any]) -> str:
    def num(x: Any) -> str:
        return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)

    loss, rate, members = d["loss"], d["samples_per_s"], d["members"]
    marks = ", ".join(f"{kind} {n}" for kind, n in d["marks"].items()) or "none"
    redone = (f"; {d['redone']} redone after {d['rewinds']} rewind(s) to a checkpoint"
              if d.get("redone") else "")
    return "\n".join([
        f"{d['events']} events, {d['steps']} committed steps ({num(d['first_step'])} to {num(d['last_step'])})"
        f"{redone}",
        f"loss       first {num(loss['first'])}  last {num(loss['last'])}  min {num(loss['min'])}",
        f"samples/s  median {num(rate['median'])}  last {num(rate['last'])}",
        f"members    {members['plans']} plans, {num(members['min'])} to {num(members['max'])}, "
        f"last {num(members['last'])}",
        f"marked     {marks}",
    ])


def plot(s: Series, path: Path, *, title: str = "") -> Any:
    """Draw the series and write them to `path` (PNG unless its suffix names another format
    matplotlib knows). ValueError for a format matplotlib does not know; OSError when the file
    cannot be written. Returns the matplotlib Figure (its axes: samples/s, loss, members, marks)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 9), layout="constrained")
    FigureCanvasAgg(fig)
    rate_ax, loss_ax, members_ax, marks_ax = fig.subplots(4, 1, sharex=True, height_ratios=[3, 3, 2, 2])
    rates = [float("nan") if x is None else x for x in s.samples_per_s]
    losses = [float("nan") if x is None else x for x in s.loss]
    for start, stop in segments(s.steps):  # one line each: a rewind is a break, not a line back
        rate_ax.plot(s.steps[start:stop], rates[start:stop], lw=1, color="tab:blue")
        loss_ax.plot(s.steps[start:stop], losses[start:stop], lw=1, color="tab:brown")
    rate_ax.set_ylabel("samples/s")
    loss_ax.set_ylabel("loss")
    if s.members:
        last = max(s.steps[-1] if s.steps else 0, s.members[-1][0])
        xs = [step for step, _ in s.members] + [last]
        ys = [n for _, n in s.members] + [s.members[-1][1]]
        parts = segments(xs[:-1], repeats=True)
        for i, (start, stop) in enumerate(parts):  # (plans keep their order; a plan may sit at the step before)
            end = stop + 1 if i == len(parts) - 1 else stop
            members_ax.step(xs[start:end], ys[start:end], where="post", color="tab:green")
        members_ax.set_ylim(0, max(ys) + 1)
        members_ax.yaxis.get_major_locator().set_params(integer=True)
    members_ax.set_ylabel("members")
    # Every mark: a thin vertical line across the data panels, and a marker on its kind's row of
    # the bottom strip (marks of different kinds at one step stay visible there).
    kinds = [k for k in MARK_STYLE if any(m.kind == k for m in s.marks)]
    legend: set[str] = set()
    for mark in s.marks:
        colour, style, label = MARK_STYLE[mark.kind]
        first = mark.kind in LEGEND_KINDS and mark.kind not in legend
        legend.add(mark.kind)
        for ax in (rate_ax, loss_ax, members_ax):
            ax.axvline(mark.step, color=colour, ls=style, lw=0.7, alpha=0.6,
                       label=label if first and ax is loss_ax else "_nolegend_")
    if legend & set(LEGEND_KINDS):  # what breaks or rewinds the curve, named on it
        loss_ax.legend(loc="upper right", fontsize=7)
    for row, kind in enumerate(kinds):
        colour, _, label = MARK_STYLE[kind]
        steps = [m.step for m in s.marks if m.kind == kind]
        marks_ax.plot(steps, [row] * len(steps), "|", color=colour, markersize=14, mew=2, label=label)
    marks_ax.set_yticks(range(len(kinds)), [MARK_STYLE[k][2] for k in kinds], fontsize=8)
    marks_ax.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    marks_ax.invert_yaxis()
    epochs = [m for m in s.marks if m.kind == "plan"]
    if len(epochs) <= 40:  # more would be unreadable: the lines alone still show them
        for mark in epochs:
            members_ax.annotate(mark.label, (mark.step, 1.0), xycoords=("data", "axes fraction"),
                                textcoords="offset points", xytext=(2, -10), fontsize=7, color="dimgray")
    marks_ax.set_xlabel("step (events at the latest step committed when they happened; checkpoints and resumes "
                        "at their own step)")
    marks_ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in (rate_ax, loss_ax, members_ax, marks_ax):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "adaptrain job")
    fig.savefig(path, dpi=100)
    return fig
