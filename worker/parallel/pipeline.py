"""One pipeline stage's part of a step: its micro-batches' forwards and backwards, the activations and
their gradients passed to and from the neighbouring stages point to point, in 1F1B order.

Why not `torch.distributed.pipelining`'s schedules: measured on torch 2.13 (gloo, CPU), GPipe and
1F1B over `PipelineStage` give exact gradients, but micro-batches of unequal sizes fail (the stage
pre-allocates its receive buffers from the first micro-batch's shape, and the schedule splits inputs
and targets differently: pytorch#126600 was closed by refusing them), and their sends and receives
wait inside torch with no way to walk away from a dead peer. Here a micro-batch may have any size
(the batch need not divide: the planner's micro-batches are contiguous slices of the step's share),
every wait goes through the caller's `wait` (the trainer's abortable one), and the mathematics is
the single process's: the last stage backpropagates each micro-batch's summed loss divided by the
global batch, so the gradients, summed over micro-batches, are the full batch's.

Every boundary tensor is preceded by a small header (its dimensions), so a stage needs to know
nothing of its neighbours' shapes; tags keep a micro-batch's activation and gradient apart. A
receive is one wait (`Incoming`: the header, then the tensor it announces, in the waiting thread),
and the sends are waited for once, together, at the end of the step (their tensors kept until
then), or by the caller with its own next wait (the pipeline executor waits for them with the
copies' exchange): a send can complete only once its receiver has posted the matching receive, and
in 1F1B two neighbours send to each other at once (an activation forward, a gradient back). Each wait is a
hand-off to the thread that can be walked away from (`worker.comm.Waiter`), so they are few: about
one per micro-batch and direction.

1F1B on stage s of p with m micro-batches: min(p − s − 1, m) forwards first (the warm-up), then one
forward and one backward in turn, then the remaining backwards; at most p − s micro-batches' activations
are held at once (what `plan.pipeline` budgets memory for).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.comm import AllOf

__all__ = ["StageStep", "one_f_one_b", "recv_tensor", "send_tensor", "stage_of_sequence"]

MAX_DIMS = 8  # dimensions a boundary tensor may have (the header's size)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)


def stage_of_sequence(model: nn.Module, units: Sequence[str]) -> nn.Sequential:
    """The stage of a model whose units form a sequence (each unit's output is the next one's input,
    as an `nn.Sequential`'s children): its `units`, in order, as one module sharing their parameters."""
    return nn.Sequential(*[model.get_submodule(u) for u in units])


@dataclass(slots=True)
class StageStep:
    """What one step of a stage needs. `send(t, dst, tag)` / `recv(t, src, tag)` start a
    point-to-point op on the stage's group and return its work; `wait(work, buf)` waits for it (or
    raises, abandoning it, once the step is given up). `inputs` (first stage) and `targets` (last
    stage) hold every micro-batch, in order; `sizes` the samples of each."""

    module: nn.Module
    stage: int
    stages: int
    prev_rank: int | None
    next_rank: int | None
    send: Callable[[torch.Tensor, int, int], Any]
    recv: Callable[[torch.Tensor, int, int], Any]
    wait: Callable[[Any, torch.Tensor | None], None]
    sizes: Sequence[int]
    device: torch.device
    inputs: Sequence[torch.Tensor] = ()
    targets: Sequence[torch.Tensor] = ()
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # summed over samples
    global_batch: int = 1
    weights: Sequence[float] = ()  # per micro-batch, what its loss counts (0: a stand-in pass; default 1)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def one_f_one_b(s: StageStep, in_flight: list[tuple[Any, torch.Tensor]] | None = None) -> torch.Tensor:
    """Run this stage's part of one step; returns the sum of the micro-batches' losses on the last
    stage (0 elsewhere), on the device. Gradients accumulate into the module's parameters. The
    step's sends are waited for at its end, or, given `in_flight`, left there (with their tensors)
    for the caller to wait for with its own next wait: one hand-off fewer a step."""
    m = len(s.sizes)
    warmup = min(s.stages - s.stage - 1, m)
    held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # micro-batch -> (its input, output or loss)
    loss_sum = torch.zeros((), dtype=torch.float32, device=s.device)
    sent: list[tuple[Any, torch.Tensor]] = [] if in_flight is None else in_flight  # sends in flight, with their tensors
    forwards = backwards = 0
    for _ in range(warmup):
        held[forwards] = _forward(s, forwards, sent)
        forwards += 1
    while backwards < m:
        if forwards < m:
            held[forwards] = _forward(s, forwards, sent)
            forwards += 1
        inp, out = held.pop(backwards)
        if s.last:
            loss_sum = loss_sum + out.detach().float() * s.global_batch
        _backward(s, backwards, inp, out, sent)
        backwards += 1
    if sent and in_flight is None:
        s.wait(AllOf(sent), None)  # (one hand-off for every send of the step)
    return loss_sum


def _forward(s: StageStep, k: int, sent: list[tuple[Any, torch.Tensor]]) -> tuple[torch.Tensor | None, torch.Tensor]:
    if s.first:
        inp: torch.Tensor | None = None
        out = s.module(s.inputs[k].to(s.device))
    else:
        assert s.prev_rank is not None
        inp = _recv(s, s.prev_rank, tag=2 * k).requires_grad_()
        out = s.module(inp)
    if s.last:
        assert s.loss is not None
        weight = s.weights[k] if s.weights else 1.0
        loss = s.loss(out, s.targets[k].to(s.device))
        return inp, loss / s.global_batch if weight == 1.0 else loss * (weight / s.global_batch)
    assert s.next_rank is not None
    _send(s, out.detach(), s.next_rank, 2 * k, sent)
    return inp, out


def _backward(s: StageStep, k: int, inp: torch.Tensor | None, out: torch.Tensor,
              sent: list[tuple[Any, torch.Tensor]]) -> None:
    if s.last:
        out.backward()  # type: ignore[no-untyped-call]
    else:
        assert s.next_rank is not None
        grad = _recv(s, s.next_rank, tag=2 * k + 1)
        out.backward(grad)  # type: ignore[no-untyped-call]
    if not s.first:
        assert s.prev_rank is not None and inp is not None and inp.grad is not None
        _send(s, inp.grad, s.prev_rank, 2 * k + 1, sent)


def _send(s: StageStep, t: torch.Tensor, dst: int, tag: int, sent: list[tuple[Any, torch.Tensor]]) -> None:
    send_tensor(s.send, t, dst, tag, s.device, sent)


def _recv(s: StageStep, src: int, tag: int) -> torch.Tensor:
    return recv_tensor(s.recv, s.wait, src, tag, s.device)


def send_tensor(send: Callable[[torch.Tensor, int, int], Any], t: torch.Tensor, dst: int, tag: int,
                device: torch.device, sent: list[tuple[Any, torch.Tensor]]) -> None:
    """Start sending `t` to `dst` under `tag`, after a header with its dimensions and dtype; the
    works go to `sent`, with their tensors (kept alive until they are waited for)."""
    t = t.contiguous()
    header = torch.tensor([t.dim(), DTYPES.index(t.dtype), *t.shape, *[0] * (MAX_DIMS - t.dim())],
                          dtype=torch.int64, device=device)
    sent.append((send(header, dst, tag), header))
    sent.append((send(t, dst, tag), t))


def recv_tensor(recv: Callable[[torch.Tensor, int, int], Any], wait: Callable[[Any, torch.Tensor | None], None],
                src: int, tag: int, device: torch.device) -> torch.Tensor:
    """Receive what `send_tensor` sent from `src` under `tag`: its header, then the tensor, as one wait."""
    incoming = Incoming(recv, src, tag, device)
    wait(incoming, incoming.header)
    assert incoming.tensor is not None
    return incoming.tensor


class Incoming:
    """A boundary tensor being received, waited for as one work: `wait()` (in the waiting thread)
    waits for the header, allocates the tensor it announces and receives it. Posting the second
    receive from that thread is safe: a group's point-to-point ops may be issued from any thread,
    and the tag keeps it apart from whatever the stage posts meanwhile."""

    def __init__(self, recv: Callable[[torch.Tensor, int, int], Any], src: int, tag: int, device: torch.device) -> None:
        self._recv, self._src, self._tag, self._device = recv, src, tag, device
        self.header = torch.zeros(MAX_DIMS + 2, dtype=torch.int64, device=device)
        self._work = recv(self.header, src, tag)
        self.tensor: torch.Tensor | None = None

    def wait(self) -> bool:
        self._work.wait()
        header = self.header.tolist()
        ndim, dtype = header[0], DTYPES[header[1]]
        self.tensor = torch.empty(header[2:2 + ndim], dtype=dtype, device=self._device)
        self._recv(self.tensor, self._src, self._tag).wait()
        return True
