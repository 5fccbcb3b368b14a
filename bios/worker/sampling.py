"""Sampling as a plain function: every row of every request of one base model in one KV-cached batch.

`generate` takes the sample requests a cycle collected for one base model, each with its own adapter (or
none), prompt, sample count and `SamplingParams`. Each request's prompt is prefilled once (left padded, with
an attention mask and position ids that skip the pads) and its cache is repeated for its samples; then one
decode step per token runs all unfinished rows together, rows of one adapter contiguous so each LoRA layer
loops over a few row ranges (`active_adapters`). Rows that finish are dropped from the batch once a quarter of
it is done, so long-running samples do not drag finished ones along.

What a sampled token's logprob is: the log-probability of that token under the distribution it was actually
drawn from, i.e. softmax(logits / temperature) restricted to the top-k / top-p set and renormalised. At
temperature 1 with no top-k/top-p this is the model's own log-softmax, the number a training `forward`
returns for the same token (importance-sampling losses rely on that). For greedy rows (temperature 0) it is
the model's untempered log-softmax of the chosen token.

Randomness: each row draws one uniform per step from its own `torch.Generator`, seeded from (seed, sample
index) and drawn up front, and picks a token by inverse CDF. A row's tokens therefore depend on its seed,
prompt and parameters only, never on what else shares the batch.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from bios import spec
from bios.exceptions import BadRequestError
from bios.types import SampledSequence, SampleResponse, SamplingParams
from bios.worker.adapter import AdapterState
from bios.worker.lora import active_adapters, attach_lora
from bios.worker.vision import ImageReader, RowImages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# max_tokens=None samples up to this many tokens (fewer if the context ends first): long enough for a
# chat answer, short enough that a forgotten max_tokens does not occupy a worker for a whole context.
DEFAULT_MAX_TOKENS = 256
# A batch is compacted (finished rows dropped from the cache) once at most this fraction of it is alive.
_COMPACT_WHEN_ALIVE = 0.75
# Prompt logprobs go through the output head this many positions at a time, so a long prompt never
# materialises [prompt, vocab] logits at once.
_PROMPT_LOGPROB_CHUNK = 1024


@dataclass
class SampleItem:
    """One sample request: `num_samples` continuations of `prompt` from the base model plus `adapter`."""

    adapter: AdapterState | None  # None: the base model alone
    prompt: list[int]  # with a vision-language model's image tokens in place of its images
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False
    images: RowImages | None = None  # the prompt's images, in order


# ------------------------------------------------------------------------------------------ rows


def resolved_max_tokens(prompt_len: int, params: SamplingParams, context: int | None) -> int:
    """`params.max_tokens`, or for None: `DEFAULT_MAX_TOKENS` capped by what the context leaves after the prompt."""
    if params.max_tokens is not None:
        return params.max_tokens
    if context is None:
        return DEFAULT_MAX_TOKENS
    return min(DEFAULT_MAX_TOKENS, context - prompt_len)




def row_seed(seed: int, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a request with `seed`: a hash, so nearby seeds and
    indices give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & spec.MAX_SEED


def _stop_token_ids(stop: object, eos_token_id: int | None) -> list[int]:
    """EOS always stops, as in the Tinker API, except with `stop=[]`, which never stops early. Stop token ids
    and stop strings add to EOS."""
    if isinstance(stop, (list, tuple)) and not stop:
        return []
    eos = [] if eos_token_id is None else [eos_token_id]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, int) for s in stop):
        return eos + [int(s) for s in stop if int(s) not in eos]
    return eos


@dataclass
class _Rows:
    """Per-row sampling state of the live batch, as tensors so a decode step is a few batched ops.

    `row` maps a batch position to its row in the output buffers; compaction indexes every field alike.
    """

    row: Tensor  # [B] int64
    inv_temperature: Tensor  # [B] float32, 1 for greedy rows
    greedy: Tensor  # [B] bool
    top_k: Tensor  # [B] int64, 2**62 when off
    top_p: Tensor  # [B] float32, 2 when off (keeps everything despite rounding in the cumulative sum)
    max_new: Tensor  # [B] int64
    position: Tensor  # [B] int64, position of the first sampled token (the prompt length)
    stop_ids: Tensor  # [B, S] int64, -1 padded
    uniforms: Tensor  # [B, max steps] float32
    attention_mask: Tensor  # [B, padded prompt + max steps] int64
    adapters: list[AdapterState | None]
    # Whether any row of the batch as built is greedy / sampled / top-k or top-p filtered (kept on compaction:
    # a flag that is no longer needed only costs a little work).
    any_greedy: bool
    any_sampled: bool
    any_filtered: bool

    def select(self, keep: Tensor) -> _Rows:
        indices = keep.tolist()
        return _Rows(
            row=self.row[keep],
            inv_temperature=self.inv_temperature[keep],
            greedy=self.greedy[keep],
            top_k=self.top_k[keep],
            top_p=self.top_p[keep],
            max_new=self.max_new[keep],
            position=self.position[keep],
            stop_ids=self.stop_ids[keep],
            uniforms=self.uniforms[keep],
            attention_mask=self.attention_mask[keep],
            adapters=[self.adapters[i] for i in indices],
            any_greedy=self.any_greedy,
            any_sampled=self.any_sampled,
            any_filtered=self.any_filtered,
        )


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


# ------------------------------------------------------------------------------------------ token choice


def _inverse_cdf(logp: Tensor, uniforms: Tensor) -> Tensor:
    """Token id drawn from each row's distribution `exp(logp)` with one uniform per row, shape [B, 1].

    `right=True` returns the first index whose CDF exceeds the target, which never is a zero-probability
    token as long as the target stays below the total (hence the clamp just under it).
    """
    cdf = logp.exp().cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target[:, None], right=True)
    return index.clamp_(max=logp.shape[-1] - 1)


def _kept_tokens(scaled: Tensor, rows: _Rows) -> Tensor:
    """[B, V] mask of the top-k tokens, then of the smallest set of those whose renormalised mass reaches
    top_p (the token that crosses top_p is kept). Rows with neither keep everything."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_logits.shape[-1], device=scaled.device)
    keep_sorted = ranks[None, :] < rows.top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, -math.inf), dim=-1)
    keep_sorted &= (probs.cumsum(dim=-1) - probs) < rows.top_p[:, None]
    return torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)


