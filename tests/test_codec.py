"""The wire codec: every message round-trips, tensors travel without copies, and hostile input only ever
raises `DecodeError` (with the sender's id when it can be read)."""

from __future__ import annotations

import dataclasses
import inspect
import random
import types as pytypes
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bios import images, model_input
from bios import messages as m
from bios import types as t
from bios.exceptions import RemoteError
from bios.messages import client, queries, worker
from bios.transport.codec import (
    INLINE_TENSOR_MAX,
    WIRE_VERSION,
    Codec,
    DecodeError,
    Envelope,
    Limits,
    TransportError,
)
from bios.types import runs, sampling, tensors, training
from bios.wire import make_codec

CODEC = make_codec()

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


def _dataclasses_of(module: pytypes.ModuleType) -> list[type]:
    return [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
    ]


WIRE_TYPES: list[type] = [*_dataclasses_of(tensors), *_dataclasses_of(training), *_dataclasses_of(sampling),
                          *_dataclasses_of(runs), *_dataclasses_of(model_input), *_dataclasses_of(images),
                          *_dataclasses_of(client), *_dataclasses_of(queries), *_dataclasses_of(worker), RemoteError,
                          TransportError]


def _round_trip(body: Any, codec: Codec = CODEC, *, env_id: int = 7, reply_to: int | None = None) -> Envelope:
    frames = codec.encode(Envelope(env_id, body, reply_to))
    return codec.decode([bytes(f) for f in frames])  # bytes: what a receiver holds, sharing nothing with the sender


def _open_header(frame0: Any) -> dict[str, Any]:
    """Frame 0 as a plain map (tensor descriptors stay `ExtType`), to tamper with before re-packing."""
    return msgpack.unpackb(bytes(frame0), raw=False)


def _pack(header: Any) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _header(kind: str, body: dict[str, Any], *, env_id: int = 7) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "id": env_id, "re": None, "kind": kind, "body": body}


def _tensor(dtype: Any, shape: Any, ref: Any, code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb([dtype, shape, ref], use_bin_type=True))


def _decode_error(frames: list[Any], codec: Codec = CODEC) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        codec.decode(frames)
    return info.value


# ------------------------------------------------------------------------------- values of every wire type

_NUMPY_NAMES = ["float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]  # all sendable
_INT64 = st.integers(-(2**63), 2**63 - 1)
_FLOAT = st.floats(allow_nan=False)
_TEXT = st.text(max_size=6)
_KEY = _TEXT.filter(lambda k: k != "__t")  # the wire reserves "__t" in maps for type tags


def _tensor_data() -> st.SearchStrategy[t.TensorData]:
    shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3)
    ints = hnp.arrays(np.int64, shapes, elements=_INT64)
    floats = hnp.arrays(np.float32, shapes, elements=st.floats(width=32, allow_nan=False))
    return st.one_of(ints.map(lambda a: t.TensorData(a, "int64")), floats.map(lambda a: t.TensorData(a, "float32")))


