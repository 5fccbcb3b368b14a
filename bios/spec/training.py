"""The rules of training requests: losses and their data (`forward`, `forward_backward`), a run's LoRA config,
its optimizer and each step's hyperparameters."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bios import types as t
from bios.custom_loss import check_custom_loss
from bios.exceptions import BadRequestError

from .inputs import ModelLimits, check_model_input, check_seed, is_int, is_number

CUSTOM_LOSS = "custom"  # the loss_fn of a forward_backward that runs a custom loss graph (Tinker's name)
MAX_LORA_RANK = 512


@dataclass(frozen=True)
class ConfigKey:
    """One `loss_fn_config` key: its default and the closed interval its values must lie in."""

    default: float
    low: float = -math.inf
    high: float = math.inf


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss as a request sees it: the per-token inputs it needs and reads, its config keys."""

    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config: Mapping[str, ConfigKey] = field(default_factory=dict)
    # A sum of per-token terms: a row split over workers (context parallelism) adds its parts' losses. GSPO's
    # sequence ratio needs the whole row.
    per_token: bool = True

    @property
    def defaults(self) -> dict[str, float]:
        return {key: spec.default for key, spec in self.config.items()}


_RL = ("target_tokens", "logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")


def _clip(low: float, high: float) -> dict[str, ConfigKey]:
    return {"clip_low_threshold": ConfigKey(low, 0.0), "clip_high_threshold": ConfigKey(high, 0.0)}


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens", "weights")),
        LossSpec("importance_sampling", _RL),
        LossSpec("ppo", _RL, _CLIP, _clip(0.8, 1.2)),
        LossSpec("cispo", _RL, _CLIP, _clip(0.0, 4.0)),
        LossSpec("dro", _RL, ("sequence_ratio_mask",), {"beta": ConfigKey(0.1, 0.0)}),
        LossSpec("gspo", (*_RL, "sequence_ratio_mask"), _CLIP, _clip(1 - 3e-4, 1 + 4e-4), per_token=False),
        LossSpec("stable_reinforce", _RL, ("sequence_ratio_mask",), {"kl_coeff": ConfigKey(0.01, 0.0)}),
    )
}


def splits_rows(loss_fn: str, custom_loss: object | None, model_input: t.ModelInput) -> bool:
    """Whether a row longer than a pass may be split over workers (context parallelism): a built-in loss that
    sums per-token terms, not a custom one (which sees whole rows), and no images (a tower sees whole images)."""
    return (custom_loss is None and loss_fn in LOSSES and LOSSES[loss_fn].per_token
            and not model_input.has_images)


# ------------------------------------------------------------------------------------------ losses


def loss_spec(loss_fn: object) -> LossSpec:
    if not isinstance(loss_fn, str) or loss_fn not in LOSSES:
        raise BadRequestError(f"unknown loss_fn {loss_fn!r}; choose one of {', '.join(LOSSES)}", field="loss_fn")
    return LOSSES[loss_fn]


def loss_config(loss_fn: str, config: Mapping[str, Any] | None) -> dict[str, float]:
    """`config` over the loss's defaults, every key known to the loss and every value in its range."""
    spec = loss_spec(loss_fn)
    given = dict(config or {})
    unknown = sorted(str(key) for key in given if key not in spec.config)
    if unknown:
        accepted = ", ".join(spec.config) or "no keys"
        raise BadRequestError(f"loss_fn_config keys {unknown} are not used by {loss_fn} (it accepts {accepted})",
                              field=f"loss_fn_config.{unknown[0]}")
    for key, value in given.items():
        rule = spec.config[key]
        if not is_number(value) or not rule.low <= value <= rule.high:
            bounds = f" in [{rule.low}, {rule.high}]" if math.isfinite(rule.high) else f" >= {rule.low}"
            raise BadRequestError(f"loss_fn_config[{key!r}] must be a finite number{bounds}, got {value!r}",
                                  field=f"loss_fn_config.{key}")
    resolved = {**spec.defaults, **{key: float(value) for key, value in given.items()}}
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise BadRequestError(
            f"loss_fn_config clip_low_threshold ({resolved['clip_low_threshold']}) must not exceed "
            f"clip_high_threshold ({resolved['clip_high_threshold']})", field="loss_fn_config.clip_low_threshold")
    return resolved


