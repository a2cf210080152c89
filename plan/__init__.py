"""adaptrain's planner: pure decisions over plain data (no torch, trio or zmq, no clock, no I/O).

The coordinator keeps a `Cluster` (devices, links, fitted costs) and the model's `Graph`, asks
`make_plan` for a `Plan` whenever the cluster changes, and ships the result to the workers.
"""

from plan.cluster import Cluster, Device
from plan.graph import Graph
from plan.layout import Layout, LayoutError, LayoutPin
from plan.planner import Alternative, Candidate, PlanLimits, PlanResult, make_plan
from plan.prediction import MemberCost, Plan, predict
from plan.shares import split_shares

__all__ = ["Alternative", "Candidate", "Cluster", "Device", "Graph", "Layout", "LayoutError", "LayoutPin", "MemberCost", "Plan", "PlanLimits", "PlanResult",
           "make_plan", "predict", "split_shares"]
