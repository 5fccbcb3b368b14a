"""Messages between a client (the SDK, the HTTP gateway) and the coordinator: sessions, requests, answers.

Training operations are *requests* (`Request`): the coordinator answers the ask with `Accepted` once the request
is validated, stored and ordered (the first await), and pushes `RequestDone` when it has run (the second await).
Every request is request `seq` of a `target` (a run, or a sampling session for `Sample`); its id,
`ids.request_id_of(request)`, is known to the client before it sends it. Queries (plain asks with a direct
reply) are in `bios.messages.queries`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from bios import ids
from bios import types as t
from bios.exceptions import RemoteError

PROTOCOL_VERSION = 1

# ------------------------------------------------------------------------------------------ sessions


@dataclass(frozen=True)
class Hello:
    api_key: str | None = None
    sdk_version: str = ""
    protocol: int = PROTOCOL_VERSION
    session_id: str | None = None  # resume this session (after a reconnect or a coordinator restart)


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


class _RunRequest:
    """A request to an existing run: request `seq_id` of run `model_id` (the dataclasses below declare both)."""

    model_id: str
    seq_id: int

    @property
    def target(self) -> str:
        """The run the request belongs to."""
        return self.model_id

    @property
    def seq(self) -> int:
        return self.seq_id


@dataclass(frozen=True)
class CheckpointState:
    """A checkpoint's tensors (PEFT key names) and metadata; travels as zero-copy frames."""

    adapter: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray] | None
    metadata: dict[str, Any]


@dataclass(frozen=True)
class CreateModel:
    """Creates a training run; its model id is `{session_id}:train:{model_seq_id}` (the Tinker format).

    With `from_path` the adapter starts from that checkpoint (and its optimizer state if `with_optimizer`);
    the coordinator fills `state` from its store before the op reaches a worker. `optimizer` is fixed for the
    run's lifetime; a run resumed with its optimizer state keeps the checkpoint's.
    """

    session_id: str
    model_seq_id: int
    base_model: str
    lora: t.LoraConfig
    from_path: str | None = None
    with_optimizer: bool = False
    state: CheckpointState | None = None
    optimizer: t.OptimizerName = "adamw"
    user_metadata: dict[str, str] | None = None  # kept with the run (Tinker's user_metadata); never read by training

    @property
    def target(self) -> str:
        """The run it creates."""
        return ids.run_id(self.session_id, self.model_seq_id)

    @property
    def seq(self) -> int:
        return 0  # a run's first request


@dataclass(frozen=True)
class ForwardBackward(_RunRequest):
    model_id: str
    seq_id: int
    data: list[t.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False
    custom_loss: t.CustomLoss | None = None  # for loss_fn "custom": the graph to run (checked at acceptance)


@dataclass(frozen=True)
class OptimStep(_RunRequest):
    """One optimizer step; `adam_params` (Tinker's wire name) is DimuonParams for a run created with Dimuon."""

    model_id: str
    seq_id: int
    adam_params: t.AdamParams | t.DimuonParams


@dataclass(frozen=True)
class SaveWeights(_RunRequest):
    """save_state (`kind="weights"`: adapter + optimizer) or save_weights_for_sampler (adapter only).

    `name=None` picks a unique name. The coordinator fills `path` before the op reaches a worker.
    """

    model_id: str
    seq_id: int
    name: str | None
    kind: Literal["weights", "sampler_weights", "external_weights"]
    overwrite: bool = False
    path: str = ""
    user_metadata: dict[str, str] | None = None  # kept with the checkpoint (Tinker's user_metadata)


@dataclass(frozen=True)
class LoadWeights(_RunRequest):
    """Replace the adapter (and the optimizer state if `optimizer`, else reset it) with a checkpoint's."""

    model_id: str
    seq_id: int
    path: str
    optimizer: bool
    state: CheckpointState | None = None


@dataclass(frozen=True)
class Sample:
    """Sampling from a base model, optionally with a saved adapter (`adapter_path`).

    The coordinator fills `base_model`, `adapter_path` and (when the worker lacks them) `adapter_state`.
    """

    sampling_session_id: str
    seq_id: int
    prompt: t.ModelInput
    num_samples: int
    sampling_params: t.SamplingParams
    prompt_logprobs: bool = False
    base_model: str = ""
    adapter_path: str | None = None
    adapter_state: CheckpointState | None = None
    topk_prompt_logprobs: int = 0  # > 0: the k most likely tokens at every prompt position
    prompt_alt_tokens_k: int = 0  # > 0: k draws at every prompt position after the first
    topk_sample_logprobs: int = 0  # > 0: the k most likely tokens (model logprobs) at every sampled position
    target_prompt_logprobs: t.TensorData | None = None  # int64 [len(prompt) - 1, K] ids to score (-1: none)
    stream: bool = False  # the worker pushes `SampleProgress` while it samples (the OpenAI gateway's streams)

    @property
    def target(self) -> str:
        """The sampling session it samples in."""
        return self.sampling_session_id

    @property
    def seq(self) -> int:
        return self.seq_id


@dataclass(frozen=True)
class ReleaseSeq(_RunRequest):
    """Give up a seq_id the client reserved but will not send (its request failed on the client's side, or the
    gateway could not parse it), so the run's later requests do not wait for it. Never runs: admission refuses
    it with `reason`, which uses the seq_id up; a resend of that seq_id gets the same answer."""

    model_id: str
    seq_id: int
    reason: str


# Everything a client submits as a request: it gets a request id (`ids.request_id_of`), an `Accepted` and a
# `RequestDone`, and runs in its target's `seq` order (`Sample`s in any order).
Request = CreateModel | ForwardBackward | OptimStep | SaveWeights | LoadWeights | Sample | ReleaseSeq
REQUEST_TYPES: tuple[type, ...] = (CreateModel, ForwardBackward, OptimStep, SaveWeights, LoadWeights, Sample,
                                   ReleaseSeq)
FORWARD_TYPES: tuple[type, ...] = (ForwardBackward,)

# ------------------------------------------------------------------------------------------ answers


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
class Notice:
    """Pushed to a request's client while it waits: why it waits (the client logs it)."""

    request_id: str
    message: str


@dataclass(frozen=True)
class SampleProgress:
    """What a streaming sample (`Sample.stream`) has generated so far, sent by the worker while it samples and
    forwarded by the coordinator to the request's waiters: for each of its sequences, the tokens (with their
    logprobs and top-k) from position `offsets[i]` on. Positions make a repeat harmless; the final `RequestDone`
    still carries the whole result, so a lost progress message loses nothing."""

    cycle_id: int
    request_id: str
    offsets: list[int]
    sequences: list[t.SampledSequence]


@dataclass(frozen=True)
class ModelCreated:
    model_id: str
    info: t.BaseModelInfo
    lora_rank: int
    num_lora_parameters: int
    lora_targets: list[t.LoraTargetGroup] = field(default_factory=list)  # what the adapter trains
