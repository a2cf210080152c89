"""A real training recipe under churn: a learning-rate schedule (warmup, then cosine) and gradient
clipping, on the GPT example (examples/gpt.py:job_short), with a SIGKILL and a join during warmup.

Every step's loss, learning rate and gradient norm (before clipping) must equal, within 1e-4
relative, those of an undisturbed run and those of a single-process run of the same recipe written
here with plain torch (`torch.nn.utils.clip_grad_norm_`, the schedule applied to each parameter
group): the schedule is a pure function of the step and the norm is the full global batch's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from localjob import LocalJob

from worker.job import load_job, sample_ids

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"
JOB = f"{GPT}:job_short"
NUM_STEPS = 40
FIELDS = ("loss", "lr", "grad_norm")


_SINGLE: dict[tuple[str, str], tuple[dict[int, dict[str, float]], Any, Any]] = {}


def single_process(keep: dict[str, Any] | None = None, job_file: Path = GPT,
                   function: str = "job_short") -> dict[int, dict[str, float]]:
    """The recipe (`function` of `job_file`) in one process, step by step (1-based, like the `step`
    events); `keep` receives the trained model (a copy of its own). Computed once per job a session:
    a reference never changes, and some thirty tests compare against the same one."""
    key = (str(job_file), function)
    if key not in _SINGLE:
        _SINGLE[key] = _single_process(job_file, function)
    out, model, job = _SINGLE[key]
    if keep is not None:
        keep.update(model=copy.deepcopy(model), job=job)
    return {step: dict(fields) for step, fields in out.items()}


def _single_process(job_file: Path, function: str) -> tuple[dict[int, dict[str, float]], Any, Any]:
    job = load_job(job_file.read_text(), function, filename=str(job_file))
    torch.manual_seed(job.seed)
    model = job.model()
    opt = job.optimizer(model.parameters())
    base = [g["lr"] for g in opt.param_groups]
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for k in range(job.num_steps):
        x, y = job.dataset[sample_ids(job.seed, k, len(job.dataset), job.global_batch)]
        for p in params:
            p.grad = None
        loss = job.loss(model(x), y)
        (loss / job.global_batch).backward()
        # clip_grad_norm_'s own arithmetic, with the norm in float64 (the workers sum float32 norms of
        # 16K-element chunks in float64: the same to ~1e-7)
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64)
                                                           for p in params if p.grad is not None])))
        torch.nn.utils.clip_grads_with_norm_(params, job.grad_clip, torch.tensor(norm))
        for group, b in zip(opt.param_groups, base):
            group["lr"] = b * job.lr_multiplier(k)
        opt.step()
        out[k + 1] = {"loss": loss.item() / job.global_batch, "lr": opt.param_groups[0]["lr"], "grad_norm": norm}
    return out, model, job


def _gap(run: dict[int, dict[str, float]], ref: dict[int, dict[str, float]]) -> dict[str, float]:
    assert sorted(run) == sorted(ref) == list(range(1, NUM_STEPS + 1)), "no step lost or doubled"
    return {f: max(abs(run[s][f] - ref[s][f]) / abs(ref[s][f]) for s in ref) for f in FIELDS}


@pytest.mark.timeout(400)
def test_schedule_and_clipping_are_exact_under_a_kill_and_a_join_in_warmup(tmp_path: Path) -> None:
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    assert sum(r["grad_norm"] > 1.0 for r in reference.values()) >= 20, "the clip must bite"
    assert reference[1]["lr"] < reference[20]["lr"] > reference[40]["lr"], "warmup, then decay"

    with LocalJob(JOB, tmp_path / "quiet", min_workers=2) as job:
        job.start()
        for name in ("w1", "w2"):
            job.add_worker(name)
        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        undisturbed = job.steps()
        finished = [e for e in job.events() if e["kind"] == "finished"]
        printed = (tmp_path / "quiet" / "coordinator.out").read_text()
    _check_the_trained_model(tmp_path / "quiet", finished, printed, trained)

    # --slowdown stretches compute (never the mathematics), so warmup lasts long enough for a new
    # worker to import torch and join inside it.
    slow = ("--slowdown", "8", "--digest-every", str(NUM_STEPS))
    with LocalJob(JOB, tmp_path / "churn", min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, *slow)
        job.wait_step(3, 180)
        job.kill("w2")
        job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 30, "failure plan")
        job.add_worker("w4", *slow)
        joined = job.wait_event(lambda e: e["kind"] == "plan" and "w4" in (e["layout"] or {}).get("members", []),
                                120, "w4 planned in")
        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        churned = job.steps()
        finals = {n: job.digests(n).get(NUM_STEPS) for n in ("w1", "w3", "w4")}
    first_w4 = min(s for s, e in churned.items() if e["epoch"] >= joined["epoch"])
    assert first_w4 <= 20, f"w4 joined at step {first_w4}: during warmup"
    assert len(set(finals.values())) == 1 and None not in finals.values(), finals
    for name, run in (("undisturbed", undisturbed), ("churned", churned)):
        gaps = _gap(run, reference)
        assert all(g <= 1e-4 for g in gaps.values()), f"{name} against one process: {gaps}"
    gaps = _gap(churned, undisturbed)
    assert all(g <= 1e-4 for g in gaps.values()), f"churned against undisturbed: {gaps}"


# The subprocess builds the GPT from examples/gpt.py with a stand-in for `worker` (the file's only
# adaptrain import, for its Job type and its schedule), so nothing of adaptrain's worker is imported.
LOAD_AND_EVALUATE = """
import json, sys, types, importlib.util
import torch
sys.modules["worker"] = stub = types.ModuleType("worker")
sys.modules["worker.job"] = stub
stub.Job = object
stub.warmup_cosine = lambda *args, **kwargs: (lambda step: 1.0)
spec = importlib.util.spec_from_file_location("gpt_example", sys.argv[1])
gpt = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpt)
vocab, tokens = gpt.load_corpus()
model = gpt.GPT(len(vocab), 64, 4, 128, 4)
model.load_state_dict(torch.load(sys.argv[2] + "/model.pt"))
optimizer_state = torch.load(sys.argv[2] + "/optimizer.pt")
x, y = gpt.CharDataset(tokens, 64)[torch.tensor(json.loads(sys.argv[3]))]
with torch.no_grad():
    loss = gpt.sequence_loss(model(x), y).item() / len(x)
