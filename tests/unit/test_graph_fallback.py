"""Graph capture of models users bring (worker.graph): plain Hugging Face GPT-2 and Llama are captured
per block; replays never see a cache another replay grew; a model that cannot run on meta is captured
on CPU; one that cannot be taken apart gets the coarse one-unit graph and one warning, never an
exception; running out of memory is not hidden behind a coarse graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plan.graph import ROOT_UNIT, Graph
from worker.graph import capture_graph
from worker.job import Job, load_job

JOBS = Path(__file__).resolve().parents[1] / "system" / "jobs"
SEQ, WIDTH = 16, 32  # the HF jobs' sequence length and width


def _load(name: str) -> Job:
    path = JOBS / f"{name}.py"
    return load_job(path.read_text(), "job", filename=str(path))


@pytest.mark.parametrize(("name", "blocks", "kind"), [("hf_gpt2", "transformer.h", "GPT2Block"),
                                                      ("hf_llama", "model.layers", "LlamaDecoderLayer")])
def test_a_plain_hugging_face_model_is_captured_per_block(name: str, blocks: str, kind: str) -> None:
    warnings: list[str] = []
    job = _load(name)
    graph = capture_graph(job, warn=warnings.append)
    assert warnings == []
    assert [layer.name for layer in graph.layers] == [ROOT_UNIT, f"{blocks}.0", f"{blocks}.1", f"{blocks}.2"]
    assert [layer.kind for layer in graph.layers[1:]] == [kind] * 3
    torch.manual_seed(job.seed)
    model = job.model()
    assert graph.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    assert [t.fqn for t in graph.tensors] == [n for n, _ in model.named_parameters()]
    for layer in graph.layers[1:]:
        weights = sum(p.numel() for p in model.get_submodule(layer.name).parameters() if p.dim() == 2)
        # 2 FLOPs per matrix weight per token, plus attention (SDPA, counted here: without the formula
        # for CPU's kernel it would vanish): q @ k^T and @ v, SEQ queries over SEQ keys of WIDTH
        assert layer.forward_flops == 2 * weights * SEQ + 2 * (2 * SEQ * SEQ * WIDTH), layer
        assert layer.backward_flops > layer.forward_flops and layer.activation_bytes > 0
        assert layer.boundary_bytes == SEQ * WIDTH * 4, "the hidden state, no cache beside it"
    assert Graph.from_dict(graph.to_dict()) == graph


class _Logits(nn.Module):
    """A one-line wrapper returning `.logits` of an eager-attention GPT-2 (whose blocks get the
    model's key/value cache among their keyword arguments)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=96, n_positions=SEQ, n_embd=WIDTH, n_layer=3, n_head=2, bos_token_id=0,
                            eos_token_id=0, attn_implementation="eager")  # type: ignore[call-arg]
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.gpt(ids).logits
        return logits


def test_an_eager_gpt2_in_a_wrapper_replays_each_block_on_what_it_saw() -> None:
    plain = capture_graph(_load("hf_gpt2"))
    job = _load("hf_gpt2")
    wrapped = capture_graph(Job(model=_Logits, optimizer=job.optimizer, dataset=job.dataset, loss=job.loss,
                                global_batch=4, num_steps=1))
    assert [layer.name for layer in wrapped.layers] == [ROOT_UNIT, "gpt.transformer.h.0", "gpt.transformer.h.1",
                                                        "gpt.transformer.h.2"]
    # every block attends over SEQ keys, as in the forward (a replay that appended to the recorded
    # cache would attend over 2 × SEQ, or fail on a mask of SEQ)
    assert {layer.forward_flops for layer in wrapped.layers[1:]} == {plain.layers[1].forward_flops}


