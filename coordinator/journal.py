"""STATE_DIR/journal.sqlite: what a coordinator must not forget when it dies, so that one started
again on the same state directory takes the job over where it was.

SQLite, in WAL mode (an embedded default that needs no server; a reader never blocks the writer,
and a crash leaves the last committed transaction), one table of keys and JSON values. `snapshot`
(pure) turns the membership state into those values: the endpoints it listened on, the epoch, the
latest plan as sent and who acknowledged it, the members' calibrated devices, the last committed
step, the checkpoints, a resume in progress, the model's graph, and the layout pin in force with
the --layout the coordinator was started with. The daemon writes only the
keys whose values changed, after every event, in one transaction (a step costs one small write).

`Journal.load` returns the values, or raises `JournalDamaged` naming the file and what SQLite
said; the daemon then moves the file aside and starts from the newest intact state it has (the
checkpoints on disk), saying what was lost. `recover` (pure) rebuilds the membership state from a
snapshot: the epoch and step go on from where they were, and the plan's members are expected back
(`State.recovering`): the workers train on meanwhile and register again by themselves.

The layout pin (`restart_layout`): a coordinator restarted with the same --layout as the one that
journaled keeps the journaled pin (the latest `ctl layout` survives a restart by a supervisor that
repeats the command line); one restarted with another --layout (or none where there was one) takes
its command line: that is the operator's latest word. The plan then re-plans under it.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

from coordinator.state import Checkpoint, State, pin_text
from plan import Device, Graph, LayoutPin, Plan
from plan.layout import LayoutError, parse_pin
from transport import MeshLayout, PlanDelta

FORMAT = 1


class JournalDamaged(Exception):
    """The journal cannot be read (truncated, overwritten, not SQLite): the message names the file."""


class OtherJob(OSError):
    """The journal belongs to another job: taking it over would train this job on another's plan."""


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._written: dict[str, str] = {}
        self._objects: dict[str, Any] = {}  # the value objects last written: the same object is not re-encoded

    def load(self) -> dict[str, Any] | None:
        """The journaled values (None: a fresh journal); JournalDamaged when it cannot be read."""
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            check = self._db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise JournalDamaged(f"{self.path}: {check[0] if check else 'no answer to quick_check'}")
            rows = self._db.execute("SELECT key, value FROM kv").fetchall()
            values = {key: json.loads(value) for key, value in rows}
        except (sqlite3.DatabaseError, json.JSONDecodeError) as e:
            raise JournalDamaged(f"{self.path}: {e}") from None
        self._written = {key: value for key, value in rows}
        if not values:
            return None
        if values.get("format") != FORMAT:
            raise JournalDamaged(f"{self.path}: format {values.get('format')!r}, this coordinator reads {FORMAT}")
        return values

    def save(self, values: dict[str, Any]) -> None:
        """Write the values that changed since the last save, in one transaction."""
        changed = {key: text for key, value in values.items()
                   if value is not self._objects.get(key)
                   and self._written.get(key) != (text := json.dumps(value, sort_keys=True))}
        self._objects = dict(values)
        if not changed:
            return
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                             "excluded.value", list(changed.items()))
        self._db.execute("COMMIT")
        self._written.update(changed)

    def close(self) -> None:
        self._db.close()


def check_job(values: dict[str, Any], path: Path, ref: str, sha256: str) -> None:
    """OtherJob unless the journaled job is this one (same job file text)."""
    job = values.get("job") or {}
    if job.get("sha256") not in (None, sha256):
        raise OtherJob(f"{path} is the journal of job {job.get('ref')} (sha256 {str(job.get('sha256'))[:12]}), not "
                       f"of {ref} (sha256 {sha256[:12]}): give the same --job, or another --state-dir to start a new job")


