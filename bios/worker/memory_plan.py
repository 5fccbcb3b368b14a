"""The parts of memory planning that need a worker: activation checkpointing of its models, and measuring it.

The arithmetic (what a plan needs, which plan fits) is `bios.models.memory_plan`, which the coordinator uses.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from bios.worker.lora import lora_holders


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations (only its input is kept).

    Hugging Face's own switch only acts in training mode, and Bios keeps the frozen base in eval mode, so each
    decoder layer's `forward` is wrapped in a non-reentrant `torch.utils.checkpoint` directly; passes without
    gradients (forward-only, sampling) run it plainly. The engine leaves `active_adapters` before backward,
    so the recomputation re-installs the LoRA segments the layer saw in forward. Idempotent. Hooks inside a
    layer (tensor-parallel all-reduces) run again on recomputation, in the same order on every worker.
    """
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers Bios knows how to checkpoint")
    for layer in layers:
        if getattr(layer, "_bios_checkpointed", False):
            continue
        plain_forward = layer.forward
        lora_layers = lora_holders(layer)

        def checkpointed(*args, _forward=plain_forward, _lora=lora_layers, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            segments = [module.lora_segments for module in _lora]

            def with_forward_segments(*args, **kwargs):
                outside = [module.lora_segments for module in _lora]
                for module, active in zip(_lora, segments):
                    module.lora_segments = active
                try:
                    return _forward(*args, **kwargs)
                finally:
                    for module, previous in zip(_lora, outside):
                        module.lora_segments = previous

            return checkpoint(with_forward_segments, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
        layer._bios_checkpointed = True
        layer._bios_plain_forward = plain_forward


def disable_activation_checkpointing(model: nn.Module) -> None:
    """Undo `enable_activation_checkpointing` (a new plan keeps activations): every layer runs plainly again."""
    for module in model.modules():
        if getattr(module, "_bios_checkpointed", False):
            module.forward = module._bios_plain_forward
            module._bios_checkpointed = False


@contextlib.contextmanager
def checkpointed(model: nn.Module) -> Iterator[None]:
    """Activation checkpointing for one pass, then as the plan says: a row longer than the plan's pass runs
    alone, and the planner sized the longest row it accepts for such a pass (`bios.models.memory_plan.
    longest_row`). A model already checkpointed, or one whose layers Bios cannot checkpoint, runs as it is."""
    if any(getattr(module, "_bios_checkpointed", False) for module in model.modules()):
        yield
        return
    try:
        enable_activation_checkpointing(model)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        disable_activation_checkpointing(model)


@functools.cache
def runtime_footprint(device: torch.device) -> int:
    """What this process holds before any model, which memory plans count as fixed overhead: on CPU the RSS
    once the Transformers model code is imported (the first model load would import it anyway), measured
    once (a re-registration must not count the models loaded since); 0 on CUDA, whose budget is device
    memory (the planner's CUDA default covers the context)."""
    if device.type == "cuda":
        return 0
    import transformers.modeling_utils  # noqa: F401  (the bulk of what loading a model imports)

    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    """The highest resident set size of this process since it started, in bytes (Linux).

    Not `getrusage().ru_maxrss`: Linux carries that over from the parent through fork and exec, so a process
    started by a big one reports the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line: peak RSS is only measured on Linux")
