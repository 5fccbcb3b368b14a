"""Bios's attention implementation for models that run SDPA: Transformers' SDPA with two additions.

- A low-precision model on CPU attends in fp32 (`cpu_attention`: faster than SDPA's bf16 kernel there).
- Training passes over rows packed end to end get a mask that keeps each row to itself
  (`packing.packed_sdpa_mask`): not every architecture builds that mask from position ids.

Everything else is SDPA, unchanged. `use_bios_attention(model)` registers it with Transformers' attention
interfaces under `ATTENTION` and switches a model that uses SDPA to it (idempotent), unless the model's code
tests the implementation's name for "sdpa" itself (Falcon, Gemma 4, DeepSeek-V3.2's sparse indexer): renamed,
such a model would leave its SDPA path for one that reads the mask differently, so it keeps plain SDPA and its
rows are padded, not packed.
"""

from __future__ import annotations

import inspect
import re
import sys
from functools import cache

from torch import nn

from bios.worker.cpu_attention import cpu_attention
from bios.worker.packing import packed_sdpa_mask

ATTENTION = "bios_sdpa"


def use_bios_attention(model: nn.Module) -> bool:
    """Switch `model` to Bios's attention if it runs SDPA; whether it now runs Bios's attention."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if not runs_bios_attention(model) and can_use_bios_attention(model):
        AttentionInterface.register(ATTENTION, cpu_attention)
        AttentionMaskInterface.register(ATTENTION, packed_sdpa_mask)
        model.set_attn_implementation(ATTENTION)  # a model outside AttentionInterface keeps its own (a warning)
    return runs_bios_attention(model)


def can_use_bios_attention(model: nn.Module) -> bool:
    """Whether `use_bios_attention` switches `model` to Bios's attention (or has): it runs SDPA, and its code
    does not test the implementation's name. The coordinator learns it at load (`BaseModelInfo.splits_long_rows`):
    only such a model's long rows split over workers."""
    current = getattr(model.config, "_attn_implementation", None)
    return current == ATTENTION or (current == "sdpa" and not _tests_for_sdpa_by_name(model))


def runs_bios_attention(model: nn.Module) -> bool:
    """Whether `model` attends through Bios's attention (after `use_bios_attention`)."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION


_SDPA_NAME_TEST = re.compile(r"""_attn_implementation\s*(?:==|!=|in|not in)\s*[^\n]*["']sdpa["']""")


def _tests_for_sdpa_by_name(model: nn.Module) -> bool:
    """Whether any of the modules that make up `model` is defined in a file that compares the attention
    implementation's name with "sdpa"."""
    return any(_module_tests_for_sdpa(type(module).__module__) for module in model.modules())


@cache
def _module_tests_for_sdpa(module_name: str) -> bool:
    if not module_name.startswith("transformers.models."):
        return False
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    return _SDPA_NAME_TEST.search(source) is not None
