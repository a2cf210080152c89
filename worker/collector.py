"""Python's cyclic garbage collector in a worker: off while it starts, then told to leave alone what
start-up built.

A worker's start (importing torch, loading the job, building the model, capturing its graph) makes
hundreds of thousands of long-lived Python objects and little cyclic garbage. With the collector
on, CPython scans all of them again and again as they accumulate: for the 10M-parameter GPT, several
full (generation 2) collections per worker during start-up, about half a second in all, on the way
to `Ready` and on a machine whose other workers are training. During training itself there are
none: a step makes little Python garbage.

So the collector is off from the first line of the worker until it is ready. Then one full
collection takes what start-up left as cyclic garbage (~15,000 objects after the GPT's graph
capture: FX graphs, temporary modules; ~200 ms), `gc.freeze()` moves everything that remains into
the permanent generation, which later collections never scan, and the collector is turned back on:
what training makes is collected as usual, over a heap of its own objects (importing torch alone
takes about a fifth less time with the collector off). This is CPython's own recipe (`gc.freeze`'s
documentation: disable early, freeze once the long-lived objects exist); torchtitan likewise keeps
automatic collection out of its training steps.

An epoch's entry is the other burst: a reshard of a row-wise tensor-parallel split makes tens of
thousands of short-lived objects (transfers, pieces, tensor views), enough for full collections
inside the members' pause. It runs with the collector off (`quiet`); what it leaves is collected
as usual afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def pause() -> None:
    """No automatic collections until `settle` (call first thing at start)."""
    gc.disable()


def settle() -> None:
    """Collect start-up's garbage once; what remains is long-lived: out of every later collection's
    scan. Automatic collections resume."""
    gc.collect()
    gc.freeze()
    gc.enable()


@contextmanager
def quiet() -> Iterator[None]:
    """No automatic collections inside (an epoch's entry); as before afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
