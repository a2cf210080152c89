"""Durability (issue #12), the parts built so far, with real coordinator and worker processes:

- one coordinator per state directory: a second one started on the state dir of a live coordinator
  refuses to start (exit 2, naming the holder), without a traceback; once the first is SIGKILLed
  (the OS drops its lock), a new one starts there.
- durable checkpoints: every worker SIGKILLed at once; the newest checkpoint's file is truncated;
  three new workers (two were killed) detect it by its checksum, resume from the checkpoint before,
  and the loss curve is the undisturbed run's, every step. The checkpoint loads with plain DCP in a
  process that never imports adaptrain's worker.
- a sharded job (FSDP2 over three members) checkpointed, then the coordinator and every worker
  SIGKILLed; a new coordinator on the same state dir waits for the journaled members, gives them
  up, and two new workers resume from the checkpoint in the planner's layout (replicated): exact
  against the single-process recipe, and the event log is appended to, not restarted. Resumed
  sharded instead, each new worker reads only its own slices of the checkpoint (exact too).
- a coordinator SIGKILLed mid-run (replicated and sharded) and started again on its journal: the
  workers train on, register again by themselves, no step is missing, the next join is planned.
- a damaged journal is moved aside and said; the job resumes from the newest checkpoint.
- `ctl checkpoint` writes one at the next step boundary; a worker that cannot write the
  checkpoint dir says so at join, with the path, and is never given work; the coordinator's
  SIGTERM writes one before it stops the workers; another job is refused on that state dir.

(Preemption in a sharded layout and the drain deadline are tested in test_sharded.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from localjob import LocalJob
from test_recipe import JOB as GPT_JOB
from test_recipe import single_process
from test_sharded import _assert_exact

ROOT = Path(__file__).resolve().parents[2]
MLP_JOB = f"{ROOT / 'examples' / 'mlp.py'}:job"
PACED_JOB = f"{ROOT / 'examples' / 'paced.py'}:job"


def _start(state: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                             "--insecure", "--state-dir", str(state)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ready"):
            return line
    raise AssertionError(f"the coordinator ended without a ready line (exit {proc.wait()})")


@pytest.mark.timeout(300)
def test_a_second_coordinator_on_a_live_state_dir_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = _start(state)
    try:
        _ready(first)
        second = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                                 "--insecure", "--state-dir", str(state)], capture_output=True, text=True,
                                timeout=150, cwd=ROOT)
        assert second.returncode == 2, second.stderr
        assert f"{state} is in use by a live coordinator (pid {first.pid})" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and "ready" not in second.stdout
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        with _start(state) as third:
            try:
                assert _ready(third)
            finally:
                third.send_signal(signal.SIGTERM)
                third.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=30)


def _checkpoints(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["kind"] == "checkpoint"]


@pytest.mark.timeout(400)
def test_every_worker_killed_resumes_from_the_newest_intact_checkpoint(
        tmp_path: Path, undisturbed: dict[int, float]) -> None:
    with LocalJob(PACED_JOB, tmp_path, min_workers=2, coordinator_args=["--checkpoint-every", "20"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= 40, 180, "checkpoint of step 40")
        for name in ("w1", "w2"):
            job.workers[name].send_signal(signal.SIGKILL)
        job.wait_workers(30)
        job.wait_until(lambda events: sum(e["kind"] == "failed" for e in events) == 2 or None, 30, "both failed")
        written = _checkpoints(job)
        newest, before = Path(written[-1]["path"]), written[-2]
        assert (newest / "adaptrain.json").exists() and not list(tmp_path.glob("checkpoints/.step-*.partial"))
        damaged = sorted(newest.glob("*.distcp"))[0]
        damaged.write_bytes(damaged.read_bytes()[:damaged.stat().st_size // 2])  # a torn copy
        reached = max(job.steps())

        for name in ("w3", "w4", "w5"):  # another number of workers
            job.add_worker(name)
        corrupt = job.wait_event(lambda e: e["kind"] == "checkpoint_corrupt", 120, "the damage found")
        assert corrupt["path"] == str(newest) and damaged.name in corrupt["detail"], corrupt
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 120, "resumed")
        assert resumed["step"] == before["step"] and resumed["path"] == before["path"], resumed
        assert resumed["redone"] == reached - before["step"], resumed
        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        assert job.wait_workers(30) == {"w1": -9, "w2": -9, "w3": 0, "w4": 0, "w5": 0}
        worst = job.loss_gap(undisturbed)  # the latest loss of every step: the resumed run's from there on
        assert sorted(job.losses()) == sorted(undisturbed) and worst <= 1e-4, worst
        lost = [e for e in job.events() if e["kind"] == "state_lost"]
        assert lost[0]["resume_from"] == str(newest) and lost[-1]["resume_from"] == before["path"], lost
        final = Path(_checkpoints(job)[-1]["path"])
    _load_with_plain_torch(final, tmp_path / "plain.pt")


def _load_with_plain_torch(checkpoint: Path, out: Path) -> None:
    """Read a checkpoint in a fresh interpreter with torch alone: DCP's own converter, and dcp.load
    into the plain model, which then matches the converted tensors; adaptrain's worker is never imported."""
    script = textwrap.dedent(f"""
        import json, sys
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save({str(checkpoint)!r}, {str(out)!r})
        full = torch.load({str(out)!r}, weights_only=False)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                  torch.nn.Linear(64, 4))
        model = torch.nn.Module()
        model.net = net
        state = {{"model": model.state_dict(), "step": torch.tensor(0)}}
        dcp.load(state, checkpoint_id={str(checkpoint)!r}, no_dist=True)
        model.load_state_dict(state["model"])
        same = all(torch.equal(p, full["model"][n]) for n, p in model.state_dict().items())
        print(json.dumps({{"step": int(full["step"]), "loaded": int(state["step"]), "same": same,
                          "optim": sorted(full["optim"]["state"])[:1],
                          "worker": any(m == "worker" or m.startswith("worker.") for m in sys.modules)}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    step = json.loads((checkpoint / "adaptrain.json").read_text())["step"]
    assert result == {"step": step, "loaded": step, "same": True, "optim": ["net.0.bias"], "worker": False}, result


def _sharded_to_a_checkpoint(job: LocalJob) -> dict[str, Any]:
    """Start the coordinator and w1..w3 (sharded) and wait for a checkpoint of step 10 or later."""
    job.start()
    for name in ("w1", "w2", "w3"):
        job.add_worker(name, "--slowdown", "2")
    return job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= 10, 240, "checkpoint of step 10")


@pytest.mark.timeout(400)
def test_a_sharded_job_resumes_after_a_total_loss_in_another_layout(tmp_path: Path) -> None:
    reference = single_process()
    with LocalJob(GPT_JOB, tmp_path, min_workers=3,
                  coordinator_args=["--layout", "dp=1", "--checkpoint-every", "10"]) as job:
        _sharded_to_a_checkpoint(job)
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGKILL)  # everything at once: a whole zone reclaimed
        for name in ("w1", "w2", "w3"):
            job.workers[name].send_signal(signal.SIGKILL)
        job.wait_workers(30)
        job.wait_coordinator(30)
    old = LocalJob(GPT_JOB, tmp_path).events()
    written = [e for e in old if e["kind"] == "checkpoint"]
    assert written and all(e["path"].startswith(str(tmp_path / "checkpoints")) for e in written)
    before = len(old)

    with LocalJob(GPT_JOB, tmp_path, min_workers=2) as job:  # same state dir; the planner picks the layout
        job.start()  # its journal expects w1..w3 back; none comes within the grace: the state is lost
        job.add_worker("w4")
        job.add_worker("w5")
        recovered = job.wait_event(lambda e: e["kind"] == "recovered", 120, "the journaled members given up")
        assert recovered["missing"] == ["w1", "w2", "w3"] and recovered["members"] == [], recovered
        lost = job.wait_event(lambda e: e["kind"] == "state_lost" and e["ts"] > recovered["ts"], 60, "state_lost")
        assert lost["resume_from"] == written[-1]["path"], lost
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 240, "resumed")
        assert resumed["step"] == written[-1]["step"], resumed
        assert job.wait_coordinator(300) == 0, job.tail("coordinator.out")
        events = job.events()
        assert events[:before] == old and len(events) > before  # appended to
        assert len([e for e in events if e["kind"] == "joined"]) == 5, "one log for both coordinators"
        _assert_exact(events, reference)  # the latest of each step: the resumed run's after the checkpoint
        plans = [e for e in events[before:] if e["kind"] == "plan" and e.get("layout")]
        assert plans and plans[0]["layout"]["dp_shard"] == 1, "resumed in the planner's replicated layout"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout,workers", [("pp=2", 2), ("pp=2,fsdp=2", 4), ("tp=2", 2), ("tp=2,fsdp=2", 4)])
def test_a_pipeline_checkpoint_resumes_replicated_after_a_total_loss(tmp_path: Path, layout: str, workers: int) -> None:
    """A pipeline (and one whose stages are sharded), and a tensor-parallel job (and one whose tp
    parts are sharded), write their checkpoints as every layout does: each member its own part (its
    stage, its shards of it, its tp slices: DCP's chunks of the DTensors). Everything SIGKILLed after one; a
    new coordinator on the same state dir, with no pin, and two new workers resume from it as
    replicas, every step after it the single-process recipe's."""
    reference = single_process()
    names = [f"w{i + 1}" for i in range(workers)]
    with LocalJob(GPT_JOB, tmp_path, min_workers=workers,
                  coordinator_args=["--layout", layout, "--checkpoint-every", "10"]) as job:
        job.start()
        for name in names:
            job.add_worker(name, "--slowdown", "2")
        job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= 10, 240, "checkpoint of step 10")
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGKILL)
        for name in names:
            job.workers[name].send_signal(signal.SIGKILL)
        job.wait_workers(30)
        job.wait_coordinator(30)
    old = LocalJob(GPT_JOB, tmp_path).events()
    written = [e for e in old if e["kind"] == "checkpoint"]
    pinned = ("tp", 2) if layout.startswith("tp") else ("pp", 2)
    assert written and all(p["layout"][pinned[0]] == pinned[1] for p in old if p["kind"] == "plan" and p.get("layout"))
    with LocalJob(GPT_JOB, tmp_path, min_workers=2) as job:
        job.start()
        job.add_worker("n1")
        job.add_worker("n2")
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 240, "resumed")
        assert resumed["step"] == written[-1]["step"], resumed
        assert job.wait_coordinator(300) == 0, job.tail("coordinator.out")
        events = job.events()
    _assert_exact(events, reference)
    plans = [e for e in events[len(old):] if e["kind"] == "plan" and e.get("layout")]
    assert plans and plans[0]["layout"]["pp"] == plans[0]["layout"]["tp"] == 1, "resumed in the planner's layout"


