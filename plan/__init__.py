"""adaptrain's planner: pure decisions over plain data (no torch, trio or zmq, no clock, no I/O).

The coordinator keeps a `Cluster` of `Device`s, asks `make_plan` for a `Plan` whenever membership
changes, and ships the result to the workers.
"""

from plan.cluster import Cluster, Device
from plan.planner import Plan, PlanLimits, PlanResult, make_plan, split_shares

__all__ = ["Cluster", "Device", "Plan", "PlanLimits", "PlanResult", "make_plan", "split_shares"]
