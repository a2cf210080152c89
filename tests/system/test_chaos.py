"""Chaos: a seeded schedule of faults over the first 200 steps of the paced job, in a replicated and
in a sharded layout, with real processes on loopback: SIGKILL of a member (a replacement is
started), SIGSTOP of a member past its lease (it is planned out, then resumes, is fenced and joins
again), `ctl drain` (a replacement is started), a join, and one SIGKILL of the coordinator (started
again on its state dir: the workers train on and register again). Checkpoints are on, for a fault
that loses more than the copies cover.

Asserted, as DESIGN.md's invariants say: every step of the run is logged with the undisturbed run's
loss within 1e-4 relative (the latest loss of a step redone after a resume), the job finishes, and
every worker that trained the last step ends with the same parameters (digests of the last step), and
the newest checkpoint, written through all of it, reads with plain torch.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from conftest import NUM_STEPS
from localjob import LocalJob
from test_durability import _load_with_plain_torch

ROOT = Path(__file__).resolve().parents[2]
PACED_JOB = f"{ROOT / 'examples' / 'paced.py'}:job"
FAULTS = 20  # plus the coordinator's
KINDS = ("kill", "stop", "drain", "join")
MAX_WORKERS = 4  # live worker processes at most (two cores): a join beyond it is a kill instead
MIN_WORKERS = 3  # a kill or a drain is followed by a replacement below this many
LEASE_S = 2.0  # (six busy processes on two cores: a 1 s lease would read load as failures)
SLOWDOWN = "8"  # every worker's compute stretched (sleeps; the mathematics unchanged): room for 21 faults in 200 steps
# (set back to 1 once the last fault is handled)


def schedule(seed: int) -> list[tuple[int, str]]:
    """(step, fault) pairs between steps 10 and 190: FAULTS of KINDS and one coordinator kill midway."""
    rng = random.Random(seed)
    steps = [10 + round(i * 180 / FAULTS) for i in range(FAULTS)]
    faults = [(s, rng.choice(KINDS)) for s in steps]
    faults.insert(FAULTS // 2, (steps[FAULTS // 2] - 4, "coordinator"))
    return faults


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["fsdp=1", "dp=1"])
def test_chaos_keeps_the_loss_curve_and_identical_replicas(tmp_path: Path, undisturbed: dict[int, float],
                                                           layout: str) -> None:
    rng = random.Random(7)
    plan = schedule(12)
    assert len(plan) == FAULTS + 1 and sum(k == "coordinator" for _, k in plan) == 1
    names = iter(f"w{i}" for i in range(1, 100))
    worker_args = ("--digest-every", str(NUM_STEPS), "--slowdown", SLOWDOWN)
    with LocalJob(PACED_JOB, tmp_path, min_workers=3, lease_s=LEASE_S, heartbeat_s=0.25,
                  coordinator_args=["--layout", layout, "--checkpoint-every", "25"]) as job:
        job.start()
        for _ in range(3):
            job.add_worker(next(names), *worker_args)
        done: list[str] = []
        took: list[tuple[str, str, int]] = []  # (fault, victim, events logged before it): checked at the end
        for step, kind in plan:
            job.wait_step(step, 240)
            at = max(job.steps())
            assert at < 200, f"the faults fell behind the training: step {at} at fault {len(done) + 1}; {done}"
            members = job.ctl("status")["workers"]
            running = [w["name"] for w in members if w["role"] == "member"]
            alive = [n for n, p in job.workers.items() if p.poll() is None]
            if kind == "join" and len(alive) >= MAX_WORKERS:
                kind = "kill"  # keep two cores' worth of processes
            if kind in ("kill", "stop", "drain") and len(running) < 2:
                kind = "join"  # keep someone training
            victim = rng.choice(running) if running else ""
            took.append((kind, victim, len(job.events())))
            if kind == "kill":
                job.workers[victim].send_signal(signal.SIGKILL)
                job.workers[victim].wait(10)
            elif kind == "stop":
                job.workers[victim].send_signal(signal.SIGSTOP)
                time.sleep(LEASE_S * 1.5)  # past its lease: failed, planned out
                job.workers[victim].send_signal(signal.SIGCONT)  # fenced: it joins again
            elif kind == "drain":
                answer = job.ctl("drain", victim)
                assert answer == {"draining": victim}, answer
            elif kind == "join":
                job.add_worker(next(names), *worker_args)
            else:
                assert job.coordinator is not None
                job.coordinator.send_signal(signal.SIGKILL)
                job.wait_coordinator(30)
                job.start()
            staying = [n for n, p in job.workers.items() if p.poll() is None and not (kind == "drain" and n == victim)]
            for _ in range(MIN_WORKERS - len(staying)):
                job.add_worker(next(names), *worker_args)
            done.append(f"{at}:{kind}{'(' + victim + ')' if kind in ('kill', 'stop', 'drain') else ''}")
        # The faults are over: the stretch only made room for them, so the rest runs at full speed
        # (`ctl slowdown NAME 1`, live; the mathematics does not change with it).
        job.wait_step(plan[-1][0] + 10, 240)
        for w in job.ctl("status")["workers"]:
            if w["role"] in ("member", "standby"):
                assert job.ctl("slowdown", w["name"], "1")["factor"] == 1.0
        assert job.wait_coordinator(600) == 0, job.tail("coordinator.out", 40)
        exits = job.wait_workers(60)
        events = job.events()
        assert not (broken := job.liveness()), (broken, done)
        kinds = [e["kind"] for e in events]
        assert kinds.count("restarted") == 1 and kinds.count("failed") >= 1, done
        # Every fault took effect: the log says so for each one, after it was injected.
        for kind, victim, before in took:
            after = events[before:]
            said = {"kill": lambda e: e["kind"] == "failed" and e["worker"] == victim,
                    "stop": lambda e: e["kind"] == "failed" and e["worker"] == victim,
                    "drain": lambda e: e["kind"] == "left" and e["worker"] == victim and e["reason"] == "drained",
                    "join": lambda e: e["kind"] == "joined",
                    "coordinator": lambda e: e["kind"] == "restarted"}[kind]
            assert any(said(e) for e in after), f"{kind} of {victim or 'a new worker'} left no trace; {done}"
        bad = {n: c for n, c in exits.items() if c not in (0, -9)}  # (a killed worker: -9; every other: 0)
        assert not bad, (bad, job.tails(bad))
        worst = job.loss_gap(undisturbed)
        assert sorted(job.losses()) == list(range(1, NUM_STEPS + 1)), f"a step is missing; faults {done}"
        assert worst <= 1e-4, (worst, done)
        finals = {n: d[NUM_STEPS] for n in job.workers if NUM_STEPS in (d := job.digests(n))}
        assert len(finals) >= 2 and len(set(finals.values())) == 1, (finals, done)
        # Checkpoints were written through many epochs (their groups, the default group changing
        # under them): the newest is complete and reads with plain torch.
        newest = max((e for e in events if e["kind"] == "checkpoint"), key=lambda e: e["step"])
        _load_with_plain_torch(Path(newest["path"]), tmp_path / "plain.pt")
        print(f"chaos {layout}: {len(done)} faults {done}; {kinds.count('plan')} plans, "
              f"{kinds.count('resumed')} resumed from a checkpoint; worst loss gap {worst:.2e}")
