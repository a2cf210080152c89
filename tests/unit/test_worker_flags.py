"""The worker's flags that change what the coordinator is told: `--host` names the machine the
planner groups the worker under (default the host name); an empty one is refused with the reason."""

from __future__ import annotations

import pytest

from worker.cli import parse_args

JOIN = ["--join", "tcp://127.0.0.1:5555", "--name", "w1"]


def test_host_names_the_machine_and_an_empty_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(JOIN).host is None
    assert parse_args([*JOIN, "--host", "rack3-a"]).host == "rack3-a"
    with pytest.raises(SystemExit) as out:
        parse_args([*JOIN, "--host", " "])
    assert out.value.code == 2 and "--host must not be empty" in capsys.readouterr().err
