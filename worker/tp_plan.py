"""Which modules of a job's model tensor parallelism splits, how, and which degrees it admits.

The split is the job's (`Job.tp_plan`: module name patterns -> "colwise" or "rowwise"), or a Hugging
Face model's own (`config.base_model_tp_plan`, under the base model's prefix); a job with neither
never gets tp. A column-wise `nn.Linear` has its weight and bias split along dim 0 (output
features), a row-wise one its weight along dim 1 (input features): DTensor's `ColwiseParallel` and
`RowwiseParallel` (`worker.parallel.tensor` applies them). A degree is admitted when it divides every
split dimension and the attention heads (`Job.tp_heads`, or the config's query and key-value heads):
each rank computes whole heads. Reads the model's structure only (a meta model will do).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

from torch import nn

from worker.job import Job, JobError

__all__ = ["MAX_TP", "tp_degrees", "tp_dims", "tp_heads", "tp_styles"]

MAX_TP = 64  # the largest tensor-parallel degree weighed
SPLIT_DIM = {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}}  # nn.Linear's tensors, by style


def tp_styles(job: Job, model: nn.Module) -> dict[str, str]:
    """Module name -> "colwise" / "rowwise" for every module the job's tensor-parallel plan splits
    (`Job.tp_plan`, else a Hugging Face model's `config.base_model_tp_plan`); {} without a plan.
    JobError where the job's own plan names a module that is not an nn.Linear, or matches none."""
    patterns, own = _plan(job, model)
    if not patterns:
        return {}
    styles: dict[str, str] = {}
    matched: set[str] = set()
    for name, module in model.named_modules():
        for pattern, style in patterns.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                matched.add(pattern)
                if not isinstance(module, nn.Linear):
                    if own:
                        raise JobError(f"Job.tp_plan: {pattern!r} matches {name!r}, a {type(module).__name__}; "
                                       "only nn.Linear modules can be split (colwise or rowwise)")
                    continue
                styles[name] = style
    unmatched = sorted(set(patterns) - matched)
    if own and unmatched:
        raise JobError(f"Job.tp_plan: {', '.join(map(repr, unmatched))} matches no module of the model "
                       f"(module names look like {next((n for n, _ in model.named_modules() if n), '?')!r})")
    return styles


def _plan(job: Job, model: nn.Module) -> tuple[Mapping[str, str], bool]:
    """(patterns -> style, whether they are the job's own) ; a Hugging Face model's base plan under its
    prefix, its styles other than colwise/rowwise left out."""
    if job.tp_plan is not None:
        return job.tp_plan, True
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    return {f"{prefix}.{p}" if prefix else p: s for p, s in base.items() if s in SPLIT_DIM}, False


def tp_dims(model: nn.Module, styles: Mapping[str, str]) -> dict[str, int | None]:
    """Every parameter's name -> the dim tp splits (None: replicated on every tp rank)."""
    split: dict[str, int] = {}
    for name, style in styles.items():
        for tensor, dim in SPLIT_DIM[style].items():
            if getattr(model.get_submodule(name), tensor, None) is not None:
                split[f"{name}.{tensor}"] = dim
    return {fqn: split.get(fqn) for fqn, _ in model.named_parameters()}


def tp_heads(job: Job, model: nn.Module) -> int | None:
    """The heads a tp degree must divide: `Job.tp_heads`, else the model config's (query and
    key-value heads: their greatest common divisor)."""
    if job.tp_heads is not None:
        return job.tp_heads
    config = getattr(model, "config", None)
    heads = [h for h in (getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None))
             if isinstance(h, int) and h > 0]
    return math.gcd(*heads) if heads else None


def tp_degrees(job: Job, model: nn.Module) -> tuple[list[int], str]:
    """The tensor-parallel degrees (> 1) the model admits, and why not more: every split dimension
    and the heads divisible by the degree. ([], why) for a model with no plan."""
    styles = tp_styles(job, model)
    if not styles:
        return [], ("the job has no tensor-parallel plan (Job.tp_plan; a Hugging Face model brings its own "
                    "as config.base_model_tp_plan)")
    sizes = []
    for name, style in styles.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        sizes.append(linear.out_features if style == "colwise" else linear.in_features)
    heads = tp_heads(job, model)
    common = math.gcd(*sizes, *([heads] if heads else []))
    degrees = [d for d in range(2, min(common, MAX_TP) + 1) if common % d == 0]
    why = (f"a tp degree must divide {'the ' + str(heads) + ' attention heads and ' if heads else ''}"
           f"the split Linears' sizes (their greatest common divisor: {common})")
    return degrees, why
