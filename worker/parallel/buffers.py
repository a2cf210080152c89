"""Buffers (BatchNorm's running statistics, step counters) kept identical on every member.

A module's buffers are not parameters: no gradient reaches them, and a forward in train mode updates
them in place from the batch it sees, in data parallel each member's own share. Left alone, the
members' buffers drift apart, and the saved model (rank 0's) no longer matches what the members
evaluated with. torch's DDP broadcasts rank 0's buffers before every forward instead, which makes
the result depend on rank 0's share, and so on the plan. Here every member ends each step with

    b = b0 + sum_r (n_r / N) * (b_r - b0)

where b0 is what every member held when the step began, b_r member r's buffer after its forward
passes, n_r its samples and N the global batch: the share-weighted mean of the members' updates.
For a running mean (an exponential average of batch means) that is exactly the update one process
makes on the whole batch, since the batch's mean is the share-weighted mean of the shares' means.
A running variance becomes the share-weighted mean of the shares' variances (it misses the spread
between the shares' means). A buffer that no forward changes (a mask, a rotary table) has
b_r - b0 = 0 everywhere and stays bit-identical. Integer buffers (`num_batches_tracked`) are
rounded. The deltas travel as one float64 tensor, all-reduced with the step's other collectives.

A step that is given up puts the buffers back as they were at its start (`restore`), so a step done
again after a failure does not count its batch twice.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BufferSync"]


class BufferSync:
    """The buffers of one model (floating and integer ones; boolean masks are constants)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = [b for _, b in model.named_buffers()
                        if b is not None and (b.is_floating_point() or not (b.dtype == torch.bool or b.is_complex()))]
        self._start: list[torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def begin(self) -> None:
        """At the start of a step, before any forward: remember b0."""
        if self.buffers:
            self._start = [b.detach().clone() for b in self.buffers]

    def deltas(self, samples: int, global_batch: int) -> torch.Tensor:
        """This member's weighted update of the step, (n_r / N) * (b_r - b0), flat, float64."""
        assert self._start is not None, "begin() first"
        weight = samples / global_batch
        device = self.buffers[0].device
        return torch.cat([(b.detach().double() - s.double()).reshape(-1) * weight
                          for b, s in zip(self.buffers, self._start)]).to(device)

    def apply(self, summed: torch.Tensor) -> None:
        """Every member's buffers from the all-reduced (summed) deltas: b0 + the sum."""
        assert self._start is not None, "begin() first"
        offset = 0
        with torch.no_grad():
            for b, s in zip(self.buffers, self._start):
                part = summed[offset:offset + b.numel()].view(b.shape).to(s.device)
                offset += b.numel()
                value = s.double() + part
                b.copy_(value if b.is_floating_point() else value.round())
        self._start = None

    def restore(self) -> None:
        """The step was given up: the buffers as they were when it began."""
        if self._start is not None:
            with torch.no_grad():
                for b, s in zip(self.buffers, self._start):
                    b.copy_(s)
            self._start = None
