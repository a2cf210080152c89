"""Executors for each parallel layout, and the state they share between epochs.

* `table`: the executors, one per layout kind (`worker.executor.Executor`): the one table a new
  parallelism is added to;
* `slices`: a member's state as slices of flattened tensors (`LocalState`), layout-free, and the
  execution of a reshard plan over point-to-point ops;
* `mesh`: the epoch's group registered with c10d, and its DeviceMesh;
* `replicated`: the replicated executor (a plain module) and its gradient buckets;
* `fsdp`: the sharded executor (FSDP2's `fully_shard` per unit), built from a LocalState;
* `staged`, `pipeline`: the pipeline executors (a stage of the model, whole or sharded) and its 1F1B schedule;
* `copies`, `update`: the ring of copies of a sharded layout, and the optimizer applied to slices.
* `meta`: the job's model on the meta device, which each executor is built from (a copy of one built once).
(Each executor's step is its own: `ReplicaExecutor.step`, `FsdpExecutor.step`, `StageExecutor.step`, the
last also a sharded stage's through the hooks `ShardedStageExecutor` overrides.)
"""