def _arrays() -> st.SearchStrategy[np.ndarray]:
    dtypes = st.sampled_from(_NUMPY_NAMES)
    small = hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    framed = st.just(np.arange(INLINE_TENSOR_MAX // 4, dtype=np.float32).reshape(128, -1))
    return small | framed


def _any_value() -> st.SearchStrategy[Any]:
    """What `Any` fields (results, work items) carry: plain values and nested registered types."""
    return st.one_of(
        st.none(),
        _INT64,
        _TEXT,
        st.lists(_INT64, max_size=3),
        st.deferred(lambda: value_of(t.ForwardBackwardOutput)),
        st.deferred(lambda: value_of(t.OptimStepResponse)),
        st.deferred(lambda: value_of(m.Ping)),
    )


def value_of(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a field type, so a newly added message type is covered without touching this file."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _any_value()
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return _INT64
    if hint is float:
        return _FLOAT
    if hint is str:
        return _TEXT
    if hint is bytes:
        return st.binary(max_size=8)
    if hint is t.TensorData:
        return _tensor_data()
    if hint is np.ndarray:
        return _arrays()
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, pytypes.UnionType):
        return st.one_of(*(value_of(a) for a in args))
    if origin in (list, Sequence):
        return st.lists(value_of(args[0]), max_size=2)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return st.tuples(*(value_of(a) for a in args))
    if origin in (dict, Mapping):
        return st.dictionaries(_KEY, value_of(args[1]), max_size=2)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        fields = {f.name: value_of(hints[f.name]) for f in dataclasses.fields(hint) if f.init}
        return st.builds(hint, **fields)
    raise TypeError(f"no test values for {hint!r}: teach value_of() about it")


def _same(a: Any, b: Any) -> bool:
    """Deep equality that also compares arrays (by dtype, shape and values) inside messages."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same_kind = type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        return same_kind and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_make_codec_knows_every_message_and_public_type() -> None:
    assert len(WIRE_TYPES) > 40
    unknown = [cls.__name__ for cls in WIRE_TYPES if not CODEC.knows(cls.__name__)]
    assert unknown == []
    assert CODEC.knows("TensorData")


@pytest.mark.parametrize("cls", WIRE_TYPES, ids=lambda cls: cls.__name__)
@settings(FUZZ, max_examples=6)
@given(data=st.data())
def test_every_wire_type_round_trips(cls: type, data: st.DataObject) -> None:
    body = data.draw(value_of(cls))
    env_id = data.draw(st.integers(0, 2**63 - 1))
    reply_to = data.draw(st.none() | st.integers(0, 2**63 - 1))
    decoded = _round_trip(body, env_id=env_id, reply_to=reply_to)
    assert type(decoded.body) is cls
    assert _same(decoded.body, body)
    assert (decoded.id, decoded.reply_to) == (env_id, reply_to)


def test_datum_with_tensor_data_round_trips() -> None:
    datum = t.Datum(
        model_input=t.ModelInput([t.EncodedTextChunk([1, 2]), t.EncodedTextChunk([3])]),
        loss_fn_inputs={
            "target_tokens": t.TensorData([2, 3, 4], "int64"),
            "weights": t.TensorData(np.linspace(0, 1, 3 * 30_000, dtype=np.float32), "float32"),  # framed
            "advantages": t.TensorData([[0.5, -1.0]], "float32"),
        },
    )
    body = m.ForwardBackward(
        model_id="s:train:0", seq_id=4, data=[datum, datum], loss_fn="cross_entropy", loss_fn_config={"clip": 0.2}
    )
    decoded = _round_trip(body).body
    assert decoded == body
    inputs = decoded.data[0].loss_fn_inputs
    assert isinstance(inputs["target_tokens"], t.TensorData)
    assert inputs["target_tokens"].to_numpy().dtype == np.int64
    assert inputs["weights"].to_numpy().dtype == np.float32
    assert inputs["advantages"].shape == [1, 2]
    assert decoded.data[1].model_input.to_ints() == [1, 2, 3]


def test_forward_backward_output_inside_a_result_push_round_trips() -> None:
    output = t.ForwardBackwardOutput(
        "cross_entropy",
        [{"logprobs": t.TensorData([-0.25, -1.5], "float32")}, {"logprobs": t.TensorData([], "float32")}],
        {"loss:sum": 1.75, "grad_norm:max": 0.5},
    )
    decoded = _round_trip(m.RequestDone(request_id="r1", result=output, cycle_id=3)).body
    assert decoded.result == output
    assert decoded.result.loss == 1.75
    error = RemoteError("BadRequestError", "bad", field="seq_id")
    assert _round_trip(m.RequestDone(request_id="r2", error=error)).body.error == error


def test_tensor_data_adapter_rejects_other_dtypes() -> None:
    tensor_data = {"__t": "TensorData", "v": _tensor("bool", [1], b"\x01")}
    header = _header("RequestDone", {"request_id": "r", "result": tensor_data})
    assert "TensorData must carry" in str(_decode_error([_pack(header)]))


# ------------------------------------------------------------------------------------------- tensors

_TORCH_DTYPES = [torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.float16, torch.int32]


_SHAPES = {
    "scalar": (),
    "empty": (0, 3),
    "small": (3, 4),
    "large": (70_000,),
    "transposed": (4, 3),
    "large-transposed": (100, 700),
}
_LAYOUTS = list(_SHAPES)


def _int_case(layout: str) -> np.ndarray:
    """Small int64 values in the layout's shape; the transposed layouts are not contiguous (>= 64 KiB when large)."""
    shape = _SHAPES[layout]
    array = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 7 - 3
    return np.asarray(array.T if "transposed" in layout else array)  # asarray: 0-d arithmetic gives scalars


def _received_frame_address(frame: bytes) -> tuple[int, int]:
    view = np.frombuffer(frame, np.uint8)
    return view.ctypes.data, view.ctypes.data + view.nbytes


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("dtype", _NUMPY_NAMES)
def test_numpy_arrays_round_trip(dtype: str, layout: str) -> None:
    base = _int_case(layout)
    array = np.asarray(base % 2 == 1) if dtype == "bool" else base.astype(dtype)
    assert array.flags.c_contiguous != ("transposed" in layout)
    frames = CODEC.encode(Envelope(1, m.RequestDone(request_id="r", result={"a": array, "b": [array]})))
    framed = array.nbytes >= INLINE_TENSOR_MAX
    assert len(frames) == (3 if framed else 1)
    if framed and array.flags.c_contiguous:
        assert np.shares_memory(np.frombuffer(frames[1], np.uint8), array)  # the sender does not copy either
    received = [bytes(f) for f in frames]
    result = CODEC.decode(received).body.result
    for out in (result["a"], result["b"][0]):
        assert type(out) is np.ndarray
        assert out.dtype == array.dtype and out.shape == array.shape
        np.testing.assert_array_equal(out, array)
    if framed:
        assert np.shares_memory(result["a"], np.frombuffer(received[1], np.uint8))
        assert np.shares_memory(result["b"][0], np.frombuffer(received[2], np.uint8))


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("dtype", _TORCH_DTYPES, ids=str)
def test_torch_tensors_round_trip(dtype: torch.dtype, layout: str) -> None:
    tensor = torch.from_numpy(_int_case(layout)).to(dtype)
    assert tensor.is_contiguous() != ("transposed" in layout)
    frames = CODEC.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=tensor)))
    nbytes = tensor.numel() * tensor.element_size()
    framed = nbytes >= INLINE_TENSOR_MAX
    assert len(frames) == (2 if framed else 1)
    received = [bytes(f) for f in frames]
    out = CODEC.decode(received).body.result
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)
    if framed:
        start, end = _received_frame_address(received[1])
        assert out.data_ptr() == start and start + nbytes == end


