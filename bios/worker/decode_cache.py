"""The keys and values of the lean decode step (`bios.worker.llama_decode`), with room for every step up front.

Two layouts, picked from how the batch's rows share prompts:

- `RowCache`: every row its own copy of its prompt's keys and values, in buffers with room for the decode's steps
  (each step writes its one position). Attention is `cpu_attention` on each row's filled part: exactly what the
  module path computes.
- `SharedPromptCache`, when every row continues one prompt (RL's many samples of one prompt, which the sampler
  prefills once), on CPU: the prompt's keys and values are kept once, not once per row, and only the generated
  positions per row. A decode step's attention reads the whole cache in every layer, and with 16 rows of a
  50-token prompt most of it was 16 copies of the prompt, read from memory. Attention is cascaded: each row's
  scores against the shared prompt come from one product for all rows, the scores against its own positions from
  its own, one softmax over both, and the two weighted sums of values added. The same arithmetic as attending
  over the concatenation, in another order (agrees to rounding); in one C call a layer where Bios's C kernels
  are built (`bios.kernels.decode_attention`: 7.6 -> 4.6 ms of SmolLM2's step). SmolLM2 fp32, 16 x 64 of a
  50-token prompt (Intel Xeon, 2 threads): 56.5 -> 54.8 ms a step, and no 16 copies of the prompt to make. On a GPU the step is
  bound by kernel launches rather than memory, so rows keep their own copies there and attend in one SDPA
  kernel instead of the cascade's dozen small ones.

Keys and values are kept in the dtype the attention reads (`cpu_attention.cache_dtype`: fp32 for a bf16 model
on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from bios.kernels.decode_attention import cascade_attention_kernel
from bios.worker.cpu_attention import cpu_attention


class _RowBuffers:
    """Each row's keys and values [rows, kv heads, positions, head dim], filled one position a step."""

    def __init__(self, keys: Tensor, values: Tensor, filled: int) -> None:
        self._keys, self._values, self._filled = keys, values, filled

    def _append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's key and value [rows, kv heads, head dim]; every filled position's keys and values."""
        self._keys[:, :, self._filled].copy_(key)
        self._values[:, :, self._filled].copy_(value)
        self._filled += 1
        return self._keys[:, :, : self._filled], self._values[:, :, : self._filled]

    def keep(self, rows: Tensor) -> None:
        self._keys, self._values = self._keys[rows], self._values[rows]


class RowCache(_RowBuffers):
    """One layer's keys and values per row: [rows, kv heads, positions + room, head dim]."""

    def __init__(self, keys: Tensor, values: Tensor, expand: Tensor, room: int, dtype: torch.dtype) -> None:
        super().__init__(_with_room(keys, expand, room, dtype), _with_room(values, expand, room, dtype),
                         keys.shape[-2])

    def attend(self, attention: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
               scaling: float) -> Tensor:
        """Add this step's key and value [rows, kv heads, head dim], attend with query [rows, heads, head dim]
        (`mask` [rows, 1, 1, positions] or None) -> [rows, heads x head dim]."""
        keys, values = self._append(key, value)
        attended, _ = cpu_attention(attention, query[:, :, None], keys, values, mask, scaling=scaling)
        return attended.reshape(query.shape[0], -1)


class SharedPromptCache(_RowBuffers):
    """One layer's keys and values when every row continues one prompt: the prompt's [kv heads, prompt, head dim]
    once, and each row's generated positions [rows, kv heads, room, head dim]."""

    def __init__(self, keys: Tensor, values: Tensor, rows: int, room: int, dtype: torch.dtype) -> None:
        self._prompt_keys = keys[0].to(dtype)
        self._prompt_values = values[0].to(dtype)
        heads, _, width = self._prompt_keys.shape
        super().__init__(keys.new_empty(rows, heads, room, width, dtype=dtype),
                         values.new_empty(rows, heads, room, values.shape[-1], dtype=dtype), 0)

    def attend(self, attention: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
               scaling: float) -> Tensor:
        """`RowCache.attend`, cascaded over the shared prompt (no row's prompt is padded, so `mask` is None)."""
        keys, values = self._append(key, value)
        return cascade_attention(query, self._prompt_keys, self._prompt_values, keys, values, scaling)


