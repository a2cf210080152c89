"""What a worker says when the job's own code raises: the cause, where it is, and the whole traceback.

A mistake in how adaptrain is used (a bad job reference, a Job field of the wrong type) is a
`JobError` with a one-line message that says what to fix. An exception raised inside the user's
model, loss, data or schedule is different: only its traceback lets the user debug it, so the worker
prints it whole, with the frames of the job's code listed first, and the `left` event carries the
exception and its innermost frame in the job's code.

"The job's code" is every frame outside adaptrain's own packages, torch and the Python standard
library: the job file itself (its text is registered with `linecache` when it loads, so its lines
show) and the libraries it brings, such as a Hugging Face model's modules.
"""

from __future__ import annotations

import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JobFailure", "describe"]

_OURS = tuple(str(Path(__file__).resolve().parents[1] / pkg) for pkg in ("coordinator", "worker", "plan", "transport"))


def _not_the_jobs() -> tuple[str, ...]:
    """Path prefixes of code that is not the job's: adaptrain, torch, the standard library."""
    import torch

    paths = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    return (*_OURS, str(Path(torch.__file__).resolve().parent), *(str(Path(p).resolve()) for p in paths))


@dataclass(frozen=True, slots=True)
class JobFailure:
    error: str
    """The exception as "TypeName: message" (first line of the message, at most 300 characters)."""
    where: str
    """The innermost frame in the job's code as "FILE:LINE in FUNCTION" ("" when none is)."""
    report: str
    """What the worker's log shows: the job's frames first, then the whole traceback."""


def describe(exc: BaseException, step: int) -> JobFailure:
    """The cause of a failure the job's code raised at `step`, for the log and the `left` event."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    error = f"{type(exc).__name__}: {message}"[:300] if message else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    excluded = _not_the_jobs()
    jobs = [f for f in frames if not _resolved(f.filename).startswith(excluded)]
    where = f"{jobs[-1].filename}:{jobs[-1].lineno} in {jobs[-1].name}" if jobs else ""
    lines = [f"worker: the job's code raised at step {step}: {error}"]
    if jobs:
        lines.append("  in the job's code (innermost last):")
        lines += ["  " + line for chunk in traceback.format_list(jobs) for line in chunk.rstrip().splitlines()]
    else:
        lines.append("  (no frame of the traceback is in the job's code: this may be a bug in adaptrain; "
                     "please report it with the traceback below)")
    lines.append("  the whole traceback:")
    lines += ["  " + line for chunk in traceback.format_exception(exc) for line in chunk.rstrip().splitlines()]
    return JobFailure(error=error, where=where, report="\n".join(lines))


def _resolved(filename: str) -> str:
    if filename.startswith("<"):
        return filename
    try:
        return str(Path(filename).resolve())
    except OSError:
        return filename
