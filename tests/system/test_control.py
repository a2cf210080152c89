"""The control plane from the outside: scripts/ctl.py against a real coordinator and real workers,
and a coordinator fed garbage on its workers endpoint.

Every process is started through scripts/localjob.LocalJob, whose `close()` (the `with` block)
kills and reaps them all.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from localjob import LocalJob  # type: ignore[import-not-found, unused-ignore]  # noqa: E402

from transport import ERR_DECODE, ERR_PROTOCOL, PROTOCOL_VERSION, Error, decode  # noqa: E402

CTL = SCRIPTS / "ctl.py"
MLP_JOB = f"{SCRIPTS.parent / 'examples' / 'mlp.py'}:job"

# A job that trains until stopped: a small MLP whose loss sleeps 10 ms per call (pacing only: the
# mathematics are untouched), so that ctl has a job in mid-training to look at.
SLOW_JOB = '''\
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job


def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def paced_sum_mse(outputs, targets):
    time.sleep(0.01)
    return nn.functional.mse_loss(outputs, targets, reduction="sum")


def job():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 2, generator=g))
    return Job(model=make_model, optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), dataset=data,
               loss=paced_sum_mse, global_batch=GLOBAL_BATCH, num_steps=100000, seed=0)
'''
GLOBAL_BATCH = 32


def ctl(endpoint: str, *args: str, timeout_s: float = 60.0,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run scripts/ctl.py as a file, from another directory than the repository's (`env`: a job's
    environment, which carries its keys)."""
    return subprocess.run([sys.executable, str(CTL), "--control", endpoint, *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=Path(SCRIPTS.anchor), env=env)


def ctl_json(endpoint: str, *args: str, env: dict[str, str] | None = None) -> Any:
    out = ctl(endpoint, *args, "--json", env=env)
    assert out.returncode == 0, f"ctl {' '.join(args)}: rc {out.returncode}: {out.stderr}"
    return json.loads(out.stdout)


def _slow_job(tmp_path: Path) -> str:
    path = tmp_path / "slow_job.py"
    path.write_text(SLOW_JOB.replace("GLOBAL_BATCH", str(GLOBAL_BATCH)))
    return f"{path}:job"


def _dead_endpoint() -> str:
    with socket.socket() as s:  # a port that nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


@pytest.mark.timeout(300)
def test_ctl_status_plan_events_drain_and_stop(tmp_path: Path) -> None:
    with LocalJob(_slow_job(tmp_path), tmp_path / "state", min_workers=2) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(5, timeout_s=180)
        endpoint = job.control_endpoint
        env = job.env()

        status = ctl_json(endpoint, "status", env=env)
        assert status["epoch"] >= 1 and status["global_batch"] == GLOBAL_BATCH
        assert status["num_steps"] == 100000 and status["step"] >= 5
        workers = {w["name"]: w for w in status["workers"]}
        assert set(workers) == {"w1", "w2"}
        assert all(w["role"] == "member" for w in workers.values())
        assert sorted(w["rank"] for w in workers.values()) == [0, 1]

        plan = ctl_json(endpoint, "plan", env=env)
        assert plan["epoch"] >= 1
        assert sorted(plan["members"]) == ["w1", "w2"]
        assert sum(plan["shares"]) == GLOBAL_BATCH == plan["global_batch"]

        human = ctl(endpoint, "status", env=env)
        assert human.returncode == 0, human.stderr
        assert "w1" in human.stdout and "w2" in human.stdout and "RANK" in human.stdout

        human_plan = ctl(endpoint, "plan", env=env)
        assert human_plan.returncode == 0 and "w1" in human_plan.stdout and "w2" in human_plan.stdout

        events = ctl_json(endpoint, "events", env=env)
        assert events["next"] == len(events["events"])
        joined = {e["worker"] for e in events["events"] if e["kind"] == "joined"}
        assert joined == {"w1", "w2"}
        assert any(e["kind"] == "plan" for e in events["events"])
        later = ctl_json(endpoint, "events", "--since", str(events["next"]), env=env)
        assert later["next"] >= events["next"]
        assert all(e["kind"] == "step" for e in later["events"]), "only steps happen meanwhile"

        human_events = ctl(endpoint, "events", "--since", "0", env=env)
        assert human_events.returncode == 0 and "joined" in human_events.stdout

        drain = ctl(endpoint, "drain", "nosuchworker", env=env)
        assert drain.returncode == 1
        assert "nosuchworker" in drain.stderr and drain.stdout == ""

        # Output goes to files: a pipe read line by line and then by communicate() loses what the
        # line reader had buffered.
        out_path, err_path = tmp_path / "follow.out", tmp_path / "follow.err"
        with out_path.open("w") as out_file, err_path.open("w") as err_file:
            follow = subprocess.Popen([sys.executable, str(CTL), "--control", endpoint, "events", "--follow",
                                       "--json", "--timeout", "2"], stdout=out_file, stderr=err_file, env=env)
        try:
            while not out_path.read_text().count("\n"):  # it answered once: a stop ends it cleanly
                assert follow.poll() is None, err_path.read_text()
                time.sleep(0.05)
            stop = ctl(endpoint, "stop", env=env)
            assert stop.returncode == 0, stop.stderr
            assert "w1" in stop.stdout and "w2" in stop.stdout
            _assert_coordinator_exits_0(job, 60)
            assert job.wait_workers(60) == {"w1": 0, "w2": 0}
            follow.wait(timeout=60)
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()
        err = err_path.read_text()
        assert follow.returncode == 0, err
        lines = [json.loads(line) for line in out_path.read_text().splitlines()]
        assert {e["worker"] for e in lines if e["kind"] == "joined"} == {"w1", "w2"}
        assert sum(e["kind"] == "joined" for e in lines) == 2, "each event printed once"
        steps = [e["step"] for e in lines if e["kind"] == "step"]
        assert steps == sorted(set(steps)) and len(steps) > 5, "steps in order, none twice"
        assert "stopped answering" in err


@pytest.mark.timeout(60)
def test_ctl_against_a_dead_port_exits_2() -> None:
    endpoint = _dead_endpoint()
    out = ctl(endpoint, "status", "--timeout", "1", timeout_s=30)
    assert out.returncode == 2
    assert "no answer" in out.stderr and endpoint in out.stderr
    follow = ctl(endpoint, "events", "--follow", "--timeout", "1", timeout_s=30)
    assert follow.returncode == 2, "follow that never got an answer is an error"


def _assert_coordinator_exits_0(job: LocalJob, timeout_s: float) -> None:
    rc = job.wait_coordinator(timeout_s)
    assert rc == 0, job.tail("coordinator")


def _ask(sock: zmq.Socket[bytes], frame: bytes) -> Error:
    sock.send(frame)
    assert sock.poll(20_000), "the coordinator did not answer"
    reply = decode(sock.recv())
    assert isinstance(reply, Error), reply
    return reply


@pytest.mark.timeout(240)
def test_coordinator_answers_bad_frames_with_errors_and_keeps_serving(tmp_path: Path) -> None:
    with LocalJob(MLP_JOB, tmp_path / "state", insecure=True) as job:
        job.start()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(job.workers_endpoint)
            garbage = _ask(sock, b"\xc1\x00garbage\xff")
            assert garbage.code == ERR_DECODE
            join_v99 = msgpack.packb({"v": 99, "kind": "Join", "name": "intruder", "host": "h", "pid": 1,
                                      "device": "cpu", "flops": 1.0, "memory_bytes": 1, "threads": 1},
                                     use_bin_type=True)
            protocol = _ask(sock, join_v99)
            assert protocol.code == ERR_PROTOCOL and "99" in protocol.message
            missing = _ask(sock, msgpack.packb({"v": PROTOCOL_VERSION, "kind": "Join", "name": "intruder"}, use_bin_type=True))
            assert missing.code == ERR_DECODE
        finally:
            sock.close(linger=0)
            ctx.term()

        status = ctl_json(job.control_endpoint, "status")
        assert status["workers"] == [], "nothing that failed to decode became a worker"
        assert ctl(job.control_endpoint, "status").returncode == 0
        wrong = ctl(job.workers_endpoint, "status")  # the workers endpoint refuses control requests
        assert wrong.returncode == 1 and "control=" in wrong.stderr

        job.add_worker("w1")
        _assert_coordinator_exits_0(job, 180)
        assert job.wait_workers(30) == {"w1": 0}
        steps = job.steps()
        assert max(steps) == 200 and sorted(steps) == list(range(1, 201))
        assert not any(e["kind"] == "joined" and e["worker"] == "intruder" for e in job.events())