def cascade_attention(query: Tensor, prompt_keys: Tensor, prompt_values: Tensor, keys: Tensor, values: Tensor,
                      scaling: float) -> Tensor:
    """One query position per row attending over a prompt all rows share and then each row's own positions.

    query [rows, heads, d]; prompt_keys/values [kv heads, prompt, d|dv]; keys/values [rows, kv heads, own, d|dv]
    -> [rows, heads x dv] in the query's dtype. Computed in at least fp32 throughout: a bf16 product would round the
    scores themselves to bf16 before the softmax (fused attention kernels keep them in fp32). In one C call where
    Bios's C kernels are built (`bios.kernels.decode_attention`), else with PyTorch's ops.
    """
    fused = cascade_attention_kernel(query, prompt_keys, prompt_values, keys, values, scaling)
    if fused is not None:
        return fused
    dtype = torch.promote_types(keys.dtype, torch.float32)
    rows, heads, width = query.shape
    kv_heads, prompt = prompt_keys.shape[0], prompt_keys.shape[1]
    group = heads // kv_heads
    grouped = query.to(dtype).reshape(rows, kv_heads, group, width)  # each kv head's query heads
    by_head = grouped.transpose(0, 1).reshape(kv_heads, rows * group, width)
    prompt_scores = torch.matmul(by_head, prompt_keys.to(dtype).transpose(1, 2))  # [kv heads, rows x group, prompt]
    own_scores = torch.matmul(grouped, keys.to(dtype).transpose(-1, -2))  # [rows, kv heads, group, own]
    scores = torch.cat([prompt_scores.view(kv_heads, rows, group, prompt).transpose(0, 1), own_scores], dim=-1)
    weights = torch.softmax(scores.mul_(scaling), dim=-1)
    output = torch.matmul(weights[..., prompt:], values.to(dtype))  # [rows, kv heads, group, dv]
    prompt_weights = weights[..., :prompt].transpose(0, 1).reshape(kv_heads, rows * group, prompt)
    from_prompt = torch.matmul(prompt_weights, prompt_values.to(dtype)).view(kv_heads, rows, group, -1).transpose(0, 1)
    return output.add_(from_prompt).reshape(rows, -1).to(query.dtype)


def decode_caches(prefill: object, expand: Tensor, room: int, dtype: torch.dtype
                  ) -> list[RowCache] | list[SharedPromptCache] | None:
    """The lean step's cache of every layer of a prefilled Transformers cache (its layers hold one row per prompt;
    row i of the decode continues prompt `expand[i]`), with `room` positions a row; None if a layer is not a plain
    full-attention layer (sliding windows and the like keep the module path)."""
    layers = prefill.layers
    if not layers or not all(type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4
                             for layer in layers):
        return None
    rows = expand.shape[0]
    if layers[0].keys.shape[0] == 1 and rows > 1 and layers[0].keys.device.type == "cpu":
        return [SharedPromptCache(layer.keys, layer.values, rows, room, dtype) for layer in layers]
    return [RowCache(layer.keys, layer.values, expand, room, dtype) for layer in layers]


def _with_room(states: Tensor, expand: Tensor, room: int, dtype: torch.dtype) -> Tensor:
    """states [prompts, heads, positions, width] expanded to one row per entry of `expand`, with `room` positions
    more, in `dtype`."""
    prompts, heads, filled, width = states.shape
    buffer = states.new_empty(expand.shape[0], heads, filled + room, width, dtype=dtype)
    buffer[:, :, :filled] = states.index_select(0, expand.to(states.device))
    return buffer
