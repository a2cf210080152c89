"""A sharded job end to end, with the real coordinator and workers on loopback: `--layout dp=1`
shards the GPT example's state over every member (FSDP2 on each epoch's group).

- Two members train sharded; a third joins (the reshard brings it only its slices); one is drained
  (it hands its slices over as a sender, then leaves). Every step's loss, learning rate and gradient
  norm equal the single-process recipe's within 1e-4, no step is lost or doubled, every plan says
  it is sharded, and the trained model is written gathered, loadable into the plain model.
- SIGKILL of a member paused in the forward, the backward or before the update: its slices come
  back from the copy its keeper holds (a ring of copies, refreshed every step from the gradient
  slices), and the loss curve is the single-process one;
- SIGSTOP of an HSDP member: its replica peer, held in the replicas' all-reduce, is released at once;
- SIGKILL of a slice's holder and of its copy's keeper together: the job stops with a `state_lost`
  event naming what was lost; it never trains on made-up state.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from liveness import problems
from localjob import LocalJob
from test_recipe import JOB, NUM_STEPS, _check_the_trained_model, _gap, single_process


def _assert_exact(events: list[dict[str, Any]], reference: dict[int, dict[str, float]]) -> None:
    """Every step once (or redone after a resume, as its `resumed` event says), its loss, learning
    rate and gradient norm within 1e-4 of the single-process run; and the run's liveness: every
    failure recovered within the bound, every join and straggler handled (scripts/liveness.py)."""
    assert not (broken := problems(events)), broken
    steps = {e["step"]: e for e in events if e["kind"] == "step"}
    assert sorted(steps) == sorted(reference), "no step lost"
    run = {s: {"loss": e["loss"], "lr": e["lr"], "grad_norm": e["grad_norm"]} for s, e in steps.items()}
    gaps = _gap(run, reference)
    assert max(gaps.values()) <= 1e-4, gaps


def stopped_past_the_lease(job: LocalJob, name: str) -> dict[str, Any]:
    """SIGSTOP `name` until the lease finds it failed and the others train a step without it, then
    SIGCONT it (it is fenced and comes back as a newcomer); the failure's plan."""
    job.signal(name, signal.SIGSTOP)
    failed = job.wait_event(lambda e: e["kind"] == "failed", 30, "failed")
    assert (failed["worker"], failed["detected_by"]) == (name, "lease")
    plan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 10, "failure plan")
    job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 30, f"a step without {name}")
    job.signal(name, signal.SIGCONT)
    return plan


def _wait_for_log(job: LocalJob, name: str, text: str, timeout_s: float = 60) -> None:
    """Wait until worker `name`'s log says `text` (a --pause-at knob reached)."""
    deadline = time.monotonic() + timeout_s
    while text not in job.tail(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in job.tail(name), job.tail(name)


def _plans(job: LocalJob) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["kind"] == "plan" and e.get("layout")]


