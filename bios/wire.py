"""The codec every Bios process speaks: `bios.transport.codec.Codec` over the shared vocabulary.

The vocabulary (`bios.types`, whose dataclasses live in its modules, `bios.model_input`, `bios.images`,
`bios.account`, `bios.messages`, and `bios.exceptions.RemoteError`) is plain data that knows nothing of the
transport; the transport knows nothing of Bios. This module binds the two: every public dataclass of the
vocabulary is registered, and `TensorData` travels as its array.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any

import numpy as np

from bios import account, images, model_input
from bios import types as t
from bios.exceptions import RemoteError
from bios.messages import client, queries, worker
from bios.transport.codec import Codec, DecodeError, Limits
from bios.types import runs, sampling, tensors, training

# Every module whose dataclasses travel on the wire.
VOCABULARY: tuple[ModuleType, ...] = (tensors, training, sampling, runs, model_input, images, account, client, queries,
                                      worker)


def vocabulary_types() -> list[type]:
    """The dataclasses defined in the vocabulary's modules, and `RemoteError`: what `make_codec` registers."""
    found = [obj for module in VOCABULARY for obj in vars(module).values()
             if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return [*found, RemoteError]


def make_codec(limits: Limits | None = None) -> Codec:
    """The codec every Bios process speaks: all public types, all messages, remote errors."""
    codec = Codec(vocabulary_types(), limits=limits)
    codec.register_adapter(t.TensorData, lambda td: td.to_numpy(), _tensor_data_from_wire)
    return codec


def _tensor_data_from_wire(value: Any) -> t.TensorData:
    if not isinstance(value, np.ndarray) or value.dtype not in (np.int64, np.float32):
        raise DecodeError("TensorData must carry an int64 or float32 array")
    return t.TensorData(value, "int64" if value.dtype == np.int64 else "float32")

