"""Sampling as a plain function: every row of every request of one base model in one KV-cached batch.

`generate` takes the sample requests a cycle collected for one base model, each with its own adapter (or
none), prompt, sample count and `SamplingParams`. Each request's prompt is prefilled once (left padded, with
an attention mask and position ids that skip the pads) and its cache is repeated for its samples; then one
decode step per token runs all unfinished rows together, rows of one adapter contiguous so each LoRA layer
loops over a few row ranges (`active_adapters`). Rows that finish are dropped from the batch once a quarter of
it is done, so long-running samples do not drag finished ones along. A Llama-family model's decode steps run
as plain calls on its parameters (`bios.worker.llama_decode`, with rows of one shared prompt attending to it
once); other models run their own modules over Transformers' cache (`bios.worker.decode_step`). Either cache
gets room for the decode steps up front (one position written per step, not the whole cache copied; in the
dtype the attention reads, `cpu_attention.cache_dtype`), and on CPU the steps multiply by prepacked copies of
the frozen weights (`bios.kernels.prepacked`), with the adapter in them when every row uses one adapter for
enough steps (`_ADAPTER_COPIES_MIN_STEPS`).

How a token is chosen and what its logprob means (penalties, temperature, min_p, top-k, top-p) is
`bios.worker.logits_processing`; what a request asks about its prompt (logprobs, top-k, alternative draws) is
`bios.worker.prompt_scoring`. Both work row by row, so batched and single sampling agree. `topk_sample_logprobs=k`
reports the k most likely tokens at every sampled position under the model's own log-softmax of that step's
logits (before penalties, temperature and filters: what a `forward` over prompt + output gives).

This module runs the batch (prefill, decode loop, compaction); each sample's row (token choice, max tokens,
stops, position, mask) is built by `bios.worker.sampling_rows`, and the output buffers become streamed progress
and `SampleResponse`s in `bios.worker.sampling_results`.

Randomness: each row draws one uniform per step from its own `torch.Generator`, seeded from (seed, sample
index) and drawn up front, and picks a token by inverse CDF. A row's tokens therefore depend on its seed,
prompt and parameters only, never on what else shares the batch.
"""

from __future__ import annotations

import secrets
from contextlib import ExitStack
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from bios import spec
from bios.exceptions import BadRequestError
from bios.kernels.prepacked import PrepackedWeights
from bios.types import (
    TOPK_MASK_LOGPROB,
    SampleResponse,
)
from bios.worker.adapter import AdapterState
from bios.worker.attention import use_bios_attention
from bios.worker.decode_step import decode_step
from bios.worker.lora import active_adapters, attach_lora
from bios.worker.prompt_scoring import PromptQuestions, PromptScores, score_prompt
from bios.worker.sampling_results import Progress, responses
from bios.worker.sampling_rows import Rows, SampleItem, build_rows
from bios.worker.stopping import string_stop_hits
from bios.worker.vision import ImageReader
from bios.worker.vision_lora import tower_adapters

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A batch is compacted (finished rows dropped from the cache) once at most this fraction of it is alive.
_COMPACT_WHEN_ALIVE = 0.75
# A decode whose rows all use one adapter multiplies by copies of the weights with the adapter in them (`W +
# scale·B·A` in fp32, `[W; A]` in bf16) if it runs at least this many steps: making them (SmolLM2, fp32: 0.4-0.7
# s) costs 20-35 steps of what the adapter's own products cost (~20 ms a step for 16 rows).
_ADAPTER_COPIES_MIN_STEPS = 32


# ------------------------------------------------------------------------------------------ adapters


def _adapter_segments(adapters: list[AdapterState | None]) -> list[tuple[int, int, AdapterState]]:
    """[start, end) runs of consecutive rows sharing an adapter; base-model rows get no segment."""
    segments: list[tuple[int, int, AdapterState]] = []
    for index, adapter in enumerate(adapters):
        if adapter is None:
            continue
        if segments and segments[-1][2] is adapter and segments[-1][1] == index:
            segments[-1] = (segments[-1][0], index + 1, adapter)
        else:
            segments.append((index, index + 1, adapter))
    return segments


