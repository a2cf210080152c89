# `python -m worker.inspect_job REF`: check a job before anything trains on it.
#
# The coordinator never imports torch, so it runs this as a subprocess at start to refuse a bad
# job early. Output contract: exactly ONE JSON line on stdout, {"ok": true, ...facts} with exit 0,
# or {"ok": false, "error": "..."} with exit 1. A user mistake never prints a traceback; whatever
# the job file itself prints goes to stderr so stdout stays parseable.

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import torch

from worker import sequence
from worker.job import JobError, load_job, resolve_job_ref
from worker.tp_plan import tp_degrees


def inspect_job(ref: str) -> dict[str, Any]:
    """Resolve, load and size the job `ref`; raise `JobError` if it is unusable."""
    source = resolve_job_ref(ref)
    job = load_job(source.source, source.name, filename=source.path)
    num_params = _count_params(lambda: sequence.build(job), job.seed)
    with torch.device("meta"):
        degrees, why = tp_degrees(job, sequence.build(job))
    try:
        dataset_len = len(job.dataset)
    except Exception as exc:
        raise JobError(f"len(job.dataset) failed: {type(exc).__name__}: {exc}") from exc
    if dataset_len <= 0:
        raise JobError(f"job.dataset is empty (len {dataset_len}); it needs at least one sample")
    return {
        "ok": True,
        "ref": source.ref,
        "path": source.path,
        "name": source.name,
        "sha256": source.sha256,
        "global_batch": job.global_batch,
        "num_steps": job.num_steps,
        "seed": job.seed,
        "num_params": num_params,
        "dataset_len": dataset_len,
        "description": job.description,
        "tp_degrees": degrees,  # the tensor-parallel degrees the model admits (none without a plan)
        "tp_why": why,
    }


def _count_params(build: Any, seed: int) -> int:
    # Meta tensors cost no memory or init time, so a 10B-parameter model can be counted on a
    # laptop; a model whose constructor needs real data falls back to the CPU.
    errors: list[str] = []
    for device in ("meta", "cpu"):
        torch.manual_seed(seed)
        try:
            with torch.device(device):
                model = build()
        except JobError:  # (the job's own mistake, e.g. a `Job.sequence` that leaves out a parameter)
            raise
        except Exception as exc:
            errors.append(f"on {device}: {type(exc).__name__}: {exc}")
            continue
        if not isinstance(model, torch.nn.Module):
            raise JobError(
                f"job.model() must return a torch.nn.Module, got {type(model).__name__}"
            )
        return sum(p.numel() for p in model.parameters())
    raise JobError("job.model() failed " + "; ".join(errors))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        result: dict[str, Any] = {
            "ok": False,
            "error": "usage: python -m worker.inspect_job PATH.py:NAME | package.module:NAME",
        }
    else:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                result = inspect_job(args[0])
        except JobError as exc:
            result = {"ok": False, "error": str(exc)}
        except Exception as exc:  # anything else the job's code raised while being sized
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
