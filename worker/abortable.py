"""A process group that can be walked away from: every wait on it ends the moment the group is
aborted, whoever waits (FSDP2, DTensor, a pipeline schedule, the step itself).

Why a wrapper: measured on torch 2.13 (gloo, CPU), `ProcessGroupGloo.abort()` and `shutdown()`
return at once but leave a thread blocked in `work.wait()` blocked until the peer's connection
closes or the group times out, and torch's higher layers wait inside their own code with no hook.
So, as torchft's `ProcessGroupWrapper` does, the epoch's backend is wrapped in a Python subclass of
c10d's `ProcessGroup` that FSDP2, DTensor and pipelining call unchanged (c10d dispatches their
collectives, `all_gather_single` and `reduce_scatter_single` included, to its overrides). Each op
goes to the real backend and returns a `Work` whose `wait()` blocks on an event that either the
op's completion or `abort()` sets; an aborted wait raises `Superseded`, and the op itself is left to
end in the background (its tensors held until then: a late write lands in a buffer nobody reads).
Measured: FSDP2 over this wrapper gives the same gradients as over the plain group, and its forward,
blocked in an all-gather on a peer that stopped, is released within the abort's latency.

One helper thread per group waits for the backend's collectives in the order they were issued
(every member issues a group's collectives in one order, and gloo completes them in it); a
point-to-point op gets a thread of its own, since a send completes only once its peer posts the
receive, which may come after later ops. A helper stuck in an op of an aborted group is left.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from worker.comm import Superseded

__all__ = ["AbortableGroup"]

SAFETY_NET_S = 0.05  # a wait re-checks `superseded` this often even without an abort


class _Work(dist.Work):
    """One op (or several issued as one) on the backend: done when they all are, or the group aborted."""

    def __init__(self, group: AbortableGroup, works: list[Any], result: Any) -> None:
        super().__init__()
        self._group = group
        self._works = works
        self._result = result  # what the future yields (the output tensors)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._finishing = threading.Lock()  # the op's end and an abort may race to finish it

    def _run(self) -> None:  # (the group's helper thread)
        try:
            for work in self._works:
                work.wait()
        except Exception as e:  # noqa: BLE001 (a peer died under it: given up in wait())
            with self._finishing:
                if not self._done.is_set():  # (an abort's reason stands)
                    self._error = e
        self._finish()

    def _finish(self) -> None:
        with self._finishing:  # (a future completed twice raises in the second finisher's thread)
            self._done.set()
            if not self._future.done():
                if self._error is not None:
                    self._future.set_exception(self._error)
                else:
                    self._future.set_result(self._result)

    def _abort(self, why: str) -> None:
        with self._finishing:
            if self._error is None and not self._done.is_set():
                self._error = Superseded(why)
        self._finish()

    def wait(self, timeout: Any = None) -> bool:
        t0 = time.perf_counter()
        while not self._done.wait(SAFETY_NET_S):
            if self._group.superseded():
                self._group.abort("the epoch was superseded")
        self._group.waited_s += time.perf_counter() - t0
        if self._error is not None:
            if isinstance(self._error, Superseded):
                raise self._error
            raise Superseded(f"collective failed: {str(self._error).splitlines()[0]}")
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class AbortableGroup(dist.ProcessGroup):
    """`backend` (a gloo or NCCL backend of one epoch) as a c10d ProcessGroup whose every wait an
    `abort()` releases. `superseded()` is asked by waits as a safety net (the agent's view of the
    epoch); `abort()` is the fast path, for whoever hears of a failure first."""

    def __init__(self, backend: Any, *, superseded: Callable[[], bool] = lambda: False) -> None:
        super().__init__(backend.rank(), backend.size())  # type: ignore[call-arg]  # (the (rank, size) form)
        self._backend = backend
        self._superseded = superseded
        self._lock = threading.Lock()
        self._pending: list[_Work] = []
        self._aborted: str | None = None
        self._jobs: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        # Seconds spent waiting on this group's ops (for the peers, and for the wire): what torch's
        # higher layers wait for inside a step's compute (DTensor's tp all-reduces), which the step
        # reports as communication, not compute.
        self.waited_s = 0.0
        threading.Thread(target=self._serve, daemon=True, name="abortable-group").start()

    # --- the state ---------------------------------------------------------------------------

    def superseded(self) -> bool:
        return self._aborted is not None or self._superseded()

    def abort(self, why: str = "aborted") -> None:
        """Release every wait on this group, now and later (each raises Superseded)."""
        with self._lock:
            if self._aborted is None:
                self._aborted = why
            pending, self._pending = self._pending, []
        for work in pending:
            work._abort(why)

    def errored(self) -> str | None:
        """Why the group was aborted, or None."""
        return self._aborted

    @property
    def backend(self) -> Any:
        return self._backend

    def _issue(self, start: Callable[[], list[Any]], result: Any = None, *, ordered: bool = True) -> _Work:
        work = _Work(self, [], result)
        with self._lock:
            if self._aborted is not None:
                work._abort(self._aborted)
                return work
            work._works = start()
            self._pending.append(work)
        if ordered:
            self._jobs.put(work)
        else:
            threading.Thread(target=self._complete, args=(work,), daemon=True, name="abortable-p2p").start()
        return work

    def _serve(self) -> None:
        while (work := self._jobs.get()) is not None:
            self._complete(work)

    def close(self) -> None:
        """Let the helper thread go once it has waited for what was issued (the group is done with:
        an epoch over). Aborting first releases every waiter; a helper stuck in an op ends with it."""
        self._jobs.put(None)

    def _complete(self, work: _Work) -> None:
        work._run()
        with self._lock:
            if work in self._pending:
                self._pending.remove(work)

    # --- the collectives c10d and torch's higher layers call -------------------------------------
    # (In c10d's (tensors, options) form; torch's stubs also list the Python bindings' overloads,
    # hence the `override` ignores.)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        b = self._backend
        return self._issue(lambda: [b.allreduce(tensors, opts) if opts is not None else b.allreduce(tensors)], tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.allreduce(tensors, _allreduce_options(opts))], tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        b = self._backend
        return self._issue(lambda: [b.broadcast(tensors, opts) if opts is not None else b.broadcast(tensors)],
                           tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.allgather(outputs, inputs, opts) if opts is not None
                                    else b.allgather(outputs, inputs)], outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.all_gather_single(output, input, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b._allgather_base(output, input)], output)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b._allgather_base(o, i) for o, i in zip(outputs, inputs)], outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.reduce_scatter(outputs, inputs, _rs_options(opts))], outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b._reduce_scatter_base(output, input, _rs_options(opts))], output)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b._reduce_scatter_base(o, i, _rs_options(opts)) for o, i in zip(outputs, inputs)],
                           outputs)

    def barrier(self, opts: Any = None) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.barrier(opts) if opts is not None else b.barrier()])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.send(tensors, dst, tag)], ordered=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        b = self._backend
        return self._issue(lambda: [b.recv(tensors, src, tag)], tensors, ordered=False)

    def size(self) -> int:
        return int(self._backend.size())

    def rank(self) -> int:
        return int(self._backend.rank())

    def getBackendName(self) -> str:
        return str(self._backend.name())


def _rs_options(opts: Any) -> dist.ReduceScatterOptions:
    out = dist.ReduceScatterOptions()
    if opts is not None:
        out.reduceOp = opts.reduceOp
    return out


def _allreduce_options(opts: Any) -> dist.AllreduceOptions:
    out = dist.AllreduceOptions()
    if opts is not None:
        out.reduceOp = opts.reduceOp
    return out