class _Appending(nn.Module):
    """Appends its input to a cache it is handed and attends over everything cached: its cost
    depends on what the cache held when it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        cache.append(x)
        keys = torch.cat(cache, dim=1)
        y: torch.Tensor = self.fc(x) + (x @ keys.transpose(1, 2)).softmax(-1) @ keys
        return y


class _CachedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Appending() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache: list[torch.Tensor] = []
        for block in self.blocks:
            x = block(x, cache=cache)
        return x


def _regression(model: type[nn.Module], n: int = 8) -> Job:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 8, generator=g))
    return Job(model=model, optimizer=lambda p: torch.optim.AdamW(p), dataset=data,
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=4, num_steps=1)


def test_a_replay_gets_a_copy_of_the_cache_as_the_block_saw_it() -> None:
    graph = capture_graph(_regression(_CachedStack))
    flops = [layer.forward_flops for layer in graph.layers]
    # block i attends over i + 1 cached inputs of 4 positions: its attention grows by the same step
    assert flops[2] - flops[1] == pytest.approx(flops[1] - flops[0]) and flops[1] > flops[0], flops
    assert flops[1] - flops[0] == 2 * 2 * 4 * 4 * 8, "one more cached input: q @ k^T and @ v over 4 more keys"


class _Checked(nn.Sequential):
    """Refuses non-finite input: reads a value, so it cannot run on meta tensors."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise ValueError("non-finite input")
        for layer in self:
            x = layer(x)
        return x


def test_a_model_that_cannot_run_on_meta_is_captured_on_cpu() -> None:
    warnings: list[str] = []
    graph = capture_graph(_regression(_Checked), warn=warnings.append)
    assert warnings == []
    assert [layer.name for layer in graph.layers] == ["0", "1", "2"]
    assert graph.layers[0].forward_flops == 2 * 8 * 16 * 4 and graph.layers[2].forward_flops == 2 * 16 * 8 * 4


def test_a_model_capture_cannot_take_apart_gets_the_coarse_graph_and_one_warning() -> None:
    warnings: list[str] = []
    job = _load("uncapturable")
    graph = capture_graph(job, warn=warnings.append)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("graph capture failed (meta: RuntimeError: ") and "cpu: StopIteration" in warnings[0]
    assert "the model is planned as one unit" in warnings[0] and "sharded layouts gather it whole" in warnings[0]
    assert [layer.name for layer in graph.layers] == ["Net"]
    torch.manual_seed(0)
    model = job.model()
    assert [(t.fqn, t.shape, t.unit) for t in graph.tensors] == [(n, tuple(p.shape), "Net")
                                                                 for n, p in model.named_parameters()]
    whole = graph.layers[0]
    assert whole.param_bytes == 4 * sum(p.numel() for p in model.parameters())
    # measured on one whole forward on CPU: 3 blocks of 16x16 and a 16x4 head
    assert whole.forward_flops == 2 * (3 * 16 * 16 + 16 * 4) and whole.activation_bytes > 0
    state = graph.optimizer_state_bytes
    assert state is not None and 2 * whole.param_bytes <= state <= 2 * whole.param_bytes + 8 * 8, "two moments, steps"


class _Picky(nn.Module):
    """Runs only on batches of at least 4 (and reads a value): no forward runs on capture's batch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 4 or not torch.isfinite(x).all():
            raise ValueError("a batch of at least 4 finite samples")
        for block in self.blocks:
            x = block(x)
        return x


def test_a_model_with_no_forward_capture_can_run_gets_estimated_costs() -> None:
    warnings: list[str] = []
    graph = capture_graph(_regression(_Picky), warn=warnings.append)
    assert len(warnings) == 1 and "FLOPs estimated" in warnings[0], warnings
    assert [layer.name for layer in graph.layers] == ["_Picky"]
    params = 2 * (8 * 8 + 8)
    assert graph.layers[0].forward_flops == 2 * params and graph.layers[0].param_bytes == 4 * params


class _Huge(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")


def test_running_out_of_memory_is_never_hidden_behind_a_coarse_graph() -> None:
    """Another worker might not run out: a coarse graph here would wrap the model unlike theirs."""
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        capture_graph(_regression(_Huge), warn=lambda line: pytest.fail(line))

