"""Multi-adapter LoRA on a shared frozen base model.

`attach_lora` turns every linear layer an adapter could train into a `LoraLinear` once per base model; the
frozen base weights stay where they are and are shared by every adapter. `active_adapters` then says, for the
duration of one forward pass, which rows of the batch use which adapter. `lora_forward` computes a LoRA
layer's output and `lora_target_logprobs` the output head's log-probs of given targets; with `BIOS_KERNELS`
on (the default) both run `bios.kernels` ops, with it off the same arithmetic through stock autograd.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.pytorch_utils import Conv1D

from bios.kernels import linear_cross_entropy, linear_weighted_loss, lora_linear_multi
from bios.kernels.frozen_matmul import (Product, adapter_copy_product, frozen_product, gemm_library,
                                        stacked_weights_product)
from bios.kernels.prepacked import LoraUpdate
from bios.kernels.grad_wanted import grad_wanted
from bios.worker.adapter import AdapterState
from bios.worker.compute_mode import base_dtype, kernels_enabled
from bios.worker.fused_llama import fuse_llama_modules
from bios.worker.lora_experts import ExpertSlot, LoraExperts, attach_experts
from bios.worker.targets import all_targets

_ATTACHED_FLAG = "_bios_lora_modules"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSegment:
    """Rows [start, end) of a layer's input use the update `scale * (x Aᵀ) Bᵀ`."""

    start: int
    end: int
    lora_a: Tensor
    lora_b: Tensor
    scale: float


def lora_forward(x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment],
                 rows_per_item: int | None = None) -> Tensor:
    """`x Wᵀ + b` plus, on each segment's rows of dim 0, that segment's LoRA update.

    A decoder layer that flattens `[batch, tokens, in]` to `[batch x tokens, in]` before a linear layer (OPT's
    fc1/fc2) hands it 2-D rows: `rows_per_item` (the layer's tokens per batch row) scales the segments.

    The update is added in place onto the base output, so besides the base matmul only `x` and the small
    `x Aᵀ` are kept for backward (no dropout: it would force an activation-sized copy of `x`). Several
    adapters loop over their row ranges rather than gathering a weight copy per row. With kernels on,
    `lora_linear_multi`'s hand-written backward also skips autograd's output-sized temporaries, and a decode
    step whose rows all use one adapter multiplies by a prepacked copy with the adapter in it
    (`adapter_copy_product`: `W + scale·B·A` in fp32, `[W; A]` otherwise).
    """
    return lora_product(x, weight, bias, segments, rows_per_item)(x)


def lora_product(x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment],
                 rows_per_item: int | None = None) -> Product:
    """How `lora_forward` computes for inputs like `x` under the current settings (`BIOS_KERNELS`, `BIOS_GEMM`),
    prepacked block and segments, as a function of the input: the one place that routes a LoRA layer's product.
    The sampler's lean decode step (`bios.worker.llama_decode`) resolves it once per projection and batch."""
    if segments and x.dim() == 2 and rows_per_item is not None and rows_per_item > 1:
        segments = [replace(segment, start=segment.start * rows_per_item, end=segment.end * rows_per_item)
                    for segment in segments]
    if not kernels_enabled() or x.dim() < 2:
        return partial(_stock_lora_forward, weight=weight, bias=bias, segments=segments)
    if not segments and not grad_wanted(x, weight, bias):  # sampling the base: no kernel bookkeeping per call
        return frozen_product(x, weight, bias)
    whole = _on_every_row(segments, x.shape[0])
    if whole is not None:
        if not grad_wanted(x, weight, bias, whole.lora_a, whole.lora_b):
            product = adapter_copy_product(x.reshape(-1, x.shape[-1]), weight, bias, whole.lora_a, whole.lora_b,
                                           whole.scale)
            if product is not None:
                return product if x.dim() == 2 else partial(_flattened, product=product, out=weight.shape[0])
    return partial(lora_linear_multi, weight=weight, bias=bias, lora_as=[s.lora_a for s in segments],
                   lora_bs=[s.lora_b for s in segments], scales=[s.scale for s in segments],
                   segments=[(s.start, s.end) for s in segments])


