"""Multi-adapter LoRA on a shared frozen base model.

`attach_lora` turns every linear layer an adapter could train into a `LoraLinear` once per base model; the
frozen base weights stay where they are and are shared by every adapter. `active_adapters` then says, for the
duration of one forward pass, which rows of the batch use which adapter. `lora_forward` is the single
function that computes a LoRA layer's output, kept apart so a fused kernel can replace it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from bios.types import LoraConfig
from bios.worker.adapter import AdapterState, lora_targets

_ATTACHED_FLAG = "_bios_lora_modules"


@dataclass(frozen=True)
class LoraSegment:
    """Rows [start, end) of a layer's input use the update `scale * (x Aᵀ) Bᵀ`."""

    start: int
    end: int
    lora_a: Tensor
    lora_b: Tensor
    scale: float


def lora_forward(x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment]) -> Tensor:
    """`x Wᵀ + b` plus, on each segment's rows of dim 0, that segment's LoRA update.

    The update is added in place onto the base output, so besides the base matmul only `x` and the small
    `x Aᵀ` are kept for backward (no dropout: it would force an activation-sized copy of `x`). Several
    adapters loop over their row ranges rather than gathering a weight copy per row.
    """
    out = F.linear(x, weight, bias)
    for segment in segments:
        lora_a = segment.lora_a.to(x.dtype)
        lora_b = segment.lora_b.to(x.dtype)
        if segment.start == 0 and segment.end == out.shape[0]:
            out.add_((x @ lora_a.T * segment.scale) @ lora_b.T)
        else:
            rows = x[segment.start : segment.end]
            out[segment.start : segment.end].add_((rows @ lora_a.T * segment.scale) @ lora_b.T)
    return out


class LoraLinear(nn.Linear):
    """An `nn.Linear` that also applies the LoRA segments `active_adapters` set on it (none: plain linear)."""

    lora_segments: list[LoraSegment]

    def forward(self, x: Tensor) -> Tensor:
        return lora_forward(x, self.weight, self.bias, self.lora_segments)


def attach_lora(model: nn.Module) -> None:
    """Make every potential LoRA target of `model` a `LoraLinear` and freeze the base model. Idempotent.

    The layer's class is switched in place rather than the layer being wrapped, so parameter names (and
    therefore the base state dict and PEFT key names), tied weights and hooks are all unchanged. The model is
    put in eval mode: a frozen shared base has no use for dropout, and eval keeps forward passes deterministic.
    """
    if hasattr(model, _ATTACHED_FLAG):
        return
    everything = LoraConfig(rank=1, train_attn=True, train_mlp=True, train_unembed=True)
    modules = dict(model.named_modules())
    wrapped: dict[str, LoraLinear] = {}
    for target in lora_targets(model, everything):
        module = modules[target.module_name]
        if type(module) not in (nn.Linear, LoraLinear):
            raise NotImplementedError(
                f"cannot attach LoRA to {target.module_name}: it is a {type(module).__name__}, and only plain "
                "torch.nn.Linear layers (unquantized base models) are supported"
            )
        module.__class__ = LoraLinear
        module.lora_segments = []
        wrapped[target.module_name] = module
    model.requires_grad_(False)
    model.eval()
    setattr(model, _ATTACHED_FLAG, wrapped)


@contextmanager
def active_adapters(model: nn.Module, segments: list[tuple[int, int, AdapterState]]) -> Iterator[None]:
    """Within the block, rows [start, end) of every layer input (dim 0) use that adapter; other rows the base.

    Segments must not overlap. Each adapter must have been created for this model (its targets are LoRA
    layers of it). The previous segments are restored on exit, so blocks nest.
    """
    wrapped: dict[str, LoraLinear] | None = getattr(model, _ATTACHED_FLAG, None)
    if wrapped is None:
        raise RuntimeError("active_adapters needs attach_lora(model) to have been called on this model first")
    ordered = sorted(segments, key=lambda segment: segment[0])
    for start, end, adapter in ordered:
        if not 0 <= start < end:
            raise ValueError(f"adapter segment of {adapter.model_id} must satisfy 0 <= start < end, got [{start}, {end})")
        unknown = [t.module_name for t in adapter.targets if t.module_name not in wrapped]
        if unknown:
            raise ValueError(
                f"adapter {adapter.model_id} targets layers this model does not have as LoRA layers: {unknown[:3]}"
            )
    for (_, previous_end, previous), (start, _, adapter) in zip(ordered, ordered[1:]):
        if start < previous_end:
            raise ValueError(
                f"adapter segments overlap: {previous.model_id} ends at row {previous_end}, "
                f"{adapter.model_id} starts at row {start}"
            )
    saved = {name: module.lora_segments for name, module in wrapped.items()}
    try:
        for name, module in wrapped.items():
            module.lora_segments = [
                LoraSegment(start, end, *adapter.lora_pair(name), adapter.scale)
                for start, end, adapter in ordered
                if adapter.has_target(name)
            ]
        yield
    finally:
        for name, module in wrapped.items():
            module.lora_segments = saved[name]
