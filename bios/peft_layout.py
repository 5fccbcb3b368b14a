"""How PEFT names and lays out LoRA factors, so Bios checkpoints load as PEFT adapters and merge the same way.

Linear and Conv1D layers: `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r]. A 3D expert
parameter (`target_parameters`) gets a `ParamWrapper`; several parameters of one module are wrapped one around
the other in the order given, so the first of n sits n-1 `.base_layer`s deep. Its factors stack the experts:
lora_A [E*r, in] (expert-major rows) and lora_B [out, r*E] (columns rank-major, expert-minor).
"""

from __future__ import annotations

from torch import Tensor

PEFT_PREFIX = "base_model.model."


def peft_keys(names: list[str], parameters: set[str]) -> dict[str, tuple[str, str]]:
    """The (lora_A, lora_B) state-dict keys of each target in `names` (module paths, or parameter paths for the
    ones in `parameters`, listed in their modules' parameter order)."""
    params_of: dict[str, list[str]] = {}
    for name in names:
        if name in parameters:
            params_of.setdefault(name.rpartition(".")[0], []).append(name)
    keys = {}
    for name in names:
        path = name
        if name in parameters:
            module_path = name.rpartition(".")[0]
            siblings = params_of[module_path]
            path = module_path + ".base_layer" * (len(siblings) - 1 - siblings.index(name))
        keys[name] = (f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight")
    return keys


def experts_to_peft(lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    """Per-expert A [E, r, in] and B [E, out, r] as PEFT's lora_A [E*r, in] and lora_B [out, r*E]."""
    experts, rank, _ = lora_a.shape
    return lora_a.reshape(experts * rank, -1), lora_b.permute(1, 2, 0).reshape(lora_b.shape[1], rank * experts)


def experts_from_peft(lora_a: Tensor, lora_b: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """The inverse of `experts_to_peft`: A [E, r, in], B [E, out, r] (views where the layout allows)."""
    rank = lora_a.shape[0] // num_experts
    return lora_a.reshape(num_experts, rank, -1), lora_b.reshape(lora_b.shape[0], rank, num_experts).permute(2, 0, 1)
