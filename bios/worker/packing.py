"""Rows of a training pass packed end to end instead of padded to the longest.

Padding a batch to its longest row spends the frozen matmuls, the LoRA products and attention on pad positions
(a batch of rows of 40 to 128 tokens is ~40% pads). Packing puts several rows of one adapter into one batch row,
each with position ids counting from 0, and narrows the attention mask so a token sees only the tokens of its
own row (`packed_sdpa_mask`, the mask of `attention.ATTENTION`): it then computes what it would alone.

A packed batch row holds up to 4x the longest row (best-fit decreasing), as long as the whole pass has no more
positions than padding would: longer batch rows mean fewer positions but more attention per position, and
`pack_rows` weighs the two. A batch row's unused tail is one more sequence whose outputs are dropped. Rows of
different adapters never share a batch row: LoRA layers apply an adapter to whole batch rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from bios.worker import context_parallel

# The pass in progress: each batch position's sequence number within its batch row, or None (nothing packed).
_SEQUENCES: ContextVar[Tensor | None] = ContextVar("bios_packed_sequences", default=None)


@dataclass(frozen=True)
class PackedBatch:
    """Where every row's tokens sit in a packed `[batch_rows, length]` input, and what to feed the model."""

    input_ids: Tensor  # [batch_rows, length], 0 in each batch row's unused tail
    position_ids: Tensor  # [batch_rows, length], counting from 0 in every row (and in the tail)
    sequence_ids: Tensor | None  # [batch_rows, length]: which row (or tail) of its batch row; None if one each
    token_index: Tensor  # [sum of row lengths]: each row's tokens, row after row, as flat indices into the batch
    owners: list[int]  # for each batch row, the index of its first row (whose adapter it runs with)

    def gather(self, hidden: Tensor) -> Tensor:
        """The model's outputs `[batch_rows, length, H]` as `[sum of row lengths, H]`, rows in their given order."""
        return hidden.reshape(-1, hidden.shape[-1])[self.token_index.to(hidden.device)]


def pack_rows(tokens: Sequence[Tensor], groups: Sequence[Hashable], pair_cost: float = 0.0) -> PackedBatch:
    """Pack 1-D token tensors into batch rows, rows of equal `groups` entries only; groups keep their order of
    first appearance, so batch rows of one group are consecutive (as the LoRA segments over batch rows want).
    The layout is `packed_layout`'s."""
    lengths = [row.numel() for row in tokens]
    bins, length = packed_layout(lengths, groups, pair_cost)
    input_ids = torch.zeros(len(bins), length, dtype=torch.int64)
    position_ids = torch.zeros(len(bins), length, dtype=torch.int64)
    sequence_ids = torch.zeros(len(bins), length, dtype=torch.int64)
    start = [0] * len(tokens)
    for b, members in enumerate(bins):
        offset = 0
        for number, index in enumerate(members):
            span = slice(offset, offset + lengths[index])
            input_ids[b, span] = tokens[index]
            position_ids[b, span] = torch.arange(lengths[index])
            sequence_ids[b, span] = number
            start[index] = b * length + offset
            offset += lengths[index]
        position_ids[b, offset:] = torch.arange(length - offset)
        sequence_ids[b, offset:] = len(members)
    token_index = torch.cat([torch.arange(start[i], start[i] + lengths[i]) for i in range(len(tokens))])
    one_each = bool((sequence_ids == 0).all())
    return PackedBatch(input_ids, position_ids, None if one_each else sequence_ids, token_index,
                       [members[0] for members in bins])


def packed_layout(lengths: Sequence[int], groups: Sequence[Hashable],
                  pair_cost: float = 0.0) -> tuple[list[list[int]], int]:
    """Which rows share each batch row, and the batch rows' length, for rows of `lengths` tokens.

    A batch row holds up to a capacity of 1 to 4 times the longest row in eighths (best-fit decreasing), whichever
    costs least: `batch_rows x length x (1 + pair_cost x length)`, where `pair_cost` is one attended token
    pair's cost in tokens' worth of the rest of the model (`attention_pair_cost`). Never more positions than
    padding."""
    lengths = list(lengths)
    members_of: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members_of.setdefault(group, []).append(index)
    longest = max(lengths)
    candidates = []  # (cost, step: the first on ties, bins, their length) where no more positions than padding
    for step in range(25):
        bins = _best_fit(members_of.values(), lengths, longest + step * longest // 8)
        length = max(sum(lengths[i] for i in members) for members in bins)
        if len(bins) * length <= len(lengths) * longest:
            candidates.append((len(bins) * length * (1 + pair_cost * length), step, bins, length))
    _, _, bins, length = min(candidates)
    return bins, length


def _best_fit(groups: Iterable[list[int]], lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing of each group's rows into bins of `capacity` tokens, groups one after another: each
    row, longest first, goes to the fullest bin it fits in."""
    bins: list[list[int]] = []
    for members in groups:
        rooms: list[tuple[int, int]] = []  # (room left, bin index), sorted
        for index in sorted(members, key=lambda i: -lengths[i]):
            at = bisect.bisect_left(rooms, (lengths[index], -1))
            if at == len(rooms):
                bins.append([])
                room, slot = capacity, len(bins) - 1
            else:
                room, slot = rooms.pop(at)
            bins[slot].append(index)
            bisect.insort(rooms, (room - lengths[index], slot))
    return bins


def attention_pair_cost(config) -> float:
    """One attended (query, key) pair's matmul FLOPs over a token's through the decoder's linear layers, from a
    Llama-style config: 4 x query width over 2 x one layer's attention and MLP weights. Used to weigh longer
    packed rows (their attention) against fewer positions; a config without those fields gets 1 (attention
    dear: batch rows stay near the longest row's length)."""
    text = config.get_text_config()
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if not hidden or not heads:
        return 1.0
    width = heads * (getattr(text, "head_dim", None) or hidden // heads)
    kv_width = (getattr(text, "num_key_value_heads", None) or heads) * width // heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    per_layer = hidden * (2 * width + 2 * kv_width) + 3 * hidden * intermediate
    return 4 * width / (2 * per_layer)


@contextmanager
def packed_sequences(batch: PackedBatch) -> Iterator[None]:
    """Attention masks built inside keep each of `batch`'s rows to itself."""
    token = _SEQUENCES.set(batch.sequence_ids)
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


def packed_sdpa_mask(*args, mask_function=None, allow_is_causal_skip: bool = True, **kwargs):
    """Transformers' `sdpa_mask`, narrowed to same-sequence pairs inside `packed_sequences`."""
    from transformers.masking_utils import (and_masks, causal_mask_function, packed_sequence_mask_function,
                                            sdpa_mask)

    if context_parallel.current() is not None:  # a split row's attention knows its keys: no mask to build
        return None
    mask_function = causal_mask_function if mask_function is None else mask_function
    sequences = _SEQUENCES.get()
    if sequences is not None:
        same_sequence = packed_sequence_mask_function(sequences.to(kwargs.get("device", "cpu")))
        mask_function, allow_is_causal_skip = and_masks(mask_function, same_sequence), False
    return sdpa_mask(*args, mask_function=mask_function, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
