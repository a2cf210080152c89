"""Graph capture (worker.graph): meta-device FLOP, parameter and byte counts per top-level block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plan.graph import Graph
from worker.graph import capture_graph
from worker.job import Job, load_job, resolve_job_ref

ROOT = Path(__file__).resolve().parents[2]


def _load(ref: str) -> Job:
    source = resolve_job_ref(str(ROOT / ref))
    return load_job(source.source, source.name, filename=source.path)


@pytest.fixture(scope="module")
def mlp_job() -> Job:
    return _load("examples/mlp.py:job")


@pytest.fixture(scope="module")
def gpt_job() -> Job:
    return _load("examples/gpt.py:job")


def _num_params(job: Job) -> int:
    torch.manual_seed(job.seed)
    return sum(p.numel() for p in job.model().parameters())


@pytest.mark.parametrize("which", ["mlp_job", "gpt_job"])
def test_param_bytes_match_real_model(which: str, request: pytest.FixtureRequest) -> None:
    job = request.getfixturevalue(which)
    graph = capture_graph(job)
    assert graph.param_bytes == 4 * _num_params(job)
    assert all(layer.name for layer in graph.layers)


def test_mlp_layers_and_linear_flops(mlp_job: Job) -> None:
    graph = capture_graph(mlp_job)
    model = mlp_job.model()
    assert isinstance(model, nn.Sequential)
    assert [layer.name for layer in graph.layers] == [name for name, _ in model.named_children()]
    assert [layer.kind for layer in graph.layers] == [type(m).__name__ for m in model]
    for layer, module in zip(graph.layers, model):
        if isinstance(module, nn.Linear):
            expected = 2 * module.in_features * module.out_features
            assert layer.forward_flops == pytest.approx(expected, rel=0.01)
            assert layer.boundary_bytes == module.out_features * 4
            assert layer.activation_bytes > 0
    # Blocks after the first also compute their input's gradient: backward ≈ 2 × forward.
    second = graph.layers[2]
    assert second.backward_flops == pytest.approx(2 * second.forward_flops, rel=0.01)


def test_gpt_blocks_include_attention(gpt_job: Job) -> None:
    graph = capture_graph(gpt_job)
    model = gpt_job.model()
    assert isinstance(model, nn.Sequential)
    block_size = gpt_job.dataset.block
    d_model = next(model[0].parameters()).shape[1]  # the token embedding's width
    blocks = [(layer, module) for layer, module in zip(graph.layers, model) if layer.kind == "Block"]
    assert len(blocks) == len(model) - 2
    flops = {layer.forward_flops for layer, _ in blocks}
    assert len(flops) == 1  # every transformer block costs the same
    for layer, module in blocks:
        params = sum(p.numel() for p in module.parameters())
        assert layer.param_bytes == 4 * params
        # Matmuls against the weights give 2 × params per token; hand-written attention adds more.
        assert layer.forward_flops > 2 * params * block_size
        assert layer.boundary_bytes == block_size * d_model * 4
        assert layer.backward_flops == pytest.approx(2 * layer.forward_flops, rel=0.01)
        assert layer.activation_bytes > 0


@pytest.mark.parametrize("which", ["mlp_job", "gpt_job"])
def test_optimizer_state_is_measured(which: str, request: pytest.FixtureRequest) -> None:
    """Both examples use Adam(W): two moments per parameter, plus a scalar step per tensor."""
    job = request.getfixturevalue(which)
    graph = capture_graph(job)
    torch.manual_seed(job.seed)
    tensors = sum(1 for p in job.model().parameters() if p.requires_grad)
    assert graph.optimizer_state_bytes is not None
    assert graph.optimizer_state_bytes - 2 * graph.param_bytes in (0, 4 * tensors, 8 * tensors)
    assert graph.state_bytes == graph.param_bytes + graph.optimizer_state_bytes


def test_graph_round_trips(gpt_job: Job) -> None:
    graph = capture_graph(gpt_job)
    again = Graph.from_dict(graph.to_dict())
    assert again == graph


def test_non_sequential_model_uses_children_or_whole(mlp_job: Job) -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(32, 8)
            self.out = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.out(self.inp(x))
            return y

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(32, 5)
            self.b = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.b(x) + self.a(x).sum(-1, keepdim=True)
            return y

    def with_model(cls: type[nn.Module]) -> Job:
        return Job(model=cls, optimizer=mlp_job.optimizer, dataset=mlp_job.dataset,
                   loss=mlp_job.loss, global_batch=8, num_steps=1)

    chain = capture_graph(with_model(Chain))
    assert [layer.name for layer in chain.layers] == ["inp", "out"]
    assert chain.layers[0].forward_flops == pytest.approx(2 * 32 * 8)
    odd = capture_graph(with_model(Odd))
    assert [(layer.name, layer.kind) for layer in odd.layers] == [("Odd", "Odd")]
    assert odd.param_bytes == 4 * (32 * 5 + 5 + 32 * 4 + 4)


def test_capture_of_the_10m_model_runs_on_meta() -> None:
    """The 10M GPT is captured without allocating its parameters (the meta device); how long that
    takes is for a benchmark, not a test."""
    job = _load("examples/gpt.py:job_10m")
    graph = capture_graph(job)
    assert graph.param_bytes == 4 * _num_params(job)
    assert graph.optimizer_state_bytes is not None and graph.optimizer_state_bytes >= 2 * graph.param_bytes
