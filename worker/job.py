# The job API: what a user writes, and how a job file reaches a worker.
#
# A job file is plain Python that defines a function returning a `Job`. The coordinator never
# imports torch, so it only resolves the reference to a file and ships the file's text (plus its
# sha256) to workers; every worker execs that same text with `load_job`. Two machines therefore
# run byte-identical job code, and the sha256 lets them check it.
#
# Invariants the rest of the system builds on (DESIGN.md, "Exactly-once data"):
# - `sample_ids(seed, step, ...)` is a pure function: step k consumes the same sample ids, in the
#   same order, whatever the number of workers.
# - `share_slice(shares, rank)` cuts that batch into contiguous, disjoint slices that cover it.
# - `Job.loss` returns the SUM of per-sample losses; the worker divides by `global_batch`, so the
#   gradient is that of the full global batch however the batch is split.

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import linecache
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

__all__ = [
    "Job",
    "JobError",
    "JobSource",
    "load_job",
    "resolve_job_ref",
    "sample_ids",
    "share_slice",
    "small_dataset_warning",
]

TP_STYLES = ("colwise", "rowwise")  # how Job.tp_plan may split a module (DTensor's Colwise/RowwiseParallel)


class JobError(ValueError):
    """A job reference or job file is unusable; the message says what to fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """A training job: everything a worker needs to train, and nothing about where it runs."""

    model: Callable[[], torch.nn.Module]
    """Builds the model. The worker calls `torch.manual_seed(seed)` right before, so the initial
    parameters are identical on every worker. It may be called under `torch.device("meta")`."""

    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer from the model's parameters, e.g. `lambda p: torch.optim.AdamW(p)`."""

    dataset: Any
    """Has `__len__` and `__getitem__(ids: LongTensor) -> (inputs, targets)`, returning the
    tensors of those sample ids, in that order (a `torch.utils.data.TensorDataset` works)."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """`(outputs, targets) -> scalar`: the SUM of the per-sample losses (e.g. `reduction="sum"`).
    The worker divides by `global_batch`; a mean here would make the gradient depend on how the
    batch is split."""

    global_batch: int
    """Samples per step, over all workers together. Fixed for the whole run."""

    num_steps: int
    """Number of optimizer steps to train."""

    seed: int = 0
    """Seeds the model's initialisation and the sampler."""

    description: str = ""
    """One line for humans: shown by `ctl status` and in the event log."""

    lr_schedule: Callable[[int], float] | None = None
    """`step -> multiplier` of every parameter group's base learning rate for the update of step
    `step` (0-based), like `torch.optim.lr_scheduler.LambdaLR`'s lambda. A pure function of the step:
    exact under churn (a joiner, a survivor and a resumed job use the learning rate an undisturbed
    run uses at that step), with no scheduler state to move. Checked when the job loads (at a few
    steps) and at every step: it must return a finite number >= 0."""

    grad_clip: float | None = None
    """Maximum L2 norm of the global gradient (the full global batch's, summed across workers, over
    every parameter), as `torch.nn.utils.clip_grad_norm_` would clip it in one process."""

    eval_dataset: Any = None
    """Held-out data, the same interface as `dataset`. Every `eval_every` steps (and after the last
    one) the members split it between them, sum `loss` over it in eval mode without gradients, and
    the coordinator logs one `eval` event with the mean: never from part of the set."""

    eval_every: int | None = None
    """Evaluate after every this many steps (needs `eval_dataset`)."""

    compute_dtype: str | None = None
    """Mixed precision: "bfloat16" or "float16" for the forward and backward, with the master
    parameters, optimizer state and gradient reduction kept in float32 (sharded layouts: FSDP2's
    `MixedPrecisionPolicy`; replicated: `torch.autocast`). Default None: the model's own dtypes."""

    blocks: tuple[str, ...] | None = None
    """The model's blocks, by module path (`"transformer.h.3"`) or class name (`"GPT2Block"`): the
    units a sharded layout gathers one at a time and a pipeline cuts between. Default: found by
    graph capture (an nn.Sequential's children, or repeated blocks of one class at any depth)."""

    sequence: Callable[[torch.nn.Module], torch.nn.Sequential] | None = None
    """The model as a sequence, for pipelines of a model that is not an nn.Sequential of its units
    (a Hugging Face model): `model -> nn.Sequential` whose children, called one after the other on
    the sample's inputs, compute the model's output (what `loss` then takes), built from the model's
    own modules (shared, not copied; each parameter in exactly one child: untie tied embeddings). The
    worker trains the sequence in every layout, and its children are the units a pipeline cuts
    between. The saved model keeps the model's own names (see worker/sequence.py)."""

    tp_plan: Mapping[str, str] | None = None
    """Tensor parallelism: module name patterns (`fnmatch`, over `model.named_modules()`: "*.attn.q")
    -> "colwise" or "rowwise", each an `nn.Linear` (or `nn.Embedding`) split as DTensor's
    `ColwiseParallel` / `RowwiseParallel` split it (Megatron: q, k, v and an MLP's first Linear
    column-wise, their output Linears row-wise). Default: a Hugging Face model's own
    (`config.base_model_tp_plan`); a job with neither is never given tp."""

    tp_heads: int | None = None
    """The attention heads a tensor-parallel degree must divide (every rank computes whole heads).
    Default: a Hugging Face model's `num_attention_heads` and `num_key_value_heads`."""

    def __post_init__(self) -> None:
        for name in ("model", "optimizer", "loss"):
            value = getattr(self, name)
            if not callable(value):
                raise JobError(
                    f"Job.{name} must be a callable (a function or a class), "
                    f"got {type(value).__name__}: {value!r:.80}"
                )
        for name in ("global_batch", "num_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise JobError(f"Job.{name} must be a positive int, got {value!r:.80}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise JobError(f"Job.seed must be a non-negative int, got {self.seed!r:.80}")
        if not hasattr(self.dataset, "__len__") or not hasattr(self.dataset, "__getitem__"):
            raise JobError(
                "Job.dataset must have __len__ and __getitem__(ids) "
                f"(a torch TensorDataset works), got {type(self.dataset).__name__}"
            )
        if not isinstance(self.description, str):
            raise JobError(f"Job.description must be a str, got {type(self.description).__name__}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and not isinstance(
                self.grad_clip, bool) and math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise JobError(f"Job.grad_clip must be a positive, finite number (a maximum gradient norm), "
                           f"got {self.grad_clip!r:.80}")
        if self.eval_dataset is not None or self.eval_every is not None:
            if self.eval_dataset is None or self.eval_every is None:
                raise JobError("Job.eval_dataset and Job.eval_every go together: give both, or neither")
            if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or self.eval_every <= 0:
                raise JobError(f"Job.eval_every must be a positive int, got {self.eval_every!r:.80}")
            if not hasattr(self.eval_dataset, "__len__") or not hasattr(self.eval_dataset, "__getitem__"):
                raise JobError("Job.eval_dataset must have __len__ and __getitem__(ids), like Job.dataset")
            if len(self.eval_dataset) == 0:
                raise JobError("Job.eval_dataset is empty")
        if self.compute_dtype not in (None, "bfloat16", "float16"):
            raise JobError(f"Job.compute_dtype must be None, 'bfloat16' or 'float16', got {self.compute_dtype!r:.80}")
        if self.blocks is not None and (isinstance(self.blocks, str) or not all(
                isinstance(b, str) and b for b in self.blocks) or not self.blocks):
            raise JobError(f"Job.blocks must be a tuple of module paths or class names, got {self.blocks!r:.80}")
        if self.tp_plan is not None and (not isinstance(self.tp_plan, Mapping) or not self.tp_plan or not all(
                isinstance(k, str) and k and v in TP_STYLES for k, v in self.tp_plan.items())):
            raise JobError(f"Job.tp_plan must map module name patterns to one of {', '.join(TP_STYLES)}, "
                           f"got {self.tp_plan!r:.120}")
        if self.tp_heads is not None and (isinstance(self.tp_heads, bool) or not isinstance(self.tp_heads, int)
                                          or self.tp_heads <= 0):
            raise JobError(f"Job.tp_heads must be a positive int (the attention heads), got {self.tp_heads!r:.80}")
        if self.sequence is not None and not callable(self.sequence):
            raise JobError(f"Job.sequence must be a function of the model, got {type(self.sequence).__name__}")
        if self.lr_schedule is not None:
            if not callable(self.lr_schedule):
                raise JobError(f"Job.lr_schedule must be a function of the step, got {type(self.lr_schedule).__name__}")
            for step in sorted({0, 1, self.num_steps // 2, self.num_steps - 1}):
                self.lr_multiplier(step)

    def lr_multiplier(self, step: int) -> float:
        """The schedule's multiplier for the update of `step` (1.0 without a schedule); JobError
        when the schedule raises or returns something that is not a finite number >= 0."""
        if self.lr_schedule is None:
            return 1.0
        try:
            value = self.lr_schedule(step)
            number = float(value)
        except Exception as e:  # noqa: BLE001 (the user's code: say where it failed)
            raise JobError(f"Job.lr_schedule raised at step {step}: {type(e).__name__}: {e}") from None
        if not math.isfinite(number) or number < 0:
            raise JobError(f"Job.lr_schedule returned {value!r:.40} at step {step}: it must be a finite number >= 0 "
                           "(a multiplier of the optimizer's base learning rate)")
        return number


@dataclass(frozen=True, slots=True)
class JobSource:
    """A resolved job reference: the job file's text, ready to ship to workers."""

    ref: str
    """The reference as the user wrote it, e.g. `examples/gpt.py:job`."""
    path: str
    """Absolute path of the job file."""
    name: str
    """Name of the function in the file that returns the `Job`."""
    source: str
    """The file's text."""
    sha256: str
    """Hex sha256 of `source` encoded as utf-8."""


def resolve_job_ref(ref: str) -> JobSource:
    """Read the job file named by `"PATH.py:NAME"` or `"package.module:NAME"`.

    A module reference is located with `importlib.util.find_spec`, which imports the parent
    packages but never executes the module itself.
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise JobError(
            f"job reference {ref!r} must look like PATH.py:NAME or package.module:NAME, "
            "e.g. examples/gpt.py:job"
        )
    if not name.isidentifier():
        raise JobError(f"job reference {ref!r}: {name!r} is not a Python function name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.suffix == ".py":
            raise JobError(f"job reference {ref!r}: {target!r} is not a .py file")
        if not path.is_file():
            raise JobError(f"job reference {ref!r}: no such file {str(path.absolute())!r}")
    else:
        path = _find_module_file(ref, target)
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"job reference {ref!r}: cannot read {str(path)!r}: {exc}") from exc
    return JobSource(
        ref=ref,
        path=str(path.resolve()),
        name=name,
        source=source,
        sha256=hashlib.sha256(source.encode("utf-8")).hexdigest(),
    )


def _find_module_file(ref: str, module: str) -> Path:
    if not all(part.isidentifier() for part in module.split(".")):
        raise JobError(
            f"job reference {ref!r}: {module!r} is neither a .py path nor a dotted module name"
        )
    try:
        spec = importlib.util.find_spec(module)
    except Exception as exc:  # a missing parent package, or a parent whose __init__ fails
        raise JobError(
            f"job reference {ref!r}: module {module!r} not found "
            f"({type(exc).__name__}: {exc}); check the name and that it is importable "
            "from the current directory"
        ) from exc
    if spec is None:
        raise JobError(
            f"job reference {ref!r}: module {module!r} not found; check the name and that "
            "it is importable from the current directory"
        )
    if spec.origin is None or not spec.origin.endswith(".py"):
        raise JobError(
            f"job reference {ref!r}: module {module!r} is not a .py source file "
            f"(origin {spec.origin!r})"
        )
    return Path(spec.origin)


_module_counter = itertools.count()


def load_job(source: str, name: str, filename: str = "<job>") -> Job:
    """Exec a job file's text in a fresh module, call `name()` and return its `Job`.

    The module is registered in `sys.modules` under a unique name (dataclasses, typing and
    pickling look a class's module up there). It stays registered when the job loads, since the
    job's classes and functions live on in the worker, and is removed when loading fails. Loading
    the same text twice gives two independent modules.
    """
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]
    module_name = f"_adaptrain_job_{digest}_{next(_module_counter)}"
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module
    # The text under `filename` for tracebacks: a failure in the job's code shows its lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    loaded = False
    try:
        try:
            exec(compile(source, filename, "exec"), module.__dict__)
        except (Exception, SystemExit) as exc:
            raise JobError(
                f"job file {filename} failed to load{_line_in(exc, filename)}: {type(exc).__name__}: {exc}"
            ) from exc
        factory = getattr(module, name, None)
        if factory is None:
            raise JobError(
                f"job file {filename} has no {name!r}; define `def {name}() -> Job` in it"
            )
        if not callable(factory):
            raise JobError(
                f"job file {filename}: {name!r} must be a function returning a Job, "
                f"got {type(factory).__name__}"
            )
        try:
            job = factory()
        except (Exception, SystemExit) as exc:  # includes a JobError from Job.__post_init__
            raise JobError(
                f"job file {filename} failed to load{_line_in(exc, filename)}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(job, Job):
            raise JobError(
                f"job file {filename}: {name}() must return a worker.Job, "
                f"got {type(job).__module__}.{type(job).__qualname__}"
            )
        loaded = True
        warning = small_dataset_warning(job)
        if warning is not None:
            print(f"warning: job file {filename}: {warning}", file=sys.stderr, flush=True)
        return job
    finally:
        if not loaded:
            sys.modules.pop(module_name, None)


def _line_in(exc: BaseException, filename: str) -> str:
    """" at line N" of the job file's innermost frame in `exc`'s traceback ("" when it has none)."""
    tb, line = exc.__traceback__, 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""


def small_dataset_warning(job: Job) -> str | None:
    """A sentence when the dataset holds fewer samples than a step draws (`global_batch`), None
    otherwise, also when `len` raises (`inspect_job` refuses such a job at the coordinator's start).
    Such a job is legal, but every step then repeats samples, which a user rarely means; `load_job`
    prints it, so each worker's log says it once."""
    try:
        size = len(job.dataset)
    except Exception:  # noqa: BLE001 (the user's dataset; its own error comes later, with context)
        return None
    if not 0 < size < job.global_batch:
        return None
    return (f"the dataset has {size} samples, fewer than global_batch {job.global_batch}: each step draws "
            f"{job.global_batch} sample ids uniformly with replacement, so every step repeats samples")


def sample_ids(seed: int, step: int, dataset_len: int, global_batch: int) -> torch.Tensor:
    """The sample ids (a LongTensor of length `global_batch`) of step `step`, in order.

    A pure function of its arguments: a fresh CPU `torch.Generator`, seeded from a hash of
    (seed, step), draws `global_batch` ids uniformly WITH replacement (cheap, needs no epoch
    bookkeeping, and any step can be recomputed alone after a failure). The CPU generator gives
    the same ids on every machine.
    """
    if dataset_len <= 0:
        raise ValueError(f"dataset_len must be positive, got {dataset_len}")
    if global_batch <= 0:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    if step < 0 or seed < 0:
        raise ValueError(f"seed and step must be non-negative, got seed={seed} step={step}")
    mixed = hashlib.sha256(f"adaptrain-sampler:{seed}:{step}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(mixed[:8], "little") >> 1)  # < 2**63
    return torch.randint(dataset_len, (global_batch,), generator=generator, dtype=torch.int64)


def share_slice(shares: list[int], rank: int) -> slice:
    """The contiguous part of the global batch that replica `rank` computes.

    `shares[r]` is replica r's number of samples (zero is allowed); the slices of all ranks are
    disjoint and, in rank order, cover `range(sum(shares))` exactly once.
    """
    if not 0 <= rank < len(shares):
        raise ValueError(f"rank {rank} out of range for {len(shares)} shares")
    if any(share < 0 for share in shares):
        raise ValueError(f"shares must be non-negative, got {shares}")
    offset = sum(shares[:rank])
    return slice(offset, offset + shares[rank])
