"""The public vocabulary shared by the SDK, the coordinator and the workers.

Names and fields follow the Tinker SDK (`tinker.types`) so that a training loop written for Tinker ports by
changing the import. Everything here is a plain dataclass over numpy arrays: no torch import at module load,
no pydantic, and every type crosses the wire through `bios.transport.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from bios.images import VisionConfig
from bios.model_input import (  # noqa: F401  (re-exported: the public vocabulary)
    EncodedTextChunk,
    ImageAssetPointerChunk,
    ImageChunk,
    ModelInput,
    ModelInputChunk,
)

LossFnType = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
]
LOSS_FNS: tuple[str, ...] = (
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
)
StopReason = Literal["stop", "length"]
TensorDtype = Literal["int64", "float32"]

_NP_DTYPES: dict[str, np.dtype] = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}
# Raw lists carry no dtype; these keys say which one they mean (the Tinker convention).
_KEY_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}


# --------------------------------------------------------------------------------------------- inputs


class TensorData:
    """A dense array with a Tinker dtype (`int64` or `float32`), stored as numpy."""

    __slots__ = ("_array",)

    def __init__(
        self,
        data: Sequence[float] | Sequence[int] | np.ndarray | None = None,
        dtype: TensorDtype | None = None,
        shape: Sequence[int] | None = None,
    ) -> None:
        if dtype is None:
            raise TypeError("TensorData needs a dtype: 'int64' or 'float32'")
        if dtype not in _NP_DTYPES:
            raise ValueError(f"TensorData dtype must be 'int64' or 'float32', got {dtype!r}")
        array = np.asarray([] if data is None else data, dtype=_NP_DTYPES[dtype])
        if shape is not None and list(array.shape) != list(shape):
            array = array.reshape(tuple(shape))
        self._array = array

    @property
    def dtype(self) -> TensorDtype:
        return "int64" if self._array.dtype == np.int64 else "float32"

    @property
    def shape(self) -> list[int]:
        return list(self._array.shape)

    @property
    def data(self) -> list[Any]:
        return self._array.reshape(-1).tolist()

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
            return cls(array.astype(np.int64, copy=False), "int64")
        return cls(array.astype(np.float32, copy=False), "float32")

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        import torch

        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            return cls(tensor.to(torch.float32).contiguous().numpy(), "float32")
        return cls(tensor.to(torch.int64).contiguous().numpy(), "int64")

    def to_numpy(self) -> np.ndarray:
        return self._array

    def to_torch(self) -> Any:
        """A tensor sharing memory when it may; arrays received read-only off the wire are copied first."""
        import torch

        array = np.ascontiguousarray(self._array)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def tolist(self) -> list[Any]:
        return self._array.tolist()

    def __len__(self) -> int:
        return int(self._array.shape[0]) if self._array.ndim else 1

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorData)
            and self.dtype == other.dtype
            and np.array_equal(self._array, other._array)
        )

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype!r}, shape={self.shape}, data={self._array!r})"


def _to_tensor_data(key: str, value: Any) -> TensorData:
    if isinstance(value, TensorData):
        return value
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if type(value).__module__.startswith("torch"):
        return TensorData.from_torch(value)
    if isinstance(value, (list, tuple)):
        if key not in _KEY_DTYPES:
            raise ValueError(
                f"loss_fn_inputs[{key!r}] is a plain list; pass a TensorData, numpy array or torch tensor "
                f"so its dtype is known (plain lists are accepted for {sorted(_KEY_DTYPES)})"
            )
        return TensorData(value, _KEY_DTYPES[key])
    raise TypeError(f"loss_fn_inputs[{key!r}] has unsupported type {type(value).__name__}")


@dataclass(frozen=True)
class Datum:
    """One training example: `model_input[i]` predicts `loss_fn_inputs['target_tokens'][i]`."""

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        coerced = {str(k): _to_tensor_data(str(k), v) for k, v in self.loss_fn_inputs.items()}
        object.__setattr__(self, "loss_fn_inputs", coerced)


@dataclass(frozen=True)
class CustomLossInput:
    """One input of a custom loss: `logprobs` (first) or a `loss_fn_inputs` key, with its rank (0, 1: [T], 2)."""

    name: str
    rank: int


@dataclass(frozen=True)
class CustomLossNode:
    """One torch.fx node as the tinker SDK encodes it (`tinker.types.CustomLossNode`): plain data, never code."""

    op: str
    name: str
    target: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CustomLoss:
    """A traced per-datum loss `(logprobs, *inputs) -> (loss, metrics)`; `bios.custom_loss` says what it may do."""

    name: str
    inputs: list[CustomLossInput]
    nodes: list[CustomLossNode]
    format: int = 1


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class DimuonParams:
    """One Dimuon step (Tinker's fields and defaults); `bios.kernels.dimuon` says what each one does."""

    learning_rate: float
    grad_clip_norm: float = 0.0  # <= 0: no clipping
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175


OptimizerName = Literal["adamw", "dimuon"]  # chosen at creation, fixed for the run's lifetime


@dataclass(frozen=True)
class AdamOptimizerConfig:
    """AdamW (the default): steps take `AdamParams`."""


@dataclass(frozen=True)
class DimuonOptimizerConfig:
    """Dimuon: steps take `DimuonParams`. Version 1 is the only one."""

    version: int = 1


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    # Beyond Tinker's fields (the tinker wire has none such; native SDK only): also the linear layers of a
    # vision-language model's image encoder.
    train_vision: bool = False


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    # Beyond Tinker's fields (vLLM's meanings; bios.worker.logits_processing applies them):
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    presence_penalty: float = 0.0  # subtracted from the logit of every token already sampled
    frequency_penalty: float = 0.0  # subtracted once per time a token was already sampled


# -------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def loss(self) -> float:
        """The summed loss of this call (`loss:sum`)."""
        return self.metrics["loss:sum"]

    @property
    def grad_norm(self) -> float | None:
        """L2 norm of the run's accumulated gradient once this call's gradients are in (None for `forward`)."""
        return self.metrics.get("grad_norm:max")


@dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float] | None = None

    @property
    def learning_rate(self) -> float | None:
        return None if self.metrics is None else self.metrics.get("learning_rate:mean")

    @property
    def grad_norm(self) -> float | None:
        """The gradient's global L2 norm before clipping."""
        return None if self.metrics is None else self.metrics.get("grad_norm:mean")


