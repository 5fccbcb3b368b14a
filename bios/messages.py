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
from typing import Any, Literal

import numpy as np

from bios import account, cluster_defaults, images, model_input
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


@dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    seq_id: int
    data: list[t.Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False
    custom_loss: t.CustomLoss | None = None  # for loss_fn "custom": the graph to run (checked at acceptance)


@dataclass(frozen=True)
class OptimStep:
    """One optimizer step; `adam_params` (Tinker's wire name) is DimuonParams for a run created with Dimuon."""

    model_id: str
    seq_id: int
    adam_params: t.AdamParams | t.DimuonParams


@dataclass(frozen=True)
class SaveWeights:
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
class LoadWeights:
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


@dataclass(frozen=True)
class ReleaseSeq:
    """Give up a seq_id the client reserved but will not send (its request failed on the client's side, or the
    gateway could not parse it), so the run's later requests do not wait for it. Never runs: admission refuses
    it with `reason`, which uses the seq_id up; a resend of that seq_id gets the same answer."""

    model_id: str
    seq_id: int
    reason: str


REQUEST_TYPES: tuple[type, ...] = (CreateModel, ForwardBackward, OptimStep, SaveWeights, LoadWeights, Sample,
                                   ReleaseSeq)
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
class SavedState:
    """A worker's answer to SaveWeights: the tensors for the coordinator's checkpoint store."""

    state: CheckpointState


@dataclass(frozen=True)
class ModelCreated:
    model_id: str
    info: t.BaseModelInfo
    lora_rank: int
    num_lora_parameters: int
    lora_targets: list[t.LoraTargetGroup] = field(default_factory=list)  # what the adapter trains


# ------------------------------------------------------------------------------------------ queries


@dataclass(frozen=True)
class GetInfo:
    model_id: str


@dataclass(frozen=True)
class GetServerCapabilities:
    pass


@dataclass(frozen=True)
class CreateSamplingSession:
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    base_model: str
    model_path: str | None = None


@dataclass(frozen=True)
class GetSamplingSession:
    sampling_session_id: str


@dataclass(frozen=True)
class ListTrainingRuns:
    limit: int = 20
    offset: int = 0
    project_id: str | None = None  # only the runs of sessions in this project (Tinker's project label)


@dataclass(frozen=True)
class GetTrainingRun:
    training_run_id: str


@dataclass(frozen=True)
class ListCheckpoints:
    training_run_id: str


@dataclass(frozen=True)
class DeleteCheckpoint:
    path: str


@dataclass(frozen=True)
class FetchCheckpoint:
    """Download a checkpoint's tensors and metadata (for export)."""

    path: str


@dataclass(frozen=True)
class GetTrainingRunMetrics:
    """A run's summary and its per-optimizer-step history; `max_points` > 0 thins it evenly (the last kept)."""

    training_run_id: str
    max_points: int = 0


@dataclass(frozen=True)
class ListRunSummaries:
    limit: int = 20
    offset: int = 0


@dataclass(frozen=True)
class MetricPoint:
    """One optimizer step of a run: what its forward_backward and optim_step results reported.

    `loss` is the summed `loss:sum` of the step's forward_backward calls; `tokens` their input tokens and
    `total_tokens` the run's running total (so a thinned history still gives tokens per second)."""

    step: int
    cycle_id: int
    time: float
    loss: float | None
    tokens: int
    total_tokens: int
    grad_norm: float | None
    learning_rate: float | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSummary:
    training_run_id: str
    base_model: str
    owner: str
    status: str  # creating | ready | lost
    created: float
    last_request_time: float
    steps: int
    tokens: int
    last_loss: float | None
    last_checkpoint: str | None  # the newest checkpoint's bios:// path, of either kind
    base_dtype: str | None = None  # as the workers hold the base model's frozen weights


@dataclass(frozen=True)
class RunSummaries:
    runs: list[RunSummary]
    total_count: int


@dataclass(frozen=True)
class TrainingRunMetrics:
    summary: RunSummary
    points: list[MetricPoint]


@dataclass(frozen=True)
class GetRunTrace:
    training_run_id: str


@dataclass(frozen=True)
class TracedRequest:
    """One request's timeline (epoch seconds): accepted, taken into cycle `cycle_id`, finished."""

    request_id: str
    seq_id: int
    op: str
    status: str  # accepted | done | failed | rejected
    accepted: float
    started: float | None
    finished: float | None
    cycle_id: int | None


@dataclass(frozen=True)
class RunTrace:
    training_run_id: str
    requests: list[TracedRequest]


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
    state: str  # active | joining | idle | waiting | leaving | dead
    last_heartbeat_age_s: float
    note: str = ""  # why a waiting worker waits (its budget cannot hold the pool's plans)


@dataclass(frozen=True)
class GroupStatus:
    """One group of workers (bios.coordinator.placement): the base models it holds, the workers the placement
    gives it, its tensor-parallel size, and the replicas and workers of the generation it runs now."""

    group_id: str
    models: list[str]
    workers: list[str]
    tp: int
    replicas: int
    formed: list[str] = field(default_factory=list)


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
    phase_seconds: dict[str, float] = field(default_factory=dict)  # summed over cycles (rank 0's view)
    plans: dict[str, str] = field(default_factory=dict)  # base model -> its memory plan and estimate
    state_dir: StateDirSpace | None = None  # the coordinator's state directory: checkpoints and the request log
    groups: list[GroupStatus] = field(default_factory=list)  # where each base model runs
    placement_notes: list[str] = field(default_factory=list)  # why the placement last changed


@dataclass(frozen=True)
class StateDirSpace:
    """How much room checkpoints and the request log have left; `warning` is set well before saves fail."""

    path: str
    free_bytes: int
    total_bytes: int
    warning: str = ""


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
    store_host: str = "127.0.0.1"
    store_port: int = 0
    runtime_bytes: int = 0  # the worker process's own footprint before any model (measured; 0: unknown)
    holdings: dict[str, float] = field(default_factory=dict)  # adapters it still holds (registering again): checksums
    last_cycle: HeldCycle | None = None  # the last cycle it committed, for a coordinator that never heard its end


@dataclass(frozen=True)
class HeldCycle:
    """What a worker keeps of the last cycle it committed: each adapter's checksum before it, and the results it
    reported. A restarted coordinator whose log stops just before this cycle records these results instead of
    running the cycle again."""

    cycle_id: int
    before: dict[str, float]
    results: list[ItemDone]


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
    """One cycle's work. Every member gets the same training items (each takes its own data shard and runs
    the replicated ops); sample items are dealt out, so each member gets its own."""

    cycle_id: int
    generation: int
    items: list[WorkItem]


@dataclass(frozen=True)
class AdapterSpec:
    model_id: str
    base_model: str
    lora: t.LoraConfig
    optimizer: t.OptimizerName = "adamw"


@dataclass(frozen=True)
class ModelPlan:
    """How workers hold one base model: its memory plan (bios.models.memory_plan.Plan) as plain data."""

    base_model: str
    activation_checkpointing: bool = False
    tokens_per_pass: int = 16384  # the per-pass token budget the plan was sized for


@dataclass(frozen=True)
class Reconfigure:
    """Form generation `generation`: rebuild the collective group, then take every adapter's state from rank 0
    by broadcast (newcomers create the adapters first). Adapters in `restore` come from a checkpoint instead:
    the pool that held them is gone.

    With `tp` > 1 the members form `world // tp` replicas of `tp` tensor-parallel shard holders (rank r is shard
    r % tp of replica r // tp) and every base model is split that way. `source_tp` is how the state's holders
    hold it: 1, whole on rank 0 (broadcast to everyone, each member keeps its slice); equal to `tp`, shard j on
    rank j (broadcast to the other replicas' rank-j members)."""

    generation: int
    rank: int
    world: int
    master_host: str
    master_port: int
    timeout_s: float
    adapters: list[AdapterSpec]
    restore: dict[str, CheckpointState] = field(default_factory=dict)
    tp: int = 1
    source_tp: int = 1
    plans: list[ModelPlan] = field(default_factory=list)
    epoch: str = ""  # the coordinator's incarnation: its generations' rendezvous keys are its own
    # How long a collective may wait for a peer that is alive but busier (`timeout_s` bounds joining only).
    collective_timeout_s: float = cluster_defaults.COLLECTIVE_TIMEOUT_S


@dataclass(frozen=True)
class Reconfigured:
    generation: int
    worker_id: str
    checksums: dict[str, float]
    error: str | None = None


@dataclass(frozen=True)
class ItemDone:
    cycle_id: int
    request_id: str
    result: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True)