def check_forward(data: Sequence[t.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None,
                  limits: ModelLimits | None, custom_loss: t.CustomLoss | None = None) -> int:
    """A forward / forward_backward batch; returns its token count. `limits` (when known) adds vocab and context.
    Loss "custom" runs `custom_loss`, a graph checked against `bios.custom_loss`'s allow-list."""
    if custom_loss is None and loss_fn != CUSTOM_LOSS:
        loss_config(loss_fn, loss_fn_config)
        spec = loss_spec(loss_fn)
    else:
        spec = _custom_loss_spec(loss_fn, loss_fn_config, custom_loss)
    if not data:
        raise BadRequestError("data is empty: send at least one Datum", field="data")
    return sum(check_datum(i, datum, spec, limits) for i, datum in enumerate(data))


def _custom_loss_spec(loss_fn: str, config: Mapping[str, Any] | None, loss: t.CustomLoss | None) -> LossSpec:
    if loss_fn != CUSTOM_LOSS or loss is None:
        raise BadRequestError(f"loss_fn {CUSTOM_LOSS!r} comes with a custom loss graph, and a graph only with loss_fn "
                              f"{CUSTOM_LOSS!r}; got loss_fn {loss_fn!r}", field="loss_fn")
    if config:
        raise BadRequestError("a custom loss takes no loss_fn_config: its inputs are loss_fn_inputs",
                              field="loss_fn_config")
    check_custom_loss(loss)
    return LossSpec(CUSTOM_LOSS, ("target_tokens", *(i.name for i in loss.inputs[1:] if i.rank == 1)))


def check_datum(i: int, datum: t.Datum, spec: LossSpec, limits: ModelLimits | None) -> int:
    """One datum of a batch for the loss `spec`; returns its token count."""
    loss_fn = spec.name
    where = f"data[{i}]"
    n = check_model_input(datum.model_input, f"{where}.model_input", limits)
    inputs = datum.loss_fn_inputs
    missing = [key for key in spec.required_inputs if key not in inputs]
    if missing:
        raise BadRequestError(
            f"{where}.loss_fn_inputs lacks {missing[0]!r}, which {loss_fn} needs ({', '.join(spec.required_inputs)})",
            field=f"{where}.loss_fn_inputs.{missing[0]}")
    for key, value in inputs.items():
        array = value.to_numpy()
        name = f"{where}.loss_fn_inputs[{key!r}]"
        if key in spec.required_inputs or key in spec.optional_inputs:
            if array.ndim != 1 or array.shape[0] != n:
                entries = array.shape[0] if array.ndim else 0
                raise BadRequestError(f"{name} has {entries} entries but model_input has {n} tokens",
                                      field=f"{where}.loss_fn_inputs.{key}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise BadRequestError(f"{name} contains NaN or infinity", field=f"{where}.loss_fn_inputs.{key}")
    targets = inputs["target_tokens"].to_numpy()
    if targets.dtype != np.int64:
        raise BadRequestError(f"{where}.loss_fn_inputs['target_tokens'] must be int64, got {targets.dtype}",
                              field=f"{where}.loss_fn_inputs.target_tokens")
    if limits is not None and targets.size and (targets.min() < 0 or targets.max() >= limits.vocab_size):
        raise BadRequestError(f"{where}.loss_fn_inputs['target_tokens'] has ids outside [0, {limits.vocab_size})",
                              field=f"{where}.loss_fn_inputs.target_tokens")
    if limits is None and targets.size and targets.min() < 0:
        raise BadRequestError(f"{where}.loss_fn_inputs['target_tokens'] has negative ids",
                              field=f"{where}.loss_fn_inputs.target_tokens")
    return n


# ------------------------------------------------------------------------------------------ optimizer, LoRA


def check_adam(params: t.AdamParams) -> None:
    rules = (
        ("learning_rate", lambda v: v >= 0, "must be >= 0"),
        ("beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("eps", lambda v: v > 0, "must be > 0"),
        ("weight_decay", lambda v: v >= 0, "must be >= 0"),
        ("grad_clip_norm", lambda v: v >= 0, "must be >= 0 (0 disables clipping)"),
    )
    _check_numbers(params, rules, "adam_params")


def check_dimuon(params: t.DimuonParams) -> None:
    rules = (
        ("learning_rate", lambda v: v >= 0, "must be >= 0"),
        ("grad_clip_norm", lambda v: True, "must be a number (<= 0 disables clipping)"),
        ("beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("damping", lambda v: v > 0, "must be > 0"),
        ("rank_lr_correction_exponent", lambda v: True, "must be a number (0 disables the rank correction)"),
    )
    _check_numbers(params, rules, "optimizer_params")


def _check_numbers(params: object, rules: Sequence[tuple[str, Any, str]], field: str) -> None:
    """Each named field of `params` a finite number obeying its rule; the error names the field."""
    for name, ok, rule in rules:
        value = getattr(params, name)
        if not is_number(value) or not ok(value):
            raise BadRequestError(f"{type(params).__name__}.{name} {rule}, got {value!r}", field=f"{field}.{name}")


OPTIMIZERS: dict[str, type] = {"adamw": t.AdamParams, "dimuon": t.DimuonParams}  # a run's optimizer: its params


def check_optimizer(name: object) -> None:
    if name not in OPTIMIZERS:
        raise BadRequestError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}", field="optimizer")


def check_optim_params(params: object, optimizer: str) -> None:
    """A step's hyperparameters: the kind the run's optimizer (chosen at creation) takes, each value in range."""
    wanted = OPTIMIZERS[optimizer]
    if not isinstance(params, wanted):
        raise BadRequestError(f"this run was created with the {optimizer} optimizer: its steps take "
                              f"{wanted.__name__}, got {type(params).__name__}", field="optim_params")
    if isinstance(params, t.DimuonParams):
        check_dimuon(params)
    else:
        check_adam(params)


# The LoraConfig switches saying which parts of the model an adapter trains.
LORA_FLAGS = ("train_attn", "train_mlp", "train_unembed", "train_vision")


def check_lora(config: t.LoraConfig) -> None:
    """What can be checked of a LoRA config without the model (workers also bound the rank by layer sizes)."""
    rank = config.rank
    if not is_int(rank) or not 1 <= rank <= MAX_LORA_RANK or rank & (rank - 1):
        raise BadRequestError(f"LoRA rank must be a power of two (1, 2, 4, ... {MAX_LORA_RANK}), got {rank!r}",
                              field="rank")
    for flag in LORA_FLAGS:
        if not isinstance(getattr(config, flag), bool):
            raise BadRequestError(f"LoRA {flag} must be true or false, got {getattr(config, flag)!r}", field=flag)
    if not any(getattr(config, flag) for flag in LORA_FLAGS):
        raise BadRequestError(f"LoRA config trains no layer: set at least one of {', '.join(LORA_FLAGS)} to true",
                              field="train_attn")
    check_seed(config.seed, "seed", "LoRA seed")
