"""Which forward a sampler's decode steps run: the lean Llama-family step (`bios.worker.llama_decode`) where it
computes the model, else the model's own modules over Transformers' cache (`ModuleDecodeStep`). Both take a
step's tokens, positions and attention mask and return the last hidden state of each row, and drop finished
rows on `keep_rows`."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from bios.worker.attention import runs_bios_attention
from bios.worker.cpu_attention import cache_dtype
from bios.worker.kv_cache import reserve_decode_room
from bios.worker.llama_decode import LlamaDecodeStep


class ModuleDecodeStep:
    """A decode step through the model's own modules and Transformers' cache (expanded to one row per sample, with
    room reserved): every model the lean step does not compute."""

    def __init__(self, model: nn.Module, cache: DynamicCache, expand: Tensor, steps: int, dtype: torch.dtype
                 ) -> None:
        """`dtype`: what Bios's attention reads the cache in (`cpu_attention.cache_dtype`), where it runs."""
        self._model, self._cache = model, cache
        cache.reorder_cache(expand)
        reserve_decode_room(cache, steps, dtype if runs_bios_attention(model) else None)

    def keep_rows(self, rows: Tensor) -> None:
        self._cache.reorder_cache(rows)

    def __call__(self, tokens: Tensor, positions: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self._model.base_model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=positions[:, None],
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state[:, -1]


def decode_step(model: nn.Module, cache: DynamicCache, expand: Tensor, steps: int
                ) -> LlamaDecodeStep | ModuleDecodeStep:
    """The forward of `steps` decode steps after the prefill `cache` (one row per prompt; row i of the decode
    continues prompt `expand[i]`)."""
    dtype = cache_dtype(model.get_input_embeddings().weight.dtype, expand.device)
    lean = LlamaDecodeStep.for_model(model, cache, expand, steps, dtype)
    return lean if lean is not None else ModuleDecodeStep(model, cache, expand, steps, dtype)
