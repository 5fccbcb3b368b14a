"""Request validation: every check the coordinator runs before it accepts a request.

A request that fails here is rejected at acceptance with a `BadRequestError` whose `field` names the input, so
nothing about the run changes. Workers run the same checks again before touching a model.
"""

from __future__ import annotations

import math

import numpy as np

from bios import types as t
from bios.exceptions import BadRequestError

# Inputs each loss needs besides the tokens (Tinker's conventions, reference §3.1).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
}
_PER_TOKEN_OPTIONAL = ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask", "mask")


def validate_lora_rank(rank: int) -> None:
    if not isinstance(rank, int) or rank < 1 or rank & (rank - 1):
        raise BadRequestError(f"LoRA rank must be a power of two (1, 2, 4, ... 512), got {rank!r}", field="rank")


def validate_forward_backward(
    data: list[t.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None, info: t.BaseModelInfo
) -> int:
    """Check a forward/forward_backward batch against the model; returns its token count."""
    if loss_fn not in LOSS_INPUTS:
        raise BadRequestError(
            f"unknown loss_fn {loss_fn!r}; choose one of {', '.join(LOSS_INPUTS)}", field="loss_fn"
        )
    if not data:
        raise BadRequestError("data is empty: send at least one Datum", field="data")
    for key, value in (loss_fn_config or {}).items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequestError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}",
                                  field=f"loss_fn_config.{key}")
    total = 0
    for i, datum in enumerate(data):
        total += _validate_datum(i, datum, loss_fn, info)
    return total


def _validate_datum(i: int, datum: t.Datum, loss_fn: str, info: t.BaseModelInfo) -> int:
    tokens = datum.model_input.to_ints()
    n = len(tokens)
    where = f"data[{i}]"
    if n == 0:
        raise BadRequestError(f"{where}.model_input is empty", field=f"{where}.model_input")
    if n > info.max_context_length:
        raise BadRequestError(
            f"{where}.model_input has {n} tokens, more than {info.name}'s context of {info.max_context_length}",
            field=f"{where}.model_input",
        )
    bad = next((tok for tok in tokens if not 0 <= tok < info.vocab_size), None)
    if bad is not None:
        raise BadRequestError(
            f"{where}.model_input has token id {bad}, outside {info.name}'s vocabulary [0, {info.vocab_size})",
            field=f"{where}.model_input",
        )
    inputs = datum.loss_fn_inputs
    for key in LOSS_INPUTS[loss_fn]:
        if key not in inputs:
            raise BadRequestError(
                f"{where}.loss_fn_inputs lacks {key!r}, which {loss_fn} needs ({', '.join(LOSS_INPUTS[loss_fn])})",
                field=f"{where}.loss_fn_inputs.{key}",
            )
    for key, value in inputs.items():
        array = value.to_numpy()
        if key in LOSS_INPUTS[loss_fn] or key in _PER_TOKEN_OPTIONAL:
            if array.ndim != 1 or array.shape[0] != n:
                raise BadRequestError(
                    f"{where}.loss_fn_inputs[{key!r}] has {array.shape[0] if array.ndim else 0} entries but "
                    f"model_input has {n} tokens",
                    field=f"{where}.loss_fn_inputs.{key}",
                )
        if array.dtype == np.float32 and not np.isfinite(array).all():
            raise BadRequestError(f"{where}.loss_fn_inputs[{key!r}] contains NaN or infinity",
                                  field=f"{where}.loss_fn_inputs.{key}")
    targets = inputs["target_tokens"].to_numpy()
    if targets.dtype != np.int64:
        raise BadRequestError(f"{where}.loss_fn_inputs['target_tokens'] must be int64, got {targets.dtype}",
                              field=f"{where}.loss_fn_inputs.target_tokens")
    if targets.size and (targets.min() < 0 or targets.max() >= info.vocab_size):
        raise BadRequestError(
            f"{where}.loss_fn_inputs['target_tokens'] has ids outside [0, {info.vocab_size})",
            field=f"{where}.loss_fn_inputs.target_tokens",
        )
    return n


def validate_adam_params(params: t.AdamParams) -> None:
    checks = (
        ("learning_rate", params.learning_rate, lambda v: v >= 0, "must be >= 0"),
        ("beta1", params.beta1, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("beta2", params.beta2, lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ("eps", params.eps, lambda v: v > 0, "must be > 0"),
        ("weight_decay", params.weight_decay, lambda v: v >= 0, "must be >= 0"),
        ("grad_clip_norm", params.grad_clip_norm, lambda v: v >= 0, "must be >= 0 (0 disables clipping)"),
    )
    for name, value, ok, rule in checks:
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise BadRequestError(f"AdamParams.{name} {rule}, got {value!r}", field=f"adam_params.{name}")


MAX_SAMPLES_PER_REQUEST = 128


def validate_sample(prompt: t.ModelInput, num_samples: int, params: t.SamplingParams,
                    info: t.BaseModelInfo | None) -> None:
    """Check a sampling request; `info` (when known) bounds token ids and the context."""
    if not isinstance(num_samples, int) or not 1 <= num_samples <= MAX_SAMPLES_PER_REQUEST:
        raise BadRequestError(f"num_samples must be between 1 and {MAX_SAMPLES_PER_REQUEST}, got {num_samples!r}",
                              field="num_samples")
    tokens = prompt.to_ints()
    if not tokens:
        raise BadRequestError("prompt is empty", field="prompt")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise BadRequestError(f"sampling_params.max_tokens must be >= 1, got {params.max_tokens}",
                              field="sampling_params.max_tokens")
    if not (isinstance(params.temperature, (int, float)) and math.isfinite(params.temperature)
            and params.temperature >= 0):
        raise BadRequestError(f"sampling_params.temperature must be >= 0, got {params.temperature!r}",
                              field="sampling_params.temperature")
    if not (isinstance(params.top_p, (int, float)) and 0 < params.top_p <= 1):
        raise BadRequestError(f"sampling_params.top_p must be in (0, 1], got {params.top_p!r}",
                              field="sampling_params.top_p")
    if not isinstance(params.top_k, int) or (params.top_k != -1 and params.top_k < 1):
        raise BadRequestError(f"sampling_params.top_k must be -1 (off) or >= 1, got {params.top_k!r}",
                              field="sampling_params.top_k")
    if info is None:
        return
    bad = next((tok for tok in tokens if not 0 <= tok < info.vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"prompt has token id {bad}, outside {info.name}'s vocabulary [0, {info.vocab_size})",
                              field="prompt")
    if len(tokens) + (params.max_tokens or 1) > info.max_context_length:
        raise BadRequestError(
            f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds {info.name}'s context of "
            f"{info.max_context_length} tokens",
            field="sampling_params.max_tokens",
        )