def snapshot(state: State, endpoints: dict[str, str], graph: dict[str, Any] | None = None, *,
             job: dict[str, Any] | None = None, flag: LayoutPin | None = None,
             devices: dict[str, Any] | None = None) -> dict[str, Any]:
    """The journaled values of `state` (plain JSON); `graph`: `state.graph.to_dict()` if the caller
    keeps it (the same object each time spares encoding it again); `flag`: the coordinator's
    --layout (`restart_layout` compares the next coordinator's with it); `devices`: the members'
    devices as `devices_of` gave them earlier, if the caller keeps them (see `Core._journal`)."""
    delta = state.delta
    return {
        "format": FORMAT,
        "endpoints": endpoints,
        "job": job or {},
        "epoch": state.epoch,
        "delta": _delta_dict(delta) if delta is not None and state.plan is not None else None,
        "acked": sorted(state.acked),
        "devices": devices if devices is not None else devices_of(state),
        "last_step": state.last_step,
        "finished": state.finished,
        "checkpoints": [dataclasses.asdict(c) for c in state.checkpoints],
        "resume": dataclasses.asdict(state.resume) if state.resume is not None else None,
        "lost_at": state.lost_at,
        "graph": graph if graph is not None else (state.graph.to_dict() if state.graph is not None else None),
        "layout": pin_text(state.layout),
        "layout_flag": pin_text(flag),
    }


def restart_layout(values: dict[str, Any], flag: LayoutPin | None) -> tuple[LayoutPin | None, str | None]:
    """The layout pin a coordinator restarted with --layout `flag` holds (see the module's comment),
    and the journaled pin it replaces when that differs (None: it does not: the journaled pin holds,
    or equals the command line's)."""
    journaled = values.get("layout")
    if not isinstance(journaled, str):  # (a journal written before pins were journaled)
        return flag, None
    if values.get("layout_flag") != pin_text(flag):
        return flag, (journaled if journaled != pin_text(flag) else None)
    try:
        return (None if journaled == "auto" else parse_pin(journaled)), None
    except LayoutError:  # (edited by hand: the command line's then)
        return flag, journaled


def recover(values: dict[str, Any], *, now: float, flag: LayoutPin | None = None) -> State:
    """The membership state a restarted coordinator (started with --layout `flag`) starts from: the
    plan's members expected back, and, when its --layout replaced the journaled pin, a re-plan
    under the new one wanted once the plan is back."""
    graph = Graph.from_dict(values["graph"]) if values.get("graph") else None
    checkpoints = tuple(Checkpoint(**c) for c in values.get("checkpoints") or [])
    resume = Checkpoint(**values["resume"]) if values.get("resume") else None
    layout, replaced = restart_layout(values, flag)
    state = State(epoch=int(values["epoch"]), last_step=int(values["last_step"]), graph=graph,
                  checkpoints=checkpoints, resume=resume, lost_at=int(values.get("lost_at", 0)),
                  finished=bool(values.get("finished")), layout=layout)
    data = values.get("delta")
    if not data or state.finished:
        return state
    if replaced is not None:
        state = dataclasses.replace(state, replan_wanted="layout")
    delta = PlanDelta(**{**data, "layout": MeshLayout(**data["layout"]),
                         "previous": MeshLayout(**data["previous"]) if data.get("previous") else None})
    plan = Plan(members=tuple(delta.members), shares=tuple(delta.shares), dp_shard=delta.layout.dp_shard,
                pp=delta.layout.pp, stages=tuple(tuple(stage) for stage in delta.layout.stages), tp=delta.layout.tp,
                micro=tuple(delta.micro_batch) if any(delta.micro_batch) else ())
    devices = {n: _device(d) for n, d in (values.get("devices") or {}).items()}
    return dataclasses.replace(state, delta=delta, recovered_plan=plan, recovered_devices=devices,
                               recovering=frozenset(delta.members),
                               recovered_acked=frozenset(values.get("acked") or []), recovery_since=now)


def _delta_dict(delta: PlanDelta) -> dict[str, Any]:
    return dataclasses.asdict(delta)  # (its layouts, `layout` and `previous`, as plain objects too)


def devices_of(state: State) -> dict[str, Any]:
    """The plan's members' devices as journaled (their measured speeds, loads and memory)."""
    members = list(state.plan.members) if state.plan is not None else []
    return {n: _device_dict(state.cluster.devices[n]) for n in members if n in state.cluster.devices}


def _device_dict(d: Device) -> dict[str, Any]:
    return dataclasses.asdict(d)


def _device(data: dict[str, Any]) -> Device:
    fields: dict[str, Any] = dict(data)
    for key in ("compute_window", "load_window"):  # JSON made the tuples lists
        fields[key] = tuple(tuple(x) for x in fields.get(key, ()))
    return Device(**fields)
