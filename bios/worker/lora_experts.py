"""Multi-adapter LoRA on routed experts (transformers 5 experts modules with 3D weights).

`attach_experts` switches an experts module's class to a subclass whose forward, while some adapter is
active on it, runs the generic experts computation of `transformers.integrations.moe` (the module's own
`has_gate` / `is_transposed` / `has_bias` / `_apply_gate` / `post_expert_norm` describe it) with each expert's
LoRA added by `bios.kernels.expert_lora.expert_linear`; with no adapter active the stock forward runs
unchanged. Each adapted 3D parameter has an `ExpertSlot` holding its `lora_segments`, set by
`active_adapters` like a `LoraLinear`'s.

With kernels on (`BIOS_KERNELS`), the gate_up projection reads its rows straight from the layer's tokens, the
down projection applies the gate to its input group by group (recomputed in backward), and
`combine_experts` weights and sums: a layer keeps its tokens, the gate_up output and the experts' outputs
for backward. With kernels off the same arithmetic runs as plain autograd ops, one expert at a time.

Segments count rows of the decoder layer's input (dim 0, sequences), while experts see flattened tokens; a
forward pre-hook on the enclosing decoder layer records how many tokens one row holds.

Under expert parallelism (`bios.worker.expert_parallel`) a module holds only experts [first, first + count)
of the layer: routes to the others become the sentinel `count` (transformers' convention) and are skipped,
and such a module always runs this computation, adapters or not (not every stock forward knows sentinels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from bios.kernels.expert_lora import (
    ExpertFactors,
    combine_experts,
    expert_groups,
    expert_linear,
)
from bios.worker.compute_mode import kernels_enabled
from bios.worker.targets import expert_parameters

if TYPE_CHECKING:
    from bios.worker.lora import LoraSegment


class ExpertSlot:
    """The adapters active on one 3D expert parameter: `LoraSegment`s whose A is [E, r, in] and B [E, out, r]."""

    def __init__(self) -> None:
        self.lora_segments: list[LoraSegment] = []


class LoraExperts:
    """Mixin put before a transformers experts class (see the module docstring)."""

    lora_slots: dict[str, ExpertSlot]
    bios_rows_per_item: int | None
    bios_local_experts: tuple[int, int] | None  # (first, count) of the experts this worker holds, if split

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self.bios_local_experts is not None:
            first, count = self.bios_local_experts
            local = top_k_index - first
            return _forward_with_lora(self, hidden_states, local.masked_fill((local < 0) | (local >= count), count),
                                      top_k_weights)
        if not any(slot.lora_segments for slot in self.lora_slots.values()):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        return _forward_with_lora(self, hidden_states, top_k_index, top_k_weights)


_lora_classes: dict[type, type] = {}


def attach_experts(model: nn.Module, module_name: str) -> dict[str, ExpertSlot]:
    """Give the experts module at `module_name` LoRA slots (idempotent); returns them by parameter name."""
    module = model.get_submodule(module_name)
    if not isinstance(module, LoraExperts):
        stock = type(module)
        if stock not in _lora_classes:
            _lora_classes[stock] = type(f"Lora{stock.__name__}", (LoraExperts, stock), {"__module__": __name__})
        module.__class__ = _lora_classes[stock]
        module.lora_slots = {name: ExpertSlot() for name in expert_parameters(module)}
        module.bios_rows_per_item = None
        module.bios_local_experts = None
    return module.lora_slots


def _blocks(module: LoraExperts) -> list[tuple[int, int, dict[str, LoraSegment]]]:
    """The distinct row ranges adapters hold on this module, in order, each with its segment per parameter."""
    by_range: dict[tuple[int, int], dict[str, LoraSegment]] = {}
    for name, slot in module.lora_slots.items():
        for segment in slot.lora_segments:
            by_range.setdefault((segment.start, segment.end), {})[name] = segment
    return [(start, end, segments) for (start, end), segments in sorted(by_range.items())]


def _forward_with_lora(module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    rows_per_item = module.bios_rows_per_item
    if rows_per_item is None:
        raise NotImplementedError(
            f"{type(module).__name__} ran with adapters active outside a decoder layer Bios hooked: LoRA on "
            "routed experts needs the experts inside a transformers GradientCheckpointingLayer"
        )
    tokens, top_k = top_k_index.shape
    num_experts = module.down_proj.shape[0]
    blocks = _blocks(module)
    slot = torch.full((tokens,), len(blocks), dtype=torch.int64, device=hidden_states.device)
    for index, (start, end, _) in enumerate(blocks):
        if end * rows_per_item > tokens:
            raise ValueError(f"adapter rows [{start}, {end}) exceed the {tokens // rows_per_item} rows of the batch")
        slot[start * rows_per_item : end * rows_per_item] = index
    expert = top_k_index.reshape(-1)
    groups = (len(blocks) + 1) * num_experts
    # (block, expert) group of every (token, k) pair; pairs routed to another worker's experts sort last
    key = (slot.repeat_interleave(top_k) * num_experts + expert).masked_fill(expert >= num_experts, groups)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=groups + 1)[:groups].view(-1, num_experts).tolist()
    order = order[: sum(map(sum, counts))]
    first, second = expert_parameters(module)
    gate = module._apply_gate if module.has_gate else module.act_fn
    weights = top_k_weights.reshape(-1)[order]
    if kernels_enabled():
        projected = _project(module, first, hidden_states, counts, blocks, rows=order // top_k)
        out = _post_expert_norm(module, _project(module, second, projected, counts, blocks, activation=gate))
        combined = combine_experts(out, weights.to(out.dtype), order, top_k, tokens)
    else:
        projected = _stock_project(module, first, hidden_states[order // top_k], counts, blocks)
        out = _post_expert_norm(module, _stock_project(module, second, gate(projected), counts, blocks))
        weighted = out * weights.to(out.dtype)[:, None]
        combined = weighted.new_zeros(tokens * top_k, weighted.shape[1]).index_copy(0, order, weighted)
        combined = combined.view(tokens, top_k, -1).sum(dim=1)
    return combined.to(hidden_states.dtype)


def _post_expert_norm(module, out: Tensor) -> Tensor:
    if getattr(module, "has_post_expert_norm", False):  # transformers >= 5.2x
        return module.post_expert_norm(out)
    return out


def _factors(name: str, blocks) -> list[ExpertFactors | None]:
    """Each block's LoRA factors of parameter `name` (None where its adapter leaves it), then None for the
    rows no adapter holds."""
    factors: list[ExpertFactors | None] = []
    for _, _, segments in blocks:
        segment = segments.get(name)
        factors.append(None if segment is None else (segment.lora_a, segment.lora_b, segment.scale))
    return [*factors, None]


def _project(module, name: str, x: Tensor, counts: list[list[int]], blocks, **inputs) -> Tensor:
    bias = getattr(module, f"{name}_bias") if module.has_bias else None
    return expert_linear(x, getattr(module, name), bias, counts, _factors(name, blocks),
                         transposed=module.is_transposed, **inputs)


def _stock_project(module, name: str, x: Tensor, counts: list[list[int]], blocks) -> Tensor:
    """`_project` as plain autograd ops, one (block, expert) group at a time (`BIOS_KERNELS=0`)."""
    weight = getattr(module, name)
    bias = getattr(module, f"{name}_bias") if module.has_bias else None
    factors = _factors(name, blocks)
    adapted = [entry for entry in factors if entry is not None]
    pieces = []
    for rows, expert, adapter, _ in expert_groups(counts, [entry is not None for entry in factors]):
        xg = x[rows]
        y = xg @ (weight[expert] if module.is_transposed else weight[expert].T)
        if bias is not None:
            y = y + bias[expert]
        if adapter is not None:
            lora_a, lora_b, scale = adapted[adapter]
            y = y + scale * ((xg @ lora_a[expert].to(x.dtype).T) @ lora_b[expert].to(x.dtype).T)
        pieces.append(y)
    if not pieces:
        return x.new_zeros(0, weight.shape[2] if module.is_transposed else weight.shape[1])
    return torch.cat(pieces)
