"""Graph capture (worker.graph): meta-device FLOP, parameter and byte counts per top-level block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plan.graph import Graph
from worker.graph import capture_graph
from worker.job import Job, JobError, load_job, resolve_job_ref

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
    assert graph.sequential, "an nn.Sequential of its units: a pipeline may cut it"
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
    assert graph.sequential and [layer.name for layer in graph.layers] == [str(i) for i in range(len(model))]
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


@pytest.mark.parametrize("which", ["mlp_job", "gpt_job"])
def test_each_tensor_records_the_optimizer_state_a_trained_member_holds_for_it(which: str,
                                                                              request: pytest.FixtureRequest) -> None:
    """The keys and dtypes of the state shaped like each parameter, in the order a member that
    trained holds them (`from_module`): what a newcomer cuts its receives for before it learns them."""
    from worker.parallel.slices import PARAM, from_module

    job = request.getfixturevalue(which)
    graph = capture_graph(job)
    torch.manual_seed(job.seed)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    x, y = job.dataset[torch.arange(2)]
    job.loss(model(x), y).backward()
    optimizer.step()
    held = from_module(1, model, optimizer)
    assert [t.fqn for t in graph.tensors] == list(held.keys)
    for t in graph.tensors:
        assert t.state is not None and t.state and held.keys[t.fqn] == (PARAM, *(k for k, _ in t.state)), t
        assert all(held.dtypes[t.fqn][k] == dtype for k, dtype in t.state), t
    bad = graph.to_dict()
    bad["tensors"][0]["state"] = [["exp_avg", "float99"]]
    with pytest.raises(ValueError, match="unknown dtype in its optimizer state"):
        Graph.from_dict(bad)


def test_graph_round_trips(gpt_job: Job) -> None:
    graph = capture_graph(gpt_job)
    again = Graph.from_dict(graph.to_dict())
    assert again == graph and again.sequential


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
    assert not chain.sequential, "children found by their shapes may hide a residual: not cut into stages"
    assert chain.layers[0].forward_flops == pytest.approx(2 * 32 * 8)
    odd = capture_graph(with_model(Odd))
    assert [(layer.name, layer.kind) for layer in odd.layers] == [("Odd", "Odd")]
    assert odd.param_bytes == 4 * (32 * 5 + 5 + 32 * 4 + 4) and not odd.sequential


def test_capture_of_the_10m_model_runs_on_meta() -> None:
    """The 10M GPT is captured without allocating its parameters (the meta device); how long that
    takes is for a benchmark, not a test."""
    job = _load("examples/gpt.py:job_10m")
    graph = capture_graph(job)
    assert graph.param_bytes == 4 * _num_params(job)
    assert graph.optimizer_state_bytes is not None and graph.optimizer_state_bytes >= 2 * graph.param_bytes


# --- units at any depth, and every tensor ------------------------------------------------------------


class _HFBlock(nn.Module):
    """A transformer layer the way Hugging Face writes one: called with keyword arguments."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        y: torch.Tensor = hidden_states + self.fc(self.ln(hidden_states))
        return y if attention_mask is None else y * attention_mask


class _HFModel(nn.Module):
    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, d)
        self.h = nn.ModuleList(_HFBlock(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        mask = torch.ones_like(x)
        for block in self.h:
            x = block(x, attention_mask=mask)
        y: torch.Tensor = self.ln_f(x)
        return y


class _LMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = _HFModel()
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.lm_head(self.transformer(ids))
        return y


class _Wrapped(nn.Module):
    """A user's one-line wrapper around a library model: the blocks sit three modules deep."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _LMHead()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.gpt(ids)
        return y


class _Tokens:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = (ids[:, None] + torch.arange(4)) % 16
        return x, x


def _job(model: type[nn.Module], **kw: object) -> Job:
    return Job(model=model, optimizer=lambda p: torch.optim.AdamW(p), dataset=_Tokens(),
               loss=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum"),
               global_batch=4, num_steps=1, **kw)  # type: ignore[arg-type]


def test_repeated_blocks_deep_inside_a_wrapper_are_units_and_the_rest_is_the_root() -> None:
    graph = capture_graph(_job(_Wrapped))
    assert [layer.name for layer in graph.layers] == ["(root)", "gpt.transformer.h.0", "gpt.transformer.h.1",
                                                      "gpt.transformer.h.2"]
    assert not graph.sequential
    assert [layer.kind for layer in graph.layers] == ["_Wrapped", "_HFBlock", "_HFBlock", "_HFBlock"]
    torch.manual_seed(0)
    model = _Wrapped()
    assert graph.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    block = graph.layers[1]
    assert block.param_bytes == 4 * sum(p.numel() for p in model.gpt.transformer.h[0].parameters())
    assert block.forward_flops == pytest.approx(2 * 8 * 8 * 4, rel=0.01), "the block's Linear, per sample of 4 tokens"
    assert graph.layers[0].forward_flops >= 2 * 8 * 16 * 4, "the root keeps the LM head"
    assert [t.fqn for t in graph.tensors] == [n for n, _ in model.named_parameters()]
    units = {t.fqn: t.unit for t in graph.tensors}
    assert units["gpt.transformer.h.1.fc.weight"] == "gpt.transformer.h.1"
    assert units["gpt.lm_head.weight"] == units["gpt.transformer.wte.weight"] == "(root)"
    head = next(t for t in graph.tensors if t.fqn == "gpt.lm_head.weight")
    assert (head.shape, head.dtype, head.rows, head.nbytes) == ((16, 8), "float32", 16, 16 * 8 * 4)
    assert Graph.from_dict(graph.to_dict()) == graph


def test_a_job_may_name_its_blocks_and_a_name_that_matches_nothing_is_a_clear_error() -> None:
    graph = capture_graph(_job(_Wrapped, blocks=("_HFModel",)))
    assert [layer.name for layer in graph.layers] == ["(root)", "gpt.transformer"]
    by_path = capture_graph(_job(_Wrapped, blocks=("gpt.transformer.h.0", "gpt.transformer.h.2")))
    assert [layer.name for layer in by_path.layers] == ["(root)", "gpt.transformer.h.0", "gpt.transformer.h.2"]
    with pytest.raises(JobError, match=r"Job.blocks names \['Block'\], but no module"):
        capture_graph(_job(_Wrapped, blocks=("Block",)))
    with pytest.raises(JobError, match="Job.blocks must be a tuple"):
        _job(_Wrapped, blocks="h")


def test_the_examples_record_every_parameter_with_its_unit(gpt_job: Job) -> None:
    graph = capture_graph(gpt_job)
    torch.manual_seed(gpt_job.seed)
    model = gpt_job.model()
    assert [(t.fqn, t.shape) for t in graph.tensors] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert {t.unit for t in graph.tensors} <= {layer.name for layer in graph.layers}
    assert all(t.unit == t.fqn.split(".")[0] for t in graph.tensors), "each child of the Sequential is a unit"
