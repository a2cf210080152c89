"""The control plane on a shared network: real coordinator and worker processes on loopback.

- raw bytes (no zmq greeting) on the workers socket used to crash the coordinator (`Frame.get(SRCFD)`
  raised EINVAL); now they are refused and counted, with keys and with --insecure, and training goes on;
- a silent connection is dropped by the coordinator after its handshake interval;
- without the right keys nobody gets in: a worker with no key or a wrong key, ctl with no key, a key
  of one worker used under another name, a second worker under a live name; each is refused with a
  sentence saying why and counted; with keys everything works (the rest of the suite runs with keys);
- `--insecure` works without keys and says so at start; a worker given keys is told to drop them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from localjob import LocalJob

from transport.security import HANDSHAKE_S, generate_keys

ROOT = Path(__file__).resolve().parents[2]
LONG_JOB = f"{ROOT / 'examples' / 'paced.py'}:long_job"


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _refused_with(job: LocalJob, name: str, words: str, timeout_s: float = 60) -> None:
    """Worker `name` must exit 2 within `timeout_s`, its log saying `words`."""
    try:
        code = job.workers[name].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.workers[name].kill()
        code = None
    log = job.tail(name)
    assert code == 2 and words in log, f"{name} exited {code}; its log:\n{log}"


def _refused(job: LocalJob) -> dict[str, int]:
    counts: dict[str, int] = job.ctl("status")["refused"]
    return counts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("insecure", [True, False], ids=["insecure", "keys"])
def test_raw_bytes_and_silent_connections_are_refused_and_training_goes_on(tmp_path: Path, insecure: bool) -> None:
    with LocalJob(LONG_JOB, tmp_path, min_workers=2, insecure=insecure) as job:
        job.start()
        job.add_worker("w1")
        job.add_worker("w2")
        job.wait_step(5, 120)
        for endpoint in (job.workers_endpoint, job.control_endpoint):
            for i in range(10):  # the reproduction: 512 random bytes, no zmq greeting
                with socket.create_connection(("127.0.0.1", _port(endpoint))) as s:
                    s.sendall(bytes([i + 1]) + os.urandom(511))  # a first byte that is not 0xFF: "ZMTP 1.0"
                    s.settimeout(10)
                    try:
                        while s.recv(4096):
                            pass
                    except OSError:
                        pass
        silent = socket.create_connection(("127.0.0.1", _port(job.workers_endpoint)))
        silent.settimeout(HANDSHAKE_S + 10)  # the coordinator gives up at HANDSHAKE_S: well inside this
        closed_by_coordinator = False
        try:  # the coordinator sends its greeting at once, then waits for ours, then gives up
            while silent.recv(64):
                pass
            closed_by_coordinator = True
        except ConnectionResetError:
            closed_by_coordinator = True
        except TimeoutError:
            pass
        finally:
            silent.close()
        assert closed_by_coordinator, "a silent connection must be closed by the coordinator, not held"

        step = max(job.steps())
        job.wait_step(step + 10, 60)  # still training
        deadline = time.monotonic() + 20
        while _refused(job).get("handshake", 0) < 21 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _refused(job) == {"handshake": 21}
        job.ctl("stop")
        assert job.wait_coordinator(60) == 0
        log = (tmp_path / "coordinator.log").read_text()
        assert ("--insecure" in log) == insecure, "an insecure coordinator says so at start"
        assert "refused (handshake)" in log


@pytest.mark.timeout(240)
def test_without_the_right_keys_nobody_gets_in(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys, workers=["alice"])
    with LocalJob(LONG_JOB, tmp_path / "job", keys=keys) as job:
        job.start()
        job.add_worker("w1")
        job.wait_step(3, 120)
        no_keys = {k: v for k, v in job.env().items() if k != "ADAPTRAIN_KEYS"}

        job.add_worker("stranger", env=no_keys)
        other = tmp_path / "other-keys"  # another cluster's keys: the wrong server key too
        generate_keys(other)
        job.add_worker("lost", "--keys", str(other))
        forged = tmp_path / "forged"  # the right server key, a worker key the coordinator never made
        forged.mkdir()
        shutil.copy(keys / "server.key", forged / "server.key")
        shutil.copy(other / "worker.key_secret", forged / "worker.key_secret")
        job.add_worker("forger", "--keys", str(forged))
        _refused_with(job, "stranger", "requires CURVE keys")
        _refused_with(job, "lost", "is server.key the coordinator's?")
        _refused_with(job, "forger", "refused this worker's key")

        # Alice's own key, used under another name: the key is bound to "alice".
        stolen = tmp_path / "stolen"
        stolen.mkdir()
        shutil.copy(keys / "server.key", stolen / "server.key")
        shutil.copy(keys / "workers" / "alice.key_secret", stolen / "worker.key_secret")
        job.add_worker("mallory", "--keys", str(stolen))
        _refused_with(job, "mallory", "alice")
        twin = subprocess.Popen([sys.executable, "-m", "worker", "--join", job.workers_endpoint, "--name", "w1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job.env())
        try:  # a second w1 while the first one lives
            twin_out = twin.communicate(timeout=60)[0].decode(errors="replace")
        finally:
            twin.kill()
            twin.wait()
        assert twin.returncode == 2 and "already named 'w1'" in twin_out, twin_out

        ctl = [sys.executable, str(ROOT / "scripts" / "ctl.py"), "--control", job.control_endpoint, "status"]
        no_key_ctl = subprocess.run(ctl, capture_output=True, text=True, env=no_keys, timeout=60)
        assert no_key_ctl.returncode == 1 and "requires CURVE keys" in no_key_ctl.stderr
        worker_key_ctl = subprocess.run([*ctl[:2], "--keys", str(stolen), *ctl[2:]], capture_output=True,
                                        text=True, env=no_keys, timeout=60)
        assert worker_key_ctl.returncode == 2 and "ctl.key_secret" in worker_key_ctl.stderr

        alice = job.add_worker("alice")
        job.wait_event(lambda e: e["kind"] == "plan" and "alice" in (e["layout"] or {}).get("members", []),
                       120, "alice planned in")
        refused = _refused(job)
        assert refused.get("handshake", 0) >= 2, refused  # the stranger and ctl without keys
        assert refused.get("auth", 0) >= 1, refused  # the forger's unknown key
        assert refused.get("name", 0) >= 2, refused  # mallory with alice's key, the second w1
        assert job.ctl("status")["secure"] is True
        joined = {e["worker"] for e in job.events() if e["kind"] == "joined"}
        assert joined == {"w1", "alice"}, "nobody refused ever joined"
        job.ctl("stop")
        assert job.wait_coordinator(60) == 0


@pytest.mark.timeout(180)
def test_insecure_runs_without_keys_and_a_keyed_worker_is_told_to_drop_them(tmp_path: Path) -> None:
    with LocalJob(LONG_JOB, tmp_path / "job", insecure=True) as job:
        job.start()
        job.add_worker("w1")
        job.wait_step(3, 120)
        assert job.ctl("status")["secure"] is False
        keys = tmp_path / "keys"
        generate_keys(keys)
        job.add_worker("keyed", "--keys", str(keys))
        _refused_with(job, "keyed", "without keys")
        job.ctl("stop")
        assert job.wait_coordinator(60) == 0
    out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--job", LONG_JOB],
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "ADAPTRAIN_KEYS"})
    assert out.returncode == 2 and "--insecure" in out.stderr and "keygen" in out.stderr, out.stderr
