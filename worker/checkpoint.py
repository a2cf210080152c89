"""Durable checkpoints with torch.distributed.checkpoint (DCP): written by the members in parallel,
in the background, readable by any later set of workers in any layout, and by plain torch tooling.

On disk, `CHECKPOINT_DIR/step-<N>/` holds DCP's own files (`.metadata`, `__<rank>_<i>.distcp`) and
`adaptrain.json`, the manifest: the step, the job's sha256, the layout that wrote it, and the size
and sha256 of every file. Everything is written under `.step-<N>.e<EPOCH>.partial/` first; rank 0
writes the manifest last and then renames the directory, so a `step-<N>` directory is either whole
or absent, and a file damaged later (a truncated copy, a bad disk) fails its checksum at load.

What is saved is `{"model", "optim", "step"}` as `get_state_dict` gives it: keyed by the parameters'
fully qualified names whatever the executor (a plain replica or FSDP2's DTensor shards), so DCP
reshards on load and a checkpoint of any layout resumes in any other; DCP's planner spreads the
replicated tensors of a replicated layout over the members, each writing its part.

Asynchronous (`dcp.async_save`): the step waits only while the state is copied aside (staging), and
the files are written by a thread. That thread's collectives (DCP gathers the members' plans and
write results) run on a group of their own, never the epoch's training group: two threads issuing
collectives on one gloo group could interleave differently on different members. A member dying
mid-write blocks that thread only, until the group's timeout; the checkpoint then fails, and no
step ever waited for it. Why not DCP's `use_collectives=False`: every member would then write every
replicated tensor, and it changes the checkpoint format.

Loading takes no group: each member checks the manifest's checksums, then either reads the whole
checkpoint into the plain model (`load`, for a replicated layout, `no_dist`) or, for a sharded one,
only its own slices of every parameter and optimizer tensor plus the small whole-state part
(buffers, optimizer scalars and hyper-parameters: `load_slices`), so that a model no member could
hold whole resumes too. The epoch's entry then brings each member exactly what its layout gives it
(the copies of a sharded layout come from their holders, as after any reshard). DCP reads a slice
through a load planner that asks for one row range of each tensor (`_RowsPlanner`): DCP's own
resharding does the rest, whatever layout wrote the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from plan.layout import Layout
from plan.reshard import TensorShape
from worker.parallel.slices import PARAM, LocalState, Piece

MANIFEST = "adaptrain.json"
FORMAT = 1  # the manifest's version


class CheckpointError(Exception):
    """A checkpoint that cannot be used: missing, incomplete or damaged; the message names the file."""


@dataclass(frozen=True, slots=True)
class Written:
    """What a finished checkpoint write reports (rank 0): `error` empty on success."""

    step: int
    path: str
    seconds: float  # from the step boundary to the manifest renamed into place
    bytes: int
    error: str = ""


def state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """The state DCP saves and loads: parameters and optimizer state by FQN, and the step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": torch.tensor(step, dtype=torch.int64)}


