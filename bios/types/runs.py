"""Runs, checkpoints and base models as the service reports them.

What saving and loading weights return, a run's `get_info`, the server's capabilities, the REST listings of
runs and checkpoints, and what the cluster knows of a loaded base model (`BaseModelInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bios.images import VisionConfig

from .training import LoraConfig, OptimizerName


@dataclass(frozen=True)
class SaveWeightsResponse:
    path: str


@dataclass(frozen=True)
class SaveWeightsForSamplerResponse:
    path: str


@dataclass(frozen=True)
class LoadWeightsResponse:
    path: str | None = None
    model_id: str | None = None


@dataclass(frozen=True)
class ModelData:
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclass(frozen=True)
class LoraTargetGroup:
    """Weights of one kind that an adapter trains, summarised over layers: `pattern` is their module path with
    layer indices as `*` (`model.layers.*.self_attn.q_proj`), `modules` how many paths match it."""

    pattern: str
    role: Literal["attn", "mlp", "unembed", "vision"]
    kind: Literal["linear", "conv1d", "experts"]  # nn.Linear, transformers Conv1D, 3D routed-expert weights
    modules: int
    experts: int = 0  # routed experts per module, each with its own A and B (0: not an experts weight)


@dataclass(frozen=True)
class GetInfoResponse:
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None
    memory_plan: str | None = None  # how the workers hold the base model (plan, layout, memory estimate)
    base_dtype: str | None = None  # the frozen base weights' dtype on the workers ("bfloat16", "float32")
    lora_seed: int | None = None  # the adapter's initialisation seed: the user's, or the one chosen at creation
    optimizer: OptimizerName = "adamw"
    # What the adapter trains; None for a run restored from the coordinator's state dir (not stored there).
    lora_targets: list[LoraTargetGroup] | None = None
    # The longest row (tokens) one forward_backward may hold on the current workers (None: not planned yet)
    longest_row: int | None = None
    longest_forward_row: int | None = None  # the same for a forward-only request (`forward`), which builds no graph


@dataclass(frozen=True)
class SupportedModel:
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


@dataclass(frozen=True)
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]
    cycle_s: float | None = None  # the coordinator's clock (--cycle-s; 0 = back to back): each step waits for a tick


@dataclass(frozen=True)
class Checkpoint:
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: float
    bios_path: str
    size_bytes: int | None = None
    user_metadata: dict[str, str] | None = None  # what the save attached


@dataclass(frozen=True)
class TrainingRun:
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    lora_rank: int | None
    last_request_time: float
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    optimizer: OptimizerName = "adamw"
    user_metadata: dict[str, str] | None = None  # what the run's creation attached
    lora: LoraConfig | None = None  # what the adapter trains (rank, seed, train_* flags); None if not recorded


@dataclass(frozen=True)
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass(frozen=True)
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass(frozen=True)
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]


@dataclass(frozen=True)
class BaseModelInfo:
    """What the cluster knows of a loaded base model: enough to validate requests without touching it."""

    name: str
    local_dir: str
    arch: str
    vocab_size: int
    max_context_length: int
    hidden_size: int
    num_layers: int
    num_parameters: int
    eos_token_id: int | None = None
    base_dtype: str | None = None  # as the workers hold the frozen weights, once one has loaded them
    # Whether a row longer than a pass may be split over a group's workers (the model runs Bios's attention,
    # `bios.worker.attention`), once a worker has loaded it; None: not known yet
    splits_long_rows: bool | None = None
    vision: VisionConfig | None = None  # a vision-language model's image geometry; None: text only
