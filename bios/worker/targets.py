"""Which weight matrices of a decoder LoRA can train, whatever the architecture calls them.

Three kinds are adaptable: a plain `nn.Linear` or one computing the same (Falcon's `FalconLinear`), separate or
fused projections alike (Phi-3's `qkv_proj` and `gate_up_proj`, DeepSeek's MLA `q_a_proj` ... `kv_b_proj`,
Falcon's `query_key_value`, shared experts, the output head), a GPT-2 style
`Conv1D` (weight stored [in, out]), and the 3D expert parameters transformers 5 keeps for routed experts
(`mlp.experts.gate_up_proj [E, ...]`, `down_proj`), each expert with its own A and B. Router gates,
embeddings, norms and biases are never adapted. Any other module holding a weight matrix (a quantized linear,
an unknown layer type) is recorded as unadaptable, and an adapter that would train it is refused naming it,
rather than silently leaving it out.

A module counts as the vision tower's when it lies in a vision-language model's image encoder (only its plain
linear layers are adaptable there, trained with `train_vision`), as attention when its path mentions
"attn"/"attention", as the output head when it is `get_output_embeddings()`, and as MLP otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from bios import peft_layout as layout
from bios.exceptions import BadRequestError
from bios.types import LoraConfig, LoraTargetGroup
from bios.worker.vision import in_vision_tower

Kind = Literal["linear", "conv1d", "experts"]
Role = Literal["attn", "mlp", "unembed", "vision"]

_ROLE_FLAG = {"attn": "train_attn", "mlp": "train_mlp", "unembed": "train_unembed", "vision": "train_vision"}
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a numeric path component: a layer's (or expert's) index


@dataclass(frozen=True)
class LoraTarget:
    """A weight an adapter attaches to: `y = W x + scale * B A x` with A [rank, in], B [out, rank].

    `module_name` names the target: the module's path for a linear or Conv1D layer, the parameter's path
    (`...mlp.experts.gate_up_proj`) for routed experts, which get one A/B per expert (`num_experts` > 0).
    """

    module_name: str
    in_features: int
    out_features: int
    kind: Kind = "linear"
    num_experts: int = 0

    @property
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of (A, B) for rank 1 with the rank axis marked by -1: [E,] r, in and [E,] out, r."""
        lead = (self.num_experts,) if self.num_experts else ()
        return (*lead, -1, self.in_features), (*lead, self.out_features, -1)


@dataclass(frozen=True)
class _Found:
    target: LoraTarget
    role: Role


@dataclass(frozen=True)
class Unadaptable:
    """A module holding a weight matrix that LoRA cannot train (quantized or of an unknown kind)."""

    module_name: str
    type_name: str
    role: Role


def is_router(name: str, module: nn.Module) -> bool:
    """MoE routers (`mlp.gate`, `mlp.router`, Qwen2-MoE's `shared_expert_gate`): they pick experts, never adapted."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("gate", "router") or leaf.endswith("_gate") or "Router" in type(module).__name__


def is_experts(module: nn.Module) -> bool:
    """A transformers 5 routed-experts module (`@use_experts_implementation`): 3D weights, one slice per expert."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and isinstance(
        getattr(module, "down_proj", None), nn.Parameter
    ) and module.down_proj.ndim == 3


