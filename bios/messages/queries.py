"""Queries between a client and the coordinator: plain asks with a direct reply (runs, checkpoints, metrics,
traces, sampling sessions, the cluster's status), and the control-plane round trip `Ping`."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    models: list[str] = field(default_factory=list)  # the base models its group holds (the placement's)
    memory_bytes: int = 0  # its memory budget (--memory-limit, else its device's), which placement fills


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
    longest_rows: dict[str, int] = field(default_factory=dict)  # base model -> the longest row (tokens) it trains
    longest_forward_rows: dict[str, int] = field(default_factory=dict)  # ... it runs forward only (no graph)
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
