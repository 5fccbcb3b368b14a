"""The sampling half of the vocabulary: how to sample (`SamplingParams`) and what a sample returns.

Sampled sequences with their logprobs and top-k alternatives, and what a request asked about its prompt
(prompt logprobs, top-k, alternative draws, scored target ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .tensors import TensorData

StopReason = Literal["stop", "length"]


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
