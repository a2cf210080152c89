"""Executors for each parallel layout, and the state they share between epochs.

* `slices`: a member's state as slices of flattened tensors (`LocalState`), layout-free, and the
  execution of a reshard plan over point-to-point ops;
* `mesh`: the epoch's group registered with c10d, and its DeviceMesh;
* `fsdp`: the sharded executor (FSDP2's `fully_shard` per unit), built from a LocalState;
* `replicated`: the replicated executor's state (a plain module) and its gradient buckets;
* `copies`, `update`: the ring of copies of a sharded layout, and the optimizer applied to slices.
* `meta`: the job's model on the meta device, which each executor is built from (a copy of one built once).
(The two steps themselves, one per layout, are `worker.step`'s.)
"""
