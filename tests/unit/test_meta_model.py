"""worker.parallel.meta: every executor's meta model is a fresh copy of one built once per job, with
the structure (tied parameters included) of the job's own constructor, and built every time when
it cannot be copied."""

from __future__ import annotations

import threading

import torch
from torch import nn

from worker.job import Job
from worker.parallel.meta import meta_model


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


class _Uncopyable(nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.lock = threading.Lock()  # deepcopy cannot copy a lock


def _job(model: object) -> Job:
    x = torch.zeros(4, 4, dtype=torch.long)
    return Job(model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),  # type: ignore[arg-type]
               dataset=torch.utils.data.TensorDataset(x, x), loss=lambda o, t: o.sum(), global_batch=2,
               num_steps=1)


def test_a_fresh_copy_with_the_constructors_structure_each_time() -> None:
    calls = []
    job = _job(lambda: calls.append(1) or _Tied())
    first, second = meta_model(job), meta_model(job)
    assert len(calls) == 1  # built once, copied after
    assert first is not second and first.body[0].weight is not second.body[0].weight
    reference = _Tied()
    for model in (first, second):
        assert [(n, p.shape, p.dtype) for n, p in model.named_parameters()] == \
               [(n, p.shape, p.dtype) for n, p in reference.named_parameters()]
        assert all(p.is_meta for p in model.parameters())
        assert model.head.weight is model.embed.weight  # still tied
    first.body[0] = nn.Identity()  # what fully_shard or a user's code does to one copy ...
    assert isinstance(meta_model(job).body[0], nn.Linear)  # ... never reaches the next


def test_a_model_that_cannot_be_copied_is_built_every_time() -> None:
    calls = []
    job = _job(lambda: calls.append(1) or _Uncopyable())
    models = [meta_model(job) for _ in range(3)]
    assert len(calls) == 4  # the template, then once per call
    assert len({id(m) for m in models}) == 3 and all(m.weight.is_meta for m in models)


def test_a_new_job_gets_its_own_template() -> None:
    a, b = _job(_Tied), _job(lambda: nn.Linear(3, 5))
    assert isinstance(meta_model(a), _Tied)
    assert isinstance(meta_model(b), nn.Linear) and meta_model(b).weight.shape == (5, 3)