def test_torch_parameter_and_numpy_scalar_are_encoded() -> None:
    param = torch.nn.Parameter(torch.ones(2, 2))
    out = _round_trip(m.ItemDone(cycle_id=1, request_id="r", result=[param, np.float32(1.5), np.int64(3)])).body.result
    assert torch.equal(out[0], torch.ones(2, 2)) and out[1:] == [1.5, 3]


@pytest.mark.parametrize(
    "value",
    [np.zeros(2, np.complex64), np.zeros(2, ">f4"), np.array(["a"]), object(), iter([1])],
    ids=["complex", "big-endian", "unicode", "object", "iterator"],
)
def test_encoder_refuses_values_it_cannot_send(value: Any) -> None:
    with pytest.raises(TypeError):
        CODEC.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=value)))


def test_encoder_refuses_unregistered_message_types() -> None:
    @dataclasses.dataclass
    class Stranger:
        x: int = 0

    with pytest.raises(TypeError, match="Stranger"):
        CODEC.encode(Envelope(1, Stranger()))


# ----------------------------------------------------------------------------------- rejected headers


def test_unknown_kind_is_rejected_with_the_envelope_id() -> None:
    error = _decode_error([_pack(_header("LaunchMissiles", {}, env_id=41))])
    assert "LaunchMissiles" in str(error) and error.envelope_id == 41


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        ("ForwardBackward", {"model_id": "m", "seq_id": "3", "data": [], "loss_fn": "ce"}, "ForwardBackward.seq_id"),
        ("ForwardBackward", {"model_id": "m", "seq_id": 3, "data": {}, "loss_fn": "ce"}, "ForwardBackward.data"),
        (
            "ForwardBackward",
            {"model_id": "m", "seq_id": 3, "data": [], "loss_fn": "ce", "loss_fn_config": [1.0]},
            "ForwardBackward.loss_fn_config",
        ),
        (
            "ForwardBackward",
            {"model_id": "m", "seq_id": 3, "data": [], "loss_fn": "ce", "loss_fn_config": {"a": "x"}},
            "ForwardBackward.loss_fn_config",
        ),
        ("ForwardBackward", {"model_id": 5, "seq_id": 3, "data": [], "loss_fn": "ce"}, "ForwardBackward.model_id"),
        ("ForwardBackward", {"model_id": "m", "seq_id": True, "data": [], "loss_fn": "ce"}, "ForwardBackward.seq_id"),
        ("OptimStep", {"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": 1.0}}, "OptimStep.adam_params"),
        ("Ping", {"payload": 1.5}, "Ping.payload"),
        (
            "ForwardBackward",
            {"model_id": "m", "seq_id": 3, "data": [{"__t": "Datum", "model_input": []}], "loss_fn": "ce"},
            "Datum.model_input",
        ),
        (
            "CreateModel",
            {"session_id": "s", "model_seq_id": 0, "base_model": "b", "lora": {"__t": "LoraConfig", "rank": 2.0}},
            "LoraConfig.rank",
        ),
        ("SampledSequence", {"stop_reason": "whenever", "tokens": []}, "SampledSequence.stop_reason"),
        (
            "RegisterWorker",
            {"worker_id": "w", "host": "h", "pid": 1, "device": "cpu", "memory_bytes": 1, "models": [1]},
            "RegisterWorker.models",
        ),
        (  # a fixed-length tuple: two ints, not three
            "WorkItem",
            {"request_id": "r", "op": {"__t": "OptimStep", "model_id": "m", "seq_id": 0,
                                       "adam_params": {"__t": "AdamParams", "learning_rate": 1.0}}, "part": [0, 1, 2]},
            "WorkItem.part",
        ),
    ],
)
def test_wrong_field_type_names_the_field(kind: str, body: dict[str, Any], field: str) -> None:
    error = _decode_error([_pack(_header(kind, body, env_id=99))])
    assert field in str(error)
    assert error.envelope_id == 99  # nested failures too: the error reply must reach the right asker


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ({"payload": 1, "bogus": 2}, "bogus"),
        ({"payload": 1, b"raw": 2, "other": 3}, "raw"),  # mixed key types must not crash the error message
        ({"payload": {"__t": "AdamParams", "learning_rate": 1.0, "momentum": 0.9}}, "momentum"),
    ],
)
def test_extra_field_is_rejected(body: dict[Any, Any], name: str) -> None:
    error = _decode_error([_pack(_header("Ping", body, env_id=5))])
    assert name in str(error) and error.envelope_id == 5


