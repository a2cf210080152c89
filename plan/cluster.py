"""The cluster object: the devices that can take part in training and what is known of each.

A device's speed is first its calibrated matmul FLOP/s (measured at join) and, once it has trained,
its measured samples per second of compute (forward + backward, communication excluded), kept as an
exponentially weighted estimate. Devices without a measurement are converted to samples/s through
the median samples-per-FLOP of the measured ones, so old and new devices compare on one scale.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One worker process and its device, as the planner sees it."""

    name: str
    host: str
    kind: str  # "cpu", "cuda:0", ...
    flops: float  # calibrated matmul FLOP/s at join
    memory_bytes: int
    samples_per_s: float | None = None  # measured compute throughput (EWMA), None until trained

    def __post_init__(self) -> None:
        if self.flops <= 0:
            raise ValueError(f"device {self.name}: calibrated FLOP/s must be positive, got {self.flops}")


EWMA_WEIGHT = 0.3  # weight of the newest measurement in the speed estimate


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices by name. Immutable: every change returns a new Cluster."""

    devices: dict[str, Device] = field(default_factory=dict)

    def with_device(self, device: Device) -> Cluster:
        return Cluster({**self.devices, device.name: device})

    def without(self, name: str) -> Cluster:
        return Cluster({k: v for k, v in self.devices.items() if k != name})

    def with_measurement(self, name: str, samples: int, compute_s: float) -> Cluster:
        """Fold one step's compute time of `samples` samples into the device's speed estimate."""
        device = self.devices.get(name)
        if device is None or samples <= 0 or compute_s <= 0:
            return self
        measured = samples / compute_s
        old = device.samples_per_s
        new = measured if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * measured
        return Cluster({**self.devices, name: replace(device, samples_per_s=new)})

    def speeds(self) -> dict[str, float]:
        """Estimated samples/s of every device, on one scale (see the module comment)."""
        measured = [d.samples_per_s / d.flops for d in self.devices.values() if d.samples_per_s]
        per_flop = statistics.median(measured) if measured else 1.0
        return {
            name: d.samples_per_s if d.samples_per_s else d.flops * per_flop
            for name, d in self.devices.items()
        }
