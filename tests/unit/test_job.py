"""The job API: sampler purity, batch slicing, job loading errors, the examples, inspect_job."""

from __future__ import annotations

import re

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.job import Job, JobError, load_job, resolve_job_ref, sample_ids, share_slice

ROOT = Path(__file__).resolve().parents[2]


# --- sampler and shares -------------------------------------------------------------------------


def test_sample_ids_is_a_pure_function_of_its_arguments() -> None:
    first = sample_ids(7, 3, 1000, 64)
    torch.manual_seed(12345)  # the global RNG must not matter
    torch.rand(10)
    again = sample_ids(7, 3, 1000, 64)
    assert first.dtype == torch.int64 and first.shape == (64,)
    assert torch.equal(first, again)
    assert int(first.min()) >= 0 and int(first.max()) < 1000


def test_sample_ids_differ_across_steps_and_seeds() -> None:
    batches = [sample_ids(0, step, 10_000, 32) for step in range(20)]
    assert len({tuple(b.tolist()) for b in batches}) == 20
    assert not torch.equal(sample_ids(0, 5, 10_000, 32), sample_ids(1, 5, 10_000, 32))
    # (seed, step) pairs that a naive seed * K + step mix would confuse stay distinct.
    assert not torch.equal(sample_ids(1, 0, 10_000, 32), sample_ids(0, 1_000_003, 10_000, 32))


def test_sample_ids_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        sample_ids(0, 0, 0, 8)
    with pytest.raises(ValueError):
        sample_ids(0, 0, 10, 0)
    with pytest.raises(ValueError):
        sample_ids(0, -1, 10, 8)


@pytest.mark.parametrize(
    "shares", [[64], [32, 32], [10, 0, 54], [0, 0, 7], [1, 2, 3, 4, 5], [0, 64, 0]]
)
def test_share_slices_cover_the_batch_exactly_once(shares: list[int]) -> None:
    total = sum(shares)
    seen: list[int] = []
    for rank, share in enumerate(shares):
        part = share_slice(shares, rank)
        assert part.stop - part.start == share
        seen.extend(range(total)[part])
    assert seen == list(range(total))


def test_share_slice_concatenation_is_the_global_batch() -> None:
    ids = sample_ids(3, 9, 500, 24)
    shares = [5, 0, 11, 8]
    parts = [ids[share_slice(shares, r)] for r in range(len(shares))]
    assert torch.equal(torch.cat(parts), ids)


def test_share_slice_rejects_bad_rank() -> None:
    with pytest.raises(ValueError):
        share_slice([4, 4], 2)
    with pytest.raises(ValueError):
        share_slice([4, -1], 0)


# --- Job validation and load_job ----------------------------------------------------------------

_GOOD_JOB = """
import torch
from worker.job import Job
from dataclasses import dataclass

@dataclass
class Config:           # a dataclass inside a job file needs its module in sys.modules
    width: int = 3

def job():
    x = torch.zeros(8, Config().width)
    return Job(model=lambda: torch.nn.Linear(3, 1), optimizer=torch.optim.SGD,
               dataset=torch.utils.data.TensorDataset(x, x[:, :1]),
               loss=lambda o, t: ((o - t) ** 2).sum(), global_batch=4, num_steps=2)
"""


def test_load_job_returns_the_job() -> None:
    job = load_job(_GOOD_JOB, "job", filename="good.py")
    assert isinstance(job, Job)
    assert job.global_batch == 4 and len(job.dataset) == 8


def test_two_loads_give_independent_modules() -> None:
    a = load_job(_GOOD_JOB, "job")
    b = load_job(_GOOD_JOB, "job")
    assert a.model.__globals__ is not b.model.__globals__


@pytest.mark.parametrize(
    ("source", "name", "expected"),
    [
        ("def job(:\n    pass\n", "job", "SyntaxError"),
        ("raise RuntimeError('no data here')\n", "job", "RuntimeError: no data here"),
        ("def job():\n    return 1 / 0\n", "job", "ZeroDivisionError"),
        ("def job():\n    return {'model': None}\n", "job", "must return a worker.Job"),
        ("def other():\n    pass\n", "job", "has no 'job'"),
        ("job = 3\n", "job", "must be a function"),
        ("import sys\nsys.exit(2)\n", "job", "SystemExit"),
    ],
)
def test_load_job_errors_are_job_errors(source: str, name: str, expected: str) -> None:
    with pytest.raises(JobError) as info:
        load_job(source, name, filename="bad_job.py")
    assert "bad_job.py" in str(info.value)
    assert expected in str(info.value)
    assert not any(m.startswith("_adaptrain_job_") and sys.modules[m].__file__ == "bad_job.py"
                   for m in list(sys.modules))


def test_job_checks_its_fields() -> None:
    good = load_job(_GOOD_JOB, "job")
    fields = dict(model=good.model, optimizer=good.optimizer, dataset=good.dataset,
                  loss=good.loss, global_batch=4, num_steps=2)
    for key, value, message in [
        ("global_batch", 0, "global_batch must be a positive int"),
        ("num_steps", 2.5, "num_steps must be a positive int"),
        ("model", "linear", "Job.model must be a callable"),
        ("loss", None, "Job.loss must be a callable"),
        ("dataset", 42, "Job.dataset must have __len__"),
        ("seed", -1, "Job.seed"),
    ]:
        with pytest.raises(JobError, match=message):
            Job(**{**fields, key: value})


