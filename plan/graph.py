"""The unified distributed graph, as the planner sees it: plain numbers per layer, no torch.

A worker captures the model (meta-device tracing) and uploads it as JSON; the coordinator rebuilds
a `Graph` with `Graph.from_dict`, which validates every field and raises `ValueError` naming the
layer and field at fault. All quantities are per sample unless the name says otherwise:
`forward_flops`, `backward_flops` (≈ 2× forward), `activation_bytes` (saved for backward) and
`boundary_bytes` (the output tensor handed to the next layer, what a pipeline cut sends);
`param_bytes` is per layer. A layer is a *unit*: one of the model's blocks (what FSDP2 shards and
gathers as one, what a pipeline cut falls between) or the root unit `ROOT_UNIT`, everything outside
them. `tensors` lists every parameter with its unit, so `plan.reshard` can say, torch-free, who holds
which slice of which tensor under any layout.

`Placement` and `TensorSpec` describe how one tensor lies on a device mesh (DTensor's vocabulary):
`Replicate()`, `Shard(dim)` or `Partial()` per mesh dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every device along the mesh dimension holds the whole tensor."""


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split along tensor dimension `dim` across the mesh dimension."""

    dim: int

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard dim must be non-negative, got {self.dim}")


@dataclass(frozen=True, slots=True)
class Partial:
    """Each device holds a partial sum; the tensor is their sum (pending reduction)."""


Placement = Replicate | Shard | Partial


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One placement per mesh dimension."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if len(self.mesh_shape) != len(self.placements):
            raise ValueError(
                f"TensorSpec: {len(self.mesh_shape)} mesh dimensions but {len(self.placements)} placements"
            )
        if any(n < 1 for n in self.mesh_shape):
            raise ValueError(f"TensorSpec: mesh sizes must be >= 1, got {self.mesh_shape}")

    def local_fraction(self) -> float:
        """The fraction of the whole tensor one device holds (sharding divides, the rest copies)."""
        fraction = 1.0
        for size, placement in zip(self.mesh_shape, self.placements):
            if isinstance(placement, Shard):
                fraction /= size
        return fraction


DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
               "float8_e5m2": 1}
ROOT_UNIT = "(root)"  # the unit of everything outside the model's blocks (no module path looks like this)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One parameter of the model: its fully qualified name (`model.named_parameters()`), shape,
    dtype (torch's name without "torch.") and the unit (layer) it belongs to; `state`: the optimizer
    state kept per element of it (Adam's two moments), as (key, dtype) in the optimizer's order, or
    None when the capture could not step the optimizer."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    unit: str
    state: tuple[tuple[str, str], ...] | None = None
    tp_dim: int | None = None  # the dim tensor parallelism splits (the job's tp plan); None: not split

    def __post_init__(self) -> None:
        if not self.fqn:
            raise ValueError("tensor: 'fqn' must be a non-empty string")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"tensor {self.fqn!r}: shape must be integers >= 0, got {list(self.shape)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {self.fqn!r}: unknown dtype {self.dtype!r}")
        if self.state is not None and any(d not in DTYPE_BYTES for _, d in self.state):
            raise ValueError(f"tensor {self.fqn!r}: unknown dtype in its optimizer state {list(self.state)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Its first dimension (what FSDP2 shards); 0 for a scalar."""
        return self.shape[0] if self.shape else 0

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fqn": self.fqn, "shape": list(self.shape), "dtype": self.dtype, "unit": self.unit}
        if self.state is not None:
            out["state"] = [[key, dtype] for key, dtype in self.state]
        if self.tp_dim is not None:
            out["tp_dim"] = self.tp_dim
        return out

    @staticmethod
    def from_dict(data: Any, index: int) -> TensorInfo:
        where = f"tensor {index}"
        required = {"fqn", "shape", "dtype", "unit"}
        if not isinstance(data, dict) or not required <= set(data) <= required | {"state", "tp_dim"}:
            raise ValueError(f"{where}: expected an object with fqn, shape, dtype and unit (and optionally state, tp_dim)")
        tp_dim = data.get("tp_dim")
        if tp_dim is not None and tp_dim not in (0, 1):
            raise ValueError(f"{where}: tp_dim must be 0 or 1, got {tp_dim!r:.40}")
        fqn, shape, dtype, unit = data["fqn"], data["shape"], data["dtype"], data["unit"]
        if not isinstance(fqn, str) or not isinstance(dtype, str) or not isinstance(unit, str):
            raise ValueError(f"{where}: fqn, dtype and unit must be strings")
        if not isinstance(shape, list):
            raise ValueError(f"{where} ({fqn!r}): shape must be a list of integers")
        state = data.get("state")
        if state is not None and not (isinstance(state, list) and all(
                isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in state)):
            raise ValueError(f"{where} ({fqn!r}): state must be a list of [key, dtype] string pairs")
        return TensorInfo(fqn=fqn, shape=tuple(shape), dtype=dtype, unit=unit,
                          state=tuple((k, d) for k, d in state) if state is not None else None, tp_dim=tp_dim)


