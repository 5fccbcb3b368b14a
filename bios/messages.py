"""Messages between the SDK, the coordinator and the workers: the only thing those processes share.

Training operations are *requests*: the coordinator answers the ask with `Accepted` once the request is
validated, stored and ordered (the first await), and pushes `RequestDone` when it has run (the second await).
Everything else is a plain ask with a direct reply.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bios import types as t
from bios.actors.remote import RemoteError
from bios.transport.codec import Codec, DecodeError, Limits

PROTOCOL_VERSION = 1

# ------------------------------------------------------------------------------------------ sessions


@dataclass(frozen=True)
class Hello:
    api_key: str | None = None
    sdk_version: str = ""
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Welcome:
    session_id: str
    server_version: str
    cycle_s: float


@dataclass(frozen=True)
class SessionHeartbeat:
    session_id: str


@dataclass(frozen=True)
class CloseSession:
    session_id: str


@dataclass(frozen=True)
class Ack:
    pass


# ------------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class CreateModel:
    """Creates a training run; its model id is `{session_id}:train:{model_seq_id}` (the Tinker format)."""

    session_id: str
    model_seq_id: int
    base_model: str
    lora: t.LoraConfig


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int
    data: list[t.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False


@dataclass(frozen=True)
class OptimStep:
    model_id: str
    seq_id: int
    adam_params: t.AdamParams


REQUEST_TYPES: tuple[type, ...] = (CreateModel, ForwardBackward, OptimStep)
FORWARD_TYPES: tuple[type, ...] = (ForwardBackward,)


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class RequestDone:
    """Pushed to the client when a request has run; exactly one of `result` and `error` is set."""

    request_id: str
    result: Any = None
    error: RemoteError | None = None
    cycle_id: int = 0


@dataclass(frozen=True)
class ModelCreated:
    model_id: str
    info: t.BaseModelInfo
    lora_rank: int
    num_lora_parameters: int


# ------------------------------------------------------------------------------------------ queries


@dataclass(frozen=True)
class GetInfo:
    model_id: str


@dataclass(frozen=True)
class GetServerCapabilities:
    pass


@dataclass(frozen=True)
class Ping:
    """An empty op that travels SDK → coordinator → worker and back: the control-plane round trip."""

    payload: int = 0


@dataclass(frozen=True)
class Pong:
    payload: int = 0


@dataclass(frozen=True)
class GetClusterStatus:
    pass


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    host: str
    pid: int
    device: str
    state: str
    last_heartbeat_age_s: float


@dataclass(frozen=True)
class ClusterStatus:
    cycles_run: int
    cycle_s: float
    generation: int
    workers: list[WorkerStatus]
    queue_depth: int
    runs: int
    busy_s: float
    uptime_s: float


# ------------------------------------------------------------------------------------------ workers


@dataclass(frozen=True)
class RegisterWorker:
    worker_id: str
    host: str
    pid: int
    device: str
    memory_bytes: int
    token: str | None = None
    models: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerAccepted:
    heartbeat_interval_s: float


@dataclass(frozen=True)
class WorkerHeartbeat:
    worker_id: str


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    op: Any


@dataclass(frozen=True)
class RunCycle:
    cycle_id: int
    items: list[WorkItem]


@dataclass(frozen=True)
class ItemDone:
    cycle_id: int
    request_id: str
    result: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True)
class CycleDone:
    cycle_id: int
    worker_id: str


@dataclass(frozen=True)
class DiscoverWorkerEndpoint:
    """Sent by a worker to the client address it was given, to learn where workers connect."""


@dataclass(frozen=True)
class WorkerEndpoint:
    port: int


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


def _tensor_data_from_wire(value: Any) -> t.TensorData:
    if not isinstance(value, np.ndarray) or value.dtype not in (np.int64, np.float32):
        raise DecodeError("TensorData must carry an int64 or float32 array")
    return t.TensorData(value, "int64" if value.dtype == np.int64 else "float32")


def make_codec(limits: Limits | None = None) -> Codec:
    """The codec every Bios process speaks: all public types, all messages, remote errors."""
    codec = Codec(limits=limits)
    for module in (t, sys.modules[__name__]):
        for obj in vars(module).values():
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                codec.register(obj)
    codec.register(RemoteError)
    codec.register_adapter(t.TensorData, lambda td: td.to_numpy(), _tensor_data_from_wire)
    return codec