@pytest.mark.timeout(400)
def test_a_sharded_resume_reads_only_each_members_slices(tmp_path: Path) -> None:
    """Every worker of a sharded job killed; three new ones resume sharded from the checkpoint,
    each reading only its own slices (together the checkpoint about once, none of them half of it:
    a model that no member could hold whole resumes too), the copies coming from their holders in
    the entry's reshard; exact against the single-process recipe."""
    import re

    reference = single_process()
    with LocalJob(GPT_JOB, tmp_path, min_workers=3,
                  coordinator_args=["--layout", "dp=1", "--checkpoint-every", "10"]) as job:
        written = _sharded_to_a_checkpoint(job)
        for name in ("w1", "w2", "w3"):
            job.workers[name].send_signal(signal.SIGKILL)
        job.wait_workers(30)
        for name in ("w4", "w5", "w6"):  # (--min-workers 3 before the first plan)
            job.add_worker(name)
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 240, "resumed")
        assert resumed["step"] >= written["step"], resumed
        assert job.wait_coordinator(300) == 0, job.tail("coordinator.out")
        _assert_exact(job.events(), reference)
        plan = next(e for e in job.events() if e["kind"] == "plan" and e["epoch"] == resumed["epoch"])
        assert plan["layout"]["dp_shard"] == 3, plan["layout"]
        reads = []
        for name in ("w4", "w5", "w6"):
            said = re.search(r"loaded checkpoint \S+ \(step \d+, its slices, ([\d.]+) of ([\d.]+) MB\)", job.tail(name, 400))
            assert said, job.tail(name)
            reads.append(float(said.group(1)))
            total = float(said.group(2))
        assert max(reads) < 0.5 * total and 0.9 * total < sum(reads) < 1.2 * total, (reads, total)