def _choose_tokens(logits: Tensor, rows: _Rows, step: int) -> tuple[Tensor, Tensor]:
    """Next token and its logprob (see the module docstring) for every row of `logits` [B, V] (fp32).

    The batch-wide flags of `rows` let the common cases skip work: no sort unless some row uses top-k or
    top-p, no draw when every row is greedy. The draw always walks the vocabulary in id order, so a row's
    token never depends on its batch-mates.
    """
    if rows.any_greedy:
        greedy_tokens = logits.argmax(dim=-1, keepdim=True)
        greedy_logp = logits.gather(1, greedy_tokens) - torch.logsumexp(logits, dim=-1, keepdim=True)
        if not rows.any_sampled:
            return greedy_tokens.squeeze(1), greedy_logp.squeeze(1)
    scaled = logits * rows.inv_temperature[:, None]
    if rows.any_filtered:
        scaled = scaled.masked_fill(~_kept_tokens(scaled, rows), -math.inf)
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = _inverse_cdf(logp, rows.uniforms[:, step])
    token_logp = logp.gather(1, tokens)
    if rows.any_greedy:
        greedy = rows.greedy[:, None]
        tokens = torch.where(greedy, greedy_tokens, tokens)
        token_logp = torch.where(greedy, greedy_logp, token_logp)
    return tokens.squeeze(1), token_logp.squeeze(1)


# ------------------------------------------------------------------------------------------ generate


def generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    items: list[SampleItem],
    *,
    eos_token_id: int | None,
    images: ImageReader | None = None,
) -> list[SampleResponse]:
    """Sample every item (all rows in one batch); one `SampleResponse` per item, in order. A vision-language
    model's prompts with images need its `images` reader.

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
            spec.check_sample(item.prompt, item.num_samples, item.params, limits)
            if spec.stop_strings(item.params.stop) and tokenizer is None:
                raise BadRequestError("stop strings need a tokenizer to decode text", field="sampling_params.stop")
        except BadRequestError as error:
            if len(items) == 1:
                raise
            raise BadRequestError(f"sample request {index}: {error.message}", field=error.field) from None
    attach_lora(model)
    with torch.inference_mode():
        return _generate(model, tokenizer, items, eos_token_id=eos_token_id, context=context, reader=images)


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
) -> list[SampleResponse]:
    order = _grouped_order(items)
    ordered = [items[i] for i in order]
    cache, logits, prompt_mask, prompt_logprobs, rope_deltas = _prefill(model, ordered, reader)
    # One row per sample; a request's samples share its prefilled cache.
    counts = torch.tensor([item.num_samples for item in ordered], device=logits.device)
    expand = torch.repeat_interleave(torch.arange(len(ordered), device=logits.device), counts)
    cache.reorder_cache(expand)
    lengths = [len(item.prompt) for item in ordered]
    rows, string_stops = _build_rows(ordered, prompt_mask[expand], lengths, eos_token_id, context, logits.device)
    if rope_deltas is not None:  # M-RoPE: an image's tokens take fewer positions than their count
        rows.position += rope_deltas.to(rows.position.device)[expand]
    tokens, logprobs, finished_at, stopped = _decode(
        model, cache, logits[expand], rows, prompt_mask.shape[1], tokenizer, string_stops
    )
    return _responses(
        items, order, tokens, logprobs, finished_at, stopped, {order[i]: lp for i, lp in prompt_logprobs.items()}
    )


def _prefill(
    model: nn.Module, ordered: list[SampleItem], reader: ImageReader | None
) -> tuple[DynamicCache, Tensor, Tensor, dict[int, list[float | None]], Tensor | None]:
    """Run each request's prompt once, left padded so every row's last position is real.

    Returns the cache, the next-token logits [requests, V], the prompt attention mask, the prompt
    logprobs of the requests that asked for them (by position in `ordered`) and, for a vision-language
    model, each request's rope delta (its next position minus its prompt length).
    """
    device = model.get_input_embeddings().weight.device
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
    with active_adapters(model, _adapter_segments([item.adapter for item in ordered])):
        hidden = model.base_model(
            input_ids=input_ids,
            attention_mask=prompt_mask,
            past_key_values=cache,
            use_cache=True,
            **extra,
        ).last_hidden_state
        logits = model.get_output_embeddings()(hidden[:, -1]).float()
    prompt_logprobs = {
        i: _prompt_logprobs(model, hidden[i, padded - lengths[i] :], item)
        for i, item in enumerate(ordered)
        if item.prompt_logprobs
    }
    return cache, logits, prompt_mask, prompt_logprobs, rope_deltas


def _decode(
    model: nn.Module,
    cache: DynamicCache,
    logits: Tensor,
    rows: _Rows,
    padded: int,
    tokenizer: PreTrainedTokenizerBase | None,
    string_stops: dict[int, list[str]],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The token loop: choose, record, check stops, drop finished rows now and then, run one step.

    Returns per row: tokens and logprobs [rows, steps] (valid up to the row's length), its length, and
    whether it stopped on a stop condition (else it reached max_tokens).
    """
    lm_head = model.get_output_embeddings()
    total_rows, steps = rows.uniforms.shape
    device = logits.device
    out_tokens = torch.zeros(total_rows, steps, dtype=torch.int64, device=device)
    out_logprobs = torch.zeros(total_rows, steps, dtype=torch.float32, device=device)
    finished_at = torch.zeros(total_rows, dtype=torch.int64, device=device)
    stopped = torch.zeros(total_rows, dtype=torch.bool, device=device)
    generated: dict[int, list[int]] = {row: [] for row in string_stops}
    alive = torch.ones(total_rows, dtype=torch.bool, device=device)
    live = total_rows
    with ExitStack() as adapters_scope:
        adapters_scope.enter_context(active_adapters(model, _adapter_segments(rows.adapters)))
        for step in range(steps):
            tokens, token_logp = _choose_tokens(logits, rows, step)
            out_tokens[rows.row, step] = tokens
            out_logprobs[rows.row, step] = token_logp
            hit_stop = (tokens[:, None] == rows.stop_ids).any(dim=-1)
            if generated:
                hit_stop |= _string_stop_hits(tokenizer, tokens, rows, alive, string_stops, generated)
            new_stop = alive & hit_stop
            finished = new_stop | (alive & (rows.max_new <= step + 1))
            alive = alive & ~finished
            previously_live, live = live, int(alive.sum())
            if live < previously_live:
                finished_at[rows.row[finished]] = step + 1
                stopped[rows.row[new_stop]] = True
            if live == 0:
                break
            if live <= _COMPACT_WHEN_ALIVE * alive.numel():
                keep = alive.nonzero().squeeze(1)
                cache.reorder_cache(keep)
                rows, tokens, alive = rows.select(keep), tokens[keep], alive[keep]
                adapters_scope.close()
                adapters_scope.enter_context(active_adapters(model, _adapter_segments(rows.adapters)))
            hidden = model.base_model(
                input_ids=tokens[:, None],
                attention_mask=rows.attention_mask[:, : padded + step + 1],
                position_ids=(rows.position + step)[:, None],
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
            logits = lm_head(hidden[:, -1]).float()
    return out_tokens, out_logprobs, finished_at, stopped


def _build_rows(
    ordered: list[SampleItem],
    prompt_mask: Tensor,
    lengths: list[int],
    eos_token_id: int | None,
    context: int,
    device: torch.device,
) -> tuple[_Rows, dict[int, list[str]]]:
    """Per-row tensors for the decode loop, and the stop strings of rows that have any (by row)."""
    no_top_k = 2**62
    inv_temperature, greedy, top_k, top_p, max_new, position, stop_ids, adapters = [], [], [], [], [], [], [], []
    uniforms: list[Tensor] = []
    string_stops: dict[int, list[str]] = {}
    any_filtered = False
    for item, length in zip(ordered, lengths):
        params = item.params
        new_tokens = resolved_max_tokens(length, params, context)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        is_greedy = params.temperature == 0
        any_filtered |= not is_greedy and (params.top_k != -1 or params.top_p < 1)
        strings = spec.stop_strings(params.stop)
        for sample_index in range(item.num_samples):
            if strings:
                string_stops[len(greedy)] = strings
            greedy.append(is_greedy)
            inv_temperature.append(1.0 if is_greedy else 1.0 / params.temperature)
            top_k.append(no_top_k if params.top_k == -1 else params.top_k)
            top_p.append(2.0 if params.top_p >= 1 else params.top_p)
            max_new.append(new_tokens)
            position.append(length)
            stop_ids.append(_stop_token_ids(params.stop, eos_token_id))
            adapters.append(item.adapter)
            if not is_greedy:
                generator = torch.Generator().manual_seed(row_seed(seed, sample_index))
                uniforms.append(torch.rand(new_tokens, generator=generator))
            else:
                uniforms.append(torch.zeros(0))
    steps = max(max_new)
    uniform_table = torch.zeros(len(greedy), steps, dtype=torch.float32)
    stop_table = torch.full((len(greedy), max(len(ids) for ids in stop_ids)), -1, dtype=torch.int64)
    for row, (row_uniforms, ids) in enumerate(zip(uniforms, stop_ids)):
        uniform_table[row, : row_uniforms.numel()] = row_uniforms
        stop_table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    attention_mask = torch.cat([prompt_mask, torch.ones(len(greedy), steps, dtype=torch.int64, device=device)], dim=1)
    rows = _Rows(
        row=torch.arange(len(greedy), device=device),
        inv_temperature=torch.tensor(inv_temperature, dtype=torch.float32, device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        max_new=torch.tensor(max_new, dtype=torch.int64, device=device),
        position=torch.tensor(position, dtype=torch.int64, device=device),
        stop_ids=stop_table.to(device),
        uniforms=uniform_table.to(device),
        attention_mask=attention_mask,
        adapters=adapters,
        any_greedy=any(greedy),
        any_sampled=not all(greedy),
        any_filtered=any_filtered,
    )
    return rows, string_stops


def _string_stop_hits(
    tokenizer: PreTrainedTokenizerBase | None,
    tokens: Tensor,
    rows: _Rows,
    alive: Tensor,
    string_stops: dict[int, list[str]],
    generated: dict[int, list[int]],
) -> Tensor:
    """True for live rows whose decoded generated text now contains one of their stop strings.

    The whole generated text is decoded each step (not just the new token) because a token may complete a
    multi-byte character or a stop string spanning several tokens; a stop string present now and not
    before was completed by this step's token.
    """
    hits = torch.zeros_like(alive)
    row_list, token_list, alive_list = rows.row.tolist(), tokens.tolist(), alive.tolist()
    for position, (row, token, is_alive) in enumerate(zip(row_list, token_list, alive_list)):
        if not is_alive or row not in string_stops:
            continue
        generated[row].append(token)
        text = tokenizer.decode(generated[row])
        if any(stop in text for stop in string_stops[row]):
            hits[position] = True
    return hits


def _prompt_logprobs(model: nn.Module, hidden: Tensor, item: SampleItem) -> list[float | None]:
    """[None, log p(prompt[1] | prompt[:1]), ...] from the prompt's final hidden states [len, H]."""
    lm_head = model.get_output_embeddings()
    targets = torch.tensor(item.prompt[1:], dtype=torch.int64, device=hidden.device)
    values: list[float | None] = [None]
    for start in range(0, targets.numel(), _PROMPT_LOGPROB_CHUNK):
        chunk = hidden[start : start + min(_PROMPT_LOGPROB_CHUNK, targets.numel() - start)]
        segments = [] if item.adapter is None else [(0, chunk.shape[0], item.adapter)]
        with active_adapters(model, segments):
            logits = lm_head(chunk).float()
        chunk_targets = targets[start : start + chunk.shape[0]]
        logp = logits.gather(1, chunk_targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        values.extend(logp.tolist())
    return values


def _responses(
    items: list[SampleItem],
    order: list[int],
    out_tokens: Tensor,
    out_logprobs: Tensor,
    finished_at: Tensor,
    stopped: Tensor,
    prompt_logprobs: dict[int, list[float | None]],
) -> list[SampleResponse]:
    """Rows back into one response per item, in the caller's item order."""
    tokens, logprobs = out_tokens.tolist(), out_logprobs.tolist()
    lengths_list, stopped_list = finished_at.tolist(), stopped.tolist()
    sequences: dict[int, list[SampledSequence]] = {}
    row = 0
    for index in order:
        sequences[index] = []
        for _ in range(items[index].num_samples):
            n = lengths_list[row]
            sequences[index].append(
                SampledSequence(
                    stop_reason="stop" if stopped_list[row] else "length",
                    tokens=tokens[row][:n],
                    logprobs=logprobs[row][:n],
                )
            )
            row += 1
    return [SampleResponse(sequences=sequences[i], prompt_logprobs=prompt_logprobs.get(i)) for i in range(len(items))]
