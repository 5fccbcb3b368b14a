"""When a sampled row stops: its stop token ids (EOS included unless `stop=[]`) and its stop strings."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def stop_token_ids(stop: object, eos_token_id: int | None) -> list[int]:
    """EOS always stops, as in the Tinker API, except with `stop=[]`, which never stops early. Stop token ids
    and stop strings add to EOS."""
    if isinstance(stop, (list, tuple)) and not stop:
        return []
    eos = [] if eos_token_id is None else [eos_token_id]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, int) for s in stop):
        return eos + [int(s) for s in stop if int(s) not in eos]
    return eos


def string_stop_hits(
    tokenizer: PreTrainedTokenizerBase | None,
    tokens: Tensor,
    row_ids: Tensor,
    alive: Tensor,
    string_stops: dict[int, list[str]],
    generated: dict[int, list[int]],
) -> Tensor:
    """True for live rows (`row_ids`: each batch position's output row) whose decoded generated text now contains one of their stop strings.

    The whole generated text is decoded each step (not just the new token) because a token may complete a
    multi-byte character or a stop string spanning several tokens; a stop string present now and not
    before was completed by this step's token.
    """
    hits = torch.zeros_like(alive)
    row_list, token_list, alive_list = row_ids.tolist(), tokens.tolist(), alive.tolist()
    for position, (row, token, is_alive) in enumerate(zip(row_list, token_list, alive_list)):
        if not is_alive or row not in string_stops:
            continue
        generated[row].append(token)
        text = tokenizer.decode(generated[row])
        if any(stop in text for stop in string_stops[row]):
            hits[position] = True
    return hits
