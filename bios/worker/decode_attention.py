"""Attention for one-token decode steps of a low-precision model on CPU.

PyTorch's CPU SDPA kernel (flash attention for CPU) is built for blocks of queries: for a decode step's single
bf16 query row against a 60-110 token cache (SmolLM2: 16 rows, 9 query heads over 3 key/value heads) it takes
0.6-1.0 ms per layer, 4-5x a plain matmul, fp32 softmax and matmul over the same tensors, so its 30 layers were
~20 ms of a ~95 ms sampling step. `decode_step_attention` does that plain computation for exactly this case
(one query position, CPU, bf16/fp16, no attention extras) in fp32, as accurate as SDPA's own fp32 accumulation,
and hands every other call to Transformers' SDPA unchanged: prompts, training, fp32 models and GPUs keep it.
It is the attention function of `attention.ATTENTION`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def decode_step_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[Tensor, None]:
    """Transformers' attention function signature: query [B, Hq, 1, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv]
    -> [B, 1, Hq, Dv] (MLA's values are narrower than its queries and keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    extras = any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias", "sinks"))
    if (query.shape[2] != 1 or query.device.type != "cpu" or query.dtype == torch.float32 or dropout or extras
            or (attention_mask is not None and attention_mask.dim() != 4)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim).float()  # each kv head's query heads
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))
    scores.mul_(scaling if scaling is not None else 1 / math.sqrt(head_dim))
    if attention_mask is not None:  # [B, 1, 1, L]: bool (True attends) or additive
        mask = attention_mask[:, :, :, : key.shape[2]]
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.float()
    output = torch.matmul(torch.softmax(scores, dim=-1), value.float())
    return output.reshape(batch, 1, heads, value.shape[-1]).to(query.dtype), None

