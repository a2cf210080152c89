"""adaptrain's coordinator: a torch-free trio daemon that keeps membership, plans, and tells workers.

Run it with the `coordinator` console script (`coordinator --help`); tests and scripts may call
`serve(config, job)` directly. The control tool (`adaptrain-ctl`, coordinator.ctl) lives here too.

The public names are loaded on first use (PEP 562 `__getattr__`): importing a submodule such as
coordinator.ctl or coordinator.report must not pull in the daemon (trio), the planner (pulp,
numpy) or anything heavier, so that ctl starts fast on any machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.daemon import CoordinatorConfig, Endpoints, serve
    from coordinator.jobinfo import JobInfo, JobRefused, inspect_job

__all__ = ["CoordinatorConfig", "Endpoints", "JobInfo", "JobRefused", "inspect_job", "serve"]

_WHERE = {"CoordinatorConfig": "daemon", "Endpoints": "daemon", "serve": "daemon",
          "JobInfo": "jobinfo", "JobRefused": "jobinfo", "inspect_job": "jobinfo"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"coordinator.{module}"), name)