@pytest.mark.timeout(300)
def test_ctl_checkpoint_and_an_unwritable_checkpoint_dir(tmp_path: Path) -> None:
    with LocalJob(PACED_JOB, tmp_path / "state", min_workers=1) as job:
        job.start()
        job.add_worker("w1")
        job.wait_step(5, 120)
        written = job.ctl("checkpoint", "--wait", "60")
        assert written["kind"] == "checkpoint" and written["step"] >= 5, written
        assert (Path(written["path"]) / "adaptrain.json").exists()
        status = job.ctl("status")
        assert status["checkpoint"]["step"] == written["step"], status
        # A worker that cannot write there (a file where the directory should be: refused even to root).
        ckpt = tmp_path / "state" / "checkpoints"
        ckpt.rename(tmp_path / "moved")
        ckpt.write_text("not a directory")
        bad = job.add_worker("w2")
        assert bad.wait(120) == 2, job.tail("w2")
        assert f"cannot write the checkpoint dir {ckpt}" in job.tail("w2"), job.tail("w2")
        left = job.wait_event(lambda e: e["kind"] == "left" and e["worker"] == "w2", 30, "w2 left")
        assert f"cannot write the checkpoint dir {ckpt}" in left["reason"], left
        assert all("w2" not in e["layout"]["members"] for e in job.events()
                   if e["kind"] == "plan" and e.get("layout")), "never given work"
        ckpt.unlink()
        (tmp_path / "moved").rename(ckpt)
        # SIGTERM to the coordinator: a checkpoint at the next step boundary, then the workers stop.
        assert job.coordinator is not None
        seen = len(job.events())
        job.coordinator.send_signal(signal.SIGTERM)
        assert job.wait_coordinator(60) == 0, job.tail("coordinator.out")
        after = job.events()[seen:]
        asked = next(e for e in after if e["kind"] == "checkpoint_requested")
        assert asked["reason"] == "the coordinator got SIGTERM", asked
        last = next(e for e in after if e["kind"] == "checkpoint")
        assert last["step"] > written["step"] and (Path(last["path"]) / "adaptrain.json").exists(), last
    # The state dir is this job's: another job is refused there, naming both (not trained on its plan).
    other = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", MLP_JOB,
                            "--insecure", "--state-dir", str(tmp_path / "state")], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert other.returncode == 2 and "is the journal of job" in other.stderr and "Traceback" not in other.stderr, \
        other.stderr


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["fsdp=1", "dp=1"])
def test_a_coordinator_killed_mid_run_is_restarted_from_its_journal(
        tmp_path: Path, undisturbed: dict[int, float], layout: str) -> None:
    """SIGKILL of the coordinator at step 40 of a replicated (fsdp=1) or sharded (dp=1) job; a new
    one on the same state dir while the workers train on. They register again by themselves, the
    plan is put back without a re-plan, no step is missing from the log, the next join is planned
    as usual, and the loss curve is the undisturbed run's."""
    with LocalJob(PACED_JOB, tmp_path, min_workers=2, coordinator_args=["--layout", layout]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(40, 180)
        endpoint = job.workers_endpoint
        assert job.coordinator is not None
        job.coordinator.send_signal(signal.SIGKILL)
        job.wait_coordinator(30)
        gone_at = max(job.steps())
        time.sleep(1.0)  # the workers train on, reporting to nobody
        job.start()  # same state dir: the journal
        assert job.workers_endpoint == endpoint, "it listens where the workers reconnect"
        recovered = job.wait_event(lambda e: e["kind"] == "recovered", 60, "recovered")
        assert recovered["members"] == ["w1", "w2"] and recovered["missing"] == [], recovered
        assert recovered["step"] > gone_at, "training went on while the coordinator was away"
        print(f"coordinator restart: recovered {recovered['seconds']:.3f} s after it started; the workers "
              f"had gone on from step {gone_at} to {recovered['step']}")
        status = job.ctl("status")
        assert status["epoch"] == 1 and [w["role"] for w in status["workers"]] == ["member", "member"], status
        job.add_worker("w3")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and (e.get("layout") or {}).get("members")
                                and "w3" in e["layout"]["members"], 120, "w3 planned in")
        assert joined["epoch"] == 2 and joined["reason"] == "join", joined
        assert job.wait_coordinator(300) == 0, job.tail("coordinator.out")
        events = job.events()
        assert sum(e["kind"] == "restarted" for e in events) == 1 and events[0]["kind"] == "joined"
        assert [e["epoch"] for e in events if e["kind"] == "plan"] == [1, 2], "no re-plan for the restart"
        worst = job.loss_gap(undisturbed)
        assert sorted(job.losses()) == sorted(undisturbed) and worst <= 1e-4, worst  # no step missing


