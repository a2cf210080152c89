"""Models users bring, trained by the real coordinator and workers on loopback: a plain Hugging Face
`GPT2LMHeadModel` and `LlamaForCausalLM` built from a config (tests/system/jobs/hf_*.py, written as
the README's "Writing a job" says: no wrapper module, the loss reads `outputs.logits`), replicated
and sharded (FSDP2), and the Llama tensor parallel with its own plan (`config.base_model_tp_plan`:
the job gives none), through a SIGKILL of one of three workers; and a model graph capture cannot
take apart (tests/system/jobs/uncapturable.py), which trains on the coarse one-unit graph.

Each run: `ctl graph` shows the blocks the capture found, the killed member is planned out, every
step is committed once, and every step's loss equals a single-process run's within 1e-4 (the
tolerance of the other exact tests).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch
from liveness import problems
from localjob import LocalJob

from worker.job import Job, load_job, sample_ids

JOBS = Path(__file__).resolve().parent / "jobs"

pytestmark = pytest.mark.timeout(180)


def _load(name: str, function: str = "job") -> Job:
    path = JOBS / f"{name}.py"
    return load_job(path.read_text(), function, filename=str(path))


def single_process(name: str, function: str = "job", outputs: Callable[[Any], Any] = lambda out: out,
                   keep: dict[str, Any] | None = None) -> dict[int, float]:
    """The job's model in one process with plain torch (`outputs`: what the loss takes of the
    model's output): each step's loss (1-based, like the `step` events); `keep` gets the trained
    model and the job."""
    job = _load(name, function)
    torch.manual_seed(job.seed)
    model = job.model()
    model.train()
    optimizer = job.optimizer(model.parameters())
    out = {}
    for k in range(job.num_steps):
        x, y = job.dataset[sample_ids(job.seed, k, len(job.dataset), job.global_batch)]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(outputs(model(x)), y)
        (loss / job.global_batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        out[k + 1] = loss.item() / job.global_batch
    if keep is not None:
        keep.update(model=model, job=job)
    return out


def _wait_for_log(job: LocalJob, name: str, text: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in job.tail(name, 200) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in job.tail(name, 200), job.tail(name)


def _train_through_a_kill(tmp_path: Path, name: str, layout: str) -> tuple[LocalJob, dict[str, Any], list[dict[str, Any]]]:
    """Three workers; w2 pauses in the forward of step 5 and is SIGKILLed there; the job runs to its
    end. Returns the job (closed), `ctl graph` as read during the pause, and the event log."""
    with LocalJob(f"{JOBS / name}.py:job", tmp_path, min_workers=3, coordinator_args=["--layout", layout]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2", "--pause-at", "forward@5")
        job.add_worker("w3")
        _wait_for_log(job, "w2", "pausing at forward of step 5")
        graph = job.ctl("graph")
        job.kill("w2")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert "w2" not in failure["layout"]["members"], failure["layout"]  # (the planner may bench w3 too)
        exits = job.wait_workers(120)
        assert exits == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0, job.tail("coordinator.out")
        return job, graph, job.events()


def _assert_exact(events: list[dict[str, Any]], reference: dict[int, float]) -> None:
    """Every step committed once, its loss within 1e-4 (relative) of the single-process run's."""
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == sorted(reference), "each step committed once, none lost"
    gaps = {e["step"]: abs(e["loss"] - reference[e["step"]]) / abs(reference[e["step"]]) for e in steps}
    assert max(gaps.values()) <= 1e-4, gaps
    assert reference[len(reference)] < reference[1], "the job learns"
    assert not (broken := problems(events)), broken


@pytest.mark.parametrize(("name", "blocks", "layout"), [
    ("hf_gpt2", "transformer.h", "fsdp=1"),
    ("hf_gpt2", "transformer.h", "dp=1"),
    ("hf_llama", "model.layers", "fsdp=1"),
    ("hf_llama", "model.layers", "dp=1"),
    ("hf_llama", "model.layers", "tp=2"),
], ids=["gpt2-replicated", "gpt2-sharded", "llama-replicated", "llama-sharded", "llama-tensor-parallel"])
def test_a_hugging_face_model_trains_exactly_through_a_kill(tmp_path: Path, name: str, blocks: str,
                                                            layout: str) -> None:
    reference = single_process(name)
    job, graph, events = _train_through_a_kill(tmp_path, name, layout)
    names = [layer["name"] for layer in graph["layers"]]
    assert names == ["(root)", f"{blocks}.0", f"{blocks}.1", f"{blocks}.2"], names
    assert all(layer["forward_flops"] > 0 and layer["param_bytes"] > 0 for layer in graph["layers"]), graph
    for plan in (e for e in events if e["kind"] == "plan" and e.get("layout") and len(e["layout"]["members"]) > 1):
        sharded = plan["layout"]["dp_shard"] == len(plan["layout"]["members"])  # (one member: both at once)
        assert sharded == (layout == "dp=1") and (sharded or plan["layout"]["dp_shard"] == 1), plan["layout"]
        assert plan["layout"]["tp"] == (2 if layout == "tp=2" else 1), plan["layout"]  # (Llama's own tp plan)
    _assert_exact(events, reference)
    for worker in ("w1", "w3"):
        assert "graph capture failed" not in job.tail(worker, 10_000), job.tail(worker)


