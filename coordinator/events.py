"""STATE_DIR/events.jsonl: one JSON object a line, each with "ts" (unix seconds) and "kind".

Every kind and its fields: docs/operations.md, "Events" (`restarted` marks each start of a
coordinator on a state dir that already has a log). The log is appended and flushed line by line,
so `tail -f` and a crashed coordinator both see every event written.

One log per job, across coordinator restarts. Opening the log streams what is already there once
(constant memory per line): every complete line that is an event (a JSON object with a string
"kind") is indexed and handed to `fold` (the daemon seeds its metrics there), every other line (a
line cut short by a crash mid-write, an edited one) is counted in `bad`, its number and why kept
for the first MAX_BAD_KEPT, and skipped. A last line without its newline (a crash mid-write) is
closed with one before anything is appended, so it stays one bad line and never corrupts the next
event.

`EventLog.events` is the whole log as a read-only sequence: the events before this coordinator
and those it wrote, oldest first, numbered from 0 across restarts. It holds only each event's byte
offset in memory (8 bytes an event) and reads a slice back from the file when asked, so `ctl
events` pages through a long job's log in bounded memory.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, overload

MAX_BAD_KEPT = 20  # bad lines whose number and reason are kept (the rest are only counted)


@dataclass(frozen=True, slots=True)
class BadLine:
    number: int  # 1-based line number in the file
    why: str


@dataclass(slots=True)
class Replayed:
    """What opening the log found before this coordinator wrote anything."""

    events: int = 0  # events read (the index of the first event this coordinator writes)
    bad: int = 0  # lines skipped
    first_bad: list[BadLine] = field(default_factory=list)  # the first MAX_BAD_KEPT of them


def parse_event(line: bytes | str) -> dict[str, Any] | str:
    """The event on one line, or why it is not one (a JSON object with a string "kind")."""
    try:
        event = json.loads(line)
    except ValueError as e:  # (JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8)
        where = f": {e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        return f"not JSON (truncated or malformed{where})"
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return "not an event (a JSON object with a \"kind\")"
    return event


def _lines(f: BinaryIO, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of each line between byte offsets `start` and `end`, streamed."""
    f.seek(start)
    offset = start
    while offset < end:
        line = f.readline(end - offset)
        if not line:
            return
        yield offset, line
        offset += len(line)


class EventView(Sequence[dict[str, Any]]):
    """The log's events, read back from the file by index (see the module's comment)."""

    def __init__(self, log: EventLog) -> None:
        self._log = log

    def __len__(self) -> int:
        return len(self._log._offsets)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        n = len(self)
        if isinstance(index, slice):
            start, stop, stride = index.indices(n)
            if stride != 1:
                return [self[i] for i in range(start, stop, stride)]
            return self._log._read(start, stop) if start < stop else []
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"event {index} of {n}")
        return self._log._read(i, i + 1)[0]


class EventLog:
    def __init__(self, path: Path, *, fold: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Open (or create) the log at `path`, streaming the events already in it through `fold`."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._offsets = array("q")  # byte offset of each event's line
        self.replayed = Replayed()
        self._file: BinaryIO = path.open("ab")
        self._reader: BinaryIO = path.open("rb")
        self._end = self._file.seek(0, 2)  # where the next line goes
        self._index(fold)
        self.events: Sequence[dict[str, Any]] = EventView(self)

    def _index(self, fold: Callable[[dict[str, Any]], None] | None) -> None:
        r = self.replayed
        last, offset = b"\n", 0
        self._reader.seek(0)
        for number, line in enumerate(self._reader, start=1):  # (nothing is appended meanwhile)
            last, at = line, offset
            offset += len(line)
            if not line.strip():
                continue
            event = parse_event(line)
            if isinstance(event, str):
                r.bad += 1
                if len(r.first_bad) < MAX_BAD_KEPT:
                    r.first_bad.append(BadLine(number, event))
                continue
            self._offsets.append(at)
            if fold is not None:
                fold(event)
        if not last.endswith(b"\n"):  # cut short mid-write: close it, so the next event is a line of its own
            self._append(b"\n")
        r.events = len(self._offsets)

    def _append(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()
        self._end += len(data)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"ts": round(time.time(), 6), "kind": kind, **fields}
        offset = self._end
        self._append(json.dumps(event).encode() + b"\n")
        self._offsets.append(offset)
        return event

    def _read(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Events start..stop-1, read back from the file (bad lines between them are skipped again)."""
        end = self._offsets[stop] if stop < len(self._offsets) else self._end
        out: list[dict[str, Any]] = []
        for _, line in _lines(self._reader, self._offsets[start], end):
            if line.strip() and not isinstance(event := parse_event(line), str):
                out.append(event)
        return out[:stop - start]  # (fewer only if someone rewrote the file under the coordinator)

    def since(self, index: int, limit: int = 1000) -> list[dict[str, Any]]:
        return list(self.events[index:index + limit])

    def close(self) -> None:
        self._file.close()
        self._reader.close()
