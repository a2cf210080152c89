"""STATE_DIR/events.jsonl: one JSON object a line, each with "ts" (unix seconds) and "kind".

Every kind and its fields: docs/operations.md, "Events". The log is appended and flushed
line by line, so `tail -f` and a crashed coordinator both see every event written. A copy stays in
memory for `ctl events`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


class EventLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")
        self.events: list[dict[str, Any]] = []

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"ts": round(time.time(), 6), "kind": kind, **fields}
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        self.events.append(event)
        return event

    def since(self, index: int, limit: int = 1000) -> list[dict[str, Any]]:
        return self.events[index:index + limit]

    def close(self) -> None:
        self._file.close()
