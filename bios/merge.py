"""Fold a Bios LoRA checkpoint into its base model's weights: `W += (alpha / r) B A` for every target.

Done directly rather than through PEFT's `merge_and_unload`: PEFT 0.21 rewrites the targets of models whose
experts transformers 5 fused (DeepSeek-V3, Mixtral, Qwen2-MoE types) as if they were transformers-4 expert
names, so a dense layer's or a shared expert's `gate_proj` is taken for a routed expert's (huggingface/peft#3711).
Linear layers add `B A` [out, in], Conv1D layers its transpose (they store [in, out]), 3D expert weights
`B_e A_e` per expert (transposed for experts stored [E, in, out]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from bios.peft_layout import experts_from_peft, peft_keys

if TYPE_CHECKING:
    from torch import nn


def merge_adapter(model: nn.Module, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Add the checkpoint's LoRA updates (PEFT keys and layouts, `tensors`) into `model`'s weights in place.

    Raises ValueError, changing nothing, when the tensors do not fit `model` (keys or shapes).
    """
    import torch
    from transformers.pytorch_utils import Conv1D

    names = list(metadata["target_modules"])
    parameters = set(metadata.get("target_parameters", []))
    scale = float(metadata["lora_alpha"]) / int(metadata["rank"])
    keys = peft_keys(names, parameters)
    expected = {key for pair in keys.values() for key in pair}
    if expected != tensors.keys():
        raise ValueError(
            f"checkpoint tensors do not fit this model: missing {sorted(expected - tensors.keys())[:3]}, "
            f"unexpected {sorted(tensors.keys() - expected)[:3]}"
        )
    updates = []
    for name in names:
        lora_a, lora_b = (torch.tensor(np.asarray(tensors[key]), dtype=torch.float32) for key in keys[name])
        if name in parameters:
            module_name, _, parameter = name.rpartition(".")
            module = model.get_submodule(module_name)
            weight = getattr(module, parameter)
            lora_a, lora_b = experts_from_peft(lora_a, lora_b, weight.shape[0])
            delta = scale * torch.bmm(lora_b, lora_a)
            delta = delta.transpose(1, 2) if module.is_transposed else delta
        else:
            module = model.get_submodule(name)
            weight = module.weight
            delta = scale * (lora_b @ lora_a)
            delta = delta.T if isinstance(module, Conv1D) else delta
        if delta.shape != weight.shape:
            raise ValueError(
                f"checkpoint factors of {name} give a {tuple(delta.shape)} update, the weight is {tuple(weight.shape)}:"
                " was it saved from another base model?"
            )
        updates.append((weight, delta))
    with torch.no_grad():
        for weight, delta in updates:
            weight.add_(delta.to(weight.dtype))
