"""A Llama-family decode step without Transformers' per-module Python.

A sampler's decode step runs one token per row through every layer. Through Transformers' modules that is ~24
module calls a layer, a mask built from the 2-D attention mask, keyword plumbing and RoPE by `rotate_half`, all
per step: a 30-layer model with hidden size 64 decoded 16 rows at 11.9 ms a step in fp32 (Intel Xeon, 2 threads)
with next to no arithmetic, a fifth of SmolLM2's whole step. `LlamaDecodeStep` runs the same layers as plain
calls on the modules' parameters (7.0 ms for that model): RMSNorm and SwiGLU from `bios.kernels`, RoPE from the
model's own rotary embedding (query and key heads in one rotation), attention over its own keys and values
(`bios.worker.decode_cache`), and the projections resolved once per batch rather than routed at every call
(`lora_product`; adapters, prepacked and merged copies as before). Projections that share an input (q, k and v;
gate and up) multiply by one stacked copy where a decode's rows use no adapter or one on every row
(`stacked_lora_product`). With fp32 hidden states on CPU, where Bios's C kernels are built, each residual add
with the next RMSNorm, the rotation and SwiGLU are one C call each (`bios.kernels.decode_ops`: small PyTorch ops
run cold between a decode step's weight products; SmolLM2 fp32, 16 x 64: 46 -> 40 ms a step). Where each row
keeps its own copy of its prompt (`decode_cache.RowCache`) the numbers are the modules' own, bit for bit on
PyTorch's ops (to fp32 rounding where MKL's AVX2 kernels multiply a stacked copy, or where the C ops sum in
another order); rows of one shared prompt attend to it once (`SharedPromptCache`), equal to rounding (tests
compare both with the module path).

It applies to Llama, Mistral, Qwen2 and Qwen3 text models whose decoder layers are the stock ones (the classes
`fuse_llama_modules` fuses), with fused kernels on (`BIOS_KERNELS`), a prefill cache of plain full-attention
layers, no hooks on the layers' parts (a tensor-parallel model's all-reduces are hooks) and no sliding window
shorter than the decode's longest row; anything else keeps the module path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bios.kernels.decode_ops import DecodeOps
from bios.kernels.norms import rms_norm, swiglu_value
from bios.kernels.rotary import rotate_heads, signed_sin
from bios.worker.compute_mode import kernels_enabled
from bios.worker.decode_cache import decode_caches
from bios.worker.fused_llama import attention_window, has_hooks, is_fused_llama_layer
from bios.worker.lora import LoraLinear, lora_product, stacked_lora_product


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, looked up once."""

    input_norm: nn.Module
    attention: nn.Module
    qkv: _Projections
    o: _Projections
    post_norm: nn.Module
    gate_up: _Projections
    down: _Projections
    query_norm: nn.Module | None  # Qwen3 normalises each head's query and key
    key_norm: nn.Module | None


class LlamaDecodeStep:
    """The decode steps of a Llama-family model after a prefill: `step(tokens, positions, mask)` -> the final
    norm's output [rows, hidden] (the model's last hidden state for the step's token), keeping its own keys and
    values (`bios.worker.decode_cache`)."""

    def __init__(self, model: nn.Module, layers: list[_Layer], caches: list) -> None:
        self._model = model.base_model
        self._layers = layers
        self._caches = caches
        first = layers[0].attention
        self._head_dim = first.head_dim
        self._scaling = first.scaling
        self._query_heads = layers[0].qkv.outs[0] // self._head_dim
        self._intermediate = layers[0].gate_up.outs[0]
        embedding = self._model.embed_tokens.weight
        self._ops = DecodeOps.for_hidden(embedding.dtype, embedding.device) or _TorchOps()

    @classmethod
    def for_model(cls, model: nn.Module, prefill, expand: Tensor, steps: int, dtype: torch.dtype
                  ) -> LlamaDecodeStep | None:
        """The steps of `model` after the prefill cache `prefill` (row i continues its prompt `expand[i]`), for up
        to `steps` tokens a row, keys and values kept in `dtype`; None where the module path must run (see the
        module docstring)."""
        base = getattr(model, "base_model", None)
        if not kernels_enabled() or base is None or not hasattr(base, "rotary_emb") or not hasattr(base, "layers"):
            return None
        longest = prefill.get_seq_length() + steps
        layers = [_layer_parts(decoder_layer, longest) for decoder_layer in base.layers]
        if not layers or None in layers or has_hooks(base.norm, base.rotary_emb, base.embed_tokens):
            return None
        caches = decode_caches(prefill, expand, steps, dtype)
        if caches is None or len(caches) != len(layers):
            return None
        return cls(model, layers, caches)

    def keep_rows(self, rows: Tensor) -> None:
        """Drop every row but `rows` (in that order) from the cache: finished rows of a compacted batch."""
        for cache in self._caches:
            cache.keep(rows)

    def __call__(self, tokens: Tensor, positions: Tensor, attention_mask: Tensor | None) -> Tensor:
        """tokens [rows], positions [rows] (each row's position of its token), attention_mask [rows, cached + 1]
        (1 attends) or None (every position) -> [rows, hidden]."""
        model, ops = self._model, self._ops
        hidden = model.embed_tokens(tokens)
        cos, sin = model.rotary_emb(hidden, positions[:, None])  # [rows, 1, head_dim]
        sin = signed_sin(sin)  # rotate_half's signs, for `rotate`
        heads, intermediate = self._query_heads, self._intermediate
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        rows = tokens.shape[0]
        pending = None  # the last layer's MLP output, added to `hidden` with the next norm
        for layer, cache in zip(self._layers, self._caches):
            qkv = layer.qkv(_add_norm(ops, hidden, pending, layer.input_norm)).view(rows, -1, self._head_dim)
            kv_heads = (qkv.shape[1] - heads) // 2
            if layer.query_norm is None:  # query and key heads side by side: one rotation
                rotated = ops.rotate(qkv[:, : heads + kv_heads], cos, sin)
                query, key = rotated[:, :heads], rotated[:, heads:]
            else:
                query = ops.rotate(_norm(layer.query_norm, qkv[:, :heads]), cos, sin)
                key = ops.rotate(_norm(layer.key_norm, qkv[:, heads : heads + kv_heads]), cos, sin)
            value = qkv[:, heads + kv_heads :]
            attended = cache.attend(layer.attention, query, key, value, mask, self._scaling)
            gate_up = layer.gate_up(_add_norm(ops, hidden, layer.o(attended), layer.post_norm))
            pending = layer.down(ops.swiglu(gate_up, intermediate))
        return _add_norm(ops, hidden, pending, model.norm)


