"""The parts of memory planning that need a worker: activation checkpointing of its models, and measuring it.

The arithmetic (what a plan needs, which plan fits) is `bios.models.memory_plan`, which the coordinator uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from bios.models.long_rows import MLP_CHUNK_TOKENS
from bios.worker.lora import lora_holders


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations (only its input is kept).

    Hugging Face's own switch only acts in training mode, and Bios keeps the frozen base in eval mode, so each
    decoder layer's `forward` is wrapped in a non-reentrant `torch.utils.checkpoint` directly; passes without
    gradients (forward-only, sampling) run it plainly. Hooks inside a layer (tensor-parallel all-reduces) run
    again on recomputation, in the same order on every worker. Idempotent.
    """
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers Bios knows how to checkpoint")
    for layer in layers:
        if getattr(layer, "_bios_checkpointed", False):
            continue
        plain_forward = layer.forward
        recomputed = _recomputed(plain_forward, lora_holders(layer))

        def checkpointed(*args, _forward=plain_forward, _recomputed=recomputed, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return _recomputed(*args, **kwargs)

        layer.forward = checkpointed
        layer._bios_checkpointed = True
        layer._bios_plain_forward = plain_forward


def _recomputed(forward, lora: list) -> Callable:
    """`forward` under a non-reentrant `torch.utils.checkpoint`, recomputed in backward with the LoRA segments
    it saw when called (the engine leaves `active_adapters` before backward)."""

    def call(*args, **kwargs):
        segments = [module.lora_segments for module in lora]

        def with_forward_segments(*args, **kwargs):
            outside = [module.lora_segments for module in lora]
            for module, active in zip(lora, segments):
                module.lora_segments = active
            try:
                return forward(*args, **kwargs)
            finally:
                for module, previous in zip(lora, outside):
                    module.lora_segments = previous

        return checkpoint(with_forward_segments, *args, use_reentrant=False, **kwargs)

    return call


def chunk_dense_mlps(model: nn.Module, chunk_tokens: int) -> list[nn.Module]:
    """Run each decoder layer's dense MLP on `chunk_tokens` positions at a time, each chunk recomputed in
    backward: an MLP is position-wise, so a long row's layer keeps its [tokens, intermediate] activations for
    one chunk instead of the whole row (`bios.models.long_rows.MLP_CHUNK_TOKENS`, which the planner counts).
    Mixture-of-experts blocks (an `experts` child) are left as they are. Returns the MLPs switched, for
    `unchunk_mlps`."""
    switched = []
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if (not isinstance(layer, GradientCheckpointingLayer) or not isinstance(mlp, nn.Module)
                or hasattr(mlp, "experts") or "forward" in vars(mlp)):
            continue
        plain_forward, recomputed = mlp.forward, _recomputed(mlp.forward, lora_holders(mlp))

        def chunked(x, *args, _forward=plain_forward, _recomputed=recomputed, **kwargs):
            if args or kwargs or x.dim() != 3 or x.shape[1] <= chunk_tokens:
                return _forward(x, *args, **kwargs)
            run = _recomputed if torch.is_grad_enabled() else _forward
            return torch.cat([run(part) for part in x.split(chunk_tokens, dim=1)], dim=1)

        mlp.forward = chunked
        switched.append(mlp)
    return switched


def unchunk_mlps(mlps: list[nn.Module]) -> None:
    for mlp in mlps:
        del mlp.forward  # the class's forward again


def disable_activation_checkpointing(model: nn.Module) -> None:
    """Undo `enable_activation_checkpointing` (a new plan keeps activations): every layer runs plainly again."""
    for module in model.modules():
        if getattr(module, "_bios_checkpointed", False):
            module.forward = module._bios_plain_forward
            module._bios_checkpointed = False


@contextlib.contextmanager
def checkpointed(model: nn.Module) -> Iterator[None]:
    """Activation checkpointing and chunked MLPs (`chunk_dense_mlps`) for one pass, then as the plan says: a row
    longer than the plan's pass runs alone, and the planner sized the longest row it accepts for such a pass
    (`bios.models.memory_plan.longest_row`). A model already checkpointed keeps its checkpointing; one whose
    layers Bios cannot checkpoint runs as it is."""
    mlps = chunk_dense_mlps(model, MLP_CHUNK_TOKENS)
    enabled = False
    try:
        if not any(getattr(module, "_bios_checkpointed", False) for module in model.modules()):
            with contextlib.suppress(ValueError):
                enable_activation_checkpointing(model)
                enabled = True
        yield
    finally:
        if enabled:
            disable_activation_checkpointing(model)
        unchunk_mlps(mlps)
        _trim_heap()


def _trim_heap() -> None:
    """Give the heap's free pages back after a long row's pass. Its tensors, freed, leave holes that the next
    long pass's differently sized ones fit badly: a 8.9k-token row's peak RSS crept 743 -> 876 MiB over seven
    passes, and stays at 725 MiB with this (glibc's `malloc_trim` also releases free pages inside the heap)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, None elsewhere (musl, macOS)."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None).malloc_trim
    return None


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
