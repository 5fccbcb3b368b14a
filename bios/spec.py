"""The request spec: what a valid request is, in one place.

The coordinator applies every rule here when it accepts a request, so a user error is a `BadRequestError`
naming the field at the first await and nothing about the run changes. Workers apply the same rules to each
item before batching it with other tenants' items, so an item that slips past admission fails alone. Nothing
here imports torch: the coordinator must not, and the rules are about values, not tensors.

A rule needs to know four things of a base model (`ModelLimits`): its name, vocabulary, context and image
geometry (None for a text-only model). Both `BaseModelInfo` (what a worker reports) and the coordinator's
`Limits` (read from `config.json` and the image processor config) have them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from bios import images
from bios import types as t
from bios.custom_loss import check_custom_loss
from bios.exceptions import BadRequestError

MAX_SEED = 2**63 - 1  # seeds travel as int64 (LoRA init, sampling generators)
MAX_SAMPLES_PER_REQUEST = 128
CUSTOM_LOSS = "custom"  # the loss_fn of a forward_backward that runs a custom loss graph (Tinker's name)
MAX_PROMPT_TOPK = 1024  # topk_prompt_logprobs / prompt_alt_tokens_k: a (prompt, k) table each
MAX_SAMPLE_TOPK = 64  # topk_sample_logprobs: a (samples, max_tokens, k) table (vLLM's default cap is 20)
MAX_TARGET_PROMPT_IDS = 1024  # target_prompt_logprobs: at most this many ids scored per prompt position
MAX_ADDITIVE_PENALTY = 2.0  # presence / frequency penalties, OpenAI's range [-2, 2]
MAX_LORA_RANK = 512


class ModelLimits(Protocol):
    """What the rules need of a base model; `BaseModelInfo` and `Limits` both have it."""

    name: str
    vocab_size: int
    max_context_length: int
    vision: images.VisionConfig | None


@dataclass(frozen=True)
class Limits:
    name: str
    vocab_size: int
    max_context_length: int
    vision: images.VisionConfig | None = None


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
        LossSpec("gspo", (*_RL, "sequence_ratio_mask"), _CLIP, _clip(1 - 3e-4, 1 + 4e-4)),
        LossSpec("stable_reinforce", _RL, ("sequence_ratio_mask",), {"kl_coeff": ConfigKey(0.01, 0.0)}),
    )
}


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


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
        if not _is_number(value) or not rule.low <= value <= rule.high:
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


def check_model_input(model_input: t.ModelInput, where: str, limits: ModelLimits | None) -> int:
    """A model input of token and image chunks; returns its length (image chunks count their tokens).

    Every image must decode as its declared format and say how many tokens it becomes (`expected_tokens`),
    which must be what the model's image processor makes of it; images need a vision-language model.
    """
    tokens: list[int] = []
    n = 0
    for i, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, t.EncodedTextChunk):
            tokens.extend(chunk.tokens)
            n += len(chunk.tokens)
        else:
            n += _check_image(chunk, f"{where}.chunks[{i}]", limits)
    _check_tokens(tokens, where, limits, length=n)
    return n


def _check_image(chunk: object, where: str, limits: ModelLimits | None) -> int:
    """One image chunk (already read from disk if it was a pointer); returns its token count."""
    if not isinstance(chunk, t.ImageChunk):
        raise BadRequestError(f"{where} is a {type(chunk).__name__}; Bios reads image pointers into image chunks "
                              "when it accepts a request, so only token and image chunks reach this check", field=where)
    if limits is not None and limits.vision is None:
        raise BadRequestError(f"{where} is an image, but {limits.name} is a text-only model: send images to a "
                              "vision-language model", field=where)
    try:
        image = images.decode_image(chunk)
    except images.ImageError as exc:
        raise BadRequestError(f"{where}: {exc}", field=where) from None
    count = None if limits is None else images.image_token_count(limits.vision, image.width, image.height)
    expected = chunk.expected_tokens
    if not _is_int(expected) or expected < 1:
        hint = f" (this {image.width}x{image.height} image is {count} tokens for {limits.name})" if count else ""
        raise BadRequestError(f"{where}.expected_tokens must be set to the image's token count{hint}, got "
                              f"{expected!r}", field=f"{where}.expected_tokens")
    if count is not None and count != expected:
        raise BadRequestError(f"{where}.expected_tokens is {expected}, but {limits.name}'s image processor makes "
                              f"{count} tokens of this {image.width}x{image.height} image", field=f"{where}.expected_tokens")
    return expected


def _check_tokens(tokens: list[int], where: str, limits: ModelLimits | None, *, length: int | None = None) -> int:
    """Token ids of a prompt or input: non-empty, in the vocabulary, within the context (`length` with images)."""
    n = len(tokens) if length is None else length
    if n == 0:
        raise BadRequestError(f"{where} is empty", field=where)
    bad = next((tok for tok in tokens if not _is_int(tok) or tok < 0
                or (limits is not None and tok >= limits.vocab_size)), None)
    if bad is not None:
        vocab = f"{limits.name}'s vocabulary [0, {limits.vocab_size})" if limits is not None else "[0, vocab)"
        raise BadRequestError(f"{where} has token id {bad!r}, outside {vocab}", field=where)
    if limits is not None and n > limits.max_context_length:
        raise BadRequestError(f"{where} has {n} tokens, more than {limits.name}'s context of "
                              f"{limits.max_context_length}", field=where)
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
        if not _is_number(value) or not ok(value):
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
    if not _is_int(rank) or not 1 <= rank <= MAX_LORA_RANK or rank & (rank - 1):
        raise BadRequestError(f"LoRA rank must be a power of two (1, 2, 4, ... {MAX_LORA_RANK}), got {rank!r}",
                              field="rank")
    for flag in LORA_FLAGS:
        if not isinstance(getattr(config, flag), bool):
            raise BadRequestError(f"LoRA {flag} must be true or false, got {getattr(config, flag)!r}", field=flag)
    if not any(getattr(config, flag) for flag in LORA_FLAGS):
        raise BadRequestError(f"LoRA config trains no layer: set at least one of {', '.join(LORA_FLAGS)} to true",
                              field="train_attn")
    check_seed(config.seed, "seed", "LoRA seed")


def check_seed(seed: object, field_name: str, what: str) -> None:
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise BadRequestError(f"{what} must be an integer between 0 and {MAX_SEED} (or None), got {seed!r}",
                              field=field_name)


# ------------------------------------------------------------------------------------------ sampling


def check_sample(prompt: t.ModelInput | Sequence[int], num_samples: int, params: t.SamplingParams,
                 limits: ModelLimits | None, *, topk_prompt_logprobs: int = 0, prompt_alt_tokens_k: int = 0,
                 topk_sample_logprobs: int = 0, target_prompt_logprobs: t.TensorData | None = None) -> None:
    """A sampling request; `limits` (when known) bounds token ids and the context and checks images."""
    for name, k, top in (("topk_prompt_logprobs", topk_prompt_logprobs, MAX_PROMPT_TOPK),
                         ("prompt_alt_tokens_k", prompt_alt_tokens_k, MAX_PROMPT_TOPK),
                         ("topk_sample_logprobs", topk_sample_logprobs, MAX_SAMPLE_TOPK)):
        if not _is_int(k) or not 0 <= k <= top:
            raise BadRequestError(f"{name} must be an integer between 0 (off) and {top}, got {k!r}", field=name)
    if not _is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES_PER_REQUEST:
        raise BadRequestError(f"num_samples must be an integer between 1 and {MAX_SAMPLES_PER_REQUEST}, got "
                              f"{num_samples!r}", field="num_samples")
    max_tokens = params.max_tokens
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise BadRequestError(f"sampling_params.max_tokens must be an integer >= 1 (or None), got {max_tokens!r}",
                              field="sampling_params.max_tokens")
    if isinstance(prompt, t.ModelInput):
        n = check_model_input(prompt, "prompt", limits)
    else:
        n = _check_tokens(list(prompt), "prompt", limits)
    if limits is not None:
        context = limits.max_context_length
        if n >= context:
            raise BadRequestError(f"prompt has {n} tokens, which leaves no room to sample in {limits.name}'s "
                                  f"context of {context}", field="prompt")
        if max_tokens is not None and n + max_tokens > context:
            raise BadRequestError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds {limits.name}'s "
                                  f"context of {context}; lower max_tokens to at most {context - n}",
                                  field="sampling_params.max_tokens")
    if not _is_number(params.temperature) or params.temperature < 0:
        raise BadRequestError(f"sampling_params.temperature must be a finite number >= 0 (0 = greedy), got "
                              f"{params.temperature!r}", field="sampling_params.temperature")
    if not _is_int(params.top_k) or params.top_k == 0 or params.top_k < -1:
        raise BadRequestError(f"sampling_params.top_k must be -1 (off) or an integer >= 1, got {params.top_k!r}",
                              field="sampling_params.top_k")
    if not _is_number(params.top_p) or not 0 < params.top_p <= 1:
        raise BadRequestError(f"sampling_params.top_p must be in (0, 1], got {params.top_p!r}",
                              field="sampling_params.top_p")
    check_seed(params.seed, "sampling_params.seed", "sampling_params.seed")
    _check_stop(params.stop, limits)
    _check_penalties(params)
    if target_prompt_logprobs is not None:
        check_target_prompt_logprobs(target_prompt_logprobs, n, limits)


def check_target_prompt_logprobs(targets: t.TensorData, prompt_length: int, limits: ModelLimits | None) -> None:
    """Tinker's `target_prompt_logprobs`: int64 ids `[len(prompt) - 1, K]`, each in the vocabulary or -1 (none)."""
    where = "target_prompt_logprobs"
    if not isinstance(targets, t.TensorData) or targets.dtype != "int64":
        raise BadRequestError(f"{where} must be an int64 tensor of token ids", field=where)
    shape = targets.shape
    if len(shape) != 2 or shape[0] != prompt_length - 1 or not 1 <= shape[1] <= MAX_TARGET_PROMPT_IDS:
        raise BadRequestError(f"{where} must have shape [len(prompt) - 1, K] = [{prompt_length - 1}, K] with 1 <= K "
                              f"<= {MAX_TARGET_PROMPT_IDS}, got {shape}", field=where)
    ids = targets.to_numpy()
    top = limits.vocab_size if limits is not None else np.iinfo(np.int64).max
    bad = ids[(ids < -1) | (ids >= top)]
    if bad.size:
        vocab = f"{limits.name}'s vocabulary [0, {limits.vocab_size})" if limits is not None else "[0, vocab)"
        raise BadRequestError(f"{where} has token id {int(bad[0])}, neither -1 (none) nor in {vocab}", field=where)