print(json.dumps({"loss": loss, "adaptrain_worker_loaded": any(m.startswith("worker.") and m != "worker.job"
                                                               for m in sys.modules),
                  "optimizer_steps": [int(s["step"]) for s in optimizer_state["state"].values()][:1]}))
"""


def _check_the_trained_model(state_dir: Path, finished: list[dict[str, Any]], printed: str,
                             trained: dict[str, Any]) -> None:
    """The job's end wrote the model where the event says, atomically, loadable without adaptrain,
    and it is the trained model: on the last step's batch it gives the single-process model's loss."""
    final = (state_dir / "final").resolve()
    assert [(e["step"], e["path"]) for e in finished] == [(NUM_STEPS, str(final))], finished
    assert str(final) in printed, "the coordinator prints where the model is"
    assert sorted(p.name for p in final.iterdir()) == ["model.pt", "optimizer.pt"], "no temporary file left"
    job, model = trained["job"], trained["model"]
    ids = sample_ids(job.seed, NUM_STEPS - 1, len(job.dataset), job.global_batch)
    out = subprocess.run([sys.executable, "-c", LOAD_AND_EVALUATE, str(GPT), str(final), json.dumps(ids.tolist())],
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["adaptrain_worker_loaded"] and got["optimizer_steps"] == [NUM_STEPS]
    x, y = job.dataset[ids]
    with torch.no_grad():
        expected = job.loss(model(x), y).item() / job.global_batch
    assert abs(got["loss"] - expected) / expected <= 1e-4, (got["loss"], expected)


@pytest.mark.timeout(240)
def test_ctl_save_writes_the_model_at_a_step_boundary_and_refuses_an_unwritable_path(tmp_path: Path) -> None:
    paced = f"{ROOT / 'examples' / 'paced.py'}:long_job"
    with LocalJob(paced, tmp_path / "job", min_workers=2) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(5, 120)

        def ctl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, str(ROOT / "scripts" / "ctl.py"), "--control", job.control_endpoint,
                                   *args], capture_output=True, text=True, timeout=120, env=job.env())

        target = tmp_path / "snapshots" / "now"
        out = ctl("save", str(target))
        assert out.returncode == 0, out.stderr
        saved = [e for e in job.events() if e["kind"] == "saved"]
        assert len(saved) == 1 and saved[0]["path"] == str(target.resolve()), saved
        assert f"after step {saved[0]['step']}" in out.stdout
        assert sorted(p.name for p in target.iterdir()) == ["model.pt", "optimizer.pt"]
        state = torch.load(target / "optimizer.pt")
        assert {int(s["step"]) for s in state["state"].values()} == {saved[0]["step"]}, "the state after that step"
        assert set(torch.load(target / "model.pt")) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias",
                                                        "net.4.weight", "net.4.bias"}

        before = max(job.steps())
        blocked = tmp_path / "blocked"
        blocked.write_text("a file, not a directory")
        refused = ctl("save", str(blocked / "inside"))
        assert refused.returncode == 1 and str(blocked) in refused.stderr, refused.stderr
        job.wait_step(before + 10, 60)  # training goes on
        job.ctl("stop")
        assert job.wait_coordinator(60) == 0


EVAL_JOB = '''\
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 2))

    def forward(self, x):
        if x.device.type != "meta":
            time.sleep(0.002 * x.shape[0])  # pacing only: time for a worker to join, never the maths
        return self.body(x)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :2] * 2) + 0.05 * torch.randn(n, 2, generator=g))


def job():
    return Job(model=Net, optimizer=lambda p: torch.optim.SGD(p, lr=0.02), dataset=data(512, 1),
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=31,
               num_steps=15, seed=4, eval_dataset=data(101, 2), eval_every=5)
'''


def _single_process_evals(path: Path) -> dict[int, float]:
    """The held-out mean loss after each evaluated step, in one process (in eval mode, no gradients)."""
    job = load_job(path.read_text(), "job", filename=str(path))
    torch.manual_seed(job.seed)
    model, out = job.model(), {}
    opt = job.optimizer(model.parameters())
    for k in range(job.num_steps):
        x, y = job.dataset[sample_ids(job.seed, k, len(job.dataset), job.global_batch)]
        opt.zero_grad()
        (job.loss(model(x), y) / job.global_batch).backward()
        opt.step()
        if (k + 1) % job.eval_every == 0 or k + 1 == job.num_steps:
            model.eval()
            with torch.no_grad():
                xe, ye = job.eval_dataset[torch.arange(len(job.eval_dataset))]
                out[k + 1] = job.loss(model(xe), ye).item() / len(job.eval_dataset)
            model.train()
    return out


@pytest.mark.timeout(300)
def test_evaluation_is_the_whole_held_out_set_with_1_2_and_3_members(tmp_path: Path) -> None:
    path = tmp_path / "eval_job.py"
    path.write_text(EVAL_JOB)
    reference = _single_process_evals(path)
    assert sorted(reference) == [5, 10, 15]
    for members in (1, 2, 3):
        with LocalJob(f"{path}:job", tmp_path / f"m{members}", min_workers=members) as job:
            job.start()
            for i in range(members):
                job.add_worker(f"w{i + 1}")
            assert job.wait_coordinator(180) == 0, job.tail("coordinator.out")
            events = job.events()
        shares = next(e for e in events if e["kind"] == "plan")["layout"]["shares"]
        assert len(shares) == members and (members == 1 or len(set(shares)) > 1 or 101 % members), shares
        evals = {e["step"]: e for e in events if e["kind"] == "eval"}
        assert sorted(evals) == [5, 10, 15], f"{members} members: {sorted(evals)}"
        for step, e in evals.items():
            assert e["samples"] == 101, "never from part of the set"
            gap = abs(e["loss"] - reference[step]) / reference[step]
            assert gap <= 1e-5, f"{members} members, step {step}: {e['loss']} against {reference[step]}"


@pytest.mark.timeout(300)
def test_an_evaluation_a_failure_interrupts_is_skipped_and_said_so_never_partial(tmp_path: Path) -> None:
    # The held-out pass is slow here (0.04 s a sample in eval mode), so a SIGKILL lands inside it.
    path = tmp_path / "slow_eval_job.py"
    path.write_text(EVAL_JOB.replace("        return self.body(x)",
                                     "        if not self.training and x.device.type != 'meta':\n"
                                     "            time.sleep(0.04 * x.shape[0])\n"
                                     "        return self.body(x)"))
    with LocalJob(f"{path}:job", tmp_path / "job", min_workers=3) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(5, 180)  # the evaluation after step 5 starts now and takes about 1.3 s
        job.kill("w2")
        assert job.wait_coordinator(180) == 0, job.tail("coordinator.out")
        events = job.events()
    skipped = [e for e in events if e["kind"] == "eval_skipped"]
    evals = {e["step"]: e for e in events if e["kind"] == "eval"}
    assert [e["step"] for e in skipped] == [5] and "failure" in skipped[0]["reason"], skipped
    assert 5 not in evals, "never reported from part of the set"
    assert sorted(evals) == [10, 15] and all(e["samples"] == 101 for e in evals.values())
    assert sorted(e["step"] for e in events if e["kind"] == "step") == list(range(1, 16)), "training went on"
