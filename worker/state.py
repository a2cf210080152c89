"""Training state (model, optimizer, step) as a small skeleton plus a few flat tensors.

State moves between workers when a joiner (or a survivor that fell a step behind) needs it. Going
through `torch.save` into bytes costs several full copies (seconds of copying for the 129 MB of a
10M-parameter model with Adam state). Instead, every tensor is concatenated into one
flat buffer per dtype, which goes over torch.distributed as it is, and the rest of the structure
(step, optimizer hyper-parameters, tensor shapes, and 0-d CPU tensors such as Adam's step count,
inline) travels as a small msgpack skeleton (below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import torch


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor of the structure: the `index`-th of the packed tensors (`meta["refs"]` says where)."""

    index: int


# The skeleton is msgpack (C-fast, and safe on bytes from the network: it builds only data), with two
# extension types: a tuple (msgpack has only arrays, and optimizer hyper-parameters such as Adam's
# betas are tuples) and a tensor's place. Not `torch.save` + `torch.load(weights_only=True)`: its
# pure-Python unpickler takes a fifth of a 10M GPT join's reshard for a 12 KB skeleton.
_TUPLE, _TENSOR, _SCALAR = 1, 2, 3
@dataclass(slots=True)
class Packed:
    skeleton: torch.Tensor  # uint8, the torch.save of the structure with tensors replaced by refs
    buffers: list[torch.Tensor]  # one flat tensor per dtype


def pack(state: dict[str, Any], device: torch.device) -> Packed:
    tensors: list[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() == 0 and obj.device.type == "cpu":
            return obj.detach()  # (inline: a 0-d CPU tensor, e.g. Adam's step, travels in the skeleton)
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return TensorRef(len(tensors) - 1)
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = strip(state)
    dtypes = sorted({t.dtype for t in tensors}, key=str)
    refs: list[tuple[int, int, tuple[int, ...]]] = []
    offsets = [0] * len(dtypes)
    for t in tensors:
        b = dtypes.index(t.dtype)
        refs.append((b, offsets[b], tuple(t.shape)))
        offsets[b] += t.numel()
    buffers = [torch.cat([t.reshape(-1).to(device) for t in tensors if t.dtype == dt]) for dt in dtypes]
    meta = {"skeleton": skeleton, "refs": refs, "dtypes": [str(dt) for dt in dtypes], "sizes": offsets}
    return Packed(skeleton=torch.frombuffer(bytearray(_dumps(meta)), dtype=torch.uint8).to(device),
                  buffers=buffers)


def read_meta(skeleton: torch.Tensor) -> dict[str, Any]:
    meta: dict[str, Any] = _loads(skeleton.cpu().numpy().tobytes())
    return meta


def empty_buffers(meta: dict[str, Any], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(size, dtype=getattr(torch, name.removeprefix("torch.")), device=device)
            for name, size in zip(meta["dtypes"], meta["sizes"])]


def unpack(meta: dict[str, Any], buffers: list[torch.Tensor]) -> dict[str, Any]:
    refs = meta["refs"]

    def fill(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            b, offset, shape = refs[obj.index]
            numel = 1
            for d in shape:
                numel *= d
            return buffers[b][offset:offset + numel].view(shape)
        if isinstance(obj, dict):
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v) for v in obj)
        return obj

    state: dict[str, Any] = fill(meta["skeleton"])
    return state


def _dumps(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_encode, strict_types=True, use_bin_type=True)  # type: ignore[no-any-return]


def _loads(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_decode, strict_map_key=False, raw=False)


def _encode(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _dumps(list(obj)))
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_TENSOR, _dumps(obj.index))
    if isinstance(obj, torch.Tensor):  # (0-d, on the CPU: `pack` keeps only those inline)
        return msgpack.ExtType(_SCALAR, _dumps([str(obj.dtype).removeprefix("torch."),
                                                obj.contiguous().view(-1).view(torch.uint8).numpy().tobytes()]))
    if isinstance(obj, dict):  # an OrderedDict (a state_dict): strict types sends subclasses here
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    raise TypeError(f"training state holds a {type(obj).__name__}, which cannot travel between workers")


def _decode(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(_loads(data))
    if code == _TENSOR:
        return TensorRef(_loads(data))
    if code == _SCALAR:
        dtype, raw = _loads(data)
        return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(()).clone()
    raise ValueError(f"unknown extension type {code} in a training-state skeleton")


def nbytes(packed: Packed) -> int:
    return packed.skeleton.numel() + sum(b.numel() * b.element_size() for b in packed.buffers)