def test_missing_field_is_rejected() -> None:
    error = _decode_error([_pack(_header("ForwardBackward", {"model_id": "m"}, env_id=6))])
    assert "ForwardBackward" in str(error) and error.envelope_id == 6


@pytest.mark.parametrize("version", [WIRE_VERSION + 1, 0, str(WIRE_VERSION), float(WIRE_VERSION), True, None])
def test_wrong_wire_version_is_rejected(version: Any) -> None:
    header = _header("Ping", {"payload": 1}, env_id=12)
    header["v"] = version
    error = _decode_error([_pack(header)])
    assert "version" in str(error) and error.envelope_id == 12


@pytest.mark.parametrize(
    "frame0",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        _pack([1, 2, 3]),
        _pack({"v": WIRE_VERSION, "kind": "Ping", "body": {}}),
        _pack({"v": WIRE_VERSION, "id": "7", "kind": "Ping", "body": {}}),
        _pack({"v": WIRE_VERSION, "id": True, "kind": "Ping", "body": {}}),
        _pack({1: 2}),  # non-string map key
        b"\xc6\xff\xff\xff\xff\x00",  # bin32 declaring 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 declaring 4 billion items
        b"\x91" * 100_000,  # nesting deeper than any stack
    ],
    ids=["empty", "reserved", "array", "no-id", "str-id", "bool-id", "int-key", "huge-bin", "huge-array", "deep"],
)
def test_unreadable_header_is_rejected_without_an_id(frame0: bytes) -> None:
    assert _decode_error([frame0]).envelope_id is None


