"""The whole wire schema of adaptrain's control plane.

Every message that crosses a ZeroMQ socket is one of the frozen, slotted, keyword-only dataclasses
below; nothing else is ever encoded. The codec (`transport.codec`) maps a message to one msgpack
frame ``{"v": PROTOCOL_VERSION, "kind": <class name>, **fields}`` and back, and rejects anything
that does not match these classes field for field and type for type.

Sockets and who talks on them:

* workers endpoint (coordinator ROUTER, ``--bind``): each worker's control agent (DEALER whose
  routing id is the worker's NAME) and each worker thread's rendezvous-store client (DEALER with a
  random routing id).
* control endpoint (coordinator ROUTER, ``--control``): ctl (``adaptrain-ctl``, ``coordinator/ctl.py``; DEALER).

Field types are limited to what the codec validates: ``int``, ``float``, ``str``, ``bytes``,
``bool``, ``X | None``, ``list[X]``, ``dict[str, Any]`` (free-form, only in control replies) and the
nested records in `NESTED_TYPES` (a map with exactly their fields).
Tensors never travel here: they go worker to worker over torch.distributed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 12  # 12: MeshLayout.stages; 11: Leave.error, Leave.where; 10: StepReport.switching (and PlanDelta.previous, TensorInfo.state); 9: Join.epoch/step, Welcome.last_step, ERR_REJOIN, Checkpointed, ResumeFailed, CheckpointNow, Welcome.checkpoint_*, PlanDelta.resume_*; 8: PlanDelta.layout (MeshLayout), PlanDelta.senders, StateLost; 2: StepReport.comm_s, Slowdown; 3: Join.cores; 4: StepReport.lr, grad_norm; 5: Saved, Welcome.final_dir; 6: SaveModel, Saved.final; 7: EvalReport

# Error codes carried by `Error.code`.
ERR_DECODE = "decode"  # the frame could not be decoded or failed validation
ERR_PROTOCOL = "protocol"  # the peer speaks another PROTOCOL_VERSION
ERR_STALE_EPOCH = "stale-epoch"  # the sender is fenced: it is not a member of the current epoch
ERR_UNKNOWN_WORKER = "unknown-worker"  # a message or command names a worker that is not a member
ERR_BAD_REQUEST = "bad-request"  # a well-formed message that makes no sense now
ERR_NAME_TAKEN = "name-taken"  # a Join whose NAME belongs to a live member (or a message under another's name)
ERR_BUSY = "busy"  # too many workers are joining at once: the worker retries its Join shortly
ERR_REJOIN = "rejoin"  # the coordinator restarted from its journal: register again (Join, Ready), keep training

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


def check_name(name: str) -> None:
    """A worker NAME: 1-128 characters, letters, digits and ._:@+- (it appears in events, logs,
    file names and ctl commands). ValueError otherwise."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"bad worker name {name[:60]!r}: use 1-128 letters, digits and ._:@+- "
                         "(starting with a letter or digit)")


def _check_counts(msg: object, *names: str) -> None:
    """Each named int field is >= 0 and each named float field finite and >= 0."""
    for field_name in names:
        value = getattr(msg, field_name)
        if not (value >= 0 and (not isinstance(value, float) or math.isfinite(value))):
            raise ValueError(f"{type(msg).__name__}.{field_name} must be finite and >= 0, got {value!r}")