def expert_parameters(module: nn.Module) -> tuple[str, str]:
    """The two weight parameters of an experts module: (`gate_up_proj` or `up_proj`, `down_proj`)."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


# `nn.Linear` subclasses whose forward is `x @ W.T + b` all the same: LoRA's layer stands in for them unchanged.
# (`FalconLinear` adds its bias in a separate op, which in bf16 rounds once more than `F.linear`.)
_LINEAR_ALIASES = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


def _is_plain_linear(module: nn.Module) -> bool:
    plain = type(module).__dict__.get("bios_lora_base", type(module))  # LoraLinear stands for its base
    return plain is nn.Linear or f"{plain.__module__}.{plain.__qualname__}" in _LINEAR_ALIASES


def _role(name: str, module: nn.Module, head: nn.Module | None) -> Role:
    if module is head:
        return "unembed"
    return "attn" if any("attn" in part or "attention" in part for part in name.split(".")) else "mlp"


def _discover(model: nn.Module) -> tuple[list[_Found], list[Unadaptable]]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: list[_Found] = []
    refused: list[Unadaptable] = []
    inside_refused: tuple[str, ...] = ()  # the parts of a refused module are not reported again
    for name, module in model.named_modules():
        if in_vision_tower(name):  # the image encoder: its linear layers only (not the patch embedding)
            if _is_plain_linear(module):
                found.append(_Found(LoraTarget(name, module.in_features, module.out_features), "vision"))
            continue
        role = _role(name, module, head)
        kind = type(module)
        if _is_plain_linear(module):
            if module is head or not is_router(name, module):
                found.append(_Found(LoraTarget(name, module.in_features, module.out_features), role))
        elif kind.__dict__.get("bios_lora_base", kind) is Conv1D:  # LoraConv1D stands for its base
            in_features, out_features = module.weight.shape
            found.append(_Found(LoraTarget(name, in_features, out_features, "conv1d"), role))
        elif is_experts(module):
            for param_name in expert_parameters(module):
                experts, rows, cols = getattr(module, param_name).shape
                in_features, out_features = (rows, cols) if module.is_transposed else (cols, rows)
                target = LoraTarget(f"{name}.{param_name}", in_features, out_features, "experts", experts)
                found.append(_Found(target, role))
        elif isinstance(module, nn.Embedding) or is_router(name, module) or name.startswith(inside_refused):
            continue
        elif isinstance(module, nn.Linear) or "Linear" in kind.__name__ or any(
            param.ndim >= 2 for param in module.parameters(recurse=False)
        ):
            refused.append(Unadaptable(name, f"{kind.__module__}.{kind.__qualname__}", role))
            inside_refused = (*inside_refused, f"{name}.")
    return found, refused


def all_targets(model: nn.Module) -> list[LoraTarget]:
    """Every adaptable weight of `model`, in module order (what `attach_lora` prepares)."""
    return [entry.target for entry in _discover(model)[0]]


def lora_targets(model: nn.Module, config: LoraConfig) -> list[LoraTarget]:
    """The weights `config` trains, in module order: attention when `train_attn`, MLP (experts included) when
    `train_mlp`, the output head when `train_unembed`, the vision tower's linear layers when `train_vision`.

    Raises `BadRequestError` naming the module when a part `config` trains holds a weight matrix LoRA cannot
    adapt (a quantized linear, an unknown layer type): training around it would silently leave it out.
    """
    found, refused = _discover(model)
    for entry in refused:
        flag = _ROLE_FLAG[entry.role]
        if getattr(config, flag):
            raise BadRequestError(
                f"cannot adapt {entry.module_name}: it is a {entry.type_name}, and LoRA trains only plain "
                "torch.nn.Linear layers, transformers Conv1D layers and 3D routed-expert weights (quantized or "
                f"custom layers are not supported); load an unquantized base model, or set {flag}=false",
                field=flag,
            )
    if config.train_vision and not any(entry.role == "vision" for entry in found):
        raise BadRequestError("train_vision trains a vision-language model's image encoder, and this base model "
                              "has none: set train_vision=false", field="train_vision")
    return [entry.target for entry in found if getattr(config, _ROLE_FLAG[entry.role])]


def target_groups(model: nn.Module, config: LoraConfig) -> list[LoraTargetGroup]:
    """What `lora_targets(model, config)` trains, for `get_info()`: one group per module path with its layer
    indices as `*` and the same role, kind and expert count, in module order."""
    trained = {target.module_name for target in lora_targets(model, config)}
    groups: dict[tuple[str, Role, Kind, int], int] = {}
    for entry in _discover(model)[0]:
        target = entry.target
        if target.module_name in trained:
            key = (_LAYER_INDEX.sub("*", target.module_name), entry.role, target.kind, target.num_experts)
            groups[key] = groups.get(key, 0) + 1
    return [LoraTargetGroup(pattern, role, kind, count, experts)
            for (pattern, role, kind, experts), count in groups.items()]


def peft_keys(targets: list[LoraTarget]) -> dict[str, tuple[str, str]]:
    """PEFT's state-dict keys (lora_A, lora_B) of every target (`bios.peft_layout`)."""
    return layout.peft_keys(
        [target.module_name for target in targets],
        {target.module_name for target in targets if target.kind == "experts"},
    )


def to_peft_layout(target: LoraTarget, lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    """(A, B) as PEFT stores them: experts' A [E, r, in] and B [E, out, r] stacked; other targets unchanged."""
    return layout.experts_to_peft(lora_a, lora_b) if target.num_experts else (lora_a, lora_b)


def from_peft_layout(target: LoraTarget, lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of `to_peft_layout`; shapes are checked by the caller against the adapter's own."""
    if not target.num_experts or lora_a.ndim != 2 or lora_b.ndim != 2:
        return lora_a, lora_b
    return layout.experts_from_peft(lora_a, lora_b, target.num_experts)
