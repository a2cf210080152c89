"""A client pointed at the wrong place is told so, in one line, with no traceback (real processes):

- a worker given the coordinator's control endpoint (with keys: its key is refused there; without: the
  control socket answers) and ctl given the workers endpoint are told which address of the ready line
  to use, not only that their key was refused;
- a --join / --control host that does not resolve fails at once (exit 2, "cannot resolve HOST");
- a port where nothing listens, or where something listens that never answers, runs into the
  timeout, and the message says which it was and what to check;
- `ctl events --follow` whose coordinator goes away ends with 0 and a note, also when the next
  connection is closed mid-handshake (as by a coordinator shutting down), not with "refused".
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq
from localjob import LocalJob

from transport import ControlReply, ControlRequest, decode, encode

ROOT = Path(__file__).resolve().parents[2]
MLP_JOB = f"{ROOT / 'examples' / 'mlp.py'}:job"


def _env_without_keys() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("ADAPTRAIN_KEYS", "ADAPTRAIN_CONTROL")}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "worker", "--name", "lost", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _ctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.ctl", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _finish(proc: subprocess.Popen[str], timeout_s: float = 150) -> tuple[int | None, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err


@pytest.mark.parametrize("insecure", [False, True], ids=["keys", "insecure"])
def test_the_wrong_endpoint_of_the_ready_line_is_named(tmp_path: Path, insecure: bool) -> None:
    with LocalJob(MLP_JOB, tmp_path, insecure=insecure) as job:
        job.start()
        worker = _worker("--join", job.control_endpoint, "--connect-timeout", "120", env=job.env())
        try:
            ctl = _ctl("--control", job.workers_endpoint, "status", env=job.env())
            code, err = _finish(worker)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
        assert code == 2, f"worker exited {code}: {err}"
        assert f"{job.control_endpoint} is the coordinator's control endpoint, not its workers endpoint" in err, err
        assert "use the `workers=` address of its ready line" in err and "Traceback" not in err, err
        assert ctl.returncode != 0 and "Traceback" not in ctl.stderr, ctl.stderr
        assert "`control=`" in ctl.stderr, ctl.stderr
        if not insecure:  # (without keys the workers socket answers ctl with an error that says so)
            assert f"{job.workers_endpoint} is the coordinator's workers endpoint, not its control endpoint" \
                in ctl.stderr, ctl.stderr


def test_an_unresolvable_host_fails_at_once() -> None:
    env = _env_without_keys()
    worker = _worker("--join", "tcp://no-such-host.invalid:5555", env=env)
    ctl = _ctl("--control", "tcp://no-such-host.invalid:5556", "status", env=env)
    code, err = _finish(worker, 60)  # the connect timeout is 60 s: a worker that waited for it fails here
    assert code == 2 and "cannot resolve no-such-host.invalid" in err and "Traceback" not in err, err
    assert ctl.returncode == 2 and "cannot resolve no-such-host.invalid" in ctl.stderr, ctl.stderr


def test_a_timeout_says_whether_anything_answered_and_what_to_check() -> None:
    env = _env_without_keys()
    closed = f"tcp://127.0.0.1:{_closed_port()}"
    worker = _worker("--join", closed, "--connect-timeout", "2", env=env)
    with socket.socket() as silent:  # accepts TCP connections, never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        quiet = _ctl("--control", mute, "--timeout", "1", "status", env=env)
    nobody = _ctl("--control", closed, "--timeout", "1", "status", env=env)
    code, err = _finish(worker)
    assert code == 2 and f"no answer from {closed} in 2 s: no connection could be made" in err, err
    assert "is the coordinator running" in err and "`workers=` port" in err and "firewall" in err, err
    assert nobody.returncode == 2 and f"no answer from {closed} in 1 s: no connection could be made" in nobody.stderr, nobody.stderr
    assert "`control=` port" in nobody.stderr, nobody.stderr
    assert quiet.returncode == 2 and f"no answer from {mute} in 1 s, though a connection was made" in quiet.stderr, quiet.stderr


def test_follow_ends_cleanly_when_the_coordinator_closes_mid_handshake() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # plays the coordinator for one answer, then goes away
    port = router.bind_to_random_port("tcp://127.0.0.1")
    follow = subprocess.Popen([sys.executable, "-m", "coordinator.ctl", "--control", f"tcp://127.0.0.1:{port}",
                               "--timeout", "10", "--json", "events", "--follow"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env_without_keys(), start_new_session=True)
    closer = socket.socket()
    try:
        assert router.poll(60_000), "ctl sent no request"
        identity, frame = router.recv_multipart()
        assert isinstance(decode(frame), ControlRequest)
        router.send_multipart([identity, encode(ControlReply(ok=True, data={"events": [{"kind": "joined", "ts": 1.0}],
                                                                             "next": 1}, error=""))])
        time.sleep(0.2)  # (the reply is on its way; ctl asks again every 0.2 s)
        router.close(linger=0)
        closer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _ in range(100):  # zmq closes its listener in its own thread, soon after close()
            try:
                closer.bind(("127.0.0.1", port))  # accepts the next connections and closes them at once
                break
            except OSError:
                time.sleep(0.05)
        closer.listen()

        def close_all() -> None:
            while True:
                try:
                    conn, _ = closer.accept()
                except OSError:
                    return
                conn.close()

        threading.Thread(target=close_all, daemon=True).start()
        out, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.communicate()
        closer.close()
        router.close(linger=0)
        ctx.term()
    assert follow.returncode == 0 and "stopped answering" in err, err
    assert '"joined"' in out
