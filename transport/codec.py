"""The msgpack codec of the control plane: one message <-> one frame.

A frame is a msgpack map ``{"v": PROTOCOL_VERSION, "kind": <class name>, **fields}``. This is the
only module that touches msgpack.

Decoding is strict because its input comes from the network: a frame larger than `max_bytes` is
refused before unpacking; the unpacker gets explicit size limits (no string, array or map can claim
more elements than the frame has bytes, extension types are refused outright); then the map must
carry exactly "v", "kind" and the fields of that kind, each of the type its dataclass annotation
names. Every failure is one `CodecError` (a `ValueError`) whose `code` is `ERR_PROTOCOL` when the
peer speaks another protocol version and `ERR_DECODE` otherwise, so a daemon can answer it with an
`Error` reply and keep serving.

Validation is driven by the annotations of `transport.messages` (resolved once per class with
`typing.get_type_hints`), limited to the types that module allows: int (a bool is not an int),
float (an int is accepted and converted), str, bytes, bool, ``X | None``, ``list[X]``,
``dict[str, Any]`` (any msgpack value, str keys) and the nested records of `NESTED_TYPES` (a map with
exactly the record's fields, each checked the same way). `encode` runs the same checks, so a sender's bug
is a `TypeError` with a traceback at the sender rather than an `Error` reply from its peer.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import msgpack

from .messages import ERR_DECODE, ERR_PROTOCOL, MESSAGE_TYPES, NESTED_TYPES, PROTOCOL_VERSION, Message

MAX_FRAME_BYTES = 16 * 1024 * 1024

_KINDS: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}
_HEADER = ("v", "kind")


class CodecError(ValueError):
    """A frame that cannot be decoded (or encoded). `code` is `ERR_DECODE` or `ERR_PROTOCOL`."""

    def __init__(self, message: str, *, code: str = ERR_DECODE) -> None:
        super().__init__(message)
        self.code = code


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The annotation of each field of a message class, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(value: Any, tp: Any, where: str) -> Any:
    """`value` checked against annotation `tp` (ints converted for float); TypeError otherwise.
    A nested record goes out as a map (encoding: `value` is the record) and comes back as the
    record (decoding: `value` is the map)."""
    if tp is Any:
        return value
    if tp in NESTED_TYPES:
        return _convert_record(value, tp, where)
    if tp is float and type(value) is int:
        return float(value)
    if tp in (int, float, str, bytes, bool):
        if type(value) is not tp:  # exact: a bool is not an int, a str subclass is not a str
            raise TypeError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is supported
        return _convert(value, inner, where)
    if origin is list:
        if type(value) is not list:
            raise TypeError(f"{where}: expected a list, got {type(value).__name__}")
        return [_convert(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict and args[0] is str:
        if type(value) is not dict:
            raise TypeError(f"{where}: expected a map, got {type(value).__name__}")
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"{where}: expected str keys, got {type(key).__name__}")
            out[key] = _convert(item, args[1], f"{where}[{key!r}]")
        return out
    raise AssertionError(f"{where}: the codec does not support the annotation {tp!r}")


def _convert_record(value: Any, tp: type, where: str) -> Any:
    fields = _field_types(tp)
    if isinstance(value, tp):  # encoding
        return {name: _convert(getattr(value, name), ftp, f"{where}.{name}") for name, ftp in fields.items()}
    if type(value) is not dict:
        raise TypeError(f"{where}: expected a {tp.__name__} map, got {type(value).__name__}")
    missing = [name for name in fields if name not in value]
    extra = [str(key) for key in value if key not in fields]
    if missing or extra:
        raise TypeError(f"{where}: a {tp.__name__} needs exactly the fields {', '.join(fields)}"
                        f"{'; missing ' + ', '.join(missing) if missing else ''}"
                        f"{'; unknown ' + ', '.join(extra) if extra else ''}")
    values = {name: _convert(value[name], ftp, f"{where}.{name}") for name, ftp in fields.items()}
    try:
        return tp(**values)
    except ValueError as exc:  # the record's own checks
        raise TypeError(f"{where}: {exc}") from None


def encode(msg: Message, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """One frame for `msg`. TypeError: not a message or a field of the wrong type; CodecError:
    the frame would exceed `max_bytes` (the peer would refuse it)."""
    cls: type = type(msg)
    if _KINDS.get(cls.__name__) is not cls:
        raise TypeError(f"not a transport message: {cls.__qualname__}")
    frame: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": cls.__name__}
    for name, tp in _field_types(cls).items():
        frame[name] = _convert(getattr(msg, name), tp, f"{cls.__name__}.{name}")
    data: bytes = msgpack.packb(frame, use_bin_type=True)
    if len(data) > max_bytes:
        raise CodecError(f"{cls.__name__} encodes to {len(data)} bytes, over the limit of {max_bytes}")
    return data


def decode(frame: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """The message in `frame`, validated field by field; CodecError for anything else."""
    if len(frame) > max_bytes:
        raise CodecError(f"frame of {len(frame)} bytes is over the limit of {max_bytes}")
    limit = len(frame)  # no container or string can hold more items than the frame has bytes
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,  # no extension types (timestamps included) on this wire
        )
    except Exception as exc:  # msgpack raises many types on garbage; none may crash the daemon
        raise CodecError(f"frame is not valid msgpack: {exc!r}") from None
    if type(obj) is not dict:
        raise CodecError(f"frame must be a msgpack map, got {type(obj).__name__}")
    if "v" not in obj:
        raise CodecError('frame has no protocol version ("v")')
    version = obj["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise CodecError(
            f"peer speaks protocol version {version!r}, this side speaks {PROTOCOL_VERSION}: "
            "run the same adaptrain version on both sides",
            code=ERR_PROTOCOL,
        )
    kind = obj.get("kind")
    if type(kind) is not str:
        raise CodecError(f'frame has no message kind ("kind" is {kind!r})')
    cls = _KINDS.get(kind)
    if cls is None:
        raise CodecError(f"unknown message kind {kind!r}")
    fields = _field_types(cls)
    missing = [name for name in fields if name not in obj]
    extra = [str(key) for key in obj if key not in fields and key not in _HEADER]
    if missing:
        raise CodecError(f"{kind} frame lacks field(s) {', '.join(missing)}")
    if extra:
        raise CodecError(f"{kind} frame has unknown field(s) {', '.join(extra)}")
    try:
        values = {name: _convert(obj[name], tp, f"{kind}.{name}") for name, tp in fields.items()}
    except TypeError as exc:
        raise CodecError(str(exc)) from None
    try:
        msg: Message = cls(**values)  # the message's own checks (names, counts)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    return msg
