# Join-time calibration: how fast and how big this device is, measured in about 0.1 s.
#
# The cost model starts from these numbers and refines speed online from measured step times,
# so a rough, quick figure is enough here. Speed is the best of a few timed runs of square
# float32 matmuls (best, not mean: interference only ever slows a run down). Memory is what is
# available now (MemAvailable on Linux, total device memory on CUDA), capped by the operator's
# --memory-limit.

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch

__all__ = ["Calibration", "calibrate"]

_REPETITIONS = 3
# 512 keeps a CPU matmul to a few ms; a GPU needs a bigger one to leave launch overhead behind.
_CPU_MATMUL_SIZE = 512
_CUDA_MATMUL_SIZE = 4096


@dataclass(frozen=True, slots=True)
class Calibration:
    """What a worker reports about its device when it joins."""

    flops: float
    """Measured float32 matmul throughput, FLOP/s."""
    memory_bytes: int
    """Memory training may use: available host memory (CPU) or total device memory (CUDA),
    capped by the memory limit."""
    host: str
    """Host name."""
    device: str
    """Torch device string, e.g. `cpu` or `cuda:0`."""
    threads: int
    """`torch.get_num_threads()` at calibration time."""
    cores: int = 0
    """CPU cores this process may run on (its affinity), shared by every worker on the host."""


def calibrate(
    device: str = "cpu", *, memory_limit_gib: float | None = None, duration_s: float = 0.1
) -> Calibration:
    """Measure this device's matmul speed for about `duration_s` and read its memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    if memory_limit_gib is not None and memory_limit_gib <= 0:
        raise ValueError(f"memory_limit_gib must be positive, got {memory_limit_gib}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")

    memory = _memory_bytes(dev)
    if memory_limit_gib is not None:
        memory = min(memory, int(memory_limit_gib * 2**30))
    return Calibration(
        flops=_matmul_flops(dev, duration_s),
        memory_bytes=memory,
        host=socket.gethostname(),
        device=str(dev),
        threads=torch.get_num_threads(),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0),
    )


def _matmul_flops(dev: torch.device, duration_s: float) -> float:
    n = _CUDA_MATMUL_SIZE if dev.type == "cuda" else _CPU_MATMUL_SIZE
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dev)
    b = torch.randn(n, n, generator=generator).to(dev)
    out = torch.empty(n, n, device=dev)
    flop_per_matmul = 2.0 * n**3

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    torch.mm(a, b, out=out)  # warm-up: allocator, kernel selection, thread pool start
    sync()
    budget_s = duration_s / _REPETITIONS
    best = 0.0
    for _ in range(_REPETITIONS):
        count = 0
        sync()
        start = time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            count += 1
            if dev.type == "cuda" and count % 8:
                continue  # check the clock (a sync) only now and then on a GPU
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s:
                break
        best = max(best, count * flop_per_matmul / elapsed)
    return best


def _memory_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except (OSError, ValueError, IndexError):
        pass
    # Not Linux (or a very old kernel): fall back to total physical memory.
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