def test_a_model_capture_cannot_take_apart_trains_sharded_on_one_unit(tmp_path: Path) -> None:
    """uncapturable.py reads a value in its forward (no meta) and its blocks cannot be run again:
    every worker logs one warning, the graph is the whole model as one unit, and FSDP2 shards it whole
    through the kill, exactly."""
    reference = single_process("uncapturable")
    job, graph, events = _train_through_a_kill(tmp_path, "uncapturable", "dp=1")
    assert [layer["name"] for layer in graph["layers"]] == ["Net"], graph
    assert graph["layers"][0]["forward_flops"] > 0 and graph["param_bytes"] == 4 * (3 * (16 * 16 + 16) + 16 * 4 + 4)
    _assert_exact(events, reference)
    for worker in ("w1", "w2", "w3"):
        log = job.tail(worker, 10_000)
        warnings = [line for line in log.splitlines() if "graph capture failed" in line]
        assert len(warnings) == 1, log
        assert "the model is planned as one unit" in warnings[0] and "sharded layouts gather it whole" in warnings[0]
        assert "Traceback" not in log


@pytest.mark.timeout(300)
def test_a_hugging_face_gpt2_given_as_a_sequence_is_pipelined_exactly_through_a_kill(tmp_path: Path) -> None:
    """hf_gpt2.py's `sequence_job`: the plain GPT2LMHeadModel given as a sequence (`Job.sequence`:
    embeddings, three blocks, norm and head) is cut by `--layout pp=2`; its first stage's holder is
    SIGKILLed in the forward of step 5 and the worker on standby takes that stage from its copy.
    Every step is committed once with the single-process loss of the model itself (its forward,
    its `.logits`); the final model.pt loads strictly into the job's GPT2LMHeadModel under its own
    names and gives the trained model's loss, and optimizer.pt loads into an AdamW over its
    parameters. The plain job (no sequence) is never pipelined, and `ctl plan --explain` says why."""
    trained: dict[str, Any] = {}
    reference = single_process("hf_gpt2", "sequence_job", outputs=lambda out: out.logits, keep=trained)
    ref = f"{JOBS / 'hf_gpt2'}.py:sequence_job"
    with LocalJob(ref, tmp_path, min_workers=2, coordinator_args=["--layout", "pp=2"]) as job:
        job.start()
        job.add_worker("w1", "--pause-at", "forward@5")
        job.add_worker("w2")
        job.wait_step(2, 120)
        job.add_worker("w3")
        job.wait_event(lambda e: e["kind"] == "standby" and e.get("worker") == "w3", 120, "w3 on standby")
        graph = job.ctl("graph")
        assert [layer["name"] for layer in graph["layers"]] == ["0", "1", "2", "3", "4"], graph
        _wait_for_log(job, "w1", "pausing at forward of step 5")
        job.kill("w1")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert sorted(failure["layout"]["members"]) == ["w2", "w3"] and failure["layout"]["pp"] == 2
        exits = job.wait_workers(180)
        assert exits == {"w1": -signal.SIGKILL, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0, job.tail("coordinator.out")
        events = job.events()
    plans = [e["layout"] for e in events if e["kind"] == "plan" and e.get("layout")]
    assert plans and all(p["pp"] == 2 and [u for s in p["stages"] for u in s] == ["0", "1", "2", "3", "4"]
                         for p in plans), plans
    assert not [e for e in events if e["kind"] == "state_lost"]
    _assert_exact(events, reference)
    # What the job wrote speaks the model's own names and parameter order.
    model, plain = trained["job"].model(), trained["model"]
    model.load_state_dict(torch.load(tmp_path / "final" / "model.pt"), strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(torch.load(tmp_path / "final" / "optimizer.pt"))
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape and float(optimizer.state[p]["step"]) == 12
               for p in model.parameters())
    x, y = trained["job"].dataset[torch.arange(24)]
    with torch.no_grad():
        got, expected = (trained["job"].loss(m(x).logits, y).item() for m in (model, plain))
    assert abs(got - expected) / expected <= 1e-4, (got, expected)


@pytest.mark.timeout(120)
def test_a_model_that_is_not_a_sequence_is_never_pipelined_and_the_plan_says_why(tmp_path: Path) -> None:
    """The plain GPT2LMHeadModel (its blocks found by graph capture, a root unit around them) cannot
    be cut: `--layout pp=2` is refused with the reason, and it names `Job.sequence`."""
    with LocalJob(f"{JOBS / 'hf_gpt2'}.py:job", tmp_path, min_workers=2, coordinator_args=["--layout", "pp=2"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        deadline = time.monotonic() + 90
        explained: dict[str, Any] = {}
        while time.monotonic() < deadline and "Job.sequence" not in str(explained):
            explained = job.ctl("plan", "--explain")
            time.sleep(0.5)
        assert "cannot be cut into pipeline stages; a job gives its model as one with Job.sequence" in str(explained), \
            explained
        assert not job.steps(), "nothing trains on a layout that cannot run"
