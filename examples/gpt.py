# A character-level GPT in one readable file (after nanoGPT), trained on Python's own source.
#
# - Corpus: the standard library's top-level .py files, in sorted order, first 2 MB of text. Every
#   machine with the same Python reads the same text, so no data files are needed.
# - Model: an nn.Sequential of Embed, Block x N, Head. Each layer maps one tensor to one tensor,
#   so the planner may cut pipeline stages between any two layers. Tensor parallel: q, k, v and the
#   MLP's first Linear split column-wise, the attention's and the MLP's output Linear row-wise
#   (`TP_PLAN`: Megatron's split, the heads divided across the group). Attention is written by hand
#   (q @ k^T, causal mask, softmax, @ v) because torch's FlopCounterMode sees no FLOPs in the CPU
#   SDPA kernel (worker/graph_measure.py). No dropout: training is deterministic. The lm head is
#   not tied to the token embedding, so the first and last stages share no parameter.
# - Loss: per sample, the mean cross-entropy over its positions; summed over samples.
#
# Run it: coordinator --bind tcp://127.0.0.1:5555 --job examples/gpt.py:job

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from worker import Job, warmup_cosine

CORPUS_CHARS = 2_000_000

# Module name patterns of the model (fnmatch) -> how tensor parallelism splits them (Job.tp_plan).
TP_PLAN = {"*.attn.q": "colwise", "*.attn.k": "colwise", "*.attn.v": "colwise", "*.attn.proj": "rowwise",
           "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}


@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[str, torch.Tensor]:
    """(vocabulary, token ids): the characters present, sorted, and the corpus as a LongTensor."""
    stdlib = os.path.dirname(os.__file__)
    parts: list[str] = []
    size = 0
    for name in sorted(os.listdir(stdlib)):
        if size >= CORPUS_CHARS:
            break
        path = os.path.join(stdlib, name)
        if name.endswith(".py") and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
            size += len(parts[-1])
    text = "".join(parts)[:CORPUS_CHARS]
    vocab = "".join(sorted(set(text)))
    # Map code points to ids through a lookup table: vectorised, ~10 ms for 2 MB.
    codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
    table = torch.zeros(ord(vocab[-1]) + 1, dtype=torch.long)
    table[torch.tensor([ord(c) for c in vocab])] = torch.arange(len(vocab))
    return vocab, table[codes]


class CharDataset:
    """Sample i is (tokens[i : i+block], tokens[i+1 : i+block+1])."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens = tokens
        self.block = block
        self._offsets = torch.arange(block + 1)

    def __len__(self) -> int:
        return len(self.tokens) - self.block

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[torch.as_tensor(ids).reshape(-1, 1) + self._offsets]
        return windows[:, :-1], windows[:, 1:]


class Embed(nn.Module):
    def __init__(self, vocab_size: int, block: int, d_model: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class CausalSelfAttention(nn.Module):
    """Heads split across a tensor-parallel group as they come: q, k and v are separate Linears (a
    column-wise split of each gives every rank whole heads; a fused qkv Linear's split would not),
    and the head count is read from the projections' outputs (-1), not fixed."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.head_dim = d_model // n_head
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # The mask is built here, not kept as a buffer: a model built on the meta device and
        # materialised with to_empty() would otherwise carry an uninitialised mask.
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class GPT(nn.Sequential):
    """idx (B, T) int64 -> logits (B, T, vocab)."""

    def __init__(self, vocab_size: int, block: int, n_layer: int, d_model: int, n_head: int):
        super().__init__(
            Embed(vocab_size, block, d_model),
            *(Block(d_model, n_head) for _ in range(n_layer)),
            Head(d_model, vocab_size),
        )
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, mean cross-entropy over its positions; SUMMED over samples."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    total = F.cross_entropy(flat_logits, targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


class HeldOut(CharDataset):
    """`count` windows spread evenly over `tokens` (text the model never trains on): a fixed,
    small held-out set, so an evaluation every few dozen steps stays cheap."""

    def __init__(self, tokens: torch.Tensor, block: int, count: int) -> None:
        super().__init__(tokens, block)
        self._starts = torch.linspace(0, len(tokens) - block - 1, count).long()

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().__getitem__(self._starts[torch.as_tensor(ids)])


def _make_job(
    *, n_layer: int, d_model: int, n_head: int, block: int, global_batch: int, num_steps: int,
    lr: float, description: str, warmup: int = 30, grad_clip: float = 1.0, eval_every: int | None = 50,
) -> Job:
    vocab, tokens = load_corpus()
    split = int(len(tokens) * 0.95)  # the last 5% of the text is held out
    train, held_out = tokens[:split], tokens[split:]

    def model() -> nn.Module:
        return GPT(len(vocab), block, n_layer, d_model, n_head)

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)

    return Job(
        model=model,
        optimizer=optimizer,
        dataset=CharDataset(train, block),
        loss=sequence_loss,
        global_batch=global_batch,
        num_steps=num_steps,
        seed=0,
        description=description,
        lr_schedule=warmup_cosine(warmup, num_steps),
        grad_clip=grad_clip,
        eval_dataset=HeldOut(held_out, block, 256) if eval_every else None,
        eval_every=eval_every,
        tp_plan=TP_PLAN,
        tp_heads=n_head,
    )


def job() -> Job:
    """A small GPT (~0.8M parameters): about 0.1 s a step on one CPU thread."""
    return _make_job(
        n_layer=4, d_model=128, n_head=4, block=64, global_batch=16, num_steps=300, lr=1e-3,
        description="char GPT, 4 layers x 128, on the Python stdlib source",
    )


def job_long_plain() -> Job:
    """`job_long` without the recipe (constant learning rate, no clipping, no evaluation): the
    baseline that scripts/bench_recipe.py measures the recipe's cost against."""
    job = job_long()
    return dataclasses.replace(job, lr_schedule=None, grad_clip=None, eval_dataset=None, eval_every=None,
                               description="char GPT, 4 layers x 128, long run, no schedule/clipping/evaluation")


def job_short() -> Job:
    """The small GPT's first 40 steps, warmup over 20 of them and clipping biting throughout: what
    the tests run under churn against a single-process run of the same recipe."""
    return _make_job(
        n_layer=4, d_model=128, n_head=4, block=64, global_batch=16, num_steps=40, lr=1e-3, warmup=20,
        eval_every=None, description="char GPT, 4 layers x 128, 40 steps (tests)",
    )


def job_soak() -> Job:
    """The demo's GPT and recipe cut to 180 steps: scripts/soak.py repeats the demo's schedule (a kill,
    a join, a slowdown) dozens of times, and 180 steps still leave room for all three (a joiner takes
    ~50 steps to import torch and calibrate on a loaded 2-core machine) plus the straggler's handling
    after the slowdown, while keeping a run near a minute."""
    return _make_job(
        n_layer=4, d_model=128, n_head=4, block=64, global_batch=16, num_steps=180, lr=1e-3,
        description="char GPT, 4 layers x 128, 180 steps (soak)",
    )


def job_10m() -> Job:
    """About 10M parameters: big enough that layout and placement matter."""
    return _make_job(
        n_layer=6, d_model=384, n_head=6, block=128, global_batch=16, num_steps=100, lr=3e-4,
        description="char GPT, 6 layers x 384 (~10M parameters), on the Python stdlib source",
    )


def job_long() -> Job:
    """The small GPT with a bigger batch and no end in sight (100,000 steps): for benchmarks that
    stop it themselves (`ctl.py stop`), such as scripts/bench_planner.py --job examples/gpt.py:job_long."""
    return _make_job(
        n_layer=4, d_model=128, n_head=4, block=64, global_batch=48, num_steps=100_000, lr=1e-3,
        description="char GPT, 4 layers x 128, long run",
    )
