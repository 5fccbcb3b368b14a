"""Attention on CPU: a training pass's and a prompt's through Bios's interval kernel, a low-precision model's
decode step in plain fp32, the rest through SDPA (in fp32 for bf16/fp16).

A training pass (or a prompt) whose mask gives each query one interval of keys (causal rows, packed sequences,
a sliding window; `bios.kernels.interval_attention.key_intervals`) runs `interval_attention`, which computes only
the pairs the intervals hold, where PyTorch's CPU flash attention computes every pair of a row of up to 512
positions; low-precision tensors go in as fp32 copies. Other masks, head widths the kernel does not take, dropout,
and machines without the C kernels run SDPA as follows.

PyTorch's CPU SDPA kernel (flash attention for CPU) is slower in bf16 than in fp32 on the same tensors, once
they are cast: for SmolLM2's training shape (4 rows x 128 tokens, 9 query heads over 3 key/value heads, head 64)
forward and backward took 7.8-8.0 ms per layer in bf16 against 4.5-5.0 ms cast to fp32 and back (AMD EPYC with
avx512_bf16, 2 threads), ~0.1 s of a ~1.6 s step over 30 layers; a prompt's forward alone 1.4 vs 1.2 ms. For a
decode step's single query row it is worse still (0.6-1.0 ms per layer, 4-5x a plain matmul, softmax and matmul
in fp32), so `cpu_attention` does that plain computation for one query position and runs SDPA's fp32 kernel on
fp32 copies of the query, keys and values for everything else. Both are at least as accurate as the bf16 kernel
(which accumulates in fp32 too); the output is cast back to the model's dtype. GPUs, and calls with attention
extras (soft-capping, sinks, position bias) go to Transformers' SDPA unchanged. The saved fp32 copies cost
backward twice the bf16 bytes of q, k, v and the output (SmolLM2, 4 x 128: ~48 MB more per step).
It is the attention function of `attention.ATTENTION`. Since a decode step's attention reads the whole cache in
fp32, the sampler keeps a low-precision model's decode cache in fp32 on CPU (`cache_dtype`): each step then casts
its one new position instead of every cached one (SmolLM2 bf16, 16 rows: ~400 casts of up to 114 positions a step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from bios.kernels import interval_attention
from bios.worker import context_parallel

_EXTRAS = ("softcap", "s_aux", "position_bias", "sinks")
# The interval kernel runs each block of queries against all its keys: past ~10k keys in a row they no longer stay
# in cache, and PyTorch's CPU flash attention, which tiles the keys, is faster. One causal row, 4 query heads over
# 2, head 64, forward and backward on 2 threads (AMD EPYC): 8k keys 0.80 s vs 0.89 s, 12k 2.8 vs 1.8 s, 16k 6.1 vs
# 3.3 s. Longer calls without a mask (a causal row) go to SDPA (a split row's share runs PyTorch's CPU flash
# attention too, chunk by chunk: `context_parallel`).
SDPA_FROM_KEYS = 10240


def cpu_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """Transformers' attention function signature: query [B, Hq, Q, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv]
    -> [B, Q, Hq, Dv] (MLA's values are narrower than its queries and keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    share = context_parallel.current()
    if share is not None:  # a row split over replicas: every earlier key of the whole row
        if _has_extras(kwargs) or kwargs.get("sliding_window") is not None or dropout:
            raise NotImplementedError("a row split over replicas takes plain causal attention: no sliding window, "
                                      "soft-capping, sinks, position bias or dropout")
        return share.attend(query, key, value, scaling), None
    if query.device.type != "cpu" or _has_extras(kwargs):
        return _stock(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    low_precision = query.dtype in (torch.bfloat16, torch.float16)
    if query.shape[2] == 1 and low_precision and not dropout and (attention_mask is None or attention_mask.dim() == 4):
        return decode_step_attention(query, key, value, attention_mask, scaling), None
    intervals = None if dropout or not interval_attention.suits(query, key, value) \
        or _long_mask_free_call(attention_mask, key) else \
        _intervals(module, attention_mask, query.shape[0], query.shape[2], kwargs)
    if intervals is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output = interval_attention.interval_attention(query.float(), key.float(), value.float(), *intervals, scale)
        return output.to(query.dtype), None
    if not low_precision:
        return _stock(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.float()
    output, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                       dropout=dropout, scaling=scaling, **kwargs)
    return output.to(query.dtype), None


def _long_mask_free_call(attention_mask: Tensor | None, key: Tensor) -> bool:
    """A mask-free call over more keys than the interval kernel runs fastest (`SDPA_FROM_KEYS`)."""
    return attention_mask is None and key.shape[2] >= SDPA_FROM_KEYS


def _has_extras(kwargs: dict) -> bool:
    """Whether the call carries attention extras (soft-capping, sinks, a position bias) only SDPA applies."""
    return any(kwargs.get(name) is not None for name in _EXTRAS)


def _stock(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Transformers' SDPA on the tensors as they are (keys and values in the query's dtype)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = key.to(query.dtype), value.to(query.dtype)  # an fp32 decode cache (`cache_dtype`), if any
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def stacked_cpu_attention(module: nn.Module, qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, sin: Tensor,
                          attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> Tensor | None:
    """`cpu_attention` of a stacked q/k/v projection output [B, S, (heads + 2 kv_heads) x D] whose queries and keys
    take RoPE by cos and sin first, in one kernel call each way (`interval_attention.stacked_attention`): the
    attention output [B, S, heads x D]. None where the interval kernel does not apply (not fp32 on CPU, dropout,
    extras, a mask that is not one interval per query, rotary tables that train or of another shape): the caller
    goes the stock way."""
    if qkv.device.type != "cpu" or qkv.dtype != torch.float32 or dropout or qkv.stride(-1) != 1 \
            or _has_extras(kwargs) or cos.requires_grad or sin.requires_grad or context_parallel.current():
        return None
    query, key, value = (part.transpose(1, 2) for part in interval_attention.split_stacked(qkv, heads, kv_heads))
    if not interval_attention.rope_tables_fit(qkv, query.shape[-1], cos, sin) \
            or not interval_attention.suits(query, key, value) or _long_mask_free_call(attention_mask, key):
        return None
    intervals = _intervals(module, attention_mask, qkv.shape[0], qkv.shape[1], kwargs)
    if intervals is None:
        return None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return interval_attention.stacked_attention(qkv, heads, kv_heads, *intervals, scale, cos, sin)


def _intervals(module: nn.Module, attention_mask: Tensor | None, batch: int, length: int, kwargs: dict):
    """Each query's interval of keys (`interval_attention.key_intervals`), a call without a mask being causal as
    Transformers' SDPA decides: more than one query, and `is_causal` if passed, else the module's (decoders: True)."""
    passed = kwargs.get("is_causal")
    causal = length > 1 and (passed if passed is not None else getattr(module, "is_causal", True))
    return interval_attention.key_intervals(attention_mask, causal, batch, length)


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a decode cache of `dtype` keys and values on `device` is best kept in for `cpu_attention`: fp32
    for bf16/fp16 on CPU (what the attention reads them in), else `dtype`."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def decode_step_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                          scaling: float | None) -> Tensor:
    """One query position: query [B, Hq, 1, D] against key/value [B, Hkv, L, D|Dv], with a [B, 1, 1, L] mask (bool,
    True attends, or additive) or None, in fp32 -> [B, 1, Hq, Dv] in the query's dtype."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim).float()  # each kv head's query heads
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))
    scores.mul_(scaling if scaling is not None else 1 / math.sqrt(head_dim))
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[2]]
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.float()
    output = torch.matmul(torch.softmax(scores, dim=-1), value.float())
    return output.reshape(batch, 1, heads, value.shape[-1]).to(query.dtype)