@pytest.mark.timeout(400)
def test_a_sharded_job_is_exact_through_a_join_and_a_drain(tmp_path: Path) -> None:
    trained: dict[str, Any] = {}
    reference = single_process(trained)
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        # --slowdown stretches compute (sleeps), the mathematics unchanged: margin for w3 to load
        # and join, and for the save and the drain, before step 40 on a loaded machine.
        job.add_worker("w1", "--slowdown", "4")
        job.add_worker("w2", "--slowdown", "4")
        job.wait_step(4, 180)
        job.add_worker("w3")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and len(e["layout"]["members"]) == 3, 120,
                                "w3 planned in")
        job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == joined["epoch"], 60, "a step with w3")
        snapshot = tmp_path / "snapshot"
        saved = job.ctl("save", str(snapshot), "--wait", "120")  # gathered from the 3 shards, written by rank 0
        assert saved["kind"] == "saved" and saved["path"] == str(snapshot) and (snapshot / "model.pt").exists(), saved
        assert job.ctl("drain", "w1") == {"draining": "w1"}
        drained = job.wait_event(lambda e: e["kind"] == "plan" and "w1" not in e["layout"]["members"]
                                 and e["epoch"] > joined["epoch"], 60, "w1 planned out")
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        _assert_exact(events, reference)
        for plan in _plans(job):
            layout = plan["layout"]
            assert (layout["dp_replicate"], layout["dp_shard"]) == (1, len(layout["members"])), layout
        left = [e for e in events if e["kind"] == "left" and e["worker"] == "w1"]
        assert [e["reason"] for e in left] == ["drained"], left  # planned out, then gone, with no failure
        reshards = {e["epoch"]: e for e in events if e["kind"] == "reshard"}
        assert reshards[joined["epoch"]]["bytes"] > 0, "the newcomer received its slices"
        assert 0 < reshards[joined["epoch"]]["largest_sender_bytes"] <= reshards[joined["epoch"]]["bytes"]
        # w1 and w2 foresaw the join's transfers and packed what they send while the group formed
        entries = [line for n in ("w1", "w2") for line in job.tail(n, 100_000).splitlines()
                   if f"epoch {joined['epoch']} (" in line and "formed in" in line]
        assert any("packed while the group formed" in line for line in entries), entries
        # w3 held nothing: it made the memory for its slices ready while the group formed (`Pool`),
        # and cut its receives there from the plan it foresaw (`delta.previous`, the graph's state keys)
        assert "into memory made ready while the group formed, its receives foreseen" in job.tail("w3", 10_000), \
            job.tail("w3")
        # w1 and w2 started the job: in its first epoch they seeded the state and made no pool
        for n in ("w1", "w2"):
            first = [line for line in job.tail(n, 100_000).splitlines() if "epoch 1 (" in line and "formed in" in line]
            assert first and "made ready" not in first[0], job.tail(n, 100)
        last = max((e for e in events if e["kind"] == "step"), key=lambda e: e["step"])
        assert last["epoch"] >= drained["epoch"]
        printed = (tmp_path / "coordinator.out").read_text() if (tmp_path / "coordinator.out").exists() else ""
        _check_the_trained_model(tmp_path, [e for e in events if e["kind"] == "finished"], printed, trained)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_a_shard_holder_killed_mid_step_loses_nothing(tmp_path: Path, phase: str) -> None:
    """SIGKILL of a member paused (--pause-at) in the forward, the backward or before the update of
    step 12: the survivors rebuild its slices from the copy its keeper holds and go on from the last
    committed step; every step's loss, learning rate and gradient norm equal the single-process run."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2", "--pause-at", f"{phase}@12")
        job.add_worker("w3")
        job.wait_event(lambda e: e["kind"] == "step" and e["step"] >= 10, 180, "step 10")
        _wait_for_log(job, "w2", f"pausing at {phase} of step 12")
        job.kill("w2")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert failure["layout"]["members"] == ["w1", "w3"] and failure["layout"]["dp_shard"] == 2
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_source_killed_mid_reshard_is_replanned_from_the_remaining_holders(tmp_path: Path) -> None:
    """A join to a sharded job, and SIGKILL of a member paused (--pause-at reshard) after the
    holdings are known and before its slices went to the newcomer: the others are released from
    the transfers, the next plan moves the dead member's slices from the copies its keeper holds,
    the newcomer gets its slices from the survivors; no state lost, every step exact."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1", "--slowdown", "3")
        job.add_worker("w2", "--slowdown", "3", "--pause-at", "reshard@6")
        job.add_worker("w3", "--slowdown", "3")
        job.wait_step(5, 180)
        job.add_worker("w4")
        joined = job.wait_event(lambda e: e["kind"] == "plan" and "w4" in e["layout"]["members"], 120, "w4 planned in")
        # Ranked where it moves least (plan.reshard.least_moving_order): third of four, not appended.
        assert joined["layout"]["members"].index("w4") == 2, joined["layout"]
        _wait_for_log(job, "w2", "pausing at the reshard")
        assert not [e for e in job.events() if e["kind"] == "reshard" and e["epoch"] == joined["epoch"]], \
            "the join's reshard cannot be done while a source is paused in it"
        job.kill("w2")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert set(failure["layout"]["members"]) == {"w1", "w3", "w4"}, failure["layout"]
        resumed = job.wait_event(lambda e: e["kind"] == "reshard" and e["epoch"] == failure["epoch"], 60, "reshard")
        assert resumed["bytes"] > 0
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0, "w4": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_sigterm_to_a_shard_holder_hands_its_slices_over_and_exits_0(tmp_path: Path) -> None:
    """A spot notice (SIGTERM) to a member of a sharded layout: it is planned out, sends its slices
    to the survivors in the new epoch's group, and exits 0; no step lost, every step exact."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--slowdown", "2")
        job.wait_step(6, 180)
        job.signal("w2", signal.SIGTERM)
        out = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "preempted", 60, "w2 planned out")
        assert out["layout"]["members"] == ["w1", "w3"]
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] in ("state_lost", "failed", "drain_deadline")]
        assert [e["reason"] for e in events if e["kind"] == "left" and e["worker"] == "w2"] == ["preempted"]
        assert next(e for e in events if e["kind"] == "reshard" and e["epoch"] == out["epoch"])["bytes"] > 0
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_drain_past_its_deadline_falls_back_to_the_copies(tmp_path: Path) -> None:
    """`ctl drain w2` while w2 hangs in its hand-over (--pause-at reshard): at `--drain-deadline`
    the coordinator lets it go as failed (a drain_deadline event) and the others rebuild its slices
    from the copies; every step exact, no state lost."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1", "--drain-deadline", "3"]) as job:
        job.start()
        job.add_worker("w1", "--slowdown", "2")
        job.add_worker("w2", "--slowdown", "2", "--pause-at", "reshard@7")
        job.add_worker("w3", "--slowdown", "2")
        job.wait_step(7, 180)
        assert job.ctl("drain", "w2") == {"draining": "w2"}
        late = job.wait_event(lambda e: e["kind"] == "drain_deadline", 60, "the drain deadline")
        assert late["worker"] == "w2" and late["seconds"] >= 3
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 30, "failure plan")
        assert failure["layout"]["members"] == ["w1", "w3"]
        exits = job.wait_workers(300)
        assert exits["w1"] == 0 and exits["w3"] == 0, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_stopped_shard_holder_is_planned_out_and_rejoins(tmp_path: Path) -> None:
    """SIGSTOP of a member for longer than the lease: the others, held in FSDP2's gathers, are
    released when the coordinator says so (the gathers and reduce-scatters wait abortably), rebuild
    its slices from the copies and go on; after SIGCONT it is fenced, joins again as a newcomer and
    receives its slices. The loss curve is the single-process one, no step lost or doubled."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, lease_s=1.0, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(10, 180)
        stopped_past_the_lease(job, "w2")
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        events = job.events()
        _assert_exact(events, reference)
        assert "fenced" in job.tail("w2", 200)


@pytest.mark.timeout(600)
def test_a_model_no_worker_can_replicate_trains_sharded_in_micro_batches(tmp_path: Path) -> None:
    """Every worker's --memory-limit is below what a replica needs (parameters, gradients, AdamW
    state, one sample's activations). Without a pinned layout the planner shards the state, with
    micro-batches of what fits beside a shard: over 4 members as HSDP 2 x 2 (its halves fit, and the
    cost model predicts it faster than 4 shards with copies), over 3 fully sharded. It trains
    exactly through a kill of an HSDP member (4 -> 3) and a join (back to HSDP over 4)."""
    from plan.cost import sharded_static_bytes, static_bytes
    from worker.graph import capture_graph
    from worker.job import load_job

    path, name = JOB.rsplit(":", 1)
    graph = capture_graph(load_job(Path(path).read_text(), name, filename=path))
    f, act = graph.optimizer_state_factor, graph.activation_bytes
    limit = sharded_static_bytes(graph, 3, optimizer_state_factor=f) + 1.5 * act
    assert limit < static_bytes(graph.param_bytes, f) + act, "no replica fits in the limit"
    memory = ("--memory-limit", f"{limit / 2**30:.12f}")
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=4) as job:
        job.start()
        for worker in ("w1", "w2", "w3", "w4"):  # --slowdown: margin for w5 to join before the end
            job.add_worker(worker, *memory, "--slowdown", "2")
        first = job.wait_event(lambda e: e["kind"] == "plan" and e["layout"] is not None, 180, "a plan")
        assert (first["layout"]["dp_replicate"], first["layout"]["dp_shard"]) == (2, 2), first
        assert "HSDP: 2 replicas of 2 shards: no replica fits" in first["detail"], first
        assert first["micro_batch"] and max(first["micro_batch"]) < max(first["layout"]["shares"]), first
        job.wait_step(8, 240)
        job.kill("w4")
        failure = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 60, "failure plan")
        assert (failure["layout"]["dp_replicate"], failure["layout"]["dp_shard"]) == (1, 3), failure
        job.add_worker("w5", *memory)
        joined = job.wait_event(lambda e: e["kind"] == "plan" and "w5" in (e["layout"] or {}).get("members", []),
                                180, "w5 planned in")
        assert (joined["layout"]["dp_replicate"], joined["layout"]["dp_shard"]) == (2, 2), joined
        exits = job.wait_workers(400)
        assert exits == {"w1": 0, "w2": 0, "w3": 0, "w4": -signal.SIGKILL, "w5": 0}, job.tails(exits)
        events = job.events()
        _assert_exact(events, reference)
        assert not [e for e in events if e["kind"] == "state_lost"]


@pytest.mark.timeout(400)
def test_a_replica_whose_share_does_not_fit_runs_it_in_micro_batches(tmp_path: Path) -> None:
    """Replicated (`--layout fsdp=1`), every worker's --memory-limit holds the whole state and 3
    samples' activations: the planner still splits the batch by speed and each member runs its
    share as micro-batches of 3 (gradients accumulated, the buckets sent in the last pass); every
    step equals the single-process run."""
    from plan.cost import static_bytes
    from worker.graph import capture_graph
    from worker.job import load_job

    path, name = JOB.rsplit(":", 1)
    graph = capture_graph(load_job(Path(path).read_text(), name, filename=path))
    limit = static_bytes(graph.param_bytes, graph.optimizer_state_factor) + 3.5 * graph.activation_bytes
    memory = ("--memory-limit", f"{limit / 2**30:.12f}")
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=2, coordinator_args=["--layout", "fsdp=1"]) as job:
        job.start()
        job.add_worker("w1", *memory)
        job.add_worker("w2", *memory)
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        events = job.events()
        plans = [e for e in events if e["kind"] == "plan" and e.get("layout")]
        assert plans and all(p["layout"]["dp_shard"] == 1 for p in plans)
        for p in plans:
            assert p["micro_batch"] == [3, 3] and min(p["layout"]["shares"]) > 3, p
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_step_some_members_applied_is_rolled_forward_by_the_others(tmp_path: Path) -> None:
    """w3 drops step 12 after its all-reduce (--pause-at abandon@12: as if the result never came),
    while w1 and w2 apply it; then w2 is SIGKILLed. Entering the next epoch w3 is a step behind: it
    rolls step 12 forward on its own slices and on its copy of w2's with the gradients it kept, and
    everyone continues from step 12. Every step's loss, learning rate and norm equal the
    single-process run's."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.add_worker("w3", "--pause-at", "abandon@12")
        deadline = time.monotonic() + 240
        while "abandoning step 12" not in job.tail("w3") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "abandoning step 12" in job.tail("w3")
        job.kill("w2")
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": -signal.SIGKILL, "w3": 0}, job.tails(exits)
        assert "rolled step 12 forward" in (tmp_path / "w3.log").read_text()
        events = job.events()
        _assert_exact(events, reference)
        assert not [e for e in events if e["kind"] == "state_lost"]