def _check_penalties(params: t.SamplingParams) -> None:
    if not _is_number(params.min_p) or not 0 <= params.min_p <= 1:
        raise BadRequestError(f"sampling_params.min_p must be in [0, 1] (0 = off), got {params.min_p!r}",
                              field="sampling_params.min_p")
    if not _is_number(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise BadRequestError(f"sampling_params.repetition_penalty must be a finite number > 0 (1 = off), got "
                              f"{params.repetition_penalty!r}", field="sampling_params.repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _is_number(value) or not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
            raise BadRequestError(f"sampling_params.{name} must be in [-{MAX_ADDITIVE_PENALTY}, "
                                  f"{MAX_ADDITIVE_PENALTY}] (0 = off), got {value!r}", field=f"sampling_params.{name}")


def stop_strings(stop: object) -> list[str]:
    """The stop strings of a (valid) `stop`; token-id stops are not strings."""
    if isinstance(stop, str):
        return [stop]
    return [s for s in stop or () if isinstance(s, str)]


def _check_stop(stop: object, limits: ModelLimits | None) -> None:
    if stop is None or isinstance(stop, str) and stop:
        return
    rule = "sampling_params.stop must be None, a non-empty string, a list of non-empty strings or a list of token ids"
    if not isinstance(stop, (list, tuple)):
        raise BadRequestError(f"{rule}, got {type(stop).__name__}", field="sampling_params.stop")
    if all(isinstance(s, str) and s for s in stop):
        return
    if not all(_is_int(s) for s in stop):
        raise BadRequestError(f"{rule} (not a mix), got {list(stop)!r}", field="sampling_params.stop")
    vocab = None if limits is None else limits.vocab_size
    bad = next((s for s in stop if s < 0 or (vocab is not None and s >= vocab)), None)
    if bad is not None:
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise BadRequestError(f"sampling_params.stop token id {bad} is outside {limit}", field="sampling_params.stop")