_NUMBER_FIELDS = ("forward_flops", "backward_flops", "param_bytes", "activation_bytes", "boundary_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    name: str
    kind: str
    forward_flops: float
    backward_flops: float = -1.0  # -1: 2 × forward (filled in by __post_init__)
    param_bytes: int = 0
    activation_bytes: int = 0
    boundary_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("layer name must be non-empty")
        if self.backward_flops == -1.0:
            object.__setattr__(self, "backward_flops", 2.0 * self.forward_flops)
        for field in _NUMBER_FIELDS:
            value = getattr(self, field)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"layer {self.name!r}: {field} must be a finite number >= 0, got {value}")

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs per sample."""
        return self.forward_flops + self.backward_flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "param_bytes": self.param_bytes,
            "activation_bytes": self.activation_bytes,
            "boundary_bytes": self.boundary_bytes,
        }

    @staticmethod
    def from_dict(data: Any, index: int = 0) -> Layer:
        where = f"layer {index}"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        where = f"layer {index} ({name!r})"
        kind = data.get("kind", "")
        if not isinstance(kind, str):
            raise ValueError(f"{where}: 'kind' must be a string")
        unknown = set(data) - {"name", "kind", *_NUMBER_FIELDS}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if "forward_flops" not in data:
            raise ValueError(f"{where}: 'forward_flops' is required")
        values: dict[str, float] = {}
        for field in _NUMBER_FIELDS:
            if field not in data:
                continue
            value = data[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {field!r} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: {field!r} must be finite and >= 0, got {value!r}")
            values[field] = float(value)
        return Layer(
            name=name,
            kind=kind,
            forward_flops=values["forward_flops"],
            backward_flops=values.get("backward_flops", 2.0 * values["forward_flops"]),
            param_bytes=int(values.get("param_bytes", 0)),
            activation_bytes=int(values.get("activation_bytes", 0)),
            boundary_bytes=int(values.get("boundary_bytes", 0)),
        )


@dataclass(frozen=True, slots=True)
class Graph:
    """The model as an ordered chain of layers (the order a pipeline would cut), and the bytes of
    optimizer state the job's optimizer keeps for it (measured at capture; None: unknown, assume
    Adam's two moments).

    `sequential`: the units are the model itself, in order (an `nn.Sequential` whose children are
    exactly the layers), so each unit's output is the next one's input and any contiguous run of
    units is a pipeline stage. Otherwise the layers are only the order the units ran in (a root
    unit around them, a residual across them): no pipeline may cut the model."""

    layers: tuple[Layer, ...]
    optimizer_state_bytes: int | None = None
    tensors: tuple[TensorInfo, ...] = ()  # every parameter, in `named_parameters()` order (empty: unknown)
    sequential: bool = False

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"graph: duplicate layer names {dup}")
        fqns = [t.fqn for t in self.tensors]
        if len(set(fqns)) != len(fqns):
            raise ValueError(f"graph: duplicate tensor names {sorted({f for f in fqns if fqns.count(f) > 1})[:5]}")
        orphans = sorted({t.unit for t in self.tensors} - set(names))
        if orphans:
            raise ValueError(f"graph: tensors name units that are not layers: {orphans[:5]}")
        if self.optimizer_state_bytes is not None and self.optimizer_state_bytes < 0:
            raise ValueError(f"graph: optimizer_state_bytes must be >= 0, got {self.optimizer_state_bytes}")

    @property
    def forward_flops(self) -> float:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> float:
        return sum(layer.backward_flops for layer in self.layers)

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs per sample of the whole model."""
        return sum(layer.train_flops for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def activation_bytes(self) -> int:
        """Activation bytes saved for backward per sample, whole model."""
        return sum(layer.activation_bytes for layer in self.layers)

    @property
    def optimizer_state_factor(self) -> float:
        """Optimizer state as a multiple of the parameter bytes (2: Adam's two moments, if unknown)."""
        if self.optimizer_state_bytes is None or self.param_bytes == 0:
            return 2.0
        return self.optimizer_state_bytes / self.param_bytes

    @property
    def state_bytes(self) -> int:
        """What moves to a device that joins: parameters and optimizer state."""
        return self.param_bytes + round(self.param_bytes * self.optimizer_state_factor)

    def unit_tensors(self, unit: str) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.unit == unit)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": [layer.to_dict() for layer in self.layers]}
        if self.optimizer_state_bytes is not None:
            out["optimizer_state_bytes"] = self.optimizer_state_bytes
        if self.tensors:
            out["tensors"] = [t.to_dict() for t in self.tensors]
        if self.sequential:
            out["sequential"] = True
        return out

    @staticmethod
    def from_dict(data: Any) -> Graph:
        if not isinstance(data, dict):
            raise ValueError(f"graph: expected an object, got {type(data).__name__}")
        unknown = set(data) - {"layers", "optimizer_state_bytes", "tensors", "sequential"}
        if unknown:
            raise ValueError(f"graph: unknown fields {sorted(unknown)}")
        layers = data.get("layers")
        if not isinstance(layers, list) or not layers:
            raise ValueError("graph: 'layers' must be a non-empty list")
        opt = data.get("optimizer_state_bytes")
        if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int) or opt < 0):
            raise ValueError(f"graph: 'optimizer_state_bytes' must be an integer >= 0, got {opt!r}")
        tensors = data.get("tensors", [])
        if not isinstance(tensors, list):
            raise ValueError("graph: 'tensors' must be a list")
        sequential = data.get("sequential", False)  # (absent from graphs captured before pipelines)
        if not isinstance(sequential, bool):
            raise ValueError(f"graph: 'sequential' must be true or false, got {sequential!r}")
        return Graph(tuple(Layer.from_dict(item, i) for i, item in enumerate(layers)), opt,
                     tuple(TensorInfo.from_dict(item, i) for i, item in enumerate(tensors)), sequential)