def check_writable(directory: str) -> None:
    """Raise OSError (naming the path) unless this process can create files in `directory`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".probe-{os.getpid()}-{threading.get_ident()}"
    try:
        with probe.open("wb") as f:
            f.write(b"ok")
    finally:
        probe.unlink(missing_ok=True)


class Writer:
    """One member's checkpoint writes: at most one in flight; the newer waits for the older when
    both belong to the same epoch (the older will finish), and does not when the older one's
    epoch is gone (its group may be hung on a dead member: it fails on its own)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self._epoch = -1  # the epoch of the newest write
        self._groups: list[tuple[Future[Any], Any]] = []  # (write, its group) until the write ends
        self._reported = threading.Event()  # the newest write is over: committed and reported, or failed
        self._reported.set()

    def busy(self) -> bool:
        return not self._reported.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the write in flight is finished and reported (or `timeout_s` passed)."""
        self._reported.wait(timeout_s)

    def start(self, state: dict[str, Any], *, directory: str, step: int, epoch: int, rank: int, world: int,
              layout: dict[str, Any], job_sha256: str, keep: int, pg: Any,
              report: Callable[[Written], None]) -> float:
        """Stage `state` and write it in the background as `directory/step-<step>`; rank 0 calls
        `report` once it is complete (or failed). Returns the seconds spent staging. Every member of the epoch calls this at the same
        step boundary, with the same `pg` (the epoch's checkpoint group)."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save

        t0 = time.perf_counter()
        if self.busy() and self._epoch == epoch:
            self.log(f"checkpoint of step {step}: waiting for the previous one to finish writing")
            self.wait()
        root = Path(directory)
        final = root / f"step-{step}"
        partial = root / f".step-{step}.e{epoch}.partial"
        self._reported = reported = threading.Event()
        saving = async_save(state, storage_writer=FileSystemWriter(str(partial)), process_group=pg)
        assert isinstance(saving, Future)  # (the default stager gives a Future; a custom one could not)
        future: Future[Any] = saving
        staged_s = time.perf_counter() - t0
        self._epoch = epoch
        self._groups.append((future, pg))
        manifest = {"format": FORMAT, "step": step, "epoch": epoch, "world": world, "layout": layout,
                    "job_sha256": job_sha256, "written_at": time.time()}

        def finished(f: Future[Any]) -> None:
            try:
                if rank == 0:
                    _finish(f)
            finally:
                reported.set()

        def _finish(f: Future[Any]) -> None:
            try:
                f.result()
                size = _commit(partial, final, manifest)
                _prune(root, keep, newest=step)
                report(Written(step, str(final), time.perf_counter() - t0, size))
            except Exception as e:  # noqa: BLE001 (a failed write is reported, never raised into training)
                shutil.rmtree(partial, ignore_errors=True)
                report(Written(step, str(final), time.perf_counter() - t0, 0, error=f"{type(e).__name__}: {e}"[:500]))

        future.add_done_callback(finished)
        self.log(f"checkpoint of step {step}: staged in {staged_s * 1e3:.0f} ms, writing to {final}")
        return staged_s

    def in_use(self, pg: Any) -> bool:
        """Whether a write in flight uses the group `pg`."""
        self._groups = [(f, g) for f, g in self._groups if not f.done()]
        return any(g is pg for _, g in self._groups)


def _commit(partial: Path, final: Path, manifest: dict[str, Any]) -> int:
    """Checksum every file DCP wrote, write the manifest, and rename `partial` to `final`; the bytes."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(partial.iterdir()):
        if path.is_file():
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    if ".metadata" not in files:
        raise CheckpointError(f"{partial}: DCP wrote no .metadata")
    body = json.dumps({**manifest, "files": files}, indent=1).encode()
    tmp = partial / f".{MANIFEST}.tmp"
    with tmp.open("wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)
    _fsync_dir(partial)
    if final.exists():  # the same step written before (a resumed run passes it again): keep one
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    return sum(int(v["bytes"]) for v in files.values()) + len(body)


def _prune(root: Path, keep: int, *, newest: int) -> None:
    """Keep the `keep` newest complete checkpoints (0: all); drop partial writes of older steps."""
    if keep > 0:
        complete = sorted((_step_of(p.name), p) for p in root.glob("step-*") if (p / MANIFEST).exists())
        for _, path in complete[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".step-*.partial"):
        if _step_of(path.name.removeprefix(".").split(".")[0]) < newest:
            shutil.rmtree(path, ignore_errors=True)


def _step_of(name: str) -> int:
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        return -1


def verify(path: str) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, once every file it lists has its size and sha256;
    CheckpointError naming the first file that does not."""
    root = Path(path)
    try:
        manifest: dict[str, Any] = json.loads((root / MANIFEST).read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        raise CheckpointError(f"{root}: no {MANIFEST} (not a complete adaptrain checkpoint)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{root / MANIFEST}: unreadable manifest ({e})") from None
    for name, want in sorted(files.items()):
        file = root / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{file}: missing") from None
        if size != want["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {want['bytes']} (truncated?)")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (damaged)")
    manifest["step"] = step
    return manifest


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint at `path` into a plain (unwrapped) model and its optimizer, after
    checking its checksums; the step it was taken after. CheckpointError when it is damaged or
    does not fit the model."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    manifest = verify(path)
    state = state_dict(model, optimizer, 0)
    try:
        dcp_load(state, checkpoint_id=path, no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: does not load into this job's model ({str(e).splitlines()[0][:300]})") from None
    step = int(state["step"])
    if step != manifest["step"]:
        raise CheckpointError(f"{path}: holds step {step}, the manifest says {manifest['step']}")
    return step


@dataclass(frozen=True, slots=True)
class Slices:
    """What `load_slices` read: the member's state, and the tensor bytes it read of how many."""

    local: LocalState
    read_bytes: int
    total_bytes: int


def load_slices(path: str, tensors: list[TensorShape], layout: Layout, rank: int) -> Slices:
    """Member `rank`'s slices of `layout` (`Layout.slice_of` of every parameter and of every
    optimizer tensor shaped like it) and the whole-state part, read from the checkpoint at `path`
    after checking its checksums, as a LocalState of the checkpoint's step. CheckpointError when it
    is damaged or does not fit the job's parameters."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    manifest = verify(path)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 (any unreadable metadata is a damaged checkpoint)
        raise CheckpointError(f"{path}/.metadata: unreadable ({str(e).splitlines()[0][:300]})") from None
    entries = metadata.state_dict_metadata
    params = {t.name: t for t in tensors}
    missing = [n for n in params if f"model.{n}" not in entries]
    if missing:
        raise CheckpointError(f"{path}: does not hold {', '.join(missing[:5])} of this job's model")
    ranges = {n: layout.slice_of(rank, t.rows, t.numel) for n, t in params.items()}
    roles = {key: _role(where, params) for key, where in (metadata.planner_data or {}).items()}
    dest: dict[str, Any] = {}
    rows_at: dict[str, int] = {}  # key -> the first row of the slice it reads
    total = 0
    for key, md in entries.items():
        if not isinstance(md, TensorStorageMetadata):
            dest[key] = None  # (a hyper-parameter, the param_groups' names: read whole)
            continue
        total += md.size.numel() * md.properties.dtype.itemsize
        kind, fqn, name = roles.get(key, ("other", "", ""))
        t = params.get(fqn)
        shape = (md.size.numel(), md.size[0] if len(md.size) else 0)
        if kind == "param" and t is not None and shape != (t.numel, t.rows):
            raise CheckpointError(f"{path}: {fqn} has shape {list(md.size)} there, which does not fit this "
                                  f"job's model ({t.rows} rows, {t.numel} elements)")
        param_md = entries.get(f"model.{fqn}")
        if kind in ("param", "optim") and isinstance(param_md, TensorStorageMetadata) and md.size == param_md.size:
            roles[key] = ("sliced", fqn, name)  # shaped like its parameter: this member's rows of it
            lo, hi = ranges[fqn]
            if t is not None and t.rows and (lo, hi) != (0, t.numel):
                per_row = t.numel // t.rows
                rows_at[key] = lo // per_row
                dest[key] = torch.empty(((hi - lo) // per_row, *md.size[1:]), dtype=md.properties.dtype)
                continue
        dest[key] = torch.empty(md.size, dtype=md.properties.dtype)  # (Adam's step, a buffer: whole)
    try:
        planner = _RowsPlanner(rows_at)
        dcp_load(dest, checkpoint_id=path, planner=planner, no_dist=True)
        dest.update(planner.values)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e).splitlines()[0][:300]})") from None
    step = int(dest["step"])
    if step != manifest["step"]:
        raise CheckpointError(f"{path}: holds step {step}, the manifest says {manifest['step']}")
    read = sum(v.numel() * v.element_size() for v in dest.values() if isinstance(v, torch.Tensor))
    return Slices(_as_local(step, params, roles, dest, ranges), read, total)


def _role(where: tuple[Any, ...], params: dict[str, TensorShape]) -> tuple[str, str, str]:
    """What a checkpoint key holds, from DCP's path of it: ("param", fqn, PARAM), ("optim", fqn,
    key), ("group", index, name), ("buffer", name, ""), or ("other", "", "")."""
    if where[0] == "model" and len(where) == 2:
        return ("param", where[1], PARAM) if where[1] in params else ("buffer", where[1], "")
    if where[:2] == ("optim", "state") and len(where) == 4 and where[2] in params:
        return "optim", where[2], where[3]
    if where[:2] == ("optim", "param_groups") and len(where) == 4 and where[3] != "params":
        return "group", str(where[2]), where[3]
    return "other", "", ""


def _as_local(step: int, params: dict[str, TensorShape], roles: dict[str, tuple[str, str, str]],
              dest: dict[str, Any], ranges: dict[str, tuple[int, int]]) -> LocalState:
    """The LocalState of what `load_slices` read: keys in one order on every member (the parameter,
    then its optimizer tensors by name)."""
    local = LocalState(step=step, keys={})
    data: dict[str, dict[str, torch.Tensor]] = {n: {} for n in params}
    scalars: dict[str, dict[str, Any]] = {n: {} for n in params}
    groups: dict[int, dict[str, Any]] = {}
    for key, value in dest.items():
        kind, owner, name = roles.get(key, ("other", "", ""))
        if kind == "sliced":
            data[owner][name] = value.reshape(-1)
        elif kind == "optim":
            scalars[owner][name] = value
        elif kind == "group":
            groups.setdefault(int(owner), {})[name] = value
        elif kind == "buffer":
            local.buffers[owner] = value
    for fqn in params:
        ordered = {PARAM: data[fqn][PARAM], **{k: v for k, v in sorted(data[fqn].items()) if k != PARAM}}
        lo, hi = ranges[fqn]
        local.keys[fqn] = tuple(ordered)
        local.dtypes[fqn] = {k: str(v.dtype).removeprefix("torch.") for k, v in ordered.items()}
        local.pieces[fqn] = [Piece(lo, hi, ordered)] if hi > lo else []
        local.scalars[fqn] = scalars[fqn]
    local.hyper = [groups[i] for i in sorted(groups)]
    return local


class _RowsPlanner(DefaultLoadPlanner):
    """DCP's load planner, asking for rows [r, r + len) of the tensors in `rows_at` (the
    destination tensor holds just those rows) and for the whole of everything else."""

    def __init__(self, rows_at: dict[str, int]) -> None:
        super().__init__(flatten_state_dict=False)
        self._rows_at = rows_at
        self.values: dict[str, Any] = {}  # the non-tensor items read (DCP's load keeps them in a copy of ours)

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        tensor: torch.Tensor = self.state_dict[index.fqn]  # (a slice: DCP's own lookup wants a whole tensor there)
        return tensor

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        whole = {k: v for k, v in self.state_dict.items() if k not in self._rows_at}
        plan = create_default_local_load_plan(whole, self.metadata, True)
        items = list(plan.items)
        for key, row in self._rows_at.items():
            tensor = self.state_dict[key]
            if tensor.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            offsets = torch.Size((row, *([0] * (tensor.dim() - 1))))
            items += create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(offsets=offsets,
                                                                                       sizes=tensor.size())])
        return LoadPlan(items)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
