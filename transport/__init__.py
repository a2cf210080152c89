"""adaptrain's control-plane transport: the wire schema, its msgpack codec, zmq sockets under trio.

Imports msgpack, zmq and trio only (never torch): the coordinator and ctl depend on it. The trio
adapter (`TrioSocket`, `SocketMonitor`, ...) is loaded on first use (PEP 562), so ctl, which only
encodes and decodes messages over a plain zmq socket, never imports trio and starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .codec import MAX_FRAME_BYTES, CodecError, decode, encode
from .messages import (
    CONTROL_COMMANDS,
    ERR_BAD_REQUEST,
    ERR_BUSY,
    ERR_REJOIN,
    ERR_DECODE,
    ERR_NAME_TAKEN,
    ERR_PROTOCOL,
    ERR_STALE_EPOCH,
    ERR_UNKNOWN_WORKER,
    MESSAGE_TYPES,
    PLANNED_EXITS,
    PROTOCOL_VERSION,
    STORE_OPS,
    Abort,
    Ack,
    ControlReply,
    ControlRequest,
    Error,
    EvalReport,
    GraphUpload,
    Heartbeat,
    Join,
    Leave,
    MeshLayout,
    Message,
    PlanDelta,
    Ready,
    SaveModel,
    Saved,
    Slowdown,
    StateLost,
    Checkpointed,
    CheckpointNow,
    ResumeFailed,
    StepReport,
    Stop,
    StoreReply,
    StoreRequest,
    Welcome,
    check_name,
)

if TYPE_CHECKING:
    from .trio_zmq import MonitorEvent, Received, SocketMonitor, TrioSocket

_LAZY = {"MonitorEvent", "Received", "SocketMonitor", "TrioSocket"}  # from .trio_zmq, on first use


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import trio_zmq

        return getattr(trio_zmq, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "PLANNED_EXITS",
    "CONTROL_COMMANDS",
    "ERR_BAD_REQUEST",
    "ERR_BUSY",
    "ERR_REJOIN",
    "ERR_DECODE",
    "ERR_NAME_TAKEN",
    "ERR_PROTOCOL",
    "ERR_STALE_EPOCH",
    "ERR_UNKNOWN_WORKER",
    "MAX_FRAME_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "STORE_OPS",
    "Abort",
    "Ack",
    "CodecError",
    "ControlReply",
    "ControlRequest",
    "Error",
    "EvalReport",
    "GraphUpload",
    "Heartbeat",
    "Join",
    "Leave",
    "MeshLayout",
    "Message",
    "MonitorEvent",
    "PlanDelta",
    "Received",
    "Ready",
    "SaveModel",
    "Saved",
    "Slowdown",
    "SocketMonitor",
    "StateLost",
    "Checkpointed",
    "CheckpointNow",
    "ResumeFailed",
    "StepReport",
    "Stop",
    "StoreReply",
    "StoreRequest",
    "TrioSocket",
    "Welcome",
    "check_name",
    "decode",
    "encode",
]