@pytest.mark.timeout(400)
def test_a_damaged_journal_is_moved_aside_and_the_job_resumes_from_its_checkpoint(
        tmp_path: Path, undisturbed: dict[int, float]) -> None:
    with LocalJob(PACED_JOB, tmp_path, min_workers=2, coordinator_args=["--checkpoint-every", "20"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        written = job.wait_event(lambda e: e["kind"] == "checkpoint" and e["step"] >= 40, 180, "checkpoint 40")
        assert job.coordinator is not None
        for proc in (job.coordinator, *job.workers.values()):
            proc.send_signal(signal.SIGKILL)
        job.wait_workers(30)
        job.wait_coordinator(30)
        journal = tmp_path / "journal.sqlite"
        for part in (Path(f"{journal}-wal"), Path(f"{journal}-shm")):
            part.unlink(missing_ok=True)
        journal.write_bytes(b"\xde\xad" * 2048)  # overwritten: not a database any more
        newest = max((e for e in job.events() if e["kind"] == "checkpoint"), key=lambda e: e["step"])
        job.start()
        damaged = job.wait_event(lambda e: e["kind"] == "journal_damaged", 30, "journal_damaged")
        assert damaged["path"] == str(journal) and Path(damaged["moved_to"]).exists(), damaged
        assert "checkpoint" in damaged["lost"], damaged
        job.add_worker("w3")
        job.add_worker("w4")
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", 120, "resumed")
        assert resumed["step"] == newest["step"] >= written["step"], resumed
        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        worst = job.loss_gap(undisturbed)
        assert sorted(job.losses()) == sorted(undisturbed) and worst <= 1e-4, worst
