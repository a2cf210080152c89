# A tiny Hugging Face GPT-2 trained as a user writes it: the plain `GPT2LMHeadModel` built from a
# config, no wrapper module. Its forward returns a `CausalLMOutputWithCrossAttentions`; the loss
# reads `.logits`. Every dropout is 0 so training is deterministic; the data is a fixed random token
# sequence from a seeded generator (no files, no downloads).

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

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


def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


def loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean cross-entropy over its positions; summed over samples."""
    logits = outputs.logits  # type: ignore[attr-defined]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


def job() -> Job:
    return Job(model=model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), dataset=Tokens(), loss=loss,
               global_batch=12, num_steps=12, seed=0, description="Hugging Face GPT2LMHeadModel, 3 layers")
