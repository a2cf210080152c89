"""Executors for each parallel layout, and the state they share between epochs.

* `slices`: a member's state as slices of flattened tensors (`LocalState`), layout-free, and the
  execution of a reshard plan over point-to-point ops;
* `mesh`: the epoch's group registered with c10d, and its DeviceMesh;
* `fsdp`: the sharded executor (FSDP2's `fully_shard` per unit), built from a LocalState;
* (the replicated executor lives in `worker.trainer` until the trainer is split).
"""
