"""`bios.kernels` norms and MLP activation inside Llama-family models, while `BIOS_KERNELS` is on.

`fuse_llama_modules` switches the class of every RMSNorm and SiLU-gated MLP of Llama, Mistral, Qwen2 and Qwen3
models (SmolLM2 is a Llama) to a subclass whose forward calls `rms_norm` / `swiglu` while `kernels_enabled()`
and the stock forward otherwise. Only classes whose forward is known to be `weight * normalise(x)` and
`down(silu(gate(x)) * up(x))` are switched; anything else (Gemma's `1 + weight` norm, GELU MLPs) keeps its
own code. Their attentions, and those MLPs, compute q, k and v, and gate and up, as one stacked layer while
training (`bios.worker.stacked_layers`), their weights laid out end to end here; such an attention then does its
RoPE in one call (`bios.kernels.rotary`). Parameter names, `isinstance` checks and hooks are unchanged.
"""

from __future__ import annotations

import sys
from functools import partial

from torch import Tensor, nn

from bios.kernels import rms_norm, swiglu
from bios.kernels.norms import swiglu_stacked, swiglu_stacked_value, swiglu_value
from bios.kernels.recompute import recomputed_when_saved
from bios.kernels.rotary import rotary
from bios.worker.compute_mode import kernels_enabled
from bios.worker.cpu_attention import cpu_attention, stacked_cpu_attention
from bios.worker.stacked_layers import lay_out_end_to_end, shared_input_projections, stacked_output


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
    this forward does the rest of the stock one (RoPE by `bios.kernels.rotary`: one call where Transformers' takes
    ten ops, and as many back; the model's attention function; o_proj). With a cache, hooks on the projections,
    or where the stack does not apply (`stacked_output`), the stock forward."""

    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    head_dim: int
    scaling: float
    attention_dropout: float

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = None
        if (not args and kwargs.get("position_embeddings") is not None and kwargs.get("cache") is None
                and kwargs.get("past_key_values") is None and not has_hooks(*projections)):
            qkv = stacked_output(hidden_states, projections)
        if qkv is None:
            return super().forward(hidden_states, *args, **kwargs)
        return self._attend(hidden_states, qkv, **kwargs)

    def _attend(self, hidden_states: Tensor, qkv: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None = None, cache=None, past_key_values=None, **kwargs):
        """The stock forward (no cache) after the projections, from their outputs side by side."""
        widths = [layer.weight.shape[0] for layer in (self.q_proj, self.k_proj, self.v_proj)]
        cos, sin = position_embeddings
        norms = _head_norms(self)
        attention = _attention_function(self)
        if attention is cpu_attention and not norms and widths[1] == widths[2]:  # RoPE and attention in one kernel
            output = stacked_cpu_attention(
                self, qkv, widths[0] // self.head_dim, widths[1] // self.head_dim, cos, sin, attention_mask,
                dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, **kwargs)
            if output is not None:
                return self.o_proj(output), None
        query_key, value = qkv.split([widths[0] + widths[1], widths[2]], dim=-1)
        if norms:  # Qwen3 normalises each head's query and key before RoPE
            query, key = (rotary(norm(part.unflatten(-1, (-1, self.head_dim))).flatten(-2), cos, sin)
                          for norm, part in zip(norms, query_key.split(widths[:2], dim=-1)))
        else:  # query and key heads side by side: one rotation
            query, key = rotary(query_key, cos, sin).split(widths[:2], dim=-1)
        # Attention keeps the values for backward: values of their own, not a view keeping queries and keys alive
        query, key, value = (part.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                             for part in (query, key, value.contiguous()))
        output, weights = attention(
            self, query, key, value, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling, sliding_window=attention_window(self), **kwargs)
        return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _attention_function(attention: nn.Module):
    """The attention function the stock forward would call: the configured implementation's, else the
    architecture's eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stock = type(attention).__bases__[-1]  # (mixin, Transformers' class): `_fused_class`
    eager = sys.modules[stock.__module__].eager_attention_forward
    implementation = attention.config._attn_implementation
    return eager if implementation == "eager" else ALL_ATTENTION_FUNCTIONS.get(implementation, eager)


def attention_window(attention: nn.Module) -> int | None:
    """The sliding window of a Llama-family attention, None for full attention: Qwen2/3 name each layer's,
    Mistral's attention reads its config's, Llama has none."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)


def has_hooks(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


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