# --- worker -> coordinator -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Join:
    """Worker -> coordinator, first message on its agent socket (and again after being fenced).

    Carries the calibration the worker ran at start: effective matmul FLOP/s, usable memory, host
    and device kind. The coordinator answers with `Welcome` (or `Error`), then, once a plan that
    includes the worker is ready, with a `PlanDelta`.
    """

    name: str
    host: str
    pid: int
    device: str  # "cpu", "cuda:0", ...
    flops: float  # calibrated matmul FLOP/s
    memory_bytes: int  # usable memory (after --memory-limit)
    threads: int  # torch intra-op threads: the cores this worker keeps busy
    cores: int = 0  # CPU cores this process may run on (0: unknown); the planner models co-located contention
    epoch: int = 0  # the epoch it trains in (0: none): a coordinator restarted from its journal takes it back
    step: int = 0  # steps it has applied

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "pid", "flops", "memory_bytes", "threads", "cores")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """Worker -> coordinator, after `Welcome`: the job is loaded and the model built, so a plan may
    include this worker now (until then a join would stall the running members at the switch)."""

    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphUpload:
    """Worker -> coordinator, when its `Welcome` asked for it: the job's model captured as a
    distributed graph (`plan.graph.Graph.to_dict()`: per layer FLOPs, parameter, activation and
    boundary bytes per sample), so the torch-free coordinator can plan from it."""

    name: str
    graph: dict[str, Any]

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Worker -> coordinator, every `Welcome.heartbeat_s` from the control agent thread.

    Sent while training computes too. A worker that misses heartbeats for `Welcome.lease_s` is
    declared failed (a stopped or hung process); a killed one is seen at once by the socket monitor.
    """

    name: str
    epoch: int  # the epoch the worker is training in (0 before its first plan)
    step: int  # optimizer steps applied so far

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "epoch", "step")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """Worker -> coordinator after each committed step.

    `loss` is the loss of the whole global batch (identical on every replica); `compute_s` is the
    time spent in forward/backward on this replica's share (stretched by a `--slowdown`), `comm_s`
    the time from issuing the gradient all-reduce to its end (waiting for slower replicas
    included), `step_s` the wall time of the step. In a sharded layout FSDP2's gathers and
    reduce-scatters (and the copies' exchange) run inside forward/backward: their time, waits
    included, is counted in `comm_s`, not `compute_s`. The coordinator refines its cost model from
    these: compute speed, pure communication (the smallest `comm_s` of a step) and the overhead
    `step_s − compute_s − comm_s` (copying gradients, the optimizer step).
    `digest` is a hash of the parameters after the step when the worker runs with
    `--digest-every`, else "". `lr` is the first parameter group's learning rate the step used
    (after `Job.lr_schedule`) and `grad_norm` the global gradient's L2 norm before clipping.
    `switching`: in this step every member voted to switch to the planned delta it holds, and they
    switch right after it. False while a planned delta is out means it reached some member after
    its vote: the members run one more whole step of the old epoch, which the coordinator may
    rather have them abandon for a join (it sends the delta again, aborting).
    """

    name: str
    epoch: int
    step: int  # steps applied, i.e. this report is for step index step-1
    loss: float
    samples: int  # this replica's share of the global batch
    global_batch: int
    compute_s: float
    comm_s: float
    step_s: float
    digest: str
    lr: float = 0.0
    grad_norm: float = 0.0  # may be inf or nan when training diverges: reported, not refused
    switching: bool = False

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "epoch", "step", "samples", "global_batch", "compute_s", "comm_s", "step_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """Worker -> coordinator: the worker formed the group of `epoch` and holds state at `step`.

    `reshard_bytes`/`reshard_s` say how much state it received (0 for a member already up to date)
    and how long forming the group and moving state took; `reshard_largest_sender` the bytes of the
    member that sent the most in this epoch's reshard (every member knows the whole transfer list).
    """

    name: str
    epoch: int
    step: int
    reshard_bytes: int
    reshard_s: float
    reshard_largest_sender: int = 0

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "epoch", "step", "reshard_bytes", "reshard_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalReport:
    """Worker -> coordinator: the evaluation after `step` on the whole held-out set (`loss` the mean
    over `samples`), sent by rank 0 once the members' sums are all-reduced; or, when `skipped` is
    not empty, why it was not finished (a failure interrupted it: it is never reported from part
    of the set)."""

    name: str
    step: int
    loss: float
    samples: int
    skipped: str

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "step", "samples")


@dataclass(frozen=True, slots=True, kw_only=True)
class Saved:
    """Worker -> coordinator: the model and optimizer state after `step` were written to `path`
    (`model.pt` and `optimizer.pt`, plain `state_dict`s, each written to a temporary name and
    renamed), `bytes` in all; or, when `error` is not empty, why they could not be."""

    name: str
    step: int
    path: str
    bytes: int
    error: str
    final: bool = True  # the job's end (False: a `ctl save` request)

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "step", "bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class StateLost:
    """Worker -> coordinator: entering `epoch`, the members found slices of the training state that
    none of them holds (`detail` names them: a sharded layout lost a slice and its copy). Nothing
    trains on made-up state: the coordinator stops the job and logs a `state_lost` event."""

    name: str
    epoch: int
    detail: str

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "epoch")


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpointed:
    """Worker (rank 0 of the epoch that wrote it) -> coordinator: a durable checkpoint of the state
    after step `step` is complete at `path` (every file written, checksummed in its manifest and
    renamed into place), or, with `error`, that writing it failed (nothing is at `path`)."""

    name: str
    step: int
    path: str
    seconds: float  # from the step boundary to the checkpoint in place
    bytes: int
    error: str

    def __post_init__(self) -> None:
        check_name(self.name)
        _check_counts(self, "step", "seconds", "bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeFailed:
    """Worker -> coordinator: the checkpoint that `PlanDelta.resume_path` of `epoch` names cannot be
    loaded (`detail` names the file: missing, truncated, a checksum that differs, or a state that
    does not fit the job's model). The coordinator drops it and resumes from the one before."""

    name: str
    epoch: int
    path: str
    detail: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Leave:
    """Worker -> coordinator: the worker leaves on purpose.

    reason: "finished" (ran all steps), "preempted" (SIGTERM), "drained" (after `ctl drain`),
    "error: ..." (the job raised).
    error: when the job's code raised, the exception as "TypeName: message" ("" otherwise).
    where: the innermost frame of that traceback in the job's own code (outside adaptrain, torch
    and the standard library), as "FILE:LINE in FUNCTION" ("" when none is).
    """

    name: str
    reason: str
    error: str = ""
    where: str = ""

    def __post_init__(self) -> None:
        check_name(self.name)


# --- coordinator -> worker -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """Coordinator -> worker, answer to `Join`.

    Carries the job itself (source text and its sha256) so that a fresh machine needs nothing but
    adaptrain installed and the coordinator's address, and the liveness contract.
    """

    name: str
    run_id: str
    job_ref: str  # "PATH:NAME" or "module:NAME" as given to the coordinator
    job_name: str  # the function in the job source that returns the Job
    job_source: str
    job_sha256: str
    heartbeat_s: float
    lease_s: float
    want_graph: bool  # the coordinator has no graph of the model yet: capture and upload it
    final_dir: str = ""  # where the trained model goes when the job finishes ("": nowhere)
    checkpoint_dir: str = ""  # where durable checkpoints go ("": none); the worker checks it can write there
    checkpoint_every: int = 0  # a checkpoint after every N-th step (0: only when asked)
    checkpoint_keep: int = 3  # the newest N complete checkpoints are kept (0: all)
    last_step: int = 0  # the last committed step the coordinator has logged: a re-registering worker re-sends later reports


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshLayout:
    """A plan's layout on the wire (`plan.layout.Layout` checks it: degrees >= 1 whose product is
    the number of members, equal shares within a data-parallel slot): the degrees, the members in
    rank order, each member's samples of every global batch, and the graph units of each pipeline
    stage."""

    dp_replicate: int
    dp_shard: int
    pp: int
    tp: int
    members: list[str]
    shares: list[int]
    stages: list[list[str]] = field(default_factory=list)  # graph units per pipeline stage ([] when pp = 1)

    def __post_init__(self) -> None:
        if len(self.members) != len(self.shares):
            raise ValueError(f"MeshLayout: {len(self.shares)} shares for {len(self.members)} members")
        if min(self.dp_replicate, self.dp_shard, self.pp, self.tp) < 1:
            raise ValueError("MeshLayout: degrees must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDelta:
    """Coordinator -> every member of the new plan (and to members that leave it).

    A new epoch: its `layout`: the members in rank order, the degrees that say who replicates and
    who shards what, and each member's samples of every global batch (`shares`; contiguous slices
    in data-parallel slot order, one share per slot summing to `global_batch`). A worker whose name
    is not among the members leaves at the switch.

    `senders`: workers that leave but hold slices of a sharded state nobody else has; they join
    the epoch's group (ranks after the members) only to send them, then leave.

    `abort` false (a planned change: join, drain): the workers switch at a step boundary that they
    agree on through the data plane. `abort` true (a failure): in-flight work of older epochs is
    abandoned at once and the new group is formed; survivors reconcile to the most advanced step.

    `resume_path` (more failed at once than the redundancy covers): no worker holds the training
    state; every member drops what it has and loads that durable checkpoint (any layout wrote it:
    it reshards on load), then the epoch starts from `resume_step`.
    """

    epoch: int
    reason: str
    layout: MeshLayout
    global_batch: int
    abort: bool
    senders: list[str] = field(default_factory=list)  # leaving holders: in the epoch's group to hand over their slices
    micro_batch: list[int] = field(default_factory=list)  # per member: samples per forward (0 / empty: whole share)
    resume_path: str = ""  # the state is lost: every member loads this checkpoint first ("": none)
    resume_step: int = 0  # ... which holds the state after this step
    from_sharded: bool = False  # some member may hold slices of a sharded layout: every member enters by the slice reshard
    # The layout of the epoch being left, as its members were told it (None: the job's first epoch):
    # what they hold, from which a member that holds nothing foresees its receives before the group forms.
    previous: MeshLayout | None = None

    @property
    def members(self) -> list[str]:
        return self.layout.members

    @property
    def shares(self) -> list[int]:
        return self.layout.shares


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Coordinator -> workers: a member of `epoch` is gone; abandon any collective of that epoch
    (or older) now. The `PlanDelta` of the next epoch follows as soon as it is solved."""

    epoch: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowdown:
    """Coordinator -> worker (`ctl slowdown NAME FACTOR`): a test knob that stretches the worker's
    compute by `factor` from its next step on (1.0: full speed), as a throttled or shared device
    would. Join-time calibration is not affected: the coordinator must find a slowed worker from
    its step timings."""

    factor: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveModel:
    """Coordinator -> one member (`ctl save PATH`): write the model and optimizer state to `path`
    at the next step boundary (as at the job's end), then answer with `Saved(final=False)`."""

    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointNow:
    """Coordinator -> every member (`ctl checkpoint`, the coordinator's SIGTERM): write a durable
    checkpoint at the next step boundary that all members agree on (they vote in the step's
    all-reduce, as for a planned switch); rank 0 answers with `Checkpointed`."""

    reason: str


