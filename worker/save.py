"""Writing the trained model out: plain `state_dict`s that `torch.load` and `load_state_dict` take,
with nothing of adaptrain in them.

`save_state(model_state, optimizer_state, directory)` writes `model.pt` and `optimizer.pt`. Each goes to a
temporary name in the same directory first, is flushed to disk, and is then renamed over the final
name, so a crash mid-write never leaves a truncated file under the final name (a rename within one
filesystem is atomic). Raises OSError (with the path) when the directory cannot be written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_state(model_state: dict[str, Any], optimizer_state: dict[str, Any], directory: Path) -> int:
    """Write the two state dicts (e.g. gathered from shards) into `directory`; the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, state in (("model.pt", model_state), ("optimizer.pt", optimizer_state)):
        final = directory / name
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        try:
            with tmp.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        written += final.stat().st_size
    return written