def test_truncated_header_is_rejected() -> None:
    frame0 = bytes(CODEC.encode(Envelope(3, m.Welcome(session_id="session", server_version="1.0", cycle_s=10.0)))[0])
    for cut in range(len(frame0)):
        _decode_error([frame0[:cut]])


def test_bad_reply_id_and_non_map_body_are_rejected() -> None:
    header = _header("Ping", {"payload": 1}, env_id=8)
    header["re"] = "x"
    assert _decode_error([_pack(header)]).envelope_id == 8
    assert "not a map" in str(_decode_error([_pack(_header("Ping", [1], env_id=8))]))  # type: ignore[arg-type]


def test_unknown_nested_type_tag_is_rejected() -> None:
    header = _header("RequestDone", {"request_id": "r", "result": {"__t": "os.system", "v": "rm"}}, env_id=4)
    error = _decode_error([_pack(header)])
    assert "os.system" in str(error) and error.envelope_id == 4


# ----------------------------------------------------------------------------------- rejected tensors


def _result_with(*tensors: msgpack.ExtType, env_id: int = 21) -> bytes:
    return _pack(_header("RequestDone", {"request_id": "r", "result": list(tensors)}, env_id=env_id))


@pytest.mark.parametrize(
    ("ext", "frames", "needle"),
    [
        (_tensor("float32", [3], b"\x00" * 8), [], "needs 12 bytes"),
        (_tensor("float32", [2, 2], 1), [b"\x00" * 12], "needs 16 bytes"),
        (_tensor("int64", [2**20, 2**20], 1), [b"\x00" * 8], "needs"),
        (_tensor("complex64", [1], b"\x00" * 8), [], "complex64"),
        (_tensor("object", [1], b"\x00" * 8), [], "object"),
        (_tensor(">f4", [1], b"\x00" * 4), [], ">f4"),
        (_tensor(7, [1], b"\x00"), [], "dtype"),
        (_tensor("float32", [-1], b""), [], "invalid dimensions"),
        (_tensor("float32", [True], b"\x00" * 4), [], "invalid dimensions"),
        (_tensor("float32", [2**40], b""), [], "invalid dimensions"),
        (_tensor("float32", [1] * 9, b"\x00" * 4), [], "at most 8 dims"),
        (_tensor("float32", "4", b"\x00" * 16), [], "shape"),
        (_tensor("float32", [1], 0), [], "frame 0"),
        (_tensor("float32", [1], 2), [b"\x00" * 4], "frame 2"),
        (_tensor("float32", [1], -1), [b"\x00" * 4], "frame -1"),
        (_tensor("float32", [1], 1.0), [b"\x00" * 4], "ref"),
        (msgpack.ExtType(1, _pack(["float32", [1]])), [], "descriptor"),
        (msgpack.ExtType(1, b"\xc1"), [], "descriptor"),
        (msgpack.ExtType(9, _pack(["float32", [1], b"\x00" * 4])), [], "ext type 9"),
    ],
    ids=[
        "inline-short", "framed-short", "huge-shape", "complex", "object", "big-endian", "int-dtype", "negative-dim",
        "bool-dim", "huge-dim", "too-many-dims", "str-shape", "ref-header", "ref-missing", "ref-negative",
        "ref-float", "two-items", "garbage", "unknown-ext",
    ],
)
def test_bad_tensor_is_rejected(ext: msgpack.ExtType, frames: list[bytes], needle: str) -> None:
    error = _decode_error([_result_with(ext), *frames])
    assert needle in str(error)
    assert error.envelope_id == 21


def test_frame_referenced_twice_is_rejected() -> None:
    frame = b"\x00" * 8
    error = _decode_error([_result_with(_tensor("float32", [2], 1), _tensor("int32", [2], 1)), frame])
    assert "referenced twice" in str(error)


def test_unreferenced_extra_frame_is_rejected() -> None:
    frames = [bytes(f) for f in CODEC.encode(Envelope(2, m.Ping(1)))]
    error = _decode_error([*frames, b"smuggled"])
    assert "not referenced" in str(error) and error.envelope_id == 2


