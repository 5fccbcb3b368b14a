"""The rules of sampling requests: sample counts, sampling params (temperature, filters, penalties, stops, seed),
the context a prompt leaves, and what a request may ask about its prompt and samples."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bios import types as t
from bios.exceptions import BadRequestError

from .inputs import ModelLimits, check_model_input, check_seed, check_tokens, is_int, is_number

# max_tokens=None samples up to this many tokens (fewer if the context ends first): long enough for a
# chat answer, short enough that a forgotten max_tokens does not occupy a worker for a whole context.
DEFAULT_MAX_TOKENS = 256


def resolved_max_tokens(prompt_len: int, params: t.SamplingParams, context: int | None) -> int:
    """`params.max_tokens`, or for None: `DEFAULT_MAX_TOKENS` capped by what the context leaves after the prompt."""
    if params.max_tokens is not None:
        return params.max_tokens
    if context is None:
        return DEFAULT_MAX_TOKENS
    return min(DEFAULT_MAX_TOKENS, context - prompt_len)


MAX_SAMPLES_PER_REQUEST = 128
MAX_PROMPT_TOPK = 1024  # topk_prompt_logprobs / prompt_alt_tokens_k: a (prompt, k) table each
MAX_SAMPLE_TOPK = 64  # topk_sample_logprobs: a (samples, max_tokens, k) table (vLLM's default cap is 20)
MAX_TARGET_PROMPT_IDS = 1024  # target_prompt_logprobs: at most this many ids scored per prompt position
MAX_ADDITIVE_PENALTY = 2.0  # presence / frequency penalties, OpenAI's range [-2, 2]


def check_sample(prompt: t.ModelInput | Sequence[int], num_samples: int, params: t.SamplingParams,
                 limits: ModelLimits | None, *, topk_prompt_logprobs: int = 0, prompt_alt_tokens_k: int = 0,
                 topk_sample_logprobs: int = 0, target_prompt_logprobs: t.TensorData | None = None) -> None:
    """A sampling request; `limits` (when known) bounds token ids and the context and checks images."""
    for name, k, top in (("topk_prompt_logprobs", topk_prompt_logprobs, MAX_PROMPT_TOPK),
                         ("prompt_alt_tokens_k", prompt_alt_tokens_k, MAX_PROMPT_TOPK),
                         ("topk_sample_logprobs", topk_sample_logprobs, MAX_SAMPLE_TOPK)):
        if not is_int(k) or not 0 <= k <= top:
            raise BadRequestError(f"{name} must be an integer between 0 (off) and {top}, got {k!r}", field=name)
    if not is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES_PER_REQUEST:
        raise BadRequestError(f"num_samples must be an integer between 1 and {MAX_SAMPLES_PER_REQUEST}, got "
                              f"{num_samples!r}", field="num_samples")
    max_tokens = params.max_tokens
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise BadRequestError(f"sampling_params.max_tokens must be an integer >= 1 (or None), got {max_tokens!r}",
                              field="sampling_params.max_tokens")
    if isinstance(prompt, t.ModelInput):
        n = check_model_input(prompt, "prompt", limits)
    else:
        n = check_tokens(list(prompt), "prompt", limits)
    if limits is not None:
        context = limits.max_context_length
        if n >= context:
            raise BadRequestError(f"prompt has {n} tokens, which leaves no room to sample in {limits.name}'s "
                                  f"context of {context}", field="prompt")
        if max_tokens is not None and n + max_tokens > context:
            raise BadRequestError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds {limits.name}'s "
                                  f"context of {context}; lower max_tokens to at most {context - n}",
                                  field="sampling_params.max_tokens")
    if not is_number(params.temperature) or params.temperature < 0:
        raise BadRequestError(f"sampling_params.temperature must be a finite number >= 0 (0 = greedy), got "
                              f"{params.temperature!r}", field="sampling_params.temperature")
    if not is_int(params.top_k) or params.top_k == 0 or params.top_k < -1:
        raise BadRequestError(f"sampling_params.top_k must be -1 (off) or an integer >= 1, got {params.top_k!r}",
                              field="sampling_params.top_k")
    if not is_number(params.top_p) or not 0 < params.top_p <= 1:
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
    if not is_number(params.min_p) or not 0 <= params.min_p <= 1:
        raise BadRequestError(f"sampling_params.min_p must be in [0, 1] (0 = off), got {params.min_p!r}",
                              field="sampling_params.min_p")
    if not is_number(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise BadRequestError(f"sampling_params.repetition_penalty must be a finite number > 0 (1 = off), got "
                              f"{params.repetition_penalty!r}", field="sampling_params.repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not is_number(value) or not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
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
    if not all(is_int(s) for s in stop):
        raise BadRequestError(f"{rule} (not a mix), got {list(stop)!r}", field="sampling_params.stop")
    vocab = None if limits is None else limits.vocab_size
    bad = next((s for s in stop if s < 0 or (vocab is not None and s >= vocab)), None)
    if bad is not None:
        limit = f"[0, {vocab})" if vocab is not None else ">= 0"
        raise BadRequestError(f"sampling_params.stop token id {bad} is outside {limit}", field="sampling_params.stop")
