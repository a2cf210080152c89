"""adaptrain's worker: joins a coordinator, trains its share, survives peers coming and going.

The public API for job files is `Job` (see `worker.job`); `python -m worker` / the `worker`
console script runs a worker (`worker --help`).
"""

from worker.job import Job, JobError, load_job, sample_ids, share_slice

__all__ = ["Job", "JobError", "load_job", "sample_ids", "share_slice"]
