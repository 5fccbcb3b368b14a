"""What a sample request asks about its own prompt, from the prompt's final hidden states in the prefill.

- `prompt_logprobs`: log p(prompt[i] | prompt[:i]) under the model (None for the first position): what a
  training `forward` reports for the same tokens.
- `topk_prompt_logprobs=k`: the k most likely tokens at every position and their model logprobs, a dense
  `(len(prompt), k)` pair with Tinker's sentinels (token 0, logprob -99999) in the first row.
- `prompt_alt_tokens_k=k`: k independent draws per position after the first from the next-token distribution
  at the request's temperature (greedy: the argmax k times), `[len(prompt) - 1, k]`. Their logprobs are under
  the distribution drawn from (tempered), Bios's rule for every sampled token; at temperature 1 that is the
  model's own logprob. Draws come from a generator seeded by the request's seed, so they depend on the seed
  and the prompt only.
- `target_prompt_logprobs` (Tinker's): chosen ids `[len(prompt) - 1, K]`, cell [i, j] scored at position i + 1
  with the model's logprob (what `topk_prompt_logprobs` reports for the same id); 0.0 where the id is -1.

The output head runs `_CHUNK` positions at a time, so a long prompt never materialises [prompt, vocab] logits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bios import spec
from bios.types import TOPK_MASK_LOGPROB, PromptAltTokens, SamplingParams, TensorData, TopkLogprobs
from bios.worker.adapter import AdapterState
from bios.worker.logits_processing import inverse_cdf
from bios.worker.lora import active_adapters

_CHUNK = 1024


@dataclass(frozen=True)
class PromptQuestions:
    """What one request asks about its prompt."""

    logprobs: bool
    topk: int
    alt_tokens_k: int
    params: SamplingParams  # temperature and seed of the alternative draws
    seed: int  # the request's seed (drawn at random when it gave none)
    targets: TensorData | None = None  # int64 [len(prompt) - 1, K]: ids whose logprobs to return (-1: none)

    @property
    def any(self) -> bool:
        return self.logprobs or self.topk > 0 or self.alt_tokens_k > 0 or self.targets is not None


@dataclass(frozen=True)
class PromptScores:
    logprobs: list[float | None] | None = None
    topk: TopkLogprobs | None = None
    alt_tokens: PromptAltTokens | None = None
    targets: TensorData | None = None


def alt_tokens_seed(seed: int) -> int:
    """The generator seed of a request's alternative prompt draws: a hash, unrelated to its rows' streams."""
    digest = hashlib.blake2b(f"{seed}:prompt_alt_tokens".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & spec.MAX_SEED


def score_prompt(model: nn.Module, hidden: Tensor, prompt: list[int], adapter: AdapterState | None,
                 questions: PromptQuestions) -> PromptScores:
    """The answers to `questions` from the prompt's final hidden states `hidden` [len, H]."""
    lm_head = model.get_output_embeddings()
    targets = torch.tensor(prompt[1:], dtype=torch.int64, device=hidden.device)
    positions = targets.numel()
    k, alt_k = questions.topk, questions.alt_tokens_k
    logprobs: list[float | None] = [None]
    topk_ids = torch.zeros(positions + 1, k, dtype=torch.int64)
    topk_logp = torch.full((positions + 1, k), TOPK_MASK_LOGPROB, dtype=torch.float32)
    alt_ids = torch.zeros(positions, alt_k, dtype=torch.int64)
    alt_logp = torch.zeros(positions, alt_k, dtype=torch.float32)
    target_ids = None
    if questions.targets is not None:
        target_ids = torch.from_numpy(questions.targets.to_numpy().astype("int64")).reshape(positions, questions.targets.shape[1])
        target_logp = torch.zeros(target_ids.shape, dtype=torch.float32)
    uniforms = None
    if alt_k and questions.params.temperature > 0:
        generator = torch.Generator().manual_seed(alt_tokens_seed(questions.seed))
        uniforms = torch.rand(positions, alt_k, generator=generator)
    for start in range(0, positions, _CHUNK):
        end = min(start + _CHUNK, positions)
        segments = [] if adapter is None else [(0, end - start, adapter)]
        with active_adapters(model, segments):
            logits = lm_head(hidden[start:end]).float()
        logp = torch.log_softmax(logits, dim=-1)
        if questions.logprobs:
            logprobs.extend(logp.gather(1, targets[start:end, None]).squeeze(1).tolist())
        if k:
            values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
            topk_ids[start + 1 : end + 1, : ids.shape[1]] = ids.cpu()
            topk_logp[start + 1 : end + 1, : values.shape[1]] = values.cpu()
        if target_ids is not None:
            wanted = target_ids[start:end].to(logp.device)
            values = logp.gather(1, wanted.clamp(min=0)).masked_fill(wanted < 0, 0.0)
            target_logp[start:end] = values.cpu()
        if alt_k:
            ids, values = _alt_draws(logits, logp, questions.params.temperature,
                                     None if uniforms is None else uniforms[start:end].to(logits.device), alt_k)
            alt_ids[start:end], alt_logp[start:end] = ids.cpu(), values.cpu()
    return PromptScores(
        logprobs=logprobs if questions.logprobs else None,
        topk=TopkLogprobs(TensorData(topk_ids.numpy(), "int64"), TensorData(topk_logp.numpy(), "float32"))
        if k else None,
        alt_tokens=PromptAltTokens(TensorData(alt_ids.numpy(), "int64"), TensorData(alt_logp.numpy(), "float32"))
        if alt_k else None,
        targets=TensorData(target_logp.numpy(), "float32") if target_ids is not None else None,
    )


def _alt_draws(logits: Tensor, logp: Tensor, temperature: float, uniforms: Tensor | None,
               k: int) -> tuple[Tensor, Tensor]:
    """k draws per row [P, k] and their logprobs; greedy (no uniforms): the argmax with the model's logprob."""
    if uniforms is None:
        ids = logp.argmax(dim=-1, keepdim=True).expand(-1, k)
        return ids, logp.gather(1, ids)
    return inverse_cdf(logp if temperature == 1 else logits / temperature, uniforms)
