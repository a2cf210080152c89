"""Writing the trained model out: plain `state_dict`s that `torch.load` and `load_state_dict` take,
with nothing of adaptrain in them.

`save_state(model_state, optimizer_state, directory)` writes `model.pt` and `optimizer.pt`. Each goes to a
temporary name in the same directory first, is flushed to disk, and is then renamed over the final
name, so a crash mid-write never leaves a truncated file under the final name (a rename within one
filesystem is atomic). Raises OSError (with the path) when the directory cannot be written. A
tensor that is a view of a larger storage is copied first, so that a file holds only its tensors.
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
                torch.save(_compact(state), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        written += final.stat().st_size
    return written


def _compact(value: Any) -> Any:
    """`value` with every tensor that is a view of a larger storage copied into its own (torch.save
    writes a view's whole storage: a pipeline's stages arrive as views of one flat buffer each, and
    the file held every part of it once per file)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.untyped_storage().nbytes() > value.numel() * value.element_size() else value
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_compact(v) for v in value)
    return value
