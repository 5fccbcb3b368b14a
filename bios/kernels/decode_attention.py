"""A decode step's cascade attention (rows that are samples of one prompt) in one C call a layer.

`bios.worker.decode_cache.cascade_attention` computes it with PyTorch's ops: the scores against the shared prompt
in one product for all rows, against each row's own positions in another, one softmax over both, two weighted
sums. For SmolLM2's 16 rows that is a dozen small ops a layer, ~200 us; `csrc/decode_attention.c` does the same
arithmetic per (row, kv head) in one parallel loop (fp32 throughout, as there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bios.kernels.c_kernels import c_kernels


def cascade_attention_kernel(query: Tensor, prompt_keys: Tensor, prompt_values: Tensor, keys: Tensor,
                             values: Tensor, scaling: float) -> Tensor | None:
    """`cascade_attention`'s result (query [rows, heads, d]; prompt keys/values [kv heads, prompt, d|dv]; keys and
    values [rows, kv heads, own, d|dv] -> [rows, heads x dv] in the query's dtype) from the C kernel; None where it
    does not apply: Bios's C kernels not built or off, a cache not in fp32 on the CPU, positions not contiguous."""
    kernels = c_kernels()
    if (kernels is None or query.device.type != "cpu" or keys.dtype != torch.float32
            or any(t.dtype != torch.float32 for t in (values, prompt_keys, prompt_values))
            or any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (keys, values))):
        return None
    rows, heads, width = query.shape
    kv_heads, prompt = prompt_keys.shape[0], prompt_keys.shape[1]
    value_width = values.shape[-1]
    fp32_query = query.float()
    if fp32_query.stride(-1) != 1 or fp32_query.stride(-2) != width:
        fp32_query = fp32_query.contiguous()
    prompt_keys, prompt_values = prompt_keys.contiguous(), prompt_values.contiguous()
    out = fp32_query.new_empty(rows, heads * value_width)
    kernels.library.bios_cascade_attention(
        fp32_query.data_ptr(), fp32_query.stride(0), prompt_keys.data_ptr(), prompt_values.data_ptr(), prompt,
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        keys.shape[2], out.data_ptr(), rows, heads, kv_heads, width, value_width, scaling, torch.get_num_threads())
    return out.to(query.dtype)
