"""The codec: every message round-trips; every malformed frame is one CodecError with its code."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

import transport as t
from transport import CodecError, decode, encode

SAMPLES: list[t.Message] = [
    t.Join(name="w1", host="node-a", pid=4242, device="cuda:0", flops=1.5e13,
           memory_bytes=80 * 2**30, threads=8),
    t.Heartbeat(name="w1", epoch=3, step=120),
    t.StepReport(name="w1", epoch=3, step=121, loss=2.75, samples=16, global_batch=64,
                 compute_s=0.12, comm_s=0.05, step_s=0.2, digest=""),
    t.Slowdown(factor=3.0),
    t.Ready(name="w1"),
    t.Saved(name="w1", step=300, path="/runs/gpt/final", bytes=9_938_561, error=""),
    t.SaveModel(path="/runs/gpt/step-120"),
    t.EvalReport(name="w1", step=100, loss=1.25, samples=512, skipped=""),
    t.StateLost(name="w1", epoch=7, detail="no member holds blocks.0.weight[0:64] of step 12"),
    t.Checkpointed(name="w1", step=200, path="/runs/gpt/checkpoints/step-200", seconds=1.25, bytes=129_000_000,
                   error=""),
    t.ResumeFailed(name="w2", epoch=9, path="/runs/gpt/checkpoints/step-200",
                   detail="__0_0.distcp: 100 bytes, the manifest says 4096 (truncated?)"),
    t.CheckpointNow(reason="ctl checkpoint"),
    t.GraphUpload(name="w1", graph={"layers": [{"name": "0", "kind": "Linear", "forward_flops": 64.0,
                                                "param_bytes": 132}]}),
    t.Ack(name="w1", epoch=4, step=121, reshard_bytes=126_000_000, reshard_s=0.15),
    t.Leave(name="w1", reason="error: RuntimeError('boom') ünïcode"),
    t.Welcome(name="w1", run_id="run-1", job_ref="examples/gpt.py:job", job_name="job",
              job_source="def job():\n    return 1\n", job_sha256="ab" * 32, heartbeat_s=0.2,
              lease_s=1.0, want_graph=True),
    t.PlanDelta(epoch=4, reason="joined w3", layout=t.MeshLayout(dp_replicate=3, dp_shard=1, pp=1, tp=1,
                                                                  members=["w1", "w2", "w3"], shares=[22, 21, 21]),
                global_batch=64, abort=False),
    t.PlanDelta(epoch=5, reason="", layout=t.MeshLayout(dp_replicate=1, dp_shard=2, pp=1, tp=1, members=["a", "b"],
                                                        shares=[3, 0]), global_batch=3, abort=True),
    t.PlanDelta(epoch=6, reason="join", layout=t.MeshLayout(dp_replicate=1, dp_shard=3, pp=1, tp=1, members=["a", "c", "b"],
                                                            shares=[1, 1, 1]), global_batch=3, abort=False,
                previous=t.MeshLayout(dp_replicate=1, dp_shard=2, pp=1, tp=1, members=["a", "b"], shares=[2, 1])),
    t.Abort(epoch=4, reason="failed w2"),
    t.Stop(reason="ctl stop"),
    t.Error(code=t.ERR_STALE_EPOCH, message="epoch 3 is over"),
    t.StoreRequest(req_id=7, op="compare_set", keys=["epoch4/k"], values=[b"", b"\x00\xff" * 10],
                   amount=0, timeout_s=30.0),
    t.StoreReply(req_id=7, ok=True, values=[b"v"], number=-1, error=""),
    t.ControlRequest(command="drain", args=["w2"]),
    t.ControlRequest(command="status"),
    t.ControlReply(ok=True, data={"workers": [{"name": "w1", "speed": 1.0}], "epoch": 4,
                                  "none": None, "raw": b"x", "nested": {"a": [1, [2.5]]}},
                   error=""),
]


def _sample(cls: type) -> Any:
    return next(m for m in SAMPLES if type(m) is cls)


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(t.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: t.Message) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert back == msg and type(back) is type(msg)
    assert decode(encode(back)) == msg


def test_frame_layout() -> None:
    obj = msgpack.unpackb(encode(t.Stop(reason="x")), raw=False)
    assert obj == {"v": t.PROTOCOL_VERSION, "kind": "Stop", "reason": "x"}


def _frame(**overrides: Any) -> dict[str, Any]:
    """A valid Heartbeat frame as a dict, with some keys replaced (or removed with a sentinel)."""
    obj: dict[str, Any] = {"v": t.PROTOCOL_VERSION, "kind": "Heartbeat", "name": "w1", "epoch": 1,
                           "step": 2}
    obj.update(overrides)
    return {k: v for k, v in obj.items() if v is not _DROP}


_DROP = object()


def _reject(frame: bytes | dict[str, Any], code: str = t.ERR_DECODE, match: str | None = None) -> None:
    raw = frame if isinstance(frame, bytes) else msgpack.packb(frame, use_bin_type=True)
    with pytest.raises(CodecError, match=match) as info:
        decode(raw)
    assert info.value.code == code
    assert isinstance(info.value, ValueError)


def test_valid_frame_helper_decodes() -> None:
    assert decode(msgpack.packb(_frame(), use_bin_type=True)) == t.Heartbeat(name="w1", epoch=1,
                                                                            step=2)


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x92\x01", b"\x81\xa1v", b"\xff" * 100,
                                     b"\x81\x01\x02\x03"])
def test_garbage_bytes(garbage: bytes) -> None:
    _reject(garbage, match="msgpack")


@pytest.mark.parametrize("obj", [[1, 2], "Heartbeat", 1, None, b"bytes"])
def test_not_a_map(obj: Any) -> None:
    _reject(msgpack.packb(obj, use_bin_type=True), match="map")


def test_trailing_bytes() -> None:
    _reject(encode(t.Stop(reason="x")) + b"\x00", match="msgpack")


def test_wrong_version_is_a_protocol_error() -> None:
    _reject(_frame(v=t.PROTOCOL_VERSION + 1), code=t.ERR_PROTOCOL, match="protocol version")
    _reject(_frame(v="1"), code=t.ERR_PROTOCOL)
    _reject(_frame(v=True), code=t.ERR_PROTOCOL)  # True == 1 in Python, not on the wire
    # a peer of another version may not even know our kinds: the version is checked first
    _reject(_frame(v=99, kind="FromTheFuture"), code=t.ERR_PROTOCOL)


def test_missing_header() -> None:
    _reject(_frame(v=_DROP), match='"v"')
    _reject(_frame(kind=_DROP), match="kind")
    _reject(_frame(kind=3), match="kind")


def test_unknown_kind() -> None:
    _reject(_frame(kind="Shutdown"), match="unknown message kind 'Shutdown'")
    _reject(_frame(kind="Message"), match="unknown")


def test_missing_field() -> None:
    _reject(_frame(step=_DROP), match="lacks field.*step")
    # even one with a default in the dataclass: encode always writes every field
    _reject({"v": t.PROTOCOL_VERSION, "kind": "ControlRequest", "command": "status"}, match="args")


def test_extra_field() -> None:
    _reject(_frame(extra=1), match="unknown field.*extra")
    bin_key: dict[Any, Any] = {**_frame(), b"bin-key": 1}
    _reject(bin_key, match="unknown field")


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", b"w1"), ("name", None), ("name", 1), ("epoch", "1"), ("epoch", 1.0),
     ("epoch", None), ("step", [2])],
)
def test_wrong_type(field: str, value: Any) -> None:
    _reject(_frame(**{field: value}), match=f"Heartbeat.{field}")


def test_bool_is_not_an_int() -> None:
    _reject(_frame(epoch=True), match="expected int, got bool")
    with pytest.raises(TypeError):
        encode(t.Heartbeat(name="w", epoch=True, step=0))


def test_int_is_accepted_for_float() -> None:
    obj = {"v": t.PROTOCOL_VERSION, "kind": "Abort", "epoch": 1, "reason": ""}
    assert decode(msgpack.packb(obj)) == t.Abort(epoch=1, reason="")
    rep = dataclasses.asdict(_sample(t.Ack)) | {"v": t.PROTOCOL_VERSION, "kind": "Ack", "reshard_s": 2}
    ack = decode(msgpack.packb(rep, use_bin_type=True))
    assert isinstance(ack, t.Ack) and type(ack.reshard_s) is float and ack.reshard_s == 2.0
    # and encode writes a float for an int given to a float field
    sent = t.Ack(name="w", epoch=1, step=1, reshard_bytes=0, reshard_s=3)
    assert msgpack.unpackb(encode(sent))["reshard_s"] == 3.0
    assert type(decode(encode(sent)).reshard_s) is float  # type: ignore[union-attr]
    # but not a bool
    _reject(rep | {"reshard_s": False}, match="expected float, got bool")


def test_nested_list_items_are_checked() -> None:
    layout = {"dp_replicate": 2, "dp_shard": 1, "pp": 1, "tp": 1, "members": ["a", "b"], "shares": [1, 2],
              "stages": []}
    good = {"v": t.PROTOCOL_VERSION, "kind": "PlanDelta", "epoch": 1, "reason": "", "layout": layout,
            "global_batch": 3, "abort": False, "senders": [], "micro_batch": [], "resume_path": "", "resume_step": 0, "from_sharded": False,
            "previous": None}
    assert decode(msgpack.packb(good, use_bin_type=True)).members == ["a", "b"]  # type: ignore[union-attr]
    _reject(good | {"layout": layout | {"members": ["a", 2]}}, match=r"PlanDelta.layout.members\[1\]: expected str")
    _reject(good | {"layout": layout | {"shares": [1, True]}}, match=r"shares\[1\]: expected int, got bool")
    _reject(good | {"layout": layout | {"members": "ab"}}, match="expected a list")
    store = dataclasses.asdict(_sample(t.StoreRequest)) | {"v": t.PROTOCOL_VERSION, "kind": "StoreRequest"}
    _reject(store | {"values": [b"ok", "not-bytes"]}, match=r"values\[1\]: expected bytes")


def test_dict_any_requires_str_keys() -> None:
    reply = {"v": t.PROTOCOL_VERSION, "kind": "ControlReply", "ok": True, "error": ""}
    _reject(reply | {"data": [1]}, match="expected a map")
    _reject(reply | {"data": {b"k": 1}}, match="str keys")
    assert decode(msgpack.packb(reply | {"data": {}}, use_bin_type=True)) == t.ControlReply(
        ok=True, data={}, error="")


def test_oversized_frame_rejected_before_unpacking() -> None:
    # not even msgpack: proves the size check comes first
    _reject(b"\xc1" * (t.MAX_FRAME_BYTES + 1), match="over the limit")
    frame = encode(SAMPLES[0])
    _reject_small = pytest.raises(CodecError, match="over the limit")
    with _reject_small as info:
        decode(frame, max_bytes=len(frame) - 1)
    assert info.value.code == t.ERR_DECODE
    assert decode(frame, max_bytes=len(frame)) == SAMPLES[0]
    assert t.MAX_FRAME_BYTES == 16 * 1024 * 1024


def test_encode_refuses_oversized_message() -> None:
    big = t.StoreReply(req_id=1, ok=True, values=[b"x" * 1000], number=0, error="")
    with pytest.raises(CodecError, match="over the limit"):
        encode(big, max_bytes=500)


def test_msgpack_bombs() -> None:
    # an array header claiming 2**32-1 elements in a 5-byte frame
    _reject(b"\xdd\xff\xff\xff\xff", match="msgpack")
    # a map header claiming 2**32-1 pairs, a str and a bin claiming 4 GiB
    _reject(b"\xdf\xff\xff\xff\xff", match="msgpack")
    _reject(b"\xdb\xff\xff\xff\xff", match="msgpack")
    _reject(b"\xc6\xff\xff\xff\xff", match="msgpack")
    # deep nesting
    _reject(b"\x91" * 100_000 + b"\x00", match="msgpack")


def test_extension_types_rejected() -> None:
    ext = msgpack.packb({"v": t.PROTOCOL_VERSION, "kind": "ControlReply", "ok": True, "error": "",
                         "data": {"x": msgpack.ExtType(5, b"abc")}})
    _reject(ext, match="msgpack")
    ts = msgpack.packb({"v": t.PROTOCOL_VERSION, "kind": "ControlReply", "ok": True, "error": "",
                        "data": {"x": msgpack.Timestamp(1, 0)}})
    _reject(ts, match="msgpack")


def test_encode_refuses_non_messages() -> None:
    for obj in [object(), {"kind": "Stop", "reason": "x"}, "Stop", None]:
        with pytest.raises(TypeError, match="not a transport message"):
            encode(obj)  # type: ignore[arg-type]

    @dataclasses.dataclass(frozen=True)
    class Stop:  # same name, not ours
        reason: str

    with pytest.raises(TypeError, match="not a transport message"):
        encode(Stop(reason="x"))  # type: ignore[arg-type]


def test_encode_checks_field_types() -> None:
    with pytest.raises(TypeError, match=r"PlanDelta.layout.members\[0\]: expected str"):
        encode(t.PlanDelta(epoch=1, reason="", layout=t.MeshLayout(dp_replicate=1, dp_shard=1, pp=1, tp=1,
                                                                   members=[1], shares=[1]),  # type: ignore[list-item]
                           global_batch=1, abort=False))
    with pytest.raises(TypeError, match="Stop.reason"):
        encode(t.Stop(reason=None))  # type: ignore[arg-type]


def test_a_nested_layout_must_be_a_map_with_exactly_its_fields() -> None:
    good = t.PlanDelta(epoch=2, reason="join", layout=t.MeshLayout(dp_replicate=1, dp_shard=2, pp=1, tp=1,
                                                                    members=["a", "b"], shares=[4, 4]),
                       global_batch=8, abort=False)
    frame = msgpack.unpackb(encode(good))
    assert frame["layout"] == {"dp_replicate": 1, "dp_shard": 2, "pp": 1, "tp": 1, "members": ["a", "b"],
                               "shares": [4, 4], "stages": []}
    assert decode(encode(good)) == good and good.members == ["a", "b"]
    for layout, why in [({**frame["layout"], "cp": 1}, "unknown cp"), ({"members": ["a"]}, "missing dp_replicate"),
                        ([1, 2], "expected a MeshLayout map"), ({**frame["layout"], "dp_shard": "2"}, "expected int"),
                        ({**frame["layout"], "shares": [4]}, "1 shares for 2 members"),
                        ({**frame["layout"], "pp": 0}, "degrees must be >= 1")]:
        with pytest.raises(CodecError, match=why):
            decode(msgpack.packb({**frame, "layout": layout}))
