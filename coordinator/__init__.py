"""adaptrain's coordinator: a torch-free trio daemon that keeps membership, plans, and tells workers.

Run it with the `coordinator` console script (`coordinator --help`); tests and scripts may call
`serve(config, job)` directly.
"""

from coordinator.daemon import CoordinatorConfig, Endpoints, serve
from coordinator.jobinfo import JobInfo, JobRefused, inspect_job

__all__ = ["CoordinatorConfig", "Endpoints", "JobInfo", "JobRefused", "inspect_job", "serve"]