@pytest.mark.timeout(400)
def test_hsdp_2x2_is_exact(tmp_path: Path) -> None:
    """`--layout dp=2,fsdp=2`: two replicas of a 2-way shard group (FSDP2 on each epoch's 2-D mesh);
    every step equals the single-process recipe's."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=4, coordinator_args=["--layout", "dp=2,fsdp=2"]) as job:
        job.start()
        for name in ("w1", "w2", "w3", "w4"):
            job.add_worker(name)
        exits = job.wait_workers(400)
        assert exits == {"w1": 0, "w2": 0, "w3": 0, "w4": 0}, job.tails(exits)
        events = job.events()
        layouts = [e["layout"] for e in events if e["kind"] == "plan" and e.get("layout")]
        assert layouts and all((lay["dp_replicate"], lay["dp_shard"]) == (2, 2) for lay in layouts), layouts
        _assert_exact(events, reference)


@pytest.mark.timeout(400)
def test_a_stopped_hsdp_member_releases_its_replica_from_the_all_reduce(tmp_path: Path) -> None:
    """HSDP 2 x 2 (`--layout fsdp=2`: the replicas planned): SIGSTOP of w4 for longer than the lease
    holds its shard-group peer in FSDP2's gathers and its replica peer in the replicas' all-reduce
    (FSDP2's all-reduce hook). Both wait abortably: they train again within seconds of the failure,
    not after the 60 s group timeout, w4's shard comes from its replica, and after SIGCONT w4 is
    fenced and joins again. Every step equals the single-process recipe's."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=4, lease_s=1.0, coordinator_args=["--layout", "fsdp=2"]) as job:
        job.start()
        for name in ("w1", "w2", "w3", "w4"):  # (w1 the slowest: w4's two peers train on without it)
            job.add_worker(name, *(["--slowdown", "1.5"] if name == "w1" else []))
        job.wait_step(8, 240)
        layout = _plans(job)[-1]["layout"]
        assert (layout["dp_replicate"], layout["dp_shard"]) == (2, 2), layout
        job.signal("w4", signal.SIGSTOP)
        failed = job.wait_event(lambda e: e["kind"] == "failed", 30, "failed")
        assert failed["worker"] == "w4"
        plan = job.wait_event(lambda e: e["kind"] == "plan" and e["reason"] == "failure", 10, "failure plan")
        job.wait_event(lambda e: e["kind"] == "step" and e["epoch"] == plan["epoch"], 40, "a step without w4")
        job.signal("w4", signal.SIGCONT)
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0, "w4": 0}, job.tails(exits)
        # The survivors were released from the stopped peer's collectives (no group timeout sat out),
        # within the liveness bound, and w4 came back: fenced, planned in again.
        assert job.liveness() == [], job.liveness()
        events = job.events()
        assert not [e for e in events if e["kind"] == "state_lost"]
        _assert_exact(events, reference)
        assert "fenced" in job.tail("w4", 200)