class CycleDone:
    """A member finished its part of a cycle. `aborted`: a collective failed, nothing uncommitted was kept."""

    cycle_id: int
    worker_id: str
    aborted: bool = False
    reason: str = ""
    checksums: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # time per phase: forward, allreduce, closing, sample


@dataclass(frozen=True)
class DiscoverWorkerEndpoint:
    """Sent by a worker to the client address it was given, to learn where workers connect."""


@dataclass(frozen=True)
class WorkerEndpoint:
    port: int


@dataclass(frozen=True)
class Leaving:
    """A worker asks to leave gracefully: it finishes its current cycle and exits when told (`Shutdown`)."""

    worker_id: str
    reason: str = ""


@dataclass(frozen=True)
class Shutdown:
    reason: str = ""


@dataclass(frozen=True)
class AbortGeneration:
    """The coordinator gave up on generation `generation` of its incarnation `epoch` (a member died, hangs or was
    cut off; another aborted): every collective of it ends now on the receiver, which reports its cycle aborted
    or its joining failed, instead of waiting out the collective timeout."""

    epoch: str
    generation: int
    reason: str = ""


@dataclass(frozen=True)
class Rejoin:
    """The coordinator does not count the sender as a member (it was declared dead, say after heartbeats went
    missing on a starved machine): the worker registers again, as a new member that receives the current state."""

    reason: str = ""


def _tensor_data_from_wire(value: Any) -> t.TensorData:
    if not isinstance(value, np.ndarray) or value.dtype not in (np.int64, np.float32):
        raise DecodeError("TensorData must carry an int64 or float32 array")
    return t.TensorData(value, "int64" if value.dtype == np.int64 else "float32")


def make_codec(limits: Limits | None = None) -> Codec:
    """The codec every Bios process speaks: all public types, all messages, remote errors."""
    codec = Codec(limits=limits)
    for module in (t, model_input, images, account, sys.modules[__name__]):
        for obj in vars(module).values():
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
                codec.register(obj)
    codec.register(RemoteError)
    codec.register_adapter(t.TensorData, lambda td: td.to_numpy(), _tensor_data_from_wire)
    return codec
