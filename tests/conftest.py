"""Every test has one kind, so the fast ones can run alone while iterating (`make test-fast`):

  pure     in one process, no process group, no child process (the default in tests/unit);
  gloo     forms real torch.distributed groups in its own process (`pytestmark = pytest.mark.gloo`);
  process  starts processes: coordinators, workers, scripts (the default in tests/system).

A test's kind is checked while it runs: a pure or gloo test that starts a process, or a pure test
that forms a gloo group, fails with the marker it needs. `make test` runs every kind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# scripts/ is not a package: the system tests use its LocalJob launcher.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

KINDS = ("pure", "gloo", "process")


def pytest_configure(config: pytest.Config) -> None:
    for kind, what in (("pure", "in one process, no process group, no child process"),
                       ("gloo", "forms real torch.distributed groups in the test's process"),
                       ("process", "starts processes (coordinators, workers, scripts)")):
        config.addinivalue_line("markers", f"{kind}: {what}")
    # matplotlib builds its font cache on its first use on a machine, running `fc-list`: once, here,
    # before any test's kind is checked (a pure test that plots would otherwise "start a process")
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


def kind_of(item: pytest.Item) -> str:
    """The closest kind marker (a test's own before its module's), else its directory's default."""
    for marker in item.iter_markers():
        if marker.name in KINDS:
            return marker.name
    return "process" if "system" in item.path.parts else "pure"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(m.name in KINDS for m in item.iter_markers()):
            item.add_marker(kind_of(item))


def _refuse(what: str, needs: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"this test {what}: mark it `@pytest.mark.{needs}` (tests/conftest.py)")
    return refused


@pytest.fixture(autouse=True)
def _kind_holds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    kind = kind_of(request.node)
    if kind != "process":
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("starts a process", "process"))
    if kind == "pure" and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        monkeypatch.setattr(dist, "ProcessGroupGloo", _refuse("forms a gloo group", "gloo"))
    yield