def test_limits_on_frames_and_sizes() -> None:
    codec = make_codec(Limits(max_frames=3, max_message_bytes=200_000, max_header_bytes=1024, max_container_len=50))
    arrays = [np.zeros(INLINE_TENSOR_MAX // 4, np.float32) for _ in range(3)]
    frames = [bytes(f) for f in codec.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=arrays)))]
    assert "frames exceed" in str(_decode_error(frames, codec))
    frames = [bytes(f) for f in codec.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=arrays[:2])))]
    assert codec.decode(frames).body.result[1].shape == arrays[1].shape  # within every limit
    big = [np.zeros(60_000, np.float32)]  # 240 KB in one frame
    frames = [bytes(f) for f in codec.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=big)))]
    assert "exceeds the limit" in str(_decode_error(frames, codec))
    long_name = [bytes(f) for f in codec.encode(Envelope(1, m.Shutdown(reason="x" * 2000)))]
    assert "header of" in str(_decode_error(long_name, codec))
    many = [bytes(f) for f in codec.encode(Envelope(1, m.ItemDone(cycle_id=1, request_id="r", result=list(range(60)))))]
    assert "exceeds max_array_len" in str(error := _decode_error(many, codec)) and error.envelope_id == 1
    assert "empty" in str(_decode_error([], codec))


# ---------------------------------------------------------------------------------------------- fuzzing
#
# Every example goes through `Codec.decode`, which holds both the envelope decoder and the tensor-frame
# decoder. Hypothesis examples per test: random bytes 3,000; random field values 500; mutated valid envelopes
# 4,000; random tensor descriptors and frames 3,000: 10,500 for envelopes, of which 7,000 reach the tensor
# decoder; each example decodes two variants. All but the field-value test draw one seed from hypothesis and
# build the input with `random.Random(seed)`: hypothesis's cost per draw would otherwise dominate the runtime,
# and a failure still names the seed that reproduces it.


def _assert_decodes_or_rejects(frames: list[Any]) -> None:
    """The fuzz property: hostile input raises `DecodeError` or yields an envelope that is really valid."""
    try:
        env = CODEC.decode(frames)
    except DecodeError:
        return
    assert isinstance(env, Envelope)
    CODEC.decode(CODEC.encode(env))  # everything decoded is a registered, well-typed, re-sendable value


