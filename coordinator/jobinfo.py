"""What the coordinator knows of the job without importing torch.

The coordinator never imports torch, so it asks a short-lived `python -m worker.inspect_job`
subprocess to resolve and load the job (a broken job is refused at start with the reason) and to
report its global batch, number of steps and seed. The source text it ships to workers is read
from the resolved path and hashed here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


class JobRefused(ValueError):
    """The job cannot be used; the message says why and what to fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    ref: str
    path: str
    name: str
    source: str
    sha256: str
    global_batch: int
    num_steps: int
    seed: int
    num_params: int
    description: str


def inspect_job(ref: str, *, timeout_s: float = 120.0) -> JobInfo:
    try:
        proc = subprocess.run([sys.executable, "-m", "worker.inspect_job", ref], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise JobRefused(f"loading job {ref} took over {timeout_s:.0f} s") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    try:
        info = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise JobRefused(f"could not inspect job {ref}: {detail}") from None
    if not info.get("ok"):
        raise JobRefused(info.get("error", f"job {ref} did not load"))
    source = Path(info["path"]).read_text(encoding="utf-8")
    sha = hashlib.sha256(source.encode()).hexdigest()
    return JobInfo(ref=ref, path=info["path"], name=info["name"], source=source, sha256=sha,
                   global_batch=int(info["global_batch"]), num_steps=int(info["num_steps"]),
                   seed=int(info["seed"]), num_params=int(info["num_params"]),
                   description=str(info.get("description", "")))