# `Leave` reasons of a worker planned out at a step boundary, and the `Stop` reasons that then let it
# go once every member has switched: the step it may still be finishing is done, not abandoned.
PLANNED_EXITS = ("drained", "preempted")


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """Coordinator -> worker: stop now and exit (``ctl stop``, SIGTERM of the coordinator, the
    answer to a `Leave`, or the job already over when a worker joins). A step in flight is
    abandoned, except by a worker let go with a reason in PLANNED_EXITS (it finishes the boundary
    step its peers already did); the worker answers with `Leave(reason="stopped")`."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """Either direction (and coordinator -> ctl): the request could not be honoured.

    The coordinator sends one for every frame it cannot decode or accept and keeps serving.
    A worker that gets `ERR_STALE_EPOCH` has been fenced out: it drops its state and joins again.
    """

    code: str
    message: str


# --- rendezvous store (worker threads <-> coordinator) ---------------------------------------

STORE_OPS = ("set", "get", "add", "compare_set", "check", "wait", "num_keys", "delete")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRequest:
    """Worker store client -> coordinator: one operation on the rendezvous key-value store that
    torch.distributed uses to form each epoch's process group.

    `get` and `wait` are answered when all `keys` exist or after `timeout_s` (then `ok` false);
    `add` adds `amount` to an integer counter; `compare_set` takes `values` = [expected, desired].
    """

    req_id: int
    op: str
    keys: list[str]
    values: list[bytes]
    amount: int
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreReply:
    """Coordinator -> worker store client, answer to `StoreRequest` with the same `req_id`."""

    req_id: int
    ok: bool
    values: list[bytes]
    number: int  # add: the new value; check: 1/0; num_keys: the count; delete: 1/0
    error: str


# --- control (ctl <-> coordinator) -----------------------------------------------------------

CONTROL_COMMANDS = ("status", "plan", "graph", "events", "drain", "slowdown", "save", "checkpoint", "layout", "stop")


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRequest:
    """ctl -> coordinator control endpoint.

    command: "status", "plan" (args: [] or ["explain"]), "graph", "events" (args: [after_index]),
    "drain" (args: [NAME]), "slowdown" (args: [NAME, FACTOR]), "save" (args: [PATH]), "checkpoint",
    "layout" (args: [SPEC], as `coordinator --layout` takes it, or "auto"), "stop".
    """

    command: str
    args: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReply:
    """Coordinator -> ctl: `data` is the command's result as plain JSON-able values."""

    ok: bool
    data: dict[str, Any]
    error: str


NESTED_TYPES: tuple[type, ...] = (MeshLayout,)  # records that travel inside messages

MESSAGE_TYPES: tuple[type, ...] = (
    Checkpointed,
    ResumeFailed,
    CheckpointNow,
    StateLost,
    EvalReport,
    Saved,
    Join,
    Ready,
    GraphUpload,
    Heartbeat,
    StepReport,
    Ack,
    Leave,
    Welcome,
    PlanDelta,
    Abort,
    Slowdown,
    SaveModel,
    Stop,
    Error,
    StoreRequest,
    StoreReply,
    ControlRequest,
    ControlReply,
)

Message = (
    Checkpointed
    | ResumeFailed
    | CheckpointNow
    | StateLost
    | EvalReport
    | Saved
    | Join
    | Ready
    | GraphUpload
    | Heartbeat
    | StepReport
    | Ack
    | Leave
    | Welcome
    | PlanDelta
    | Abort
    | Slowdown
    | SaveModel
    | Stop
    | Error
    | StoreRequest
    | StoreReply
    | ControlRequest
    | ControlReply
)