def stacked_lora_product(x: Tensor, layers: list[tuple[Tensor, Tensor | None, list[LoraSegment]]]) -> Product | None:
    """The LoRA layers (weight, bias, segments) that share the input x [rows, in] (q, k and v; gate and up), their
    outputs side by side [rows, sum of outs] from one product by a stacked copy (`stacked_weights_product`): where
    kernels are on, no gradient is wanted and each layer has no segment or one over every row (a decode whose rows
    all use one adapter, or none); None otherwise, the caller then takes `lora_product` per layer."""
    rows = x.shape[0]
    if not kernels_enabled() or x.dim() != 2:
        return None
    updates = []
    for weight, bias, segments in layers:
        whole = _on_every_row(segments, rows)
        if segments and whole is None:
            return None
        if grad_wanted(x, weight, bias, *(() if whole is None else (whole.lora_a, whole.lora_b))):
            return None
        updates.append(None if whole is None else LoraUpdate(whole.lora_a, whole.lora_b, whole.scale))
    return stacked_weights_product(x, [w for w, _, _ in layers], [b for _, b, _ in layers], updates)


def _on_every_row(segments: list[LoraSegment], rows: int) -> LoraSegment | None:
    """The one segment when one adapter covers all `rows` rows, else None."""
    return segments[0] if len(segments) == 1 and (segments[0].start, segments[0].end) == (0, rows) else None


def _flattened(x: Tensor, *, product: Product, out: int) -> Tensor:
    """`product` of x's rows flattened to 2-D, in x's leading shape."""
    return product(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], out)


def _stock_lora_forward(x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment]) -> Tensor:
    """`lora_forward`'s arithmetic through stock autograd (`BIOS_KERNELS=0`)."""
    out = F.linear(x, weight, bias)
    for segment in segments:
        lora_a = segment.lora_a.to(x.dtype)
        lora_b = segment.lora_b.to(x.dtype)
        if segment.start == 0 and segment.end == out.shape[0]:
            out.add_((x @ lora_a.T * segment.scale) @ lora_b.T)
        else:
            rows = x[segment.start : segment.end]
            out[segment.start : segment.end].add_((rows @ lora_a.T * segment.scale) @ lora_b.T)
    return out