@dataclass(frozen=True)
class SampledSequence:
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = None
    # `topk_sample_logprobs=k`: the k most likely tokens at each generated position and their logprobs under the
    # model's own log-softmax (before penalties, temperature and filters), a dense `(len(tokens), k)` pair
    topk_logprobs: TopkLogprobs | None = None


# Tinker's filler for the empty cells of a `TopkLogprobs` (with token id 0).
TOPK_MASK_LOGPROB = -99999.0


@dataclass(frozen=True)
class TopkLogprobs:
    """The k most likely tokens at each position, most likely first, as dense `(length, k)` int64 / float32
    matrices; a position without values (the prompt's first) holds token 0 with `TOPK_MASK_LOGPROB`."""

    token_ids: TensorData
    logprobs: TensorData


@dataclass(frozen=True)
class PromptAltTokens:
    """`k` draws (with replacement, at the request's temperature) from the next-token distribution at each
    prompt position after the first, and their logprobs under that distribution: `[len(prompt) - 1, k]`."""

    tokens: TensorData
    logprobs: TensorData


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    # the logprobs of the ids of the request's `target_prompt_logprobs` ([len(prompt) - 1, K], cell [i, j] scored at
    # prompt position i + 1): float32, same shape, 0.0 where the request had -1
    target_prompt_logprobs: TensorData | None = None


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
    vision: VisionConfig | None = None  # a vision-language model's image geometry; None: text only