def _sampling_adapters(model: nn.Module, adapters: list[AdapterState | None]):
    """`active_adapters` for these rows, their factors cast once to the dtype the base model computes in (no
    gradient flows back in sampling)."""
    return active_adapters(model, _adapter_segments(adapters),
                           factor_dtype=model.get_input_embeddings().weight.dtype)


# ------------------------------------------------------------------------------------------ generate


def generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    items: list[SampleItem],
    *,
    eos_token_id: int | None,
    images: ImageReader | None = None,
    prepacked: PrepackedWeights | None = None,
    prefill_tokens: int | None = None,
) -> list[SampleResponse]:
    """Sample every item (all rows in one batch); one `SampleResponse` per item, in order. A vision-language
    model's prompts with images need its `images` reader. Decode steps multiply by `prepacked`'s copies of the
    frozen weights (kept for the next call; default: copies made for this call only). Prompts longer than
    `prefill_tokens` (the plan's pass; None: no bound) are prefilled in chunks of that many tokens in all.

    Raises `BadRequestError` (before any compute) if an item cannot run on this model. `tokenizer` is only
    used to decode text for stop strings.
    """
    if not items:
        return []
    config = model.config.get_text_config()
    context = int(config.max_position_embeddings)
    vocab_size = model.get_input_embeddings().num_embeddings
    limits = spec.Limits(getattr(config, "name_or_path", "") or "this model", vocab_size, context)
    for index, item in enumerate(items):
        try:
            spec.check_sample(item.prompt, item.num_samples, item.params, limits,
                              topk_prompt_logprobs=item.topk_prompt_logprobs,
                              prompt_alt_tokens_k=item.prompt_alt_tokens_k,
                              topk_sample_logprobs=item.topk_sample_logprobs,
                              target_prompt_logprobs=item.target_prompt_logprobs)
            if spec.stop_strings(item.params.stop) and tokenizer is None:
                raise BadRequestError("stop strings need a tokenizer to decode text", field="sampling_params.stop")
        except BadRequestError as error:
            if len(items) == 1:
                raise
            raise BadRequestError(f"sample request {index}: {error.message}", field=error.field) from None
    attach_lora(model)
    use_bios_attention(model)
    with torch.inference_mode():
        return _generate(model, tokenizer, items, eos_token_id=eos_token_id, context=context, reader=images,
                         prepacked=prepacked or PrepackedWeights(), prefill_tokens=prefill_tokens)


def _shared_prompts(ordered: list[SampleItem]) -> tuple[list[int], list[int]]:
    """(the requests whose prompts are prefilled, each request's row among them): requests with the same prompt
    and adapter (and no images) share one prefill and decode from its cache (RL sends many per cycle)."""
    row_of: dict[tuple, int] = {}
    prefilled: list[int] = []
    rows = []
    for i, item in enumerate(ordered):
        key = ("images", i) if item.images else (tuple(item.prompt), id(item.adapter))
        if key not in row_of:
            row_of[key] = len(prefilled)
            prefilled.append(i)
        rows.append(row_of[key])
    return prefilled, rows


def _grouped_order(items: list[SampleItem]) -> list[int]:
    """Item indices with items of one adapter together (in order of first appearance), stable otherwise."""
    first_seen: dict[int, int] = {}
    for item in items:
        first_seen.setdefault(id(item.adapter), len(first_seen))
    return sorted(range(len(items)), key=lambda i: first_seen[id(items[i].adapter)])


