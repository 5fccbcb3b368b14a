"""Bios's attention implementation for models that run SDPA: Transformers' SDPA with two additions.

- Decode steps of a low-precision model on CPU attend through `decode_attention.decode_step_attention`.
- Training passes over rows packed end to end get a mask that keeps each row to itself
  (`packing.packed_sdpa_mask`): not every architecture builds that mask from position ids.

Everything else is SDPA, unchanged. `use_bios_attention(model)` registers it with Transformers' attention
interfaces under `ATTENTION` and switches a model that uses SDPA to it (idempotent).
"""

from __future__ import annotations

from torch import nn

from bios.worker.decode_attention import decode_step_attention
from bios.worker.packing import packed_sdpa_mask

ATTENTION = "bios_sdpa"


def use_bios_attention(model: nn.Module) -> bool:
    """Switch `model` to Bios's attention if it runs SDPA; whether it now runs Bios's attention."""
    from transformers import AttentionInterface, AttentionMaskInterface

    current = getattr(model.config, "_attn_implementation", None)
    if current == "sdpa":
        AttentionInterface.register(ATTENTION, decode_step_attention)
        AttentionMaskInterface.register(ATTENTION, packed_sdpa_mask)
        model.set_attn_implementation(ATTENTION)
        return True
    return current == ATTENTION
