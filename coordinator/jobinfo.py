"""What the coordinator knows of the job without importing torch.

The coordinator never imports torch, so it asks a short-lived `python -m worker.inspect_job`
subprocess to resolve and load the job (a broken job is refused at start with the reason) and to
report its global batch, number of steps and seed. The source text it ships to workers is read
from the resolved path and hashed here.

A coordinator restarted on a state dir whose journal holds the same job (the same reference, and
the journaled file still has the journaled sha256) takes those facts from the journal instead
(`journaled_job`): the job was inspected when it first started, and the subprocess (importing torch,
loading the job) would keep the restarted coordinator from listening for seconds while its workers
wait to register again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    tp_degrees: tuple[int, ...] = ()  # the tensor-parallel degrees the model admits (> 1)
    tp_why: str = ""  # why not others (or why none)

    def refuses(self, tp: int | None) -> str:
        """Why a pinned tp degree cannot run on this job ("" where it can)."""
        if tp is None or tp == 1 or tp in self.tp_degrees:
            return ""
        admitted = f" (it admits tp={', '.join(map(str, self.tp_degrees))})" if self.tp_degrees else ""
        return f"tp={tp} cannot run: {self.tp_why}{admitted}"


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
                   description=str(info.get("description", "")),
                   tp_degrees=tuple(int(d) for d in info.get("tp_degrees", ())), tp_why=str(info.get("tp_why", "")))


def facts(job: JobInfo) -> dict[str, Any]:
    """What the journal keeps of the job: everything but its text (read again from `path`)."""
    return {k: v for k, v in dataclasses.asdict(job).items() if k != "source"}


def journaled_job(journal: Path, ref: str) -> JobInfo | None:
    """The job the journal at `journal` was started with, if it is `ref` and its file is unchanged
    (the same sha256); None otherwise (no journal, another job, an edited file, an older journal
    without the facts, one that cannot be read): then the job is inspected as at a first start."""
    if not journal.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
        try:
            row = db.execute("SELECT value FROM kv WHERE key = 'job'").fetchone()
        finally:
            db.close()
        known = json.loads(row[0]) if row else {}
        if known.get("ref") != ref:
            return None
        source = Path(known["path"]).read_text(encoding="utf-8")
        if hashlib.sha256(source.encode()).hexdigest() != known["sha256"]:
            return None
        return JobInfo(ref=ref, path=known["path"], name=known["name"], source=source, sha256=known["sha256"],
                       global_batch=int(known["global_batch"]), num_steps=int(known["num_steps"]),
                       seed=int(known["seed"]), num_params=int(known["num_params"]),
                       description=str(known.get("description", "")),
                       tp_degrees=tuple(int(d) for d in known.get("tp_degrees", ())),
                       tp_why=str(known.get("tp_why", "")))
    except (sqlite3.Error, OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
