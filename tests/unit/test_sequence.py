"""`Job.sequence` (worker/sequence.py): the sequence is checked against the model it is built from
(a tied parameter, one left out, one of its own, something that is not an nn.Sequential, a sequence
function that raises: each a JobError saying what to fix), and the state the job writes out speaks
the model's names and parameter order even where the sequence orders them otherwise."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

from worker import sequence
from worker.job import Job, JobError


class Model(nn.Module):
    """Declares its head before its embedding, so the model's parameter order is not the sequence's."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids)) * self.scale))


class Scaled(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.body = m.body
        self.register_buffer("scale", m.scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(h) * self.scale)


def as_sequence(m: Model) -> nn.Sequential:
    return nn.Sequential(m.embed, Scaled(m), m.head)


def _job(seq: Callable[[nn.Module], nn.Module] | None, model: Callable[[], nn.Module] = Model) -> Job:
    ids = torch.arange(16) % 10
    return Job(model=model, sequence=seq, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1),
               dataset=torch.utils.data.TensorDataset(ids, torch.zeros(16, dtype=torch.long)),
               loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"), global_batch=4, num_steps=2)


def test_the_sequence_computes_the_model_and_its_state_is_written_under_the_models_names() -> None:
    job = _job(as_sequence)
    torch.manual_seed(0)
    model = job.model()
    torch.manual_seed(0)
    seq = sequence.build(job)
    ids = torch.arange(6)
    assert torch.equal(seq(ids), model(ids))
    # Train the sequence two steps; its written state loads into the model and its optimizer.
    opt = job.optimizer(seq.parameters())
    for _ in range(2):
        opt.zero_grad()
        seq(ids).square().sum().backward()
        opt.step()
    names = sequence.model_names(job)
    assert names is not None and names.tensors["0.weight"] == "embed.weight" and names.tensors["1.scale"] == "scale"
    model_state, optimizer_state = sequence.as_model_names(names, seq.state_dict(), opt.state_dict())
    fresh = Model()
    fresh.load_state_dict(model_state, strict=True)
    assert torch.equal(fresh(ids), seq(ids))
    fresh_opt = job.optimizer(fresh.parameters())
    fresh_opt.load_state_dict(optimizer_state)
    by_name = dict(fresh.named_parameters())
    for seq_name, p in seq.named_parameters():
        got = fresh_opt.state[by_name[names.tensors[seq_name]]]
        assert torch.equal(got["exp_avg"], opt.state[p]["exp_avg"]), seq_name
    assert sequence.as_model_names(None, {"a": 1}, {"state": {}}) == ({"a": 1}, {"state": {}})


class Tied(Model):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = nn.Parameter(torch.zeros(3, 8))
        self.out = nn.Linear(3, 8, bias=False)
        self.out.weight = self.body.weight  # (8x8 shared with body)


@pytest.mark.parametrize(("seq", "model", "says"), [
    (lambda m: nn.Sequential(m.embed, m.body, m.head, nn.Sequential(m.out)), Tied,
     "children '1' and '3' share the parameter 'body.weight' (tied weights)"),
    (lambda m: nn.Sequential(m.embed, m.head), Model, "leaves out 2 of the model's parameters ('body.weight', 'body.bias')"),
    (lambda m: nn.Sequential(m.embed, m.body, nn.Linear(8, 3)), Model, "holds 2 parameter(s) the model does not"),
    (lambda m: [m.embed, m.body, m.head], Model, "must return an nn.Sequential of the model's parts, got list"),
    (lambda m: nn.Sequential(), Model, "got Sequential with no children"),
    (lambda m: m.missing, Model, "Job.sequence raised: AttributeError"),
], ids=["tied", "left-out", "foreign", "not-sequential", "empty", "raises"])
def test_a_sequence_that_does_not_match_its_model_is_refused_with_what_to_fix(
        seq: Callable[[nn.Module], nn.Module], model: Callable[[], nn.Module], says: str) -> None:
    with pytest.raises(JobError, match=None) as raised:
        sequence.build(_job(seq, model))
    assert says in str(raised.value), str(raised.value)
    with pytest.raises(JobError), torch.device("meta"):
        sequence.model_names(_job(seq, model))


def test_a_sequence_that_is_not_callable_is_refused_when_the_job_is_made() -> None:
    with pytest.raises(JobError, match="Job.sequence must be a function of the model, got int"):
        dataclasses.replace(_job(as_sequence), sequence=3)  # type: ignore[arg-type]
    assert sequence.model_names(_job(None)) is None
