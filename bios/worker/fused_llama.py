"""`bios.kernels` norms and MLP activation inside Llama-family models, while `BIOS_KERNELS` is on.

`fuse_llama_modules` switches the class of every RMSNorm and SiLU-gated MLP of Llama, Mistral, Qwen2 and Qwen3
models (SmolLM2 is a Llama) to a subclass whose forward calls `rms_norm` / `swiglu` while `kernels_enabled()`
and the stock forward otherwise. Only classes whose forward is known to be `weight * normalise(x)` and
`down(silu(gate(x)) * up(x))` are switched; anything else (Gemma's `1 + weight` norm, GELU MLPs) keeps its
own code. Their attentions, and those MLPs, compute q, k and v, and gate and up, as one stacked layer while
training (`bios.worker.stacked_layers`), their weights laid out end to end here. Parameter names, `isinstance`
checks and hooks are unchanged.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor, nn

from bios.kernels import rms_norm, swiglu
from bios.kernels.norms import swiglu_stacked, swiglu_stacked_value, swiglu_value
from bios.kernels.recompute import recomputed_when_saved
from bios.worker.compute_mode import kernels_enabled
from bios.worker.stacked_layers import (handed_outputs, lay_out_end_to_end, shared_input_projections,
                                        stacked_output)


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
        gate_up = stacked_output(x, (self.gate_proj, self.up_proj))
        if gate_up is not None:
            hidden = swiglu_stacked(gate_up)
            recompute = partial(swiglu_stacked_value, gate_up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            hidden = swiglu(gate, up)
            recompute = partial(swiglu_value, gate, up)
        with recomputed_when_saved(hidden, recompute):  # not held until backward
            return self.down_proj(hidden)


class _StackedQKVAttention:
    """Mixin put before a Llama-style attention class: while training, q, k and v come from one stacked layer and
    the stock forward (RoPE, the attention function, o_proj) receives them (`handed_outputs`)."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = stacked_output(hidden_states, projections)
        if qkv is None:
            return super().forward(hidden_states, *args, **kwargs)
        query, key, value = qkv.split([layer.weight.shape[0] for layer in projections], dim=-1)
        # Attention keeps the values for backward, RoPE neither queries nor keys: values of their own, so those
        # go once rotated (a view would keep all three alive: SmolLM2 fp32, +28 MiB at the step's peak)
        with handed_outputs(hidden_states, projections, (query, key, value.contiguous())):
            return super().forward(hidden_states, *args, **kwargs)


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
    """Route the known RMSNorms, SiLU MLPs and attentions of `model` through `bios.kernels` while
    `kernels_enabled()`, and lay out the weights of their projections that share an input end to end.

    In place and idempotent; returns how many modules use the fused forward (0 for other architectures). Call it
    once the frozen weights have their final dtype and device: a parameter made again loses its place.
    """
    fused = 0
    for module in model.modules():
        stock = type(module)
        name = (stock.__module__, stock.__qualname__)
        if isinstance(module, (_FusedRMSNorm, _FusedSwiGLUMLP, _StackedQKVAttention)):
            fused += 1
        elif name in _RMS_NORMS:
            module.__class__ = _fused_class(_FusedRMSNorm, stock)
            fused += 1
        elif name in _MLPS and _is_silu(module.act_fn):
            module.__class__ = _fused_class(_FusedSwiGLUMLP, stock)
            fused += 1
        elif name in _ATTENTIONS:
            module.__class__ = _fused_class(_StackedQKVAttention, stock)
            fused += 1
        else:
            continue
        for projections in shared_input_projections(module):
            lay_out_end_to_end(projections)
    return fused


def is_fused_llama_layer(layer: nn.Module) -> bool:
    """Whether `layer` is a stock Llama-family decoder layer whose attention, norms and MLP `fuse_llama_modules`
    switched: what `bios.worker.llama_decode` can compute without its modules."""
    stock = (type(layer).__module__, type(layer).__qualname__) in _DECODER_LAYERS
    return (stock and isinstance(layer.self_attn, _StackedQKVAttention)
            and isinstance(layer.mlp, _FusedSwiGLUMLP)
            and all(isinstance(norm, _FusedRMSNorm) for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                  *_head_norms(layer.self_attn))))


def _head_norms(attention: nn.Module) -> list[nn.Module]:
    """Qwen3's per-head query and key norms (none elsewhere)."""
    norms = (getattr(attention, "q_norm", None), getattr(attention, "k_norm", None))
    return [norm for norm in norms if norm is not None]