def _corpus() -> list[list[bytes]]:
    datum = t.Datum(
        t.ModelInput.from_ints([1, 2, 3]),
        {"target_tokens": t.TensorData([2, 3, 4], "int64"), "weights": t.TensorData([1.0, 1.0, 0.0], "float32")},
    )
    output = t.ForwardBackwardOutput("ce", [{"logprobs": t.TensorData([-1.0], "float32")}], {"loss:sum": 1.0})
    tensors = [
        np.arange(6, dtype=np.int32),
        torch.ones(3, dtype=torch.bfloat16),
        np.zeros(INLINE_TENSOR_MAX // 4, np.float32),
    ]
    run = t.TrainingRun("r", "b", "o", True, 4, 1.0, t.Checkpoint("c", "training", 1.0, "bios://x"))
    bodies = [
        m.Ping(3),
        m.Hello(api_key="key", sdk_version="0.1"),
        m.ForwardBackward(model_id="s:train:0", seq_id=1, data=[datum], loss_fn="ce", loss_fn_config={"a": 1.0}),
        m.OptimStep(model_id="s:train:0", seq_id=2, adam_params=t.AdamParams(grad_clip_norm=1.0)),
        m.CreateModel(session_id="s", model_seq_id=0, base_model="bios/tiny-llama", lora=t.LoraConfig(rank=4, seed=1)),
        m.RequestDone(request_id="r", result=output),
        m.RequestDone(request_id="r", error=RemoteError("BadRequestError", "no", field="seq_id")),
        m.ItemDone(cycle_id=1, request_id="r", result=tensors),
        m.WorkerStatus(worker_id="w", host="h", pid=1, device="cpu", state="idle", last_heartbeat_age_s=0.5),
        t.SampleResponse([t.SampledSequence("stop", [1, 2], [-0.5, -0.25])], [None, -1.0]),
        t.TrainingRunsResponse([run], t.Cursor(0, 1, 1)),
        m.RegisterWorker(worker_id="w", host="h", pid=1, device="cpu", memory_bytes=10, models=["a", "b"]),
        m.WorkItem(request_id="r", op=m.OptimStep(model_id="m", seq_id=1, adam_params=t.AdamParams())),
    ]
    return [[bytes(f) for f in CODEC.encode(Envelope(i + 1, body, i or None))] for i, body in enumerate(bodies)]


CORPUS = _corpus()
FIELD_NAMES = sorted({f.name for cls in WIRE_TYPES for f in dataclasses.fields(cls)})
TYPE_NAMES = sorted(cls.__name__ for cls in WIRE_TYPES) + ["TensorData"]
_KEYS: list[Any] = [*FIELD_NAMES, *TYPE_NAMES, "__t", "v", "id", "re", "kind", "body", "", b"k"]
_DTYPE_NAMES = [*_NUMPY_NAMES, "bfloat16", "uint16", "complex64", "object", "<f4", ">f4", "V8", "S3", "O", "float"]
_DIMS: list[Any] = [0, 1, 2, 3, 4, -1, 2**31, 2**40 - 1, 2**40, 2**62, 2**64 - 1, True, 1.0, None]
_SCALARS: list[Any] = [None, True, False, 0, 1, -1, 7, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0, 1.5,
                       float("nan"), float("inf"), "", "x", b"", b"\x00" * 8, *_KEYS, *_DTYPE_NAMES,
                       msgpack.Timestamp(1, 2)]


def _random_value(rng: random.Random, depth: int = 2) -> Any:
    """A random msgpack value, biased towards names and numbers the decoder gives meaning to."""
    r = rng.random()
    if depth and r < 0.12:
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if depth and r < 0.24:
        return {rng.choice(_KEYS): _random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}
    if depth and r < 0.27:
        return {"__t": rng.choice(TYPE_NAMES), **{rng.choice(_KEYS): _random_value(rng, depth - 1) for _ in range(3)}}
    if r < 0.34:
        return _random_tensor(rng)
    if r < 0.38:
        return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 12)))
    if r < 0.44:
        return rng.randbytes(rng.randint(0, 16))
    if r < 0.50:
        return rng.randint(-(2**63), 2**64 - 1)
    if r < 0.53:
        return rng.uniform(-1e9, 1e9)
    return rng.choice(_SCALARS)


