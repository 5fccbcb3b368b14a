"""From next-token logits to a token and its logprob, for every row of a decode batch at once.

Each row applies, in this order (vLLM's order and meanings):

1. penalties on the raw logits: `repetition_penalty` r divides a positive logit by r and multiplies a negative
   one by r for every token seen in the prompt or the output so far; then `frequency_penalty * count` and
   `presence_penalty * (count > 0)` are subtracted, counting the row's own sampled tokens;
2. temperature: logits / temperature (greedy rows take the argmax of the penalised logits instead);
3. min_p: tokens whose probability is below `min_p` times the most likely token's are dropped;
4. top-k, then top-p over what is left (the token that crosses top_p is kept).

A sampled token's logprob is its log-probability under the distribution it was drawn from: the softmax of the
penalised, tempered logits restricted to the kept set and renormalised. With no penalties, temperature 1 and no
filters that is the model's own log-softmax, the number a training `forward` returns. A greedy row reports the
untempered log-softmax of the penalised logits (the model's own when it has no penalties).

The draw is an inverse CDF over the vocabulary in id order with one pre-drawn uniform per row and step, so a
row's token depends on its own seed, prompt, output and parameters only, never on its batch-mates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from bios.types import SamplingParams

_NO_TOP_K = 2**62
_NO_TOP_P = 2.0  # keeps everything despite rounding in the cumulative sum


@dataclass(frozen=True)
class RowSpec:
    """One row of a decode batch as the token choice sees it."""

    params: SamplingParams
    uniforms: Tensor  # [steps] float32, one per token the row may sample (empty for greedy rows)
    prompt: list[int]  # the tokens the repetition penalty counts as seen before any output


@dataclass
class TokenChoice:
    """Per-row choice parameters and penalty state of the live batch, as tensors (a step is a few batched ops).

    `select` keeps a subset of rows (compaction); `record` adds the tokens just chosen to the output counts.
    The `any_*` flags are batch-wide and survive compaction (a stale flag only costs a little work).
    """

    inv_temperature: Tensor  # [B] float32, 1 for greedy rows
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    log_min_p: Tensor  # [B] float32, -inf when off
    repetition: Tensor  # [B] float32
    presence: Tensor  # [B] float32
    frequency: Tensor  # [B] float32
    uniforms: Tensor  # [B, steps] float32
    seen: Tensor | None  # [B, V] bool: prompt tokens and tokens output so far (only when a row penalises)
    counts: Tensor | None  # [B, V] float32: output token counts (only when a row penalises)
    any_greedy: bool
    any_sampled: bool
    any_filtered: bool
    any_tempered: bool  # a sampled row's temperature is not 1

    def select(self, keep: Tensor) -> TokenChoice:
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value[keep] if isinstance(value, Tensor) else value
        return TokenChoice(**values)

    def record(self, tokens: Tensor) -> None:
        """Count this step's tokens (one per row) for the penalties."""
        if self.counts is None:
            return
        rows = torch.arange(tokens.numel(), device=tokens.device)
        self.counts[rows, tokens] += 1
        self.seen[rows, tokens] = True

    def choose(self, logits: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Next token and its logprob (see the module docstring) for every row of `logits` [B, V] (fp32)."""
        logits = self._penalised(logits)
        if self.any_greedy:
            greedy_tokens = logits.argmax(dim=-1, keepdim=True)
            greedy_logp = logits.gather(1, greedy_tokens) - torch.logsumexp(logits, dim=-1, keepdim=True)
            if not self.any_sampled:
                return greedy_tokens.squeeze(1), greedy_logp.squeeze(1)
        scaled = logits * self.inv_temperature[:, None] if self.any_tempered else logits
        if self.any_filtered:
            scaled = scaled.masked_fill(~self._kept_tokens(scaled), -math.inf)
        tokens, token_logp = inverse_cdf(scaled, self.uniforms[:, step])
        if self.any_greedy:
            greedy = self.greedy[:, None]
            tokens = torch.where(greedy, greedy_tokens, tokens)
            token_logp = torch.where(greedy, greedy_logp, token_logp)
        return tokens.squeeze(1), token_logp.squeeze(1)

    def _penalised(self, logits: Tensor) -> Tensor:
        """Step 1 of the module docstring; rows without penalties come back bit-identical."""
        if self.counts is None:
            return logits
        repetition = self.repetition[:, None]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(self.seen, penalised, logits)
        return logits - self.frequency[:, None] * self.counts - self.presence[:, None] * (self.counts > 0)

    def _kept_tokens(self, scaled: Tensor) -> Tensor:
        """[B, V] mask of steps 3 and 4 of the module docstring; rows without filters keep everything."""
        kept_min_p = scaled >= scaled.max(dim=-1, keepdim=True).values + self.log_min_p[:, None]
        sorted_logits, order = scaled.masked_fill(~kept_min_p, -math.inf).sort(dim=-1, descending=True)
        ranks = torch.arange(sorted_logits.shape[-1], device=scaled.device)
        keep_sorted = (ranks[None, :] < self.top_k[:, None]) & (sorted_logits > -math.inf)
        probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
        keep_sorted &= (probs.cumsum(dim=-1) - probs) < self.top_p[:, None]
        return torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)


def inverse_cdf(log_weights: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids drawn from each row's distribution `softmax(log_weights)` [B, V] (-inf: never drawn), one per
    uniform, and their log-probabilities: uniforms [B] gives [B, 1] each, uniforms [B, k] gives [B, k].

    The CDF is the cumulative sum of `exp(log_weights - row max)`, unnormalised, and the target each uniform
    times its total: one [B, V] buffer and three passes over it, where a log-softmax first costs a second buffer
    (its page faults, every step) and two passes more. `right=True` returns the first index whose CDF exceeds
    the target, which never is a zero-probability token as long as the target stays below the total (hence the
    clamp just under it).
    """
    row_max = log_weights.amax(dim=-1, keepdim=True)
    cdf = torch.sub(log_weights, row_max).exp_().cumsum_(dim=-1)
    total = cdf[:, -1:]
    targets = uniforms if uniforms.dim() == 2 else uniforms[:, None]
    targets = torch.minimum(targets * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, targets.contiguous(), right=True).clamp_(max=log_weights.shape[-1] - 1)
    return tokens, log_weights.gather(1, tokens) - row_max - total.log()


def token_choice(rows: list[RowSpec], steps: int, vocab: int, device: torch.device) -> TokenChoice:
    """The batch's `TokenChoice` for up to `steps` decode steps; penalty state [B, vocab] is only allocated
    when some row penalises."""
    params = [row.params for row in rows]
    greedy = [p.temperature == 0 for p in params]
    uniforms = torch.zeros(len(rows), steps, dtype=torch.float32)
    for index, row in enumerate(rows):
        uniforms[index, : row.uniforms.numel()] = row.uniforms
    penalises = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
    seen = counts = None
    if penalises:
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for index, row in enumerate(rows):
            seen[index, torch.tensor(row.prompt, dtype=torch.int64)] = True
        seen, counts = seen.to(device), torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)

    def column(values: list[float], dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return TokenChoice(
        inv_temperature=column([1.0 if g else 1.0 / p.temperature for p, g in zip(params, greedy)]),
        greedy=column(greedy, torch.bool),
        top_k=column([_NO_TOP_K if p.top_k == -1 else p.top_k for p in params], torch.int64),
        top_p=column([_NO_TOP_P if p.top_p >= 1 else p.top_p for p in params]),
        log_min_p=column([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]),
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        uniforms=uniforms.to(device),
        seen=seen,
        counts=counts,
        any_greedy=any(greedy),
        any_sampled=not all(greedy),
        any_filtered=any(not g and (p.top_k != -1 or p.top_p < 1 or p.min_p > 0) for p, g in zip(params, greedy)),
        any_tempered=any(not g and p.temperature != 1 for p, g in zip(params, greedy)),
    )
