"""The checkpoints a coordinator finds on disk when it starts: torch-free, reading manifests only.

The workers write checkpoints (`worker.checkpoint`): `CHECKPOINT_DIR/step-<N>/` with DCP's files and
an `adaptrain.json` manifest that lists every file's size and sha256, written last. A coordinator
started on a directory that holds some (a job restarted after everything was lost) resumes from
the newest one that is complete: its manifest reads, names this job (the job file's sha256), and
every file it lists is there at its size. Sizes catch a truncated copy at once; the checksums are
the loading worker's to check (reading every byte is the worker's business, not the event loop's),
and a worker that finds one wrong says so (`ResumeFailed`), which falls back to the one before.
"""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.state import Checkpoint

MANIFEST = "adaptrain.json"  # the name `worker.checkpoint` writes


def scan(directory: Path, job_sha256: str) -> tuple[list[Checkpoint], list[str]]:
    """The usable checkpoints in `directory`, oldest first, and a line for each one passed over
    (the file and why)."""
    found: list[Checkpoint] = []
    skipped: list[str] = []
    if not directory.is_dir():
        return found, skipped
    for path in sorted(directory.glob("step-*")):
        manifest = path / MANIFEST
        try:
            data = json.loads(manifest.read_text())
            step, files = int(data["step"]), dict(data["files"])
        except FileNotFoundError:
            skipped.append(f"{path}: no {MANIFEST} (an incomplete write)")
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            skipped.append(f"{manifest}: unreadable ({e})")
            continue
        if data.get("job_sha256") != job_sha256:
            skipped.append(f"{path}: written by another job file (sha256 {str(data.get('job_sha256'))[:12]}, "
                           f"this job's {job_sha256[:12]})")
            continue
        problem = _damage(path, files)
        if problem:
            skipped.append(problem)
            continue
        found.append(Checkpoint(step=step, path=str(path.resolve()), bytes=sum(int(f["bytes"]) for f in files.values())))
    found.sort(key=lambda c: c.step)
    return found, skipped


def _damage(path: Path, files: dict[str, dict[str, object]]) -> str:
    """What is wrong with the listed files' presence and sizes ("" when nothing)."""
    for name, want in sorted(files.items()):
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{file}: missing"
        if size != want.get("bytes"):
            return f"{file}: {size} bytes, the manifest says {want.get('bytes')} (truncated?)"
    return ""
