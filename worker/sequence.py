"""A job's own pipeline split (`Job.sequence`): the model as an `nn.Sequential` of its parts, for a
model that is not one already (a Hugging Face model, whose forward adds position embeddings, masks
and a head around its blocks). The worker trains the sequence in every layout: its children are the
units a pipeline cuts between and a sharded layout gathers one at a time, and its parameter names
(`"3.block.attn.c_attn.weight"`) are the ones the reshard, the copies and the checkpoints use.

The sequence is built from the model's own modules (shared, not copied), so it is checked once per
build: every parameter of the model sits in exactly one child (a parameter in two children, such as
tied input and output embeddings, would be held by two stages; one in none would never train), and
the sequence holds no parameter the model does not.

What a user gets back speaks the model's names: the final model and `ctl save` write `model.pt` and
`optimizer.pt` renamed to the model's own parameter and buffer names and parameter order
(`as_model_names`), so they load into the model the job builds, as in a job without a sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.job import Job, JobError

__all__ = ["ModelNames", "as_model_names", "build", "model_names"]


def build(job: Job) -> nn.Module:
    """The module the worker trains: `job.model()`, or its sequence where the job gives one (checked:
    see the file comment). Built on the current default device, as `job.model()` is."""
    model = job.model()
    if job.sequence is None:
        return model
    return _checked(model, _call_sequence(job, model))


def _call_sequence(job: Job, model: nn.Module) -> nn.Sequential:
    assert job.sequence is not None
    try:
        seq = job.sequence(model)
    except Exception as e:  # noqa: BLE001 (the user's code: say where it failed)
        raise JobError(f"Job.sequence raised: {type(e).__name__}: {e}") from e
    if not isinstance(seq, nn.Sequential) or len(seq) == 0:
        raise JobError(f"Job.sequence must return an nn.Sequential of the model's parts, got {type(seq).__name__}"
                       + (" with no children" if isinstance(seq, nn.Sequential) else ""))
    return seq


def _checked(model: nn.Module, seq: nn.Sequential) -> nn.Sequential:
    names = {id(p): n for n, p in model.named_parameters()}
    holder: dict[int, str] = {}
    for child_name, child in seq.named_children():
        for p in child.parameters():
            if id(p) in holder and holder[id(p)] != child_name:
                raise JobError(
                    f"Job.sequence: children {holder[id(p)]!r} and {child_name!r} share the parameter "
                    f"{names.get(id(p), '?')!r} (tied weights): each parameter must sit in one child, as a pipeline "
                    "holds it in one stage; untie them (a Hugging Face config's tie_word_embeddings=False)")
            holder[id(p)] = child_name
    foreign = [n for n, p in seq.named_parameters() if id(p) not in names]
    if foreign:
        raise JobError(f"Job.sequence holds {len(foreign)} parameter(s) the model does not, e.g. {foreign[0]!r}: "
                       "build its children from the model's own modules (shared, not copied)")
    left_out = [n for i, n in names.items() if i not in holder]
    if left_out:
        shown = ", ".join(repr(n) for n in left_out[:3]) + (", ..." if len(left_out) > 3 else "")
        raise JobError(f"Job.sequence leaves out {len(left_out)} of the model's parameters ({shown}): every "
                       "parameter must sit in one child, or it would never train")
    return seq


@dataclass(frozen=True, slots=True)
class ModelNames:
    """How the sequence's state maps to the model's: tensor names, and each parameter's index in the
    model's `parameters()` order (an optimizer's state dict is keyed by it)."""

    tensors: Mapping[str, str]  # sequence name -> model name (parameters and buffers)
    index: Mapping[int, int]  # sequence parameter index -> model parameter index


def model_names(job: Job) -> ModelNames | None:
    """The map from the sequence's names to the model's (None for a job without a sequence), built
    on the meta device."""
    if job.sequence is None:
        return None
    with torch.device("meta"):
        model = job.model()
        seq = _checked(model, _call_sequence(job, model))
    def by_id(named: Any) -> dict[int, str]:
        return {id(t): n for n, t in named}
    model_tensors = {**by_id(model.named_buffers()), **by_id(model.named_parameters())}
    seq_tensors = [*seq.named_parameters(), *seq.named_buffers()]
    tensors = {n: model_tensors[id(t)] for n, t in seq_tensors if id(t) in model_tensors}
    model_order = {id(p): i for i, p in enumerate(model.parameters())}
    index = {i: model_order[id(p)] for i, p in enumerate(seq.parameters())}
    return ModelNames(tensors=tensors, index=index)


def as_model_names(names: ModelNames | None, model_state: Mapping[str, Any],
                   optimizer_state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sequence's model and optimizer state dicts under the model's names and parameter order
    (unchanged without a sequence). A tensor of the sequence's own (not the model's) is left out."""
    if names is None:
        return dict(model_state), dict(optimizer_state)
    model = {names.tensors[k]: v for k, v in model_state.items() if k in names.tensors}
    optimizer = dict(optimizer_state)
    if "state" in optimizer:
        optimizer["state"] = {names.index[int(i)]: v for i, v in optimizer_state["state"].items()}
    if "param_groups" in optimizer:
        optimizer["param_groups"] = [{**g, "params": sorted(names.index[int(i)] for i in g["params"])}
                                     for g in optimizer_state["param_groups"]]
    return model, optimizer
