"""Fuzz every coordinator socket while a real job trains (scripts/fuzzer.py makes the inputs).

Over 10,000 inputs against the workers socket (which also serves the rendezvous store) and over
10,000 against the control socket, from an insider holding each socket's key and from outsiders
(raw TCP, no key, unknown key, the other role's key), while three workers train the paced job.
The coordinator must stay up, every step must commit with the undisturbed run's loss, the replicas
must end identical, and its refusal counters must account for every input, reason by reason.
Seeded: ADAPTRAIN_FUZZ_SEED=N reproduces a run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import NUM_STEPS, PACED_JOB
from fuzzer import FuzzReport, fuzz_socket, seed_from_env
from localjob import LocalJob

MESSAGES = 10_000
CONNECTIONS = 120


@pytest.mark.timeout(420)
def test_fuzz_every_socket_while_training(tmp_path: Path, undisturbed: dict[int, float]) -> None:
    seed = seed_from_env(20261203)
    # The even planner keeps one epoch throughout (no re-plan on timing noise), so no worker opens a
    # new store connection mid-fuzz; the counters are then exact at once (coordinator.guard).
    with LocalJob(PACED_JOB, tmp_path, min_workers=3, coordinator_args=["--planner", "even"]) as job:
        job.start()
        for name in ("w1", "w2", "w3"):
            job.add_worker(name, "--slowdown", "6", "--digest-every", str(NUM_STEPS))  # (full speed after the fuzzing)
        job.wait_step(10, 120)
        assert job.ctl("status")["refused_total"] == 0

        reports: dict[str, FuzzReport] = {}
        errors: list[BaseException] = []

        def run(which: str, endpoint: str, control: bool, offset: int) -> None:
            try:
                reports[which] = fuzz_socket(endpoint, job.keys_dir, seed=seed + offset, messages=MESSAGES,
                                             connections=CONNECTIONS, control=control, live=["w1", "w2", "w3"])
            except BaseException as e:  # noqa: BLE001 (re-raised in the test thread)
                errors.append(e)

        threads = [threading.Thread(target=run, args=("workers", job.workers_endpoint, False, 0)),
                   threading.Thread(target=run, args=("control", job.control_endpoint, True, 1))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        assert not errors, errors
        during = max(job.steps())
        assert during < NUM_STEPS - 20, "the fuzzing must overlap training (slow the workers more)"

        expected: Counter[str] = Counter()
        for report in reports.values():
            expected.update(report.expected)
        for which, report in reports.items():
            assert report.total >= MESSAGES + CONNECTIONS - 1, (which, report.sent)
            assert report.dropped == 1, f"{which}: the over-limit frame's connection is dropped by zmq"
            print(f"{which}: {report.total} inputs in {report.seconds:.1f} s, kinds {dict(report.sent)}")

        deadline = time.monotonic() + 20
        while True:
            refused = job.ctl("status")["refused"]
            if refused == dict(expected) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert refused == dict(expected), f"seed {seed}: counted {refused}, expected {dict(expected)}"
        for name in ("w1", "w2", "w3"):  # (the stretch only kept training going under the fuzzing)
            assert job.ctl("slowdown", name, "1")["factor"] == 1.0

        assert job.wait_coordinator(240) == 0, job.tail("coordinator.out")
        assert job.wait_workers(30) == {"w1": 0, "w2": 0, "w3": 0}
        events = job.events()
        assert sorted(job.steps()) == list(range(1, NUM_STEPS + 1)), "no step lost or doubled"
        assert job.loss_gap(undisturbed) <= 1e-4
        assert {e["worker"] for e in events if e["kind"] == "joined"} == {"w1", "w2", "w3"}
        assert not [e for e in events if e["kind"] in ("failed", "left") and e.get("reason") != "finished"]
        assert sum(e["kind"] == "plan" for e in events) == 1, "nothing refused changed the plan"
        finals = {name: job.digests(name)[NUM_STEPS] for name in ("w1", "w2", "w3")}
        assert len(set(finals.values())) == 1, finals
