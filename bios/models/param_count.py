"""Parameters of a Llama-family model counted from its `config.json` alone, without torch or Transformers.

`bios models list` shows every model's size; building each one on the meta device to count would import torch
and Transformers (seconds) for a listing. The decoders Bios knows differ only in which projections carry a
bias and whether attention normalises q and k, so the count is exact for them; other architectures get None.
The Qwen2-VL and Qwen2.5-VL vision-language models add their image encoder (`bios.models.vision_shape`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bios.models.vision_shape import vision_tower

# model_type -> (q/k/v biased, o biased, q/k norms): None for "as config.attention_bias says"
_LAYOUTS: dict[str, tuple[bool | None, bool | None, bool]] = {
    "llama": (None, None, False),
    "mistral": (False, False, False),
    "qwen2": (True, False, False),
    "qwen3": (None, None, True),
    "qwen2_vl": (True, False, False),
    "qwen2_vl_text": (True, False, False),
    "qwen2_5_vl": (True, False, False),
    "qwen2_5_vl_text": (True, False, False),
}


def count_parameters(config: Mapping[str, Any]) -> int | None:
    """Parameters of the model `config` (a `config.json` dict) describes, tied ones once; None if unknown."""
    text = {**config, **config.get("text_config", {})}
    layout = _LAYOUTS.get(text.get("model_type", ""))
    vision = vision_tower(config.get("model_type", ""), config["vision_config"]) if "vision_config" in config else None
    if layout is None or (vision is not None and vision.parameters is None):
        return None
    attention_bias = bool(text.get("attention_bias", False))
    qkv_bias, o_bias, qk_norm = layout
    qkv_bias = attention_bias if qkv_bias is None else qkv_bias
    o_bias = attention_bias if o_bias is None else o_bias
    h, vocab, inter = text["hidden_size"], text["vocab_size"], text["intermediate_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or h // heads
    q, kv = heads * head_dim, (text.get("num_key_value_heads") or heads) * head_dim
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if qkv_bias else 0) + (h if o_bias else 0)
    mlp = 3 * h * inter + (2 * inter + h if text.get("mlp_bias", False) else 0)
    norms = 2 * h + (2 * head_dim if qk_norm else 0)
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)) else 2)
    decoder = embeddings + text["num_hidden_layers"] * (attention + mlp + norms) + h
    return decoder + (vision.parameters if vision is not None else 0)
