"""adaptrain's worker: joins a coordinator, trains its share, survives peers coming and going.

The public API for job files is `Job` (see `worker.job`) and the learning-rate schedules of
`worker.schedules` (`warmup_cosine`); `python -m worker` / the `worker` console script runs a
worker (`worker --help`).
"""

from worker.job import Job, JobError, load_job, sample_ids, share_slice
from worker.schedules import warmup_cosine

__all__ = ["Job", "JobError", "load_job", "sample_ids", "share_slice", "warmup_cosine"]
