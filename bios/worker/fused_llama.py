"""`bios.kernels` norms and MLP activation inside Llama-family models, while `BIOS_KERNELS` is on.

`fuse_llama_modules` switches the class of every RMSNorm and SiLU-gated MLP of Llama, Mistral, Qwen2 and Qwen3
models (SmolLM2 is a Llama) to a subclass whose forward calls `rms_norm` / `swiglu` while `kernels_enabled()`
and the stock forward otherwise. Only classes whose forward is known to be `weight * normalise(x)` and
`down(silu(gate(x)) * up(x))` are switched; anything else (Gemma's `1 + weight` norm, GELU MLPs) keeps its
own code. Parameter names, `isinstance` checks and hooks are unchanged.
"""

from __future__ import annotations

from torch import Tensor, nn

from bios.kernels import rms_norm, swiglu
from bios.kernels.norms import swiglu_value
from bios.kernels.recompute import recomputed_when_saved
from bios.worker.compute_mode import kernels_enabled


class _FusedRMSNorm:
    """Mixin put before a Llama-style RMSNorm class: same numbers in fp32, backward keeps only x and 1/rms."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not kernels_enabled():
            return super().forward(hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedSwiGLUMLP:
    """Mixin put before a Llama-style MLP class: `silu(gate) * up` recomputes silu in backward instead of saving
    it, and `down_proj` recomputes its input from gate and up (`recomputed_when_saved`) instead of keeping it."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def forward(self, x: Tensor) -> Tensor:
        if not kernels_enabled():
            return super().forward(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = swiglu(gate, up)
        with recomputed_when_saved(hidden, lambda: swiglu_value(gate, up)):  # not held until backward
            return self.down_proj(hidden)


_fused_classes: dict[type, type] = {}


def _fused_class(mixin: type, stock: type) -> type:
    if stock not in _fused_classes:
        _fused_classes[stock] = type(f"Fused{stock.__name__}", (mixin, stock), {"__module__": __name__})
    return _fused_classes[stock]


# (module, class) of the Transformers classes whose forwards are exactly Llama's; named rather than imported so
# fusing a Llama does not import every other architecture's modeling code.
_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_RMS_NORMS = {(f"transformers.models.{m}.modeling_{m}", f"{prefix}RMSNorm") for m, prefix in _FAMILIES.items()}
_MLPS = {(f"transformers.models.{m}.modeling_{m}", f"{prefix}MLP") for m, prefix in _FAMILIES.items()}
_DECODER_LAYERS = {(f"transformers.models.{m}.modeling_{m}", f"{p}DecoderLayer") for m, p in _FAMILIES.items()}
_ATTENTIONS = {(f"transformers.models.{m}.modeling_{m}", f"{prefix}Attention") for m, prefix in _FAMILIES.items()}


def _is_silu(activation: nn.Module) -> bool:
    from transformers.activations import SiLUActivation

    return type(activation) in (SiLUActivation, nn.SiLU)


def fuse_llama_modules(model: nn.Module) -> int:
    """Route the known RMSNorms and SiLU MLPs of `model` through `bios.kernels` while `kernels_enabled()`.

    In place and idempotent; returns how many modules use the fused forward (0 for other architectures).
    """
    fused = 0
    for module in model.modules():
        stock = type(module)
        name = (stock.__module__, stock.__qualname__)
        if isinstance(module, (_FusedRMSNorm, _FusedSwiGLUMLP)):
            fused += 1
        elif name in _RMS_NORMS:
            module.__class__ = _fused_class(_FusedRMSNorm, stock)
            fused += 1
        elif name in _MLPS and _is_silu(module.act_fn):
            module.__class__ = _fused_class(_FusedSwiGLUMLP, stock)
            fused += 1
    return fused


def is_fused_llama_layer(layer: nn.Module) -> bool:
    """Whether `layer` is a stock Llama-family decoder layer (its attention too) whose norms and MLP
    `fuse_llama_modules` switched: what `bios.worker.llama_decode` can compute without its modules."""
    def stock(module: nn.Module, names: set) -> bool:
        return (type(module).__module__, type(module).__qualname__) in names

    return (stock(layer, _DECODER_LAYERS) and stock(layer.self_attn, _ATTENTIONS)
            and isinstance(layer.mlp, _FusedSwiGLUMLP)
            and all(isinstance(norm, _FusedRMSNorm) for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                  *_head_norms(layer.self_attn))))


def _head_norms(attention: nn.Module) -> list[nn.Module]:
    """Qwen3's per-head query and key norms (none elsewhere)."""
    norms = (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
    return [norm for norm in norms if norm is not None]