def _generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    items: list[SampleItem],
    *,
    eos_token_id: int | None,
    context: int,
    reader: ImageReader | None,
    prepacked: PrepackedWeights,
    prefill_tokens: int | None,
) -> list[SampleResponse]:
    order = _grouped_order(items)
    ordered = [items[i] for i in order]
    seeds = [item.params.seed if item.params.seed is not None else secrets.randbits(63) for item in ordered]
    prefilled, rows_of_requests = _shared_prompts(ordered)
    cache, logits, prompt_mask, prompt_scores, rope_deltas = _prefill(model, ordered, prefilled, rows_of_requests,
                                                                      seeds, reader, prefill_tokens)
    # One row per sample; the samples of every request with one prompt share its prefilled cache.
    counts = torch.tensor([item.num_samples for item in ordered], device=logits.device)
    expand = torch.repeat_interleave(torch.tensor(rows_of_requests, device=logits.device), counts)
    lengths = [len(item.prompt) for item in ordered]
    rows, string_stops = build_rows(ordered, seeds, prompt_mask[expand], lengths, eos_token_id, context, logits)
    if rope_deltas is not None:  # M-RoPE: an image's tokens take fewer positions than their count
        rows.position += rope_deltas.to(rows.position.device)[expand]
    topk = max(item.topk_sample_logprobs for item in ordered)
    progress = Progress.of(ordered)
    with prepacked.using(adapter=_adapter_copies(rows), rows=len(rows.adapters)):
        tokens, logprobs, finished_at, stopped, top = _decode(
            model, cache, expand, logits[expand], rows, prompt_mask.shape[1], tokenizer, string_stops, topk, progress
        )
    return responses(
        items, order, tokens, logprobs, finished_at, stopped, {order[i]: sc for i, sc in prompt_scores.items()}, top
    )


