"""The training half of the vocabulary: what a training loop sends and gets back.

Examples (`Datum`, whose `loss_fn_inputs` become `TensorData`), custom loss graphs, a run's LoRA and optimizer
choice, each step's hyperparameters, and the results of `forward_backward` and `optim_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

from bios.model_input import ModelInput

from .tensors import TensorData, TensorDtype

LossFnType = Literal[
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
]
LOSS_FNS: tuple[str, ...] = (
    "cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"
)

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
