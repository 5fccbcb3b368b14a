"""The msgpack wire codec: typed dataclass messages in frame 0, large tensors as their own zero-copy frames.

A message is a multipart ZeroMQ message. Frame 0 is a msgpack map `{v, id, re, kind, body}` where `kind` names a
registered dataclass and `body` holds its fields. Nested registered dataclasses are maps tagged with `"__t"`.
numpy arrays and torch tensors are msgpack ext values `[dtype, shape, ref]`: `ref` is the index of the frame that
holds the bytes (arrays of `INLINE_TENSOR_MAX` bytes or more) or the bytes themselves (smaller ones).

Decoding never trusts the sender: every size, dtype, shape and type is checked before anything is allocated,
and any violation raises `DecodeError`, which endpoints turn into an error reply and a log line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

WIRE_VERSION = 1
INLINE_TENSOR_MAX = 64 * 1024
_EXT_NUMPY = 1
_EXT_TORCH = 2
_TAG = "__t"

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
_DTYPES["bfloat16"] = np.dtype(np.uint16)  # bf16 travels as raw 16-bit words; torch reinterprets them


class DecodeError(ValueError):
    """A message that cannot be trusted; `envelope_id` is set when the sender's id could be read."""

    def __init__(self, message: str, envelope_id: int | None = None) -> None:
        super().__init__(message)
        self.envelope_id = envelope_id


@dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces before allocating."""

    max_message_bytes: int = 512 * 1024 * 1024
    max_frames: int = 4096
    max_header_bytes: int = 64 * 1024 * 1024
    max_tensor_dims: int = 8
    max_container_len: int = 10_000_000


@dataclass(frozen=True)
class Envelope:
    """One message: `body` is a registered dataclass; `reply_to` is the id of the message it answers."""

    id: int
    body: Any
    reply_to: int | None = None


@dataclass(frozen=True)
class TransportError:
    """Sent back when a message could not be decoded or dispatched."""

    message: str


@dataclass(frozen=True)
class _Adapter:
    cls: type
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


class Codec:
    """Encodes and decodes `Envelope`s whose bodies are instances of the registered types."""

    def __init__(self, types_: Iterable[type] = (), *, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._by_name: dict[str, type] = {}
        self._fields: dict[type, tuple[str, ...]] = {}
        self._checkers: dict[type, dict[str, Callable[[Any], bool]]] = {}
        self._tuples: dict[type, set[str]] = {}  # each type's tuple fields (msgpack gives lists)
        self._adapters: dict[type, _Adapter] = {}
        self._adapter_by_name: dict[str, _Adapter] = {}
        self.register(TransportError)
        for cls in types_:
            self.register(cls)

    # ------------------------------------------------------------------------------------ registry

    def register(self, cls: type) -> None:
        """Register a dataclass so it may travel as a message body or nested value."""
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass; use register_adapter")
        self._register_name(cls.__name__, cls)
        self._fields[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def register_adapter(self, cls: type, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]) -> None:
        """Register a non-dataclass type by conversion to and from a wire-friendly value."""
        adapter = _Adapter(cls, to_wire, from_wire)
        self._register_name(cls.__name__, cls)
        self._adapters[cls] = adapter
        self._adapter_by_name[cls.__name__] = adapter

    def _register_name(self, name: str, cls: type) -> None:
        known = self._by_name.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"two message types are named {name!r}: {known} and {cls}")
        self._by_name[name] = cls

    def knows(self, name: str) -> bool:
        return name in self._by_name

    # ------------------------------------------------------------------------------------ encoding

    def encode(self, envelope: Envelope) -> list[Any]:
        """Frames ready for `send_multipart(copy=False)`; callers must not touch sent tensors afterwards."""
        frames: list[Any] = [b""]

        def default(obj: Any) -> Any:
            return self._encode_value(obj, frames)

        body = envelope.body
        cls = type(body)
        if cls not in self._fields:
            raise TypeError(f"cannot send unregistered message type {cls.__name__}")
        header = {
            "v": WIRE_VERSION,
            "id": envelope.id,
            "re": envelope.reply_to,
            "kind": cls.__name__,
            "body": {name: getattr(body, name) for name in self._fields[cls]},
        }
        frames[0] = msgpack.packb(header, default=default, use_bin_type=True, datetime=False)
        return frames

    def _encode_value(self, obj: Any, frames: list[Any]) -> Any:
        if isinstance(obj, np.ndarray):
            return _array_ext(_EXT_NUMPY, obj, frames)
        if any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(obj).__mro__):  # Parameter too
            return _tensor_ext(obj, frames)
        if isinstance(obj, np.generic):
            return obj.item()
        cls = type(obj)
        fields = self._fields.get(cls)
        if fields is not None:
            out = {name: getattr(obj, name) for name in fields}
            out[_TAG] = cls.__name__
            return out
        adapter = self._adapters.get(cls)
        if adapter is not None:
            return {_TAG: cls.__name__, "v": adapter.to_wire(obj)}
        if isinstance(obj, (tuple, set, frozenset)):
            return list(obj)
        raise TypeError(f"cannot encode a value of type {cls.__name__}")

    # ------------------------------------------------------------------------------------ decoding

    def decode(self, frames: Sequence[Any]) -> Envelope:
        """Decode and validate a received multipart message (bytes, memoryviews or zmq.Frame objects)."""
        limits = self.limits
        if not frames:
            raise DecodeError("empty message")
        if len(frames) > limits.max_frames:
            raise DecodeError(f"{len(frames)} frames exceed the limit of {limits.max_frames}")
        buffers = [_buffer(f) for f in frames]
        total = sum(b.nbytes for b in buffers)
        if total > limits.max_message_bytes:
            raise DecodeError(f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}")
        if buffers[0].nbytes > limits.max_header_bytes:
            raise DecodeError(f"header of {buffers[0].nbytes} bytes exceeds {limits.max_header_bytes}")
        used: set[int] = set()

        def ext_hook(code: int, data: bytes) -> Any:
            return _decode_tensor(code, data, buffers, used, limits)

        try:
            header = msgpack.unpackb(
                buffers[0],
                raw=False,
                strict_map_key=True,
                ext_hook=ext_hook,
                object_hook=self._object_hook,
                max_bin_len=limits.max_header_bytes,
                max_str_len=limits.max_header_bytes,
                max_array_len=limits.max_container_len,
                max_map_len=limits.max_container_len,
                max_ext_len=4096 + INLINE_TENSOR_MAX,
            )
        except DecodeError as exc:
            raise DecodeError(str(exc), _readable_id(buffers[0])) from None
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise DecodeError(f"malformed msgpack header: {exc}", _readable_id(buffers[0])) from None
        except Exception as exc:  # msgpack raises assorted errors on hostile input
            raise DecodeError(f"malformed message: {type(exc).__name__}: {exc}", _readable_id(buffers[0])) from None
        return self._envelope(header, len(buffers), used)

    def _envelope(self, header: Any, n_frames: int, used: set[int]) -> Envelope:
        if not isinstance(header, dict):
            raise DecodeError("header is not a map")
        env_id = header.get("id")
        if not isinstance(env_id, int) or isinstance(env_id, bool):
            raise DecodeError("header has no integer id")
        version = header.get("v")
        if type(version) is not int or version != WIRE_VERSION:
            raise DecodeError(f"unsupported wire version {header.get('v')!r}; this side speaks {WIRE_VERSION}", env_id)
        reply_to = header.get("re")
        if reply_to is not None and (not isinstance(reply_to, int) or isinstance(reply_to, bool)):
            raise DecodeError("reply id is not an integer", env_id)
        kind = header.get("kind")
        cls = self._by_name.get(kind) if isinstance(kind, str) else None
        if cls is None or cls not in self._fields:
            raise DecodeError(f"unknown message kind {kind!r}", env_id)
        body = header.get("body")
        if not isinstance(body, dict):
            raise DecodeError(f"{kind} body is not a map", env_id)
        if len(used) != n_frames - 1:
            raise DecodeError(f"{n_frames - 1 - len(used)} frames are not referenced by the header", env_id)
        try:
            return Envelope(id=env_id, body=self._construct(cls, body), reply_to=reply_to)
        except DecodeError as exc:
            raise DecodeError(str(exc), env_id) from None

    def _object_hook(self, obj: dict[str, Any]) -> Any:
        name = obj.get(_TAG)
        if name is None:
            return obj
        if not isinstance(name, str):
            raise DecodeError("type tag is not a string")
        adapter = self._adapter_by_name.get(name)
        if adapter is not None:
            try:
                return adapter.from_wire(obj.get("v"))
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"invalid {name}: {exc}") from None
        cls = self._by_name.get(name)
        if cls is None or cls not in self._fields:
            raise DecodeError(f"unknown type {name!r}")
        del obj[_TAG]
        return self._construct(cls, obj)

    def _construct(self, cls: type, values: dict[str, Any]) -> Any:
        fields = self._fields[cls]
        extra = set(values) - set(fields)
        if extra:
            raise DecodeError(f"{cls.__name__} has no field(s) {sorted(extra, key=repr)}")
        checkers = self._checkers.get(cls)
        if checkers is None:
            checkers = self._checkers[cls] = self._compile(cls)
        for name, value in values.items():
            if not checkers[name](value):
                raise DecodeError(f"{cls.__name__}.{name} has the wrong type ({type(value).__name__})")
        for name in self._tuples[cls] & values.keys():  # msgpack has arrays only: a tuple field comes back a tuple
            if values[name] is not None:
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"invalid {cls.__name__}: {exc}") from None

    # ------------------------------------------------------------------------------------ type checks

    def _compile(self, cls: type) -> dict[str, Callable[[Any], bool]]:
        hints = typing.get_type_hints(cls)
        self._tuples[cls] = {name for name in self._fields[cls] if _is_tuple(hints.get(name, Any))}
        return {name: self._checker(hints.get(name, Any)) for name in self._fields[cls]}

    def _checker(self, hint: Any) -> Callable[[Any], bool]:
        """A predicate for values of `hint`; deep enough to stop type confusion, cheap enough for the hot path."""
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if hint is Any or hint is object:
            return lambda v: True
        if hint is type(None) or hint is None:
            return lambda v: v is None
        if hint is float:
            return lambda v: isinstance(v, (float, int)) and not isinstance(v, bool)
        if hint is int:
            return lambda v: isinstance(v, int) and not isinstance(v, bool)
        if hint in (str, bool, bytes):
            return lambda v, t=hint: isinstance(v, t)
        if origin is typing.Literal:
            allowed = set(args)
            return lambda v: isinstance(v, (str, int, bool)) and v in allowed
        if origin in (typing.Union, types.UnionType):
            parts = [self._checker(a) for a in args]
            return lambda v: any(p(v) for p in parts)
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: each item its own type
            items = [self._checker(a) for a in args]
            return lambda v: isinstance(v, list) and len(v) == len(items) and all(c(x) for c, x in zip(items, v))
        if origin in (list, tuple, Sequence, set, frozenset) or hint in (list, tuple):
            item = self._checker(args[0]) if args and args[-1] is not Ellipsis and len(args) == 1 else None
            if origin is tuple and args and args[-1] is Ellipsis:
                item = self._checker(args[0])
            return lambda v: isinstance(v, list) and (item is None or all(item(x) for x in v))
        if origin in (dict, Mapping) or hint is dict:
            key = self._checker(args[0]) if args else None
            val = self._checker(args[1]) if args else None
            return lambda v: isinstance(v, dict) and (
                key is None or all(key(k) and val(x) for k, x in v.items())  # type: ignore[misc]
            )
        if hint is np.ndarray:
            return lambda v: isinstance(v, np.ndarray)
        if isinstance(hint, type):
            return lambda v, t=hint: isinstance(v, t)
        return lambda v: True


def _is_tuple(hint: Any) -> bool:
    """Whether a field's type is a tuple, or a union with one (`tuple[int, int] | None`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_tuple(arg) for arg in typing.get_args(hint))
    return hint is tuple or typing.get_origin(hint) is tuple


