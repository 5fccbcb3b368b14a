"""Projections that multiply the same input, computed as one layer while training: a Llama-family layer's q, k and
v, and its gate and up (`bios.kernels.stacked_lora`).

`lay_out_end_to_end` puts such projections' frozen weights (and biases) one after another in one tensor; each
parameter becomes a view of it, so memory, parameter names and state dicts are unchanged. `stacked_output` then
computes the projections in one `stacked_lora_linear` (a training pass and a forward pass alike, so both give the
same numbers), and says None where it cannot (kernels off; a decode step's products by prepacked copies; the
weights made again since, e.g. by a tensor-parallel split before it lays them out again), so the caller computes
each projection on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from bios.kernels.grad_wanted import grad_wanted
from bios.kernels.prepacked import prepacking
from bios.kernels.stacked_lora import AdapterRows, end_to_end, stacked_lora_linear
from bios.worker.compute_mode import kernels_enabled

# The projections of one block that multiply the block's input, by their Transformers names.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_input_projections(block: nn.Module) -> list[list[nn.Linear]]:
    """`block`'s groups of projections (`SHARED_INPUT`) that it holds as plain linear layers."""
    groups = []
    for names in SHARED_INPUT:
        layers = [getattr(block, name, None) for name in names]
        if all(isinstance(layer, nn.Linear) for layer in layers):
            groups.append(layers)
    return groups


def lay_out_end_to_end(projections: Sequence[nn.Linear]) -> bool:
    """Store the projections' weights (and biases, if every one has one) one after another in one tensor, in place;
    whether they are so laid out now. Idempotent; projections of differing dtypes, devices or input sizes stay as
    they are."""
    weights = [layer.weight for layer in projections]
    biases = [layer.bias for layer in projections]
    has_bias = [b is not None for b in biases]
    if any(has_bias) != all(has_bias):
        return False
    parts = [weights, biases] if all(has_bias) else [weights]
    for tensors in parts:
        if end_to_end(tensors) is not None:
            continue
        if len({(t.dtype, t.device, t.shape[1:]) for t in tensors}) != 1:
            return False
        stacked = torch.cat([t.detach() for t in tensors])
        for tensor, part in zip(tensors, stacked.split([t.shape[0] for t in tensors])):
            tensor.data = part
    return True


def stacked_output(x: Tensor, projections: Sequence[nn.Linear]) -> Tensor | None:
    """The projections' outputs side by side, [batch, ..., sum of outs], for x [batch, ..., in] (LoRA layers, their
    adapters' segments over dim 0), from one stacked layer; None where that does not apply (see the module
    docstring)."""
    if not kernels_enabled() or x.dim() < 3:
        return None
    segments = [getattr(layer, "lora_segments", None) for layer in projections]
    if any(s is None for s in segments):
        return None
    factors = [t for layer_segments in segments for s in layer_segments for t in (s.lora_a, s.lora_b)]
    if not grad_wanted(x, *factors) and prepacking():
        return None
    weight = end_to_end([layer.weight for layer in projections])
    biases = [layer.bias for layer in projections]
    has_bias = [b is not None for b in biases]
    bias = end_to_end(biases) if all(has_bias) else None
    if weight is None or weight.requires_grad or (any(has_bias) and bias is None):
        return None
    adapters = _adapter_rows(segments)
    if adapters is None:
        return None
    return stacked_lora_linear(x, weight, bias, tuple(layer.weight.shape[0] for layer in projections), adapters)


def _adapter_rows(segments: list[list]) -> list[AdapterRows] | None:
    """The projections' LoRA segments grouped by rows: one adapter covers the same rows in every projection it
    adapts (`active_adapters`); None if they disagree (rows that overlap, or one range with two scales)."""
    by_rows: dict[tuple[int, int], list[tuple[int, object]]] = {}
    for index, layer_segments in enumerate(segments):
        for segment in layer_segments:
            by_rows.setdefault((segment.start, segment.end), []).append((index, segment))
    adapters, previous_end = [], 0
    for (start, end), members in sorted(by_rows.items()):
        if start < previous_end or len({segment.scale for _, segment in members}) != 1:
            return None
        previous_end = end
        adapters.append(AdapterRows(start, end, tuple(i for i, _ in members),
                                    tuple(s.lora_a for _, s in members), tuple(s.lora_b for _, s in members),
                                    members[0][1].scale))
    return adapters

