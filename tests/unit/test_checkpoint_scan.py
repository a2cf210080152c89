"""The checkpoints a starting coordinator finds on disk (`coordinator.checkpoints.scan`): torch-free,
from the manifests; incomplete, foreign and truncated ones are passed over, each with the reason."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.checkpoints import scan


def _checkpoint(root: Path, step: int, *, job: str = "job-a", files: dict[str, bytes] | None = None,
                manifest: bool = True) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    files = files if files is not None else {".metadata": b"m" * 10, "__0_0.distcp": b"d" * 100}
    for name, data in files.items():
        (path / name).write_bytes(data)
    if manifest:
        listed = {name: {"bytes": len(data), "sha256": "-"} for name, data in files.items()}
        (path / "adaptrain.json").write_text(json.dumps({"step": step, "job_sha256": job, "files": listed}))
    return path


def test_the_complete_checkpoints_of_this_job_oldest_first(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 20)
    _checkpoint(tmp_path, 100)
    _checkpoint(tmp_path, 30, manifest=False)  # a write that never finished
    _checkpoint(tmp_path, 40, job="job-b")  # another job's
    torn = _checkpoint(tmp_path, 50)
    (torn / "__0_0.distcp").write_bytes(b"d" * 40)  # truncated after it was written
    (tmp_path / ".step-60.e3.partial").mkdir()  # in flight: never a candidate
    found, skipped = scan(tmp_path, "job-a")
    assert [(c.step, Path(c.path).name, c.bytes) for c in found] == [(20, "step-20", 110), (100, "step-100", 110)]
    assert len(skipped) == 3
    assert any("step-30" in s and "incomplete" in s for s in skipped)
    assert any("step-40" in s and "another job" in s for s in skipped)
    assert any("__0_0.distcp: 40 bytes, the manifest says 100" in s for s in skipped)


def test_no_directory_is_no_checkpoint(tmp_path: Path) -> None:
    assert scan(tmp_path / "missing", "job-a") == ([], [])
