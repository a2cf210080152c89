# A tiny Hugging Face GPT-2 trained as a user writes it: the plain `GPT2LMHeadModel` built from a
# config, no wrapper module. Its forward returns a `CausalLMOutputWithCrossAttentions`; the loss
# reads `.logits`. Every dropout is 0 so training is deterministic; the data is a fixed random token
# sequence from a seeded generator (no files, no downloads).
#
# `sequence_job`: the same model given as a sequence (`Job.sequence`), so that it can be pipelined:
# the embeddings, each GPT2Block, and the final norm with the head, each a child holding the model's
# own modules; its embeddings untied (a pipeline holds each parameter in one stage); its loss takes
# the head's logits.

from __future__ import annotations

import torch
from torch import nn
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


def model(tied: bool = True) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied))


def loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """Per sample, the mean cross-entropy over its positions; summed over samples."""
    logits = outputs.logits  # type: ignore[attr-defined]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return total / targets.shape[-1]


def job() -> Job:
    return Job(model=model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), dataset=Tokens(), loss=loss,
               global_batch=12, num_steps=12, seed=0, description="Hugging Face GPT2LMHeadModel, 3 layers")


def untied() -> GPT2LMHeadModel:
    return model(tied=False)


class Embeddings(nn.Module):
    def __init__(self, m: GPT2LMHeadModel) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = m.transformer.wte, m.transformer.wpe, m.transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)


class Head(nn.Module):
    def __init__(self, m: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f, self.lm_head = m.transformer.ln_f, m.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


def sequence(m: GPT2LMHeadModel) -> nn.Sequential:
    return nn.Sequential(Embeddings(m), *[Block(b) for b in m.transformer.h], Head(m))


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss(type("Out", (), {"logits": logits})(), targets)


def sequence_job() -> Job:
    return Job(model=untied, sequence=sequence, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
               dataset=Tokens(), loss=logits_loss, global_batch=12, num_steps=12, seed=0,
               description="Hugging Face GPT2LMHeadModel as a sequence of 5 units, 3 layers")