BF16_JOB = """
import dataclasses, importlib.util
spec = importlib.util.spec_from_file_location("gpt_example", {path!r})
gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt)

def job():
    return dataclasses.replace(gpt.job_short(), compute_dtype="bfloat16")
"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["dp=1", "fsdp=1"], ids=["sharded", "replicated"])
def test_bf16_compute_keeps_float32_master_state(tmp_path: Path, layout: str) -> None:
    """`Job.compute_dtype="bfloat16"`: sharded (FSDP2's MixedPrecisionPolicy, float32 reduction) and
    replicated (autocast) both train, with float32 parameters and optimizer state: the loss follows
    the float32 single-process curve within bf16's precision, and the model written at the end is
    float32."""
    job_file = tmp_path / "bf16_job.py"
    job_file.write_text(BF16_JOB.format(path=JOB.rsplit(":", 1)[0]))
    reference = single_process()
    with LocalJob(f"{job_file}:job", tmp_path / "run", min_workers=2, coordinator_args=["--layout", layout]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        exits = job.wait_workers(400)
        assert exits == {"w1": 0, "w2": 0}, job.tails(exits)
        steps = {e["step"]: e for e in job.events() if e["kind"] == "step"}
    assert sorted(steps) == list(range(1, NUM_STEPS + 1))
    worst = max(abs(steps[k]["loss"] - reference[k]["loss"]) / reference[k]["loss"] for k in reference)
    assert 0 < worst <= 0.05, f"bf16 compute: {worst:.2e} from the float32 curve (0 would mean no bf16 at all)"
    import torch
    state = torch.load(tmp_path / "run" / "final" / "model.pt", weights_only=True)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.timeout(300)
def test_a_slice_and_its_copy_both_lost_stop_the_job_naming_them(tmp_path: Path) -> None:
    """Three members in a ring of copies (w2 keeps w1's, w3 keeps w2's, w1 keeps w3's): SIGKILL of w1
    and w2 together loses w1's slices with their only copy. The job stops with a `state_lost`
    event naming them; nothing trains on made-up state."""
    with LocalJob(JOB, tmp_path, min_workers=3, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name)
        job.wait_step(5, 180)
        for name in ("w1", "w2"):
            job.workers[name].send_signal(signal.SIGKILL)
        lost = job.wait_event(lambda e: e["kind"] == "state_lost", 60, "state_lost")
        assert "no member holds" in lost["detail"] and "weight" in lost["detail"], lost
        assert lost["worker"] == "w3"
        exits = job.wait_workers(60)
        assert exits["w3"] == 0, job.tail("w3")
        assert job.wait_coordinator(30) == 0, job.tail("coordinator.out")  # it stops the job, it does not crash
        assert max(job.steps()) < NUM_STEPS, "nothing trained on after the loss"


@pytest.mark.timeout(300)
def test_a_sharded_members_speed_is_its_own_compute_not_the_slowest_members(tmp_path: Path) -> None:
    """In a sharded step every member waits for the slowest inside FSDP2's gathers, so its raw step
    time is the slowest member's whatever its own share. The workers time those collectives apart:
    the planner sees w2 (`--slowdown 4`) about 4x slower than w1 and gives w1 the larger share.
    (Counted with the waits, a small share read as a slow device and a share of 0 once measured as
    an infinitely fast one: the chaos suite saw plans of one member and of members with no samples.)"""
    paced = f"{Path(__file__).resolve().parents[2] / 'examples' / 'paced.py'}:job"
    with LocalJob(paced, tmp_path, min_workers=2, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2", "--slowdown", "4")
        job.wait_step(60, 240)
        workers = {w["name"]: w for w in job.ctl("status")["workers"]}
        speeds = {n: float(w["speed"]) for n, w in workers.items()}
        plan = max((e for e in job.events() if e["kind"] == "plan"), key=lambda e: e["epoch"])
        job.ctl("stop")
        assert speeds["w1"] > 2 * speeds["w2"], speeds  # (counted with the waits the two read alike)
        shares = dict(zip(plan["layout"]["members"], plan["layout"]["shares"]))
        assert shares.get("w1", 0) > 2 * shares.get("w2", 0) > 0, (shares, speeds)


@pytest.mark.timeout(400)
def test_a_member_stopped_during_a_save_does_not_hold_the_others(tmp_path: Path) -> None:
    """`ctl save` of a sharded job gathers the model through torch's own state-dict collectives (no
    hook of ours around them). w2 pauses before its part of the gather (`--pause-at save@5`) and
    is SIGSTOPped there: w1 and w3, waiting in the gather, are released by the epoch's abortable
    groups once the lease finds w2, and train again within the liveness bound (not after the 60 s
    group timeout); the save is answered once, as failed with the reason, and asked again it is
    written. Every step equals the single-process recipe's."""
    reference = single_process()
    with LocalJob(JOB, tmp_path, min_workers=3, lease_s=1.0, coordinator_args=["--layout", "dp=1"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, *(["--pause-at", "save@5"] if name == "w2" else []))
        job.wait_step(5, 180)
        first, answers = tmp_path / "first", []
        asking = threading.Thread(target=lambda: answers.append(_ctl_error(job, "save", str(first), "--wait", "25")))
        asking.start()
        _wait_for_log(job, "w2", "pausing at the save after step")
        stopped_past_the_lease(job, "w2")
        failed = job.wait_event(lambda e: e["kind"] == "save_failed", 30, "the save answered")
        assert failed["path"] == str(first) and "interrupted" in failed["error"], failed
        asking.join()
        assert answers and "interrupted: a member failed while the model was gathered; ask again" in answers[0], answers
        second = tmp_path / "second"
        saved = job.ctl("save", str(second), "--wait", "120")
        assert saved["kind"] == "saved" and saved["path"] == str(second), saved
        exits = job.wait_workers(300)
        assert exits == {"w1": 0, "w2": 0, "w3": 0}, job.tails(exits)
        assert job.wait_coordinator(30) == 0
        assert job.liveness() == [], job.liveness()
        events = job.events()
        assert [e["path"] for e in events if e["kind"] == "save_failed"] == [str(first)], "answered once"
        assert not [e for e in events if e["kind"] == "saved" and e["path"] == str(first)]
        assert sorted(p.name for p in second.iterdir()) == ["model.pt", "optimizer.pt"]
        _assert_exact(events, reference)


def _ctl_error(job: LocalJob, *args: str) -> str:
    """What a ctl command that fails says (its error), or "" when it succeeds."""
    try:
        job.ctl(*args)
    except RuntimeError as e:
        return str(e)
    return ""