class _TorchOps:
    """`DecodeOps`' interface on PyTorch's ops: what runs where Bios's C kernels do not (bf16, GPUs, no compiler)."""

    @staticmethod
    def add_rms_norm(hidden: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, weight, eps)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        return rotate_heads(x, cos, signed_sin)

    @staticmethod
    def swiglu(gate_up: Tensor, intermediate: int) -> Tensor:
        return swiglu_value(gate_up[:, :intermediate], gate_up[:, intermediate:])


def _add_norm(ops: DecodeOps | _TorchOps, hidden: Tensor, delta: Tensor | None, norm: nn.Module) -> Tensor:
    """`hidden += delta` (the residual), then `norm`'s RMSNorm of it."""
    return ops.add_rms_norm(hidden, delta, norm.weight, norm.variance_epsilon)


class _Projections:
    """LoRA layers that share an input, their outputs side by side: one product by a stacked copy where one
    serves (`stacked_lora_product`), else each layer's own (`lora_product`), concatenated. Resolved again when a
    layer's segments (the sampler's `active_adapters`) or the batch's rows change, not looked up at every call."""

    __slots__ = ("modules", "outs", "_segments", "_rows", "_product", "_products")

    def __init__(self, *modules: LoraLinear) -> None:
        self.modules = modules
        self.outs = [module.weight.shape[0] for module in modules]
        self._segments: list[list] = []
        self._rows = -1
        self._product = None
        self._products: list = []

    def __call__(self, x: Tensor) -> Tensor:
        segments = [module.lora_segments for module in self.modules]
        if x.shape[0] != self._rows or any(a is not b for a, b in zip(segments, self._segments)):
            self._segments, self._rows = segments, x.shape[0]
            layers = [(module.weight, module.bias, module.lora_segments) for module in self.modules]
            self._product = stacked_lora_product(x, layers) if len(layers) > 1 else None
            self._products = [] if self._product is not None else [lora_product(x, *layer) for layer in layers]
        if self._product is not None:
            return self._product(x)
        outputs = [product(x) for product in self._products]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def _norm(module: nn.Module, x: Tensor) -> Tensor:
    return rms_norm(x, module.weight, module.variance_epsilon)


def _layer_parts(layer: nn.Module, longest: int) -> _Layer | None:
    """A stock Llama-family decoder layer's parts, or None if any part is not what `LlamaDecodeStep` computes."""
    if not is_fused_llama_layer(layer):
        return None
    attention = layer.self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    query_norm, key_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if not all(type(p) is LoraLinear for p in projections) or (query_norm is None) != (key_norm is None):
        return None
    window = attention_window(attention)
    if window is not None and window < longest:
        return None
    modules = [layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm, *projections]
    if has_hooks(*modules, *(n for n in (query_norm, key_norm) if n is not None)):
        return None
    q, k, v, o, gate, up, down = projections
    return _Layer(layer.input_layernorm, attention, _Projections(q, k, v), _Projections(o),
                  layer.post_attention_layernorm, _Projections(gate, up), _Projections(down), query_norm, key_norm)
