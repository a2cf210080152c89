"""bench_relayout's job: the 10M GPT of examples/gpt.py (`job_10m`), with room for a tour of layout
changes (every layout trains several steps; two laps of the default tour take ~120), so the job does
not finish half way round. Loaded by file path, as a user's job file is."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("gpt_example", Path(__file__).resolve().parent.parent / "examples" / "gpt.py")
assert _spec is not None and _spec.loader is not None
gpt: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

STEPS = 400


def job_10m() -> Any:
    """examples/gpt.py's `job_10m` (6 layers x 384, global batch 16), trained for STEPS steps."""
    return gpt._make_job(n_layer=6, d_model=384, n_head=6, block=128, global_batch=16, num_steps=STEPS, lr=3e-4,
                         description=f"char GPT, 6 layers x 384 (~10M parameters), {STEPS} steps (bench_relayout)")
