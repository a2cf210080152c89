"""The wheel a user installs works on its own: `make test` and CI install the checkout editable, which
hides a package the wheel leaves out (a wheel without worker/parallel makes every `worker` exit 1 with
"No module named 'worker.parallel'"), so this test builds the wheel, installs it non-editable in
a fresh venv (no site packages, no PYTHONPATH) and runs a two-worker job from a directory outside the
checkout with nothing but the installed console scripts and a job file written there.

It also checks that building leaves nothing in the checkout (no build/, no *.egg-info) and that the
wheel holds every package directory (one with an __init__.py) and every .py file of the checkout's
packages. Installing torch and the other dependencies into the venv takes about a minute, from pip's
index and the local wheel cache, pinned by constraints.txt as `make install` pins them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from localjob import kill_and_reap

ROOT = Path(__file__).resolve().parents[2]
NOT_SHIPPED = {"tests", "scripts", "examples"}  # directories of the checkout that are not in the wheel
READY = re.compile(r"^ready workers=(\S+) control=(\S+)")

JOB = '''\
import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker import Job
from worker.schedules import warmup_cosine


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def sum_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target, reduction="sum")


def job() -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return Job(model=model, optimizer=sgd, dataset=TensorDataset(x, x.sum(dim=1, keepdim=True)), loss=sum_mse,
               global_batch=32, num_steps=30, lr_schedule=warmup_cosine(5, 30), description="wheel check MLP")
'''


def _package_dirs() -> set[str]:
    """Every importable package of the checkout: a directory with an __init__.py whose parents up to
    the root have one too (so a stale build/lib/ or a venv is not one), outside what is not shipped."""
    found: set[str] = set()
    todo = [d for d in ROOT.iterdir() if d.is_dir() and d.name not in NOT_SHIPPED and not d.name.startswith(".")]
    while todo:
        d = todo.pop()
        if (d / "__init__.py").is_file():
            found.add(d.relative_to(ROOT).as_posix())
            todo += [c for c in d.iterdir() if c.is_dir() and not c.name.startswith((".", "__"))]
    return found


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment of a user's shell with the venv activated: nothing points at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "ADAPTRAIN_KEYS",
                        "ADAPTRAIN_CONTROL")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path.name}: nothing)"
    return f"--- {path.name}:\n" + "\n".join(text.splitlines()[-lines:])


def _build_wheel(dist: Path) -> Path:
    before = sorted(p.name for p in ROOT.iterdir())
    out = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], timeout=300)
    assert out.returncode == 0, f"pip wheel failed:\n{out.stdout}\n{out.stderr}"
    after = sorted(p.name for p in ROOT.iterdir())
    assert after == before, f"building the wheel wrote into the checkout: {sorted(set(after) - set(before))}"
    wheels = list(dist.glob("adaptrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _check_contents(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    shipped = {Path(n).parent.as_posix() for n in names if n.endswith("/__init__.py")}
    expected = _package_dirs()
    assert {"coordinator", "worker", "worker/parallel", "plan", "transport"} <= expected, expected
    assert expected <= shipped, f"the wheel lacks packages {sorted(expected - shipped)} (pyproject.toml)"
    sources = {p.relative_to(ROOT).as_posix() for d in expected for p in (ROOT / d).glob("*.py")}
    assert sources <= names, f"the wheel lacks modules {sorted(sources - names)[:10]}"
    assert not any(n.split("/")[0] in NOT_SHIPPED for n in names), "tests/, scripts/ or examples/ in the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        scripts = z.read(entry_points).decode()
    for script in ("coordinator = coordinator.cli:main", "worker = worker.cli:main",
                   "adaptrain-ctl = coordinator.ctl:main"):
        assert script in scripts, scripts


def _install(wheel: Path, venv: Path) -> None:
    out = _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert out.returncode == 0, f"python -m venv failed:\n{out.stderr}"
    out = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                "-c", str(ROOT / "constraints.txt"), str(wheel)], timeout=420, env=_clean_env(venv))
    assert out.returncode == 0, f"installing the wheel in a fresh venv failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def _wait_ready(out_path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in out_path.read_text(errors="replace").split("\n")[:-1]:  # whole lines only
            m = READY.match(line)
            if m:
                return m.group(1), m.group(2)
        assert proc.poll() is None, f"the coordinator exited {proc.returncode} before its ready line\n" + _tail(
            out_path.with_suffix(".err"))
        time.sleep(0.1)
    raise AssertionError("the coordinator printed no ready line\n" + _tail(out_path.with_suffix(".err")))


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


@pytest.mark.timeout(600)
def test_the_installed_wheel_runs_a_job_from_outside_the_checkout(tmp_path: Path) -> None:
    work = tmp_path / "user"
    work.mkdir()
    assert ROOT not in work.resolve().parents, "the job must run outside the checkout"
    venv = tmp_path / "venv"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        wheel = _build_wheel(tmp_path / "dist")
        _check_contents(wheel)
        _install(wheel, venv)
        env, bin_ = _clean_env(venv), venv / "bin"
        where = _run([str(bin_ / "python"), "-c", "import coordinator, plan, transport, importlib.util as u; "
                      "print(coordinator.__file__, u.find_spec('worker.parallel').origin)"],
                     timeout=120, cwd=work, env=env)
        assert where.returncode == 0, where.stderr
        assert all(str(venv) in p for p in where.stdout.split()), f"imported from outside the venv: {where.stdout}"

        (work / "job.py").write_text(JOB)
        keygen = _run([str(bin_ / "coordinator"), "keygen", "keys"], timeout=120, cwd=work, env=env)
        assert keygen.returncode == 0, keygen.stderr
        files = {}
        for name in ("coordinator", "w1", "w2", "follow"):
            files[name] = (work / f"{name}.out", work / f"{name}.err")

        def logs() -> str:
            return "\n".join(_tail(p) for pair in files.values() for p in pair)

        def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
            out, err = files[name]
            with out.open("wb") as o, err.open("wb") as e:
                proc = subprocess.Popen(cmd, stdout=o, stderr=e, cwd=work, env=env, start_new_session=True)
            procs.append(proc)
            return proc

        coordinator = start("coordinator", [str(bin_ / "coordinator"), "--bind", "tcp://127.0.0.1:0", "--job",
                                            "job.py:job", "--keys", "keys", "--state-dir", "state", "--min-workers", "2"])
        workers_at, control_at = _wait_ready(files["coordinator"][0], coordinator, 120)
        ctl = [str(bin_ / "adaptrain-ctl"), "--control", control_at, "--keys", "keys", "--timeout", "10"]
        status = _run([*ctl, "--json", "status"], timeout=120, cwd=work, env=env)
        assert status.returncode == 0, f"ctl status: {status.stderr}\n{logs()}"
        assert json.loads(status.stdout)["num_steps"] == 30, status.stdout
        # Follows every event from the first until the coordinator ends (exit 0 then).
        follow = start("follow", [*ctl, "--json", "events", "--follow"])
        workers = [start(name, [str(bin_ / "worker"), "--join", workers_at, "--keys", "keys", "--name", name])
                   for name in ("w1", "w2")]

        deadline = time.monotonic() + 240
        for name, proc in [("w1", workers[0]), ("w2", workers[1]), ("coordinator", coordinator)]:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not finish in time\n{logs()}") from None
            assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{logs()}"
        follow.wait(timeout=60)
        assert follow.returncode == 0, f"ctl events --follow exited {follow.returncode}\n{logs()}"

        events = _events(work / "state" / "events.jsonl")
        finished = [e for e in events if e["kind"] == "finished"]
        assert finished and finished[0]["step"] == 30, logs()
        assert {e["worker"] for e in events if e["kind"] == "joined"} == {"w1", "w2"}, logs()
        followed = _events(files["follow"][0])
        assert {e["kind"] for e in followed} >= {"joined", "plan"}, f"{followed[:5]}\n{logs()}"
        assert followed == events[:len(followed)], f"ctl events --follow differs from events.jsonl\n{logs()}"
    finally:
        kill_and_reap(procs)
        shutil.rmtree(venv, ignore_errors=True)  # about 1 GB: not kept among pytest's last runs
