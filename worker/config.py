"""A worker's settings for its training loop (`worker.trainer`), from its command line (`worker.cli`)."""

from __future__ import annotations

from dataclasses import dataclass

from transport.security import ClientKeys


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    group_timeout_s: float = 60.0
    digest_every: int = 0  # 0: never hash parameters
    log_every: int = 10
    delta_timeout_s: float = 600.0  # how long a plan is waited for with the coordinator unreachable before giving up
    device: str = "cpu"
    keys: ClientKeys | None = None  # CURVE keys for the store's sockets (None: --insecure coordinator)
    trace_path: str | None = None  # append every step report here as a JSON line (--trace-steps)
    pause_at: tuple[str, int] | None = None  # (phase, step): the --pause-at fault-injection knob
    final_dir: str = ""  # where rank 0 of the last step writes the trained model ("": nowhere)
    checkpoint_dir: str = ""  # where durable checkpoints go ("": none; `worker.checkpoint`)
    checkpoint_every: int = 0  # a checkpoint after every N-th step (0: only when asked)
    checkpoint_keep: int = 3  # the newest N are kept
    job_sha256: str = ""  # recorded in each checkpoint's manifest
