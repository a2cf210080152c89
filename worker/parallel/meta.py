"""The job's model on the meta device (structure only, no memory), which every executor is built from
at every epoch entry.

Building it runs the job's constructor, whose initialisers (`normal_`, `uniform_`) go through torch's
reference implementations on meta tensors: 42 ms for the 10M-parameter GPT, at every entry of every
member (a join or a failure pauses the members for it). A deepcopy of one built once takes 4 ms and
gives the same structure, tied parameters included (deepcopy keeps sharing). A model that cannot be
deep-copied (a constructor that keeps something uncopyable) is built every time.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from worker import sequence
from worker.job import Job

# (job, its meta model or None when it cannot be copied): one job per worker process
_template: tuple[Job, nn.Module | None] | None = None


def meta_model(job: Job) -> nn.Module:
    """A fresh meta-device instance of `job`'s model (the global RNG seeded with the job's seed, as
    the constructor runs after `torch.manual_seed(seed)` everywhere else)."""
    global _template
    torch.manual_seed(job.seed)
    if _template is None or _template[0] is not job:
        _template = (job, _build(job))
    model = _template[1]
    if model is not None:
        try:
            return copy.deepcopy(model)
        except Exception:  # noqa: BLE001 (any failure to copy: build every time from now on)
            _template = (job, None)
    return _build(job)


def _build(job: Job) -> nn.Module:
    with torch.device("meta"):
        return sequence.build(job)
