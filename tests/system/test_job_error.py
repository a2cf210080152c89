"""An exception raised in the job's own code shows its cause: the worker's log has the traceback with
the job file's frames (file, line, source) listed first, and the `left` event carries the exception
and the innermost frame in the job's code. A user cannot debug a job from "RuntimeError: <msg>"."""

from __future__ import annotations

from pathlib import Path

from localjob import LocalJob

BROKEN_JOB = '''\
import torch
from torch import nn
from torch.utils.data import TensorDataset

from worker.job import Job


def check_inputs(x, calls):
    if calls == 4:
        raise ValueError(f"my model broke on a batch of {x.shape[0]}")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.calls = 0

    def forward(self, x):
        if x.device.type != "meta":
            self.calls += 1
            check_inputs(x, self.calls)
        return self.body(x)


def job():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return Job(model=Net, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), dataset=TensorDataset(x, x[:, :1]),
               loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"), global_batch=8, num_steps=20)
'''


def test_an_exception_in_the_jobs_forward_shows_the_users_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken_job.py"
    path.write_text(BROKEN_JOB)
    raise_line = 1 + BROKEN_JOB.splitlines().index('        raise ValueError(f"my model broke on a batch of {x.shape[0]}")')
    call_line = 1 + BROKEN_JOB.splitlines().index("            check_inputs(x, self.calls)")
    with LocalJob(f"{path}:job", tmp_path / "job", min_workers=1) as job:
        job.start()
        worker = job.add_worker("w1")
        left = job.wait_event(lambda e: e["kind"] == "left" and e["worker"] == "w1", 120, "w1 left")
        assert worker.wait(60) == 1, job.tail("w1", 40)
        log = (job.state_dir / "w1.log").read_text()

    assert left["reason"] == "error: ValueError: my model broke on a batch of 8", left
    assert left["error"] == "ValueError: my model broke on a batch of 8", left
    assert left["where"] == f"{path}:{raise_line} in check_inputs", left
    # The log: the job's frames first (the call in forward, then the raise), each with its source line.
    jobs_part = log[log.index("in the job's code"):log.index("the whole traceback")]
    assert f'File "{path}", line {call_line}, in forward' in jobs_part, log
    assert f'File "{path}", line {raise_line}, in check_inputs' in jobs_part, log
    assert 'raise ValueError(f"my model broke on a batch of {x.shape[0]}")' in jobs_part, log
    assert "worker/" not in jobs_part and "torch/" not in jobs_part, "only the job's frames come first"
    whole = log[log.index("the whole traceback"):]
    assert "Traceback (most recent call last)" in whole and "worker/parallel/replicated.py" in whole, log