def _readable_id(header: memoryview) -> int | None:
    """The sender's id from a header whose contents failed to decode, so the error reply can name its request."""
    try:
        raw = msgpack.unpackb(header, raw=False, ext_hook=lambda code, data: None)
    except Exception:
        return None
    env_id = raw.get("id") if isinstance(raw, dict) else None
    return env_id if isinstance(env_id, int) and not isinstance(env_id, bool) else None


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf
    return memoryview(frame)


def _array_ext(code: int, array: np.ndarray, frames: list[Any], dtype_name: str | None = None) -> msgpack.ExtType:
    dtype_name = dtype_name or array.dtype.name
    if _DTYPES.get(dtype_name) != array.dtype or array.dtype.byteorder == ">":
        raise TypeError(f"cannot send arrays of dtype {array.dtype}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # only when needed: it would also turn a 0-d array into shape (1,)
    ref: int | bytes
    if array.nbytes >= INLINE_TENSOR_MAX:
        frames.append(memoryview(array.reshape(-1).view(np.uint8)))
        ref = len(frames) - 1
    else:
        ref = array.tobytes()
    return msgpack.ExtType(code, msgpack.packb([dtype_name, list(array.shape), ref], use_bin_type=True))


def _tensor_ext(tensor: Any, frames: list[Any]) -> msgpack.ExtType:
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return _array_ext(_EXT_TORCH, t.view(torch.int16).numpy().view(np.uint16), frames, "bfloat16")
    return _array_ext(_EXT_TORCH, t.numpy(), frames)


def _decode_tensor(code: int, data: bytes, buffers: list[memoryview], used: set[int], limits: Limits) -> Any:
    if code not in (_EXT_NUMPY, _EXT_TORCH):
        raise DecodeError(f"unknown ext type {code}")
    try:
        spec = msgpack.unpackb(data, raw=False, max_array_len=limits.max_tensor_dims + 3)
    except Exception:
        raise DecodeError("malformed tensor descriptor") from None
    if not (isinstance(spec, list) and len(spec) == 3):
        raise DecodeError("tensor descriptor must be [dtype, shape, ref]")
    dtype_name, shape, ref = spec
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or (code == _EXT_NUMPY and dtype_name == "bfloat16"):  # numpy has no bfloat16
        raise DecodeError(f"tensor dtype {dtype_name!r} is not allowed")
    if not (isinstance(shape, list) and len(shape) <= limits.max_tensor_dims):
        raise DecodeError("tensor shape must be a list of at most %d dims" % limits.max_tensor_dims)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise DecodeError(f"tensor shape {shape!r} has invalid dimensions")
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype.itemsize
    if isinstance(ref, bytes):
        buf: memoryview | bytes = ref
    elif isinstance(ref, int) and not isinstance(ref, bool):
        if not 1 <= ref < len(buffers):
            raise DecodeError(f"tensor refers to frame {ref}, which does not exist")
        if ref in used:
            raise DecodeError(f"frame {ref} is referenced twice")
        used.add(ref)
        buf = buffers[ref]
    else:
        raise DecodeError("tensor ref must be a frame index or bytes")
    nbytes = buf.nbytes if isinstance(buf, memoryview) else len(buf)
    if nbytes != expected:
        raise DecodeError(f"tensor of shape {shape} and dtype {dtype_name} needs {expected} bytes, got {nbytes}")
    array = np.frombuffer(buf, dtype=dtype).reshape(shape)
    if code == _EXT_NUMPY:
        return array
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only zmq buffers: we never write into received tensors
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype_name == "bfloat16" else tensor
