"""Models users bring, trained by the real coordinator and workers on loopback: a plain Hugging Face
`GPT2LMHeadModel` and `LlamaForCausalLM` built from a config (tests/system/jobs/hf_*.py, written as
the README's "Writing a job" says: no wrapper module, the loss reads `outputs.logits`), replicated
and sharded (FSDP2), through a SIGKILL of one of three workers; and a model graph capture cannot
take apart (tests/system/jobs/uncapturable.py), which trains on the coarse one-unit graph.

Each run: `ctl graph` shows the blocks the capture found, the killed member is planned out, every
step is committed once, and every step's loss equals a single-process run's within 1e-4 (the
tolerance of the other exact tests).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from liveness import problems
from localjob import LocalJob

from worker.job import Job, load_job, sample_ids

JOBS = Path(__file__).resolve().parent / "jobs"

pytestmark = pytest.mark.timeout(180)


def _load(name: str) -> Job:
    path = JOBS / f"{name}.py"
    return load_job(path.read_text(), "job", filename=str(path))


def single_process(name: str) -> dict[int, float]:
    """The job in one process with plain torch: each step's loss (1-based, like the `step` events)."""
    job = _load(name)
    torch.manual_seed(job.seed)
    model = job.model()
    model.train()
    optimizer = job.optimizer(model.parameters())
    out = {}
    for k in range(job.num_steps):
        x, y = job.dataset[sample_ids(job.seed, k, len(job.dataset), job.global_batch)]
        optimizer.zero_grad(set_to_none=True)
        loss = job.loss(model(x), y)
        (loss / job.global_batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        out[k + 1] = loss.item() / job.global_batch
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
], ids=["gpt2-replicated", "gpt2-sharded", "llama-replicated", "llama-sharded"])
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