def test_a_bad_job_field_in_a_job_file_names_the_file() -> None:
    source = _GOOD_JOB.replace("global_batch=4", "global_batch=-4")
    line = 1 + next(i for i, text in enumerate(source.splitlines()) if "Job(" in text)
    with pytest.raises(JobError, match=rf"bad\.py failed to load at line {line}: JobError: .*global_batch"):
        load_job(source, "job", filename="bad.py")


def test_a_job_file_that_raises_says_at_which_line() -> None:
    source = "x = 1\n\ndef job():\n    return {}['missing']\n"
    with pytest.raises(JobError, match=r"bad\.py failed to load at line 4: KeyError: 'missing'"):
        load_job(source, "job", filename="bad.py")


# --- resolve_job_ref ----------------------------------------------------------------------------


def test_resolve_path_and_module_refs_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    by_path = resolve_job_ref(str(ROOT / "examples" / "mlp.py") + ":job")
    assert by_path.name == "job" and by_path.path == str(ROOT / "examples" / "mlp.py")
    assert by_path.source == (ROOT / "examples" / "mlp.py").read_text(encoding="utf-8")
    assert len(by_path.sha256) == 64
    monkeypatch.syspath_prepend(str(ROOT))
    by_module = resolve_job_ref("examples.mlp:job")
    assert (by_module.path, by_module.sha256) == (by_path.path, by_path.sha256)


