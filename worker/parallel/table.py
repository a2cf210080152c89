"""The executors, one per layout kind: the one table a new parallelism is added to (with its plan
file in `plan/`). The loop asks `executor_for(layout)` and never branches on the kind itself."""

from __future__ import annotations

from plan.layout import Layout
from worker.executor import Executor
from worker.parallel.fsdp import FsdpExecutor
from worker.parallel.replicated import ReplicaExecutor
from worker.parallel.staged import ShardedStageExecutor, StageExecutor
from worker.parallel.tensor import (ShardedTensorExecutor, ShardedTensorStageExecutor, TensorParallelExecutor,
                                    TensorStageExecutor)

EXECUTORS: tuple[type[Executor], ...] = (ReplicaExecutor, FsdpExecutor, StageExecutor, ShardedStageExecutor,
                                         TensorParallelExecutor, ShardedTensorExecutor, TensorStageExecutor,
                                         ShardedTensorStageExecutor)


def executor_for(layout: Layout) -> type[Executor]:
    """The executor that runs `layout`; ValueError naming the layout where none does."""
    for executor in EXECUTORS:
        if executor.fits(layout):
            return executor
    raise ValueError(f"no executor runs the layout {layout.describe()} (the planner should not have sent it)")