def lora_target_logprobs(
    x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment], target_ids: Tensor
) -> Tensor:
    """log softmax(`lora_forward(x, ...)`)[i, target_ids[i]] for x [T, in], in fp32, shape [T].

    With kernels on, `linear_cross_entropy` runs once per run of rows sharing an adapter (or none), so at
    most one chunk of [T, vocab] logits exists at a time. A head with a bias (no Llama-family head has one)
    takes the stock path, as does everything with kernels off.
    """
    if bias is not None or not kernels_enabled():
        return _stock_logprobs(x, weight, bias, segments, target_ids)
    pieces = [linear_cross_entropy(x[rows], weight, target_ids[rows], **factors)
              for rows, factors in _head_pieces(x.shape[0], segments)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class HeadLoss(NamedTuple):
    logprobs: Tensor  # [T] fp32, not differentiable
    loss: Tensor  # the scalar -(token_weights * logprobs).sum(), differentiable


def lora_target_loss(
    x: Tensor, weight: Tensor, bias: Tensor | None, segments: list[LoraSegment], target_ids: Tensor,
    token_weights: Tensor,
) -> HeadLoss:
    """The head's log-probs of `target_ids` and the cross-entropy `-(token_weights * logprobs).sum()`.

    With kernels on, `linear_weighted_loss` per run of rows sharing an adapter: as its gradient w.r.t. the
    log-probs is known up front, the head's logits are computed once, where `lora_target_logprobs` followed
    by a loss must compute them again in backward when the head has LoRA factors.
    """
    if bias is not None or not kernels_enabled():
        logprobs = _stock_logprobs(x, weight, bias, segments, target_ids)
        return HeadLoss(logprobs.detach(), -(token_weights.to(logprobs.dtype) * logprobs).sum())
    pieces = [linear_weighted_loss(x[rows], weight, target_ids[rows], token_weights[rows], **factors)
              for rows, factors in _head_pieces(x.shape[0], segments)]
    return HeadLoss(torch.cat([piece[0] for piece in pieces]), torch.stack([piece[1] for piece in pieces]).sum())


def _stock_logprobs(x, weight, bias, segments, target_ids) -> Tensor:
    logits = lora_forward(x, weight, bias, segments).float()
    return logits.gather(-1, target_ids[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _head_pieces(rows: int, segments: list[LoraSegment]) -> list[tuple[slice, dict]]:
    """The runs of `rows` rows that share an adapter (or none), in order, each with its LoRA keyword arguments
    for the fused head ops (none for rows without an adapter)."""
    pieces: list[tuple[slice, dict]] = []
    done = 0
    for segment in [*segments, None]:
        start = rows if segment is None else segment.start
        if start > done:
            pieces.append((slice(done, start), {}))
        if segment is not None:
            factors = dict(lora_a=segment.lora_a, lora_b=segment.lora_b, lora_scale=segment.scale)
            pieces.append((slice(segment.start, segment.end), factors))
            done = segment.end
    return pieces


class LoraLinear(nn.Linear):
    """An `nn.Linear` that also applies the LoRA segments `active_adapters` set on it (none: plain linear)."""

    lora_segments: list[LoraSegment]
    bios_rows_per_item: int | None = None  # set by `_record_rows_per_item` inside decoder layers

    def forward(self, x: Tensor, target_ids: Tensor | None = None, token_weights: Tensor | None = None):
        """Outputs [..., out]; given `target_ids` [T] for x [T, in] (an output head), only the log-prob of
        each row's target instead, [T] fp32, without the whole [T, vocab] logits (`lora_target_logprobs`);
        given `token_weights` [T] too, those log-probs and their cross-entropy (`lora_target_loss`).
        Called as a module either way, so hooks on the head see the call."""
        if token_weights is not None:
            return lora_target_loss(x, self.weight, self.bias, self.lora_segments, target_ids, token_weights)
        if target_ids is not None:
            return lora_target_logprobs(x, self.weight, self.bias, self.lora_segments, target_ids)
        return lora_forward(x, self.weight, self.bias, self.lora_segments, self.bios_rows_per_item)


LoraLinear.bios_lora_base = nn.Linear  # what `bios.worker.targets` sees it as


class LoraConv1D(Conv1D):
    """A GPT-2 `Conv1D` (weight stored [in, out]) that also applies the LoRA segments `active_adapters` set on it."""

    bios_lora_base = Conv1D
    lora_segments: list[LoraSegment]
    bios_rows_per_item: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        return lora_forward(x, self.weight.T, self.bias, self.lora_segments, self.bios_rows_per_item)


LoraHolder = LoraLinear | LoraConv1D | ExpertSlot


def lora_holders(module: nn.Module) -> list[LoraHolder]:
    """Everything inside `module` that carries `lora_segments` (LoRA layers and expert slots), in module order."""
    holders: list[LoraHolder] = []
    for child in module.modules():
        if isinstance(child, (LoraLinear, LoraConv1D)):
            holders.append(child)
        holders.extend(getattr(child, "lora_slots", {}).values())
    return holders


def _record_rows_per_item(model: nn.Module) -> None:
    """Hook every decoder layer holding LoRA layers or experts so they learn how many tokens one batch row has:
    segments are over batch rows, and experts (and layers like OPT's fc1) see the tokens flattened."""
    for layer in model.modules():
        if not isinstance(layer, GradientCheckpointingLayer) or getattr(layer, "_bios_rows_hook", False):
            continue
        holders = [module for module in layer.modules() if isinstance(module, (LoraLinear, LoraConv1D, LoraExperts))]
        if not holders:
            continue

        def record(_layer, args, kwargs, _holders=holders):
            hidden = args[0] if args else kwargs["hidden_states"]
            rows = math.prod(hidden.shape[1:-1])
            for module in _holders:
                if module.bios_rows_per_item != rows:  # (nn.Module's __setattr__ costs ~5 us, 210 a decode step)
                    module.bios_rows_per_item = rows

        layer.register_forward_pre_hook(record, with_kwargs=True)
        layer._bios_rows_hook = True


def attach_lora(model: nn.Module) -> None:
    """Make every potential LoRA target of `model` carry LoRA segments and freeze the base model. Idempotent.

    Linear layers become `LoraLinear`, `Conv1D` layers `LoraConv1D`, routed experts get `ExpertSlot`s
    (`bios.worker.lora_experts`). Modules LoRA cannot adapt are left as they are: an adapter that would train
    one is refused when it is created (`lora_targets`).

    The layer's class is switched in place rather than the layer being wrapped, so parameter names (and
    therefore the base state dict and PEFT key names), tied weights and hooks are all unchanged. The model is
    put in eval mode: a frozen shared base has no use for dropout, and eval keeps forward passes deterministic.
    Llama-family norms, MLPs and attentions get their `bios.kernels` forwards the same way (`fuse_llama_modules`,
    after the dtype below: it lays out projections that share an input end to end). The
    frozen floating-point parameters are stored in the dtype `base_dtype` picks for the model's device (bf16
    where the hardware multiplies it natively, unless `BIOS_BASE_DTYPE` says otherwise) and logged; buffers
    such as RoPE frequencies keep theirs and tied weights stay tied (being one parameter).
    """
    if hasattr(model, _ATTACHED_FLAG):
        return
    wrapped: dict[str, LoraHolder] = {}
    for target in all_targets(model):
        if target.kind == "experts":
            module_name, _, parameter = target.module_name.rpartition(".")
            wrapped[target.module_name] = attach_experts(model, module_name)[parameter]
            continue
        module = model.get_submodule(target.module_name)
        module.__class__ = LoraConv1D if target.kind == "conv1d" else LoraLinear
        module.lora_segments = []
        wrapped[target.module_name] = module
    _record_rows_per_item(model)
    weights = model.get_input_embeddings().weight
    choice = base_dtype(weights.device)
    if choice.dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(choice.dtype)
    fuse_llama_modules(model)
    log.info("%s: frozen base weights in %s (%s); matmuls through %s", model.config.name_or_path or
             type(model).__name__, str(weights.dtype).removeprefix("torch."), choice.reason, gemm_library(weights))
    model.requires_grad_(False)
    model.eval()
    setattr(model, _ATTACHED_FLAG, wrapped)


@contextmanager
def active_adapters(model: nn.Module, segments: list[tuple[int, int, AdapterState]], *,
                    factor_dtype: torch.dtype | None = None) -> Iterator[None]:
    """Within the block, rows [start, end) of every layer input (dim 0) use that adapter; other rows the base.

    Segments must not overlap. Each adapter must have been created for this model (its targets are LoRA
    layers of it). The previous segments are restored on exit, so blocks nest. `factor_dtype` hands the layers
    copies of the factors in that dtype (`AdapterState.lora_pair_in`: cast once per version of the adapter, not
    at every call): for sampling, where no gradient flows back to them.
    """
    wrapped: dict[str, LoraHolder] | None = getattr(model, _ATTACHED_FLAG, None)
    if wrapped is None:
        raise RuntimeError("active_adapters needs attach_lora(model) to have been called on this model first")
    ordered = sorted(segments, key=lambda segment: segment[0])
    for start, end, adapter in ordered:
        if not 0 <= start < end:
            raise ValueError(f"adapter segment of {adapter.model_id} must satisfy 0 <= start < end, got [{start}, {end})")
        unknown = [t.module_name for t in adapter.targets if t.module_name not in wrapped]
        if unknown:
            raise ValueError(
                f"adapter {adapter.model_id} targets layers this model does not have as LoRA layers: {unknown[:3]}"
            )
    for (_, previous_end, previous), (start, _, adapter) in zip(ordered, ordered[1:]):
        if start < previous_end:
            raise ValueError(
                f"adapter segments overlap: {previous.model_id} ends at row {previous_end}, "
                f"{adapter.model_id} starts at row {start}"
            )
    saved = {name: module.lora_segments for name, module in wrapped.items()}
    # object.__setattr__: a plain attribute needs none of nn.Module.__setattr__'s checks (~4 us each, 400+ a pass)
    try:
        for name, module in wrapped.items():
            object.__setattr__(module, "lora_segments", [
                LoraSegment(start, end, *(adapter.lora_pair(name) if factor_dtype is None
                                          else adapter.lora_pair_in(name, factor_dtype)), adapter.scale)
                for start, end, adapter in ordered
                if adapter.has_target(name)
            ])
        yield
    finally:
        for name, module in wrapped.items():
            object.__setattr__(module, "lora_segments", saved[name])
