"""An adapter's LoRA factors in a bf16 (or fp16) model's dtype for one training pass.

The factors live in fp32 (`AdapterState.params`) and a bf16 model's layers multiply by bf16 copies. Cast where
they are used, that is two casts forward and two back for each LoRA layer: SmolLM2 has 211, so ~840 small ops a
pass, each a kernel launch on a GPU, whose step for a small model is bound by launches. A `FactorCopy` casts
the adapter's flat buffer once, hands the layers leaf views of it whose gradients land in one flat buffer of
that dtype, and adds that into the adapter's `pending_grad` in one op after backward.

The numbers are those of the per-layer casts: each factor's gradient was computed in the model's dtype and then
cast, and it is added into the copy's zeroed buffer once per pass (each LoRA layer runs once per pass, over one
row range per adapter), so exactly.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from bios.worker.adapter import AdapterState, LoraTarget


class FactorCopy:
    """Stands for its adapter in `active_adapters` (the same targets, scale and `lora_pair`) for one pass."""

    def __init__(self, adapter: AdapterState, dtype: torch.dtype) -> None:
        self.adapter = adapter
        self.params = adapter.params.detach().to(dtype)
        self.grad = torch.zeros_like(self.params)
        # The factors lie in `params` in target order, A then B (`AdapterState`): one split each, not a slice per
        # factor (SmolLM2 has 422 factors, and every view is an op to dispatch).
        originals = [factor for target in adapter.targets for factor in adapter.lora_pair(target.module_name)]
        sizes = [factor.numel() for factor in originals]
        starts = [factor.storage_offset() - adapter.params.storage_offset() for factor in originals]
        if starts != list(accumulate(sizes, initial=0))[:-1] or sum(sizes) != self.params.numel():
            raise RuntimeError(f"adapter {adapter.model_id}: its factors do not lie end to end in its parameters")
        copies = []
        for original, factor, grad in zip(originals, self.params.split(sizes), self.grad.split(sizes)):
            factor = factor.view(original.shape).requires_grad_(True)  # a leaf: its buffer needs no gradient
            factor.grad = grad.view(original.shape)
            copies.append(factor)
        self._pairs = {target.module_name: (copies[2 * i], copies[2 * i + 1])
                       for i, target in enumerate(adapter.targets)}

    @property
    def model_id(self) -> str:
        return self.adapter.model_id

    @property
    def targets(self) -> list[LoraTarget]:
        return self.adapter.targets

    @property
    def scale(self) -> float:
        return self.adapter.scale

    def has_target(self, module_name: str) -> bool:
        return module_name in self._pairs

    def lora_pair(self, module_name: str) -> tuple[Tensor, Tensor]:
        return self._pairs[module_name]

    def add_grad(self) -> None:
        """Add this pass's gradients into the adapter's `pending_grad` (in fp32)."""
        self.adapter.pending_grad.add_(self.grad)


def factor_copies(adapters: list[AdapterState], dtype: torch.dtype) -> dict[int, FactorCopy]:
    """A copy in `dtype` of each distinct trainable adapter (keyed by its id) when `dtype` is not the factors' own
    (fp32); none otherwise, and the layers multiply by the adapters' own factors."""
    copies: dict[int, FactorCopy] = {}
    for adapter in adapters:
        if adapter.trainable and adapter.params.dtype != dtype and id(adapter) not in copies:
            copies[id(adapter)] = FactorCopy(adapter, dtype)
    return copies