def _random_tensor(rng: random.Random, frames: list[bytes] | None = None) -> msgpack.ExtType:
    """A tensor descriptor: often well-formed with a matching byte count, sometimes anything at all."""
    dtype = rng.choice(_DTYPE_NAMES) if rng.random() < 0.9 else _random_value(rng, 1)
    if rng.random() < 0.85:
        shape: Any = [rng.choice(_DIMS) if rng.random() < 0.3 else rng.randint(0, 4) for _ in range(rng.randint(0, 9))]
    else:
        shape = _random_value(rng, 1)
    itemsize = np.dtype(dtype).itemsize if dtype in _NUMPY_NAMES else 2  # 2: bfloat16's, or any for junk
    numel = int(np.prod(shape)) if isinstance(shape, list) and all(type(d) is int and 0 <= d < 5 for d in shape) else 1
    size = rng.choice([numel * itemsize, numel * itemsize, numel * itemsize + 1, max(numel * itemsize - 1, 0), 0])
    r = rng.random()
    if r < 0.4:
        ref: Any = rng.randbytes(size)
    elif r < 0.8 and frames is not None:  # `frames` is the whole message, header slot included
        frames.append(rng.randbytes(size))
        ref = rng.choice([len(frames) - 1, len(frames) - 1, 0, -1, len(frames), 1])
    else:
        ref = _random_value(rng, 1)
    code = rng.choice([1, 2]) if rng.random() < 0.9 else rng.randint(0, 127)
    data = msgpack.packb([dtype, shape, ref], use_bin_type=True)
    if rng.random() < 0.05:
        data = rng.randbytes(rng.randint(0, 20))
    return msgpack.ExtType(code, data)


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) inside a header, so a mutation can land anywhere."""
    out: list[tuple[Any, Any]] = []
    stack = [node]
    while stack:
        current = stack.pop()
        keys = list(current) if isinstance(current, dict) else range(len(current)) if isinstance(current, list) else ()
        for key in keys:
            out.append((current, key))
            stack.append(current[key])
    return out


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    header = _open_header(frames[0])
    frames = list(frames)
    for _ in range(rng.randint(1, 3)):
        node, key = rng.choice(_slots(header))
        action = rng.random()
        if action < 0.45:
            node[key] = _random_value(rng)
        elif action < 0.65:
            node[key] = _random_tensor(rng, frames)
        elif action < 0.75 and isinstance(node, dict):
            del node[key]
        elif action < 0.85 and isinstance(node, dict):
            node[rng.choice(_KEYS) if rng.random() < 0.75 else rng.randbytes(2)] = _random_value(rng)
        elif len(frames) > 1:
            k = rng.randrange(1, len(frames))
            frames[k] = rng.choice([frames[k][:-1], frames[k] + b"\x00", b"", frames[k][:4], frames[0]])
        else:
            frames.append(rng.randbytes(rng.randint(0, 8)))
    frames[0] = _pack(header)
    if rng.random() < 0.2:  # and sometimes damage the packed bytes themselves
        raw = bytearray(frames[0])
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        frames[0] = bytes(raw[: rng.randint(1, len(raw))] if rng.random() < 0.3 else raw)
    return frames


@settings(FUZZ, max_examples=3000)
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_random_bytes_raise_only_decode_error(seed: int) -> None:
    rng = random.Random(seed)
    frames = [rng.randbytes(rng.choice([0, 1, 2, 5, 16, 64, 200])) for _ in range(rng.randint(1, 4))]
    _assert_decodes_or_rejects(frames)
    valid = rng.choice(CORPUS)[0]
    start = valid[: rng.randint(0, len(valid))]
    _assert_decodes_or_rejects([start + frames[0], *frames[1:]])  # garbage after a real beginning


_FLAT_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=12),
    st.lists(st.integers(-(2**63), 2**63 - 1) | st.text(max_size=3), max_size=3),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
)


@settings(FUZZ, max_examples=500)
@given(
    kind=st.sampled_from(TYPE_NAMES) | st.text(max_size=6),
    body=st.dictionaries(st.sampled_from(FIELD_NAMES) | st.binary(max_size=2), _FLAT_VALUE, max_size=5),
)
def test_fuzz_random_field_values_raise_only_decode_error(kind: str, body: dict[str, Any]) -> None:
    _assert_decodes_or_rejects([_pack(_header(kind, body))])
    _assert_decodes_or_rejects([_pack(_header("RequestDone", {"request_id": "r", "result": {**body, "__t": kind}}))])


@settings(FUZZ, max_examples=4000)
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_mutated_envelopes_raise_only_decode_error(seed: int) -> None:
    rng = random.Random(seed)
    frames = _mutate(rng, rng.choice(CORPUS))
    _assert_decodes_or_rejects(frames)
    _assert_decodes_or_rejects(_mutate(rng, frames) if _is_map(frames[0]) else frames[:1])


def _is_map(frame0: bytes) -> bool:
    try:
        return isinstance(_open_header(frame0), dict)
    except Exception:
        return False


@settings(FUZZ, max_examples=3000)
@given(seed=st.integers(0, 2**64 - 1))
def test_fuzz_tensor_descriptors_raise_only_decode_error(seed: int) -> None:
    rng = random.Random(seed)
    frames = [b""]
    tensors = [_random_tensor(rng, frames) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        frames.append(rng.randbytes(rng.randint(0, 8)))
    frames[0] = _pack(_header("RequestDone", {"request_id": "r", "result": tensors}))
    _assert_decodes_or_rejects(frames)
    as_tensor_data = [{"__t": "TensorData", "v": x} for x in tensors]
    frames[0] = _pack(_header("ItemDone", {"cycle_id": 1, "request_id": "r", "result": as_tensor_data}))
    _assert_decodes_or_rejects(frames)