def test_resolve_module_ref_does_not_execute_the_module(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "boom_job.py").write_text("raise SystemExit('executed!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    resolved = resolve_job_ref("boom_job:job")
    assert resolved.path == str(tmp_path / "boom_job.py")
    assert "boom_job" not in sys.modules


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("examples/mlp.py", "must look like PATH.py:NAME"),
        ("examples/mlp.py:", "must look like PATH.py:NAME"),
        ("examples/nope.py:job", "no such file"),
        ("examples/mlp.txt:job", "not a .py file"),
        ("no_such_module_xyz:job", "module 'no_such_module_xyz' not found"),
        ("no_such_pkg_xyz.sub:job", "not found"),
        ("examples/mlp.py:not-a-name", "not a Python function name"),
        ("_json:loads", "is not a .py source file"),  # a C extension has no source
    ],
)
def test_resolve_job_ref_errors(ref: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(JobError, match=expected):
        resolve_job_ref(ref)


# --- the examples -------------------------------------------------------------------------------


def _load_example(ref: str) -> Job:
    source = resolve_job_ref(str(ROOT / ref))
    return load_job(source.source, source.name, filename=source.path)


@pytest.mark.parametrize("ref", ["examples/mlp.py:job", "examples/gpt.py:job"])
def test_example_takes_one_step_with_finite_loss(ref: str) -> None:
    job = _load_example(ref)
    torch.manual_seed(job.seed)
    model = job.model()
    optimizer = job.optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = job.dataset[sample_ids(job.seed, 0, len(job.dataset), job.global_batch)]
    assert len(inputs) == len(targets) == job.global_batch
    loss = job.loss(model(inputs), targets) / job.global_batch
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_example_models_are_deterministic_under_the_seed() -> None:
    job = _load_example("examples/gpt.py:job")
    torch.manual_seed(job.seed)
    a = job.model().state_dict()
    torch.manual_seed(job.seed)
    b = job.model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gpt_10m_has_about_ten_million_parameters() -> None:
    job = _load_example("examples/gpt.py:job_10m")
    with torch.device("meta"):
        model = job.model()
    num_params = sum(p.numel() for p in model.parameters())
    assert 8_000_000 <= num_params <= 12_000_000


def test_gpt_dataset_windows_are_shifted_by_one() -> None:
    job = _load_example("examples/gpt.py:job")
    ids = torch.tensor([0, 5, len(job.dataset) - 1])
    inputs, targets = job.dataset[ids]
    assert inputs.shape == targets.shape and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(job.dataset[torch.tensor([5])][0][0], inputs[1])


@pytest.mark.parametrize("ref", ["examples/mlp.py:job", "examples/gpt.py:job"])
def test_loss_sums_over_samples(ref: str) -> None:
    job = _load_example(ref)
    torch.manual_seed(job.seed)
    model = job.model()
    inputs, targets = job.dataset[torch.tensor([3, 1000])]
    with torch.no_grad():
        outputs = model(inputs)
        pair = job.loss(outputs, targets)
        each = job.loss(outputs[:1], targets[:1]) + job.loss(outputs[1:], targets[1:])
    assert torch.allclose(pair, each, rtol=1e-5)
    assert not torch.allclose(pair, job.loss(outputs[:1], targets[:1]), rtol=1e-3)


# --- inspect_job as the coordinator runs it -----------------------------------------------------


def _inspect(ref: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.inspect_job", ref], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.process
def test_inspect_job_prints_one_ok_json_line() -> None:
    proc = _inspect("examples/mlp.py:job")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    assert info["ok"] is True
    assert info["name"] == "job" and info["path"] == str(ROOT / "examples" / "mlp.py")
    assert info["global_batch"] == 64 and info["num_steps"] == 200 and info["seed"] == 0
    assert info["dataset_len"] == 4096 and info["num_params"] > 0
    assert len(info["sha256"]) == 64 and isinstance(info["description"], str)


@pytest.mark.process
def test_inspect_job_refuses_a_missing_file_without_a_traceback() -> None:
    proc = _inspect("examples/does_not_exist.py:job")
    assert proc.returncode == 1
    info = json.loads(proc.stdout.strip())
    assert info["ok"] is False and "no such file" in info["error"]
    assert "Traceback" not in proc.stderr


@pytest.mark.process
def test_inspect_job_refuses_a_sequence_that_leaves_out_a_parameter(tmp_path: Path) -> None:
    """The coordinator's check at start builds the job's sequence: one that leaves a parameter out
    is refused with the reason, before any worker trains on it."""
    path = tmp_path / "seq.py"
    path.write_text("import torch\nfrom torch import nn\nfrom worker import Job\n\n"
                    "def job():\n"
                    "    return Job(model=lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)),\n"
                    "               sequence=lambda m: nn.Sequential(m[0]), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),\n"
                    "               dataset=torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1)),\n"
                    "               loss=lambda o, t: ((o - t) ** 2).sum(), global_batch=4, num_steps=2)\n")
    proc = _inspect(f"{path}:job")
    assert proc.returncode == 1, proc.stdout
    info = json.loads(proc.stdout.strip())
    assert info["ok"] is False and "Job.sequence leaves out 2 of the model's parameters ('1.weight', '1.bias')" in info["error"]
    assert "Traceback" not in proc.stderr


# --- the training recipe (issue 10): learning-rate schedules and gradient clipping ---------------


def _recipe_job(**kw: object) -> Job:
    import torch as _torch
    from torch.utils.data import TensorDataset

    data = TensorDataset(_torch.zeros(8, 2), _torch.zeros(8, 1))
    return Job(model=lambda: _torch.nn.Linear(2, 1), optimizer=lambda p: _torch.optim.SGD(p, lr=0.1),
               dataset=data, loss=lambda o, t: ((o - t) ** 2).sum(), global_batch=4, num_steps=100,
               **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule, needle", [
    (lambda step: 1 / (50 - step), "raised at step 50: ZeroDivisionError"),
    (lambda step: -0.5, "returned -0.5 at step 0"),
    (lambda step: float("nan") if step == 99 else 1.0, "returned nan at step 99"),
    (lambda step: "fast", "raised at step 0: ValueError"),
])
def test_a_bad_schedule_is_refused_when_the_job_loads_with_the_step(schedule: object, needle: str) -> None:
    with pytest.raises(JobError, match=re.escape(needle)):
        _recipe_job(lr_schedule=schedule)


@pytest.mark.parametrize("clip", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_a_clip_that_is_not_a_positive_number_is_refused(clip: object) -> None:
    with pytest.raises(JobError, match="grad_clip"):
        _recipe_job(grad_clip=clip)


def test_the_multiplier_is_the_schedule_at_that_step_and_1_without_one() -> None:
    assert _recipe_job().lr_multiplier(7) == 1.0
    assert _recipe_job(lr_schedule=lambda step: step / 10).lr_multiplier(7) == 0.7
    assert _recipe_job(grad_clip=2).grad_clip == 2


@pytest.mark.process
def test_the_coordinator_refuses_a_job_whose_schedule_fails_with_the_step_and_reason(tmp_path: Path) -> None:
    from coordinator.jobinfo import JobRefused, inspect_job

    bad = tmp_path / "bad_schedule.py"
    bad.write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\nfrom worker.job import Job\n"
        "def job():\n"
        "    return Job(model=lambda: torch.nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),\n"
        "               dataset=TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1)),\n"
        "               loss=lambda o, t: ((o - t) ** 2).sum(), global_batch=4, num_steps=100,\n"
        "               lr_schedule=lambda step: 1.0 - step / 60)\n")
    with pytest.raises(JobRefused, match=r"lr_schedule returned -0\.6499\d* at step 99: it must be a finite number"):
        inspect_job(f"{bad}:job")


def test_compute_dtype_and_blocks_are_checked() -> None:
    from torch import nn

    def make(**kw: object) -> Job:
        return Job(model=lambda: nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   dataset=torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1)),
                   loss=lambda o, t: ((o - t) ** 2).sum(), global_batch=2, num_steps=1, **kw)  # type: ignore[arg-type]

    assert make(compute_dtype="bfloat16").compute_dtype == "bfloat16"
    with pytest.raises(JobError, match="compute_dtype must be None, 'bfloat16' or 'float16'"):
        make(compute_dtype="int8")
    assert make(blocks=("layers.0", "Block")).blocks == ("layers.0", "Block")
    with pytest.raises(JobError, match="Job.blocks must be a tuple"):
        make(blocks=())