def _prefill(
    model: nn.Module, requests: list[SampleItem], prefilled: list[int], rows: list[int], seeds: list[int],
    reader: ImageReader | None, prefill_tokens: int | None = None,
) -> tuple[DynamicCache, Tensor, Tensor, dict[int, PromptScores], Tensor | None]:
    """Run the prompts of the requests `prefilled` (indices into `requests`) once each, left padded so every
    row's last position is real; request i reads row `rows[i]`. Text prompts of more than `prefill_tokens` in
    all go through in chunks of positions, each attending to the cache of those before: a long prompt's pass
    holds one chunk's activations, not the whole prompt's.

    Returns the cache, the next-token logits, the prompt attention mask and, for a vision-language model, the
    rope deltas (its next position minus its prompt length), each with one row per prefilled prompt, and the
    prompt scores of the requests that asked for any (by position in `requests`).
    """
    device = model.get_input_embeddings().weight.device
    ordered = [requests[i] for i in prefilled]
    lengths = [len(item.prompt) for item in ordered]
    padded = max(lengths)
    input_ids = torch.zeros(len(ordered), padded, dtype=torch.int64)
    prompt_mask = torch.zeros(len(ordered), padded, dtype=torch.int64)
    for i, item in enumerate(ordered):
        input_ids[i, padded - lengths[i] :] = torch.tensor(item.prompt, dtype=torch.int64)
        prompt_mask[i, padded - lengths[i] :] = 1
    input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
    extra: dict[str, Tensor] = {"position_ids": (prompt_mask.cumsum(dim=-1) - 1).clamp_(min=0)}
    rope_deltas = None
    if reader is not None:
        extra, rope_deltas = reader.model_kwargs(model, input_ids, prompt_mask, [item.images for item in ordered])
    cache = DynamicCache(config=model.config)
    adapters = [item.adapter for item in ordered]
    chunked = reader is None and prefill_tokens is not None and len(ordered) * padded > prefill_tokens
    step = max(1, prefill_tokens // len(ordered)) if chunked else padded
    with _sampling_adapters(model, adapters), \
            tower_adapters(model, [item.images for item in ordered], adapters):
        hidden = torch.cat([model.base_model(
            input_ids=input_ids[:, start:start + step],
            attention_mask=prompt_mask[:, :start + step],
            past_key_values=cache,
            use_cache=True,
            **({key: value[:, start:start + step] for key, value in extra.items()} if chunked else extra),
        ).last_hidden_state for start in range(0, padded, step)], dim=1)
        logits = model.get_output_embeddings()(hidden[:, -1]).float()
    scores = {}
    for i, (item, seed) in enumerate(zip(requests, seeds)):
        questions = PromptQuestions(item.prompt_logprobs, item.topk_prompt_logprobs, item.prompt_alt_tokens_k,
                                    item.params, seed, item.target_prompt_logprobs)
        if questions.any:
            scores[i] = score_prompt(model, hidden[rows[i], padded - lengths[rows[i]] :], item.prompt, item.adapter,
                                     questions)
    return cache, logits, prompt_mask, scores, rope_deltas


def _decode(
    model: nn.Module,
    cache: DynamicCache,
    expand: Tensor,
    logits: Tensor,
    rows: Rows,
    padded: int,
    tokenizer: PreTrainedTokenizerBase | None,
    string_stops: dict[int, list[str]],
    topk: int = 0,
    progress: Progress | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """The token loop: choose, record, check stops, drop finished rows now and then, run one step. `cache` holds
    the prefilled prompts, one row each; row i continues prompt `expand[i]`.

    Returns per row: tokens and logprobs [rows, steps] (valid up to the row's length), its length, and
    whether it stopped on a stop condition (else it reached max_tokens); with `topk` > 0 also the `topk` most
    likely tokens at every step and their logprobs under the model's own log-softmax of the step's logits
    (before penalties, temperature and filters), [rows, steps, topk] each.
    """
    lm_head = model.get_output_embeddings()
    total_rows, steps = rows.choice.uniforms.shape
    device = logits.device
    out_tokens = torch.zeros(total_rows, steps, dtype=torch.int64, device=device)
    out_logprobs = torch.zeros(total_rows, steps, dtype=torch.float32, device=device)
    finished_at = torch.zeros(total_rows, dtype=torch.int64, device=device)
    stopped = torch.zeros(total_rows, dtype=torch.bool, device=device)
    top = None
    if topk:
        k = min(topk, logits.shape[-1])
        top = (torch.zeros(total_rows, steps, topk, dtype=torch.int64, device=device),
               torch.full((total_rows, steps, topk), TOPK_MASK_LOGPROB, dtype=torch.float32, device=device))
    generated: dict[int, list[int]] = {row: [] for row in string_stops}
    alive = torch.ones(total_rows, dtype=torch.bool, device=device)
    live = total_rows
    forward = decode_step(model, cache, expand, steps)
    pads = _has_pads(rows)
    with ExitStack() as adapters_scope:
        adapters_scope.enter_context(_sampling_adapters(model, rows.adapters))
        for step in range(steps):
            if top is not None:  # before `choose`, which leaves `logits` as they are
                values, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                top[0][rows.row, step, :k] = ids
                top[1][rows.row, step, :k] = values
            tokens, token_logp = rows.choice.choose(logits, step)
            rows.choice.record(tokens)
            out_tokens[rows.row, step] = tokens
            out_logprobs[rows.row, step] = token_logp
            hit_stop = (tokens[:, None] == rows.stop_ids).any(dim=-1)
            if generated:
                hit_stop |= string_stop_hits(tokenizer, tokens, rows.row, alive, string_stops, generated)
            new_stop = alive & hit_stop
            finished = new_stop | (alive & (rows.max_new <= step + 1))
            alive = alive & ~finished
            previously_live, live = live, int(alive.sum())
            if live < previously_live:
                finished_at[rows.row[finished]] = step + 1
                stopped[rows.row[new_stop]] = True
            if progress is not None:
                progress.report(step, out_tokens, out_logprobs, finished_at, top, force=live == 0)
            if live == 0:
                break
            if live <= _COMPACT_WHEN_ALIVE * alive.numel():
                keep = alive.nonzero().squeeze(1)
                forward.keep_rows(keep)
                rows, tokens, alive = rows.select(keep), tokens[keep], alive[keep]
                pads = _has_pads(rows)
                adapters_scope.close()
                adapters_scope.enter_context(_sampling_adapters(model, rows.adapters))
            mask = rows.attention_mask[:, : padded + step + 1] if pads else None
            logits = lm_head(forward(tokens, rows.position + step, mask)).float()
    return out_tokens, out_logprobs, finished_at, stopped, top


def _has_pads(rows: Rows) -> bool:
    """Whether any live row's prompt is left padded: only then does a decode step need an attention mask (the
    module path's mask builder skips an all-ones mask the same way)."""
    return not bool(rows.attention_mask.all())


def _adapter_copies(rows: Rows) -> bool:
    """Whether the decode may multiply by copies with an adapter in them (`_ADAPTER_COPIES_MIN_STEPS`)."""
    first = rows.adapters[0]
    return (first is not None and all(adapter is first for adapter in rows.adapters)
            and rows.choice.uniforms.shape[1] >= _ADAPTER_COPIES_MIN_STEPS)
