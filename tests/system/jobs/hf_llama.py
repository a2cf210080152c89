# A tiny Hugging Face Llama trained as a user writes it: the plain `LlamaForCausalLM` built from a
# config, no wrapper module. Its forward returns a `CausalLMOutputWithPast`; the loss reads
# `.logits`. Attention dropout is 0 (Llama has no other dropout) so training is deterministic; the
# data is a seeded token sequence that mostly follows a fixed rule (learnable; no files, no downloads).

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from worker import Job

VOCAB = 96
SEQ = 16


class Tokens:
    """Sample i is (tokens[i : i+SEQ], tokens[i+1 : i+SEQ+1]) of one seeded sequence in which each
    token is (5 * previous + 1) mod VOCAB, or with probability 0.2 a random token."""

    def __init__(self, count: int = 2048, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        noise = torch.randint(0, VOCAB, (count + SEQ,), generator=g)
        keep = torch.rand(count + SEQ, generator=g) >= 0.2
        tokens = [0]
        for t in range(1, count + SEQ):
            tokens.append((5 * tokens[-1] + 1) % VOCAB if keep[t] else int(noise[t]))
        self.tokens = torch.tensor(tokens)
        self.offsets = torch.arange(SEQ + 1)

    def __len__(self) -> int:
        return len(self.tokens) - SEQ

    def __getitem__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[torch.as_tensor(ids).reshape(-1, 1) + self.offsets]
        return windows[:, :-1], windows[:, 1:]


def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        attention_dropout=0.0))


def loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean cross-entropy over its positions; summed over samples."""
    logits = outputs.logits  # type: ignore[attr-defined]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


def job() -> Job:
    return Job(model=model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), dataset=Tokens(), loss=loss,
               global_batch=12, num_steps=12, seed=0, description="Hugging Face LlamaForCausalLM, 3 layers")
