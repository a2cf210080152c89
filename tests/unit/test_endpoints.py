"""What a client is told about the endpoint it connects to: a host that does not resolve fails at once,
a refused key names the wrong-port slip, a timeout says what to check, and a job whose dataset is
smaller than its global batch is pointed out when it loads."""

from __future__ import annotations

import pytest
import zmq

from transport.endpoints import EndpointError, check_connect_endpoint, no_answer, split_tcp
from transport.security import handshake_failure
from worker.job import load_job, small_dataset_warning

UNRESOLVABLE = "tcp://no-such-host.invalid:5555"  # .invalid never resolves (RFC 6761)


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("tcp://127.0.0.1:5555", ("127.0.0.1", 5555)),
    ("tcp://coord.example:1", ("coord.example", 1)),
    ("tcp://[::1]:5555", ("::1", 5555)),
    ("tcp://eth0;10.0.0.5:5555", ("10.0.0.5", 5555)),  # zmq's source;destination form
])
def test_split_tcp(endpoint: str, expected: tuple[str, int]) -> None:
    assert split_tcp(endpoint) == expected


@pytest.mark.parametrize(("endpoint", "needle"), [
    ("tcp://127.0.0.1", "must look like tcp://HOST:PORT"),
    ("tcp://127.0.0.1:port", "must look like tcp://HOST:PORT"),
    ("tcp://:5555", "must look like tcp://HOST:PORT"),
    ("tcp://127.0.0.1:0", "the port must be between 1 and 65535"),
    ("tcp://127.0.0.1:70000", "the port must be between 1 and 65535"),
    ("tcp://*:5555", "'*' is only for binding"),
])
def test_malformed_endpoints_are_refused(endpoint: str, needle: str) -> None:
    with pytest.raises(EndpointError) as info:
        check_connect_endpoint(endpoint)
    assert needle in str(info.value)


def test_an_unresolvable_host_fails_at_once_naming_the_host() -> None:
    with pytest.raises(EndpointError) as info:
        check_connect_endpoint(UNRESOLVABLE)
    assert str(info.value).startswith("cannot resolve no-such-host.invalid: ")
    check_connect_endpoint("tcp://127.0.0.1:5555")  # resolvable: no error, nothing connects
    check_connect_endpoint("tcp://localhost:5555")
    check_connect_endpoint("ipc:///tmp/adaptrain.sock")  # not a host: not checked


def test_a_timeout_says_what_to_check() -> None:
    never = no_answer("tcp://10.0.0.5:5555", 60, who="worker", connected=False)
    assert never.startswith("no answer from tcp://10.0.0.5:5555 in 60 s: no connection could be made")
    assert "coordinator running" in never and "`workers=` port" in never and "firewall" in never
    silent = no_answer("tcp://10.0.0.5:5556", 5, who="ctl", connected=True)
    assert silent.startswith("no answer from tcp://10.0.0.5:5556 in 5 s, though a connection was made")
    assert "`control=` address" in silent and "not `workers=`" in silent


@pytest.mark.parametrize(("who", "mine", "other"), [("worker", "workers", "control"), ("ctl", "control", "workers")])
def test_a_refused_key_names_the_wrong_endpoint_first(who: str, mine: str, other: str) -> None:
    why = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, None, who=who, endpoint="tcp://h:1")
    assert why is not None
    assert f"refused this {who}'s key" in why
    assert f"tcp://h:1 is the coordinator's {other} endpoint, not its {mine} endpoint" in why
    assert f"use the `{mine}=` address of its ready line" in why
    assert "not made by the `coordinator keygen`" in why, "the other cause stays named"


# --- a dataset smaller than the global batch --------------------------------------------------------

JOB = '''\
import torch
from torch import nn
from torch.utils.data import TensorDataset
from worker import Job

def job():
    x = torch.zeros({size}, 3)
    return Job(model=lambda: nn.Linear(3, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
               dataset=TensorDataset(x, x[:, :1]), loss=lambda o, t: ((o - t) ** 2).sum(),
               global_batch=32, num_steps=2)
'''


def test_a_dataset_smaller_than_the_global_batch_is_warned_about_once(capsys: pytest.CaptureFixture[str]) -> None:
    job = load_job(JOB.format(size=10), "job", filename="small.py")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("warning: job file small.py: the dataset has 10 samples, fewer than global_batch 32")
    assert "uniformly with replacement" in err[0]
    assert small_dataset_warning(job) is not None


@pytest.mark.parametrize("size", [32, 1000])
def test_a_dataset_of_at_least_a_batch_loads_silently(size: int, capsys: pytest.CaptureFixture[str]) -> None:
    job = load_job(JOB.format(size=size), "job", filename="big.py")
    assert capsys.readouterr().err == ""
    assert small_dataset_warning(job) is None
