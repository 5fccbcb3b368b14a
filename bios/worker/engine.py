"""The worker's training ops as plain functions: forward/backward over many adapters, commit, optimizer step.

A cycle calls `forward_backward` with every forward/forward_backward request of one base model; rows of all
adapters run together (grouped per adapter so each LoRA layer loops over a few row ranges), split into
micro-batches by a padded-token budget. Gradients land in each adapter's `pending_grad`; the daemon then
all-reduces them if needed and calls `commit_gradients` (or `discard_gradients` when the cycle aborts), and
`optim_step` applies AdamW to the committed gradient.

`check_item` is the worker's one wall for a forward item: the executor runs it on each request before batching
it with other tenants' (a bad one fails alone), and `forward_backward` runs it itself unless told its items
passed it. Past the wall nothing checks the request again: `prepare_rows` only converts, the losses only compute.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bios import spec
from bios.exceptions import BadRequestError
from bios.kernels.adamw import adamw_step
from bios.kernels.dimuon import DimuonFactor, dimuon_step
from bios.types import (AdamParams, BaseModelInfo, CustomLoss, Datum, DimuonParams, ForwardBackwardOutput,
                        OptimStepResponse, TensorData)
from bios.worker.adapter import AdapterState
from bios.worker.attention import use_bios_attention
from bios.worker.compute_mode import packing_enabled
from bios.worker.custom_loss import CompiledLoss, check_custom_inputs
from bios.worker.factor_copies import FactorCopy, factor_copies
from bios.worker.losses import compute_loss, fixed_token_weights
from bios.worker.lora import LoraLinear, active_adapters, attach_lora
from bios.worker.memory_plan import checkpointed
from bios.worker.packing import attention_pair_cost, pack_rows, packed_layout, packed_sequences
from bios.worker.vision import ImageReader, RowImages
from bios.worker.vision_lora import tower_adapters

# Per-token inputs that say how much a position counts; image positions count for nothing.
_POSITION_WEIGHTS = ("weights", "advantages", "sequence_ratio_mask")


@dataclass
class ForwardItem:
    """One request's share of a cycle: its adapter, its data, its loss, and whether to skip the backward."""

    adapter: AdapterState
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None
    forward_only: bool = False
    custom_loss: CompiledLoss | None = None  # for loss_fn "custom": the session's checked graph

    def loss(self, logprobs: Tensor, inputs: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One datum's summed loss under this item's loss, and its metrics (a custom loss's `custom/...`)."""
        if self.custom_loss is not None:
            return self.custom_loss(logprobs, inputs)
        return compute_loss(self.loss_fn, logprobs, inputs, self.loss_fn_config), {}

    def fixed_token_weights(self, inputs: dict[str, Tensor]) -> Tensor | None:
        """The loss's `-d loss / d logp` when it does not depend on the log-probs (`losses.fixed_token_weights`)."""
        return None if self.custom_loss is not None else fixed_token_weights(self.loss_fn, inputs)


@dataclass
class _Row:
    """One datum ready to run: where its result goes, its tokens, targets and loss inputs as tensors."""

    item: int
    index: int
    adapter: AdapterState
    tokens: Tensor
    targets: Tensor
    inputs: dict[str, Tensor]
    images: RowImages | None = None
    text_mask: Tensor | None = None  # [T] bool, False at image positions (None: all text)


def target_logprobs(hidden: Tensor, lm_head: LoraLinear, targets: Tensor) -> Tensor:
    """log p(targets[t]) from final hidden states [T, H] through the output head, in fp32, shape [T].

    The head is called as a module so a LoRA on it (active for the same rows) applies and hooks see it; it
    returns only the targets' log-probs, chunked over tokens with kernels on, so no loss ever holds the
    whole [T, V] logits (`lora_target_logprobs`).
    """
    return lm_head(hidden, target_ids=targets)


def check_item(data: list[Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None,
               custom_loss: CustomLoss | None, limits: spec.ModelLimits | None) -> None:
    """The worker's wall for one forward / forward_backward item: the request spec's rules (`spec.check_forward`)
    against `limits` (`model_limits`), and what only a custom loss's graph declares: its inputs of rank 0 and 2.
    BadRequestError naming the field."""
    spec.check_forward(data, loss_fn, loss_fn_config, limits, custom_loss)
    if custom_loss is not None:
        for index, datum in enumerate(data):
            check_custom_inputs(custom_loss, datum.loss_fn_inputs, datum.model_input.length, f"data[{index}]")


def model_limits(model: nn.Module, info: BaseModelInfo | None = None, reader: ImageReader | None = None
                 ) -> spec.Limits:
    """What `check_item` checks against: the base model's limits (`info`), with the vocabulary its input
    embeddings and output head hold, so every id that passes the wall indexes both. Without `info` (a direct
    caller of `forward_backward`) the context is unbounded and images are the `reader`'s."""
    vocab = min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().out_features)
    if info is not None:
        return spec.Limits(info.name, min(vocab, info.vocab_size), info.max_context_length, info.vision)
    name = getattr(model.config, "name_or_path", "") or "this model"
    return spec.Limits(name, vocab, sys.maxsize, None if reader is None else reader.vision)


def prepare_rows(items: list[ForwardItem], reader: ImageReader | None) -> list[_Row]:
    """Every datum as tensors, its images expanded, before any compute; image positions get weight 0
    (`_POSITION_WEIGHTS`). The items passed `check_item`, so nothing here checks them again."""
    rows = []
    for item_index, item in enumerate(items):
        for datum_index, datum in enumerate(item.data):
            expanded = None
            if reader is not None and datum.model_input.has_images:
                where = f"item {item_index} ({item.adapter.model_id}), datum {datum_index}: model_input"
                expanded = reader.expand(datum.model_input, where)
                tokens = expanded.tokens
            else:
                tokens = torch.tensor(datum.model_input.to_ints(), dtype=torch.int64)
            inputs = {key: value.to_torch() for key, value in datum.loss_fn_inputs.items()}
            text_mask = None
            if expanded is not None:
                text_mask = ~expanded.image_mask
                inputs.update({key: inputs[key] * text_mask for key in _POSITION_WEIGHTS if key in inputs})
            rows.append(_Row(item_index, datum_index, item.adapter, tokens, inputs["target_tokens"].to(torch.int64),
                             inputs, None if expanded is None else expanded.images, text_mask))
    return rows


def _group_rows(rows: list[_Row]) -> list[_Row]:
    """Rows of one adapter together (in order of first appearance), longest first within an adapter."""
    first_seen: dict[int, int] = {}
    for row in rows:
        first_seen.setdefault(id(row.adapter), len(first_seen))
    return sorted(rows, key=lambda row: (first_seen[id(row.adapter)], -row.tokens.numel()))


def _micro_batches(rows: list[_Row], max_tokens_per_pass: int,
                   positions: Callable[[list[_Row]], int]) -> list[list[_Row]]:
    """Consecutive runs of rows, each as long as found whose pass (`positions`: the batch positions it runs,
    padded or packed) fits the budget; a row longer than the budget runs alone.

    Packing never takes more positions than padding, so a run first grows by the cheap padded count, then by
    `positions`: a packed layout is computed a few times per pass."""
    batches: list[list[_Row]] = []
    start = 0
    while start < len(rows):
        fits = _longest_run(rows, start, start + 1, max_tokens_per_pass, _padded_positions)
        if positions is not _padded_positions:
            fits = _longest_run(rows, start, fits, max_tokens_per_pass, positions)
        batches.append(rows[start:fits])
        start = fits
    return batches


def _longest_run(rows: list[_Row], start: int, fits: int, budget: int,
                 positions: Callable[[list[_Row]], int]) -> int:
    """An end past `fits` (where `rows[start:fits]` is known to run) such that `rows[start:end]` fits the budget
    and one more row does not, searched by doubling then halving (exact where `positions` grows with rows)."""
    step, too_many = 1, None
    while fits < len(rows):
        trial = min(fits + step, len(rows))
        if positions(rows[start:trial]) > budget:
            too_many = trial
            break
        fits, step = trial, step * 2
    while too_many is not None and too_many - fits > 1:
        middle = (fits + too_many) // 2
        if positions(rows[start:middle]) <= budget:
            fits = middle
        else:
            too_many = middle
    return fits


def _padded_positions(rows: list[_Row]) -> int:
    return len(rows) * max(row.tokens.numel() for row in rows)


def _packed_positions(pair_cost: float) -> Callable[[list[_Row]], int]:
    def positions(rows: list[_Row]) -> int:
        bins, length = packed_layout([row.tokens.numel() for row in rows], [id(row.adapter) for row in rows],
                                     pair_cost)
        return len(bins) * length

    return positions


def _packs(model: nn.Module, reader: ImageReader | None) -> bool:
    """Whether training passes pack rows: asked for (`BIOS_PACKING`), no images, and Bios's attention runs."""
    return (packing_enabled() and reader is None and getattr(model.config, "vision_config", None) is None
            and use_bios_attention(model))


def _segments(sizes: list[int], adapters: list[AdapterState | FactorCopy]
              ) -> list[tuple[int, int, AdapterState | FactorCopy]]:
    """[start, end) ranges of consecutive entries that share an adapter, over entries of the given sizes."""
    segments: list[tuple[int, int, AdapterState | FactorCopy]] = []
    start = 0
    for size, adapter in zip(sizes, adapters):
        if segments and segments[-1][2] is adapter:
            segments[-1] = (segments[-1][0], start + size, adapter)
        else:
            segments.append((start, start + size, adapter))
        start += size
    return segments


def run_pass(
    model: nn.Module, rows: list[_Row], items: list[ForwardItem], *, backward: bool, reader: ImageReader | None,
    packs: bool, positions: Tensor | None = None,
) -> tuple[list[Tensor], list[float], list[dict[str, float]]]:
    """One forward pass over `rows` (and one backward of their summed loss if `backward`).

    Rows are packed end to end (`packing`) when `packs`, else right-padded: either way a token sees
    only its own row, so outputs do not depend on what else shares the batch. Only real positions go through
    the head. `positions`: one row's tokens' positions in a longer row (a share of a split row).
    """
    embeddings = model.get_input_embeddings().weight
    device = embeddings.device
    lengths = [row.tokens.numel() for row in rows]
    copies = factor_copies([row.adapter for row in rows], embeddings.dtype) if backward else {}
    adapters = [copies.get(id(row.adapter), row.adapter) for row in rows]  # what each row's LoRA layers take
    targets = torch.cat([row.targets for row in rows]).to(device)
    with torch.set_grad_enabled(backward):
        hidden = (_packed_hidden(model, rows, adapters, device) if packs
                  else _padded_hidden(model, rows, adapters, reader, device, positions))
        token_weights = [items[row.item].fixed_token_weights(row.inputs) for row in rows]
        head_loss = backward and all(weights is not None for weights in token_weights)
        with active_adapters(model, _segments(lengths, adapters)):
            if head_loss:  # every row's loss is a fixed weighting of its log-probs: the head does it all at once
                weights = torch.cat(token_weights).to(device)
                logprobs, total = model.get_output_embeddings()(hidden, target_ids=targets, token_weights=weights)
            else:
                logprobs = target_logprobs(hidden, model.get_output_embeddings(), targets)
        per_row = list(torch.split(logprobs, lengths))
        losses, metrics = zip(*(items[row.item].loss(row_logprobs, row.inputs)
                                for row, row_logprobs in zip(rows, per_row)))
        stacked = torch.stack(losses)
        if backward:
            (total if head_loss else stacked.sum()).backward()
            for copy in copies.values():
                copy.add_grad()
    outputs = [lp.detach() if row.text_mask is None else lp.detach().masked_fill(~row.text_mask.to(lp.device), 0.0)
               for row, lp in zip(rows, per_row)]
    row_metrics = [{key: float(value.detach()) if isinstance(value, Tensor) else float(value)
                    for key, value in datum_metrics.items()} for datum_metrics in metrics]
    return outputs, stacked.detach().tolist(), row_metrics


def _packed_hidden(model: nn.Module, rows: list[_Row], adapters: list[AdapterState | FactorCopy],
                   device: torch.device) -> Tensor:
    """Final hidden states `[sum of row lengths, H]` of `rows` packed end to end, rows of one adapter together;
    `adapters`: each row's LoRA factors."""
    packed = pack_rows([row.tokens for row in rows], [id(adapter) for adapter in adapters],
                       attention_pair_cost(model.config))
    with active_adapters(model, _segments([1] * len(packed.owners), [adapters[i] for i in packed.owners])), \
            packed_sequences(packed):
        return packed.gather(model.base_model(input_ids=packed.input_ids.to(device),
                                              position_ids=packed.position_ids.to(device),
                                              use_cache=False).last_hidden_state)


def _padded_hidden(model: nn.Module, rows: list[_Row], adapters: list[AdapterState | FactorCopy],
                   reader: ImageReader | None, device: torch.device, positions: Tensor | None = None) -> Tensor:
    """Final hidden states `[sum of row lengths, H]` of `rows` right-padded to the longest: with a causal model
    real tokens never see the pads. The way for models that take images or cannot read packed positions."""
    lengths = [row.tokens.numel() for row in rows]
    input_ids = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : lengths[i]] = row.tokens
        attention_mask[i, : lengths[i]] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    extra = {} if reader is None else reader.model_kwargs(model, input_ids, attention_mask,
                                                          [row.images for row in rows])[0]
    extra |= {} if positions is None else {"position_ids": positions[None].to(device)}
    with active_adapters(model, _segments([1] * len(rows), adapters)), \
            tower_adapters(model, [row.images for row in rows], [row.adapter for row in rows]):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                  **extra).last_hidden_state
    return hidden[attention_mask.bool()]


def forward_backward(
    model: nn.Module, items: list[ForwardItem], *, max_tokens_per_pass: int = 16384,
    images: ImageReader | None = None, checked: bool = False,
) -> list[ForwardBackwardOutput]:
    """Log-probs and summed loss of every datum of every item; gradients into `pending_grad` unless forward_only.

    A vision-language model takes image chunks through `images`; the log-prob reported at an image position
    is 0 and such positions count for nothing in any loss.

    Rows needing gradients and forward-only rows run in separate passes, so forward-only items build no graph.
    `checked`: every item already passed `check_item` (the executor's wall). Otherwise each is checked here
    against the model's own limits (`model_limits`), and a bad one raises ValueError naming it before anything
    is computed.
    """
    if not checked:
        limits = model_limits(model, reader=images)
        for index, item in enumerate(items):
            try:
                check_item(item.data, item.loss_fn, item.loss_fn_config,
                           None if item.custom_loss is None else item.custom_loss.graph, limits)
            except BadRequestError as error:
                raise ValueError(f"item {index} ({item.adapter.model_id}): {error.message}") from None
    attach_lora(model)
    rows = prepare_rows(items, images)
    for item in items:
        if not item.forward_only and not item.adapter.grad_views_intact():
            raise RuntimeError(
                f"adapter {item.adapter.model_id}: a LoRA .grad no longer aliases pending_grad; gradients would be lost"
            )
    logprobs: list[list[Tensor | None]] = [[None] * len(item.data) for item in items]
    sums: list[dict[str, float]] = [{"loss:sum": 0.0} for _ in items]
    packs = _packs(model, images)
    positions = _packed_positions(attention_pair_cost(model.config)) if packs else _padded_positions
    for backward in (True, False):
        selected = [row for row in rows if items[row.item].forward_only != backward]
        for batch in _micro_batches(_group_rows(selected), max_tokens_per_pass, positions):
            alone = batch[0].tokens.numel() > max_tokens_per_pass  # a row longer than the plan's pass (MLPs chunked)
            with checkpointed(model) if alone else contextlib.nullcontext():
                batch_logprobs, batch_losses, batch_metrics = run_pass(model, batch, items, backward=backward,
                                                                        reader=images, packs=packs)
            for row, row_logprobs, loss, row_metrics in zip(batch, batch_logprobs, batch_losses, batch_metrics):
                logprobs[row.item][row.index] = row_logprobs
                for key, value in {"loss:sum": loss, **row_metrics}.items():
                    sums[row.item][key] = sums[row.item].get(key, 0.0) + value
    return [
        ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord",
            loss_fn_outputs=[{"logprobs": TensorData.from_torch(lp)} for lp in item_logprobs],
            # per-datum metrics: `:sum` ones summed, `:mean` ones averaged over the item's data
            metrics={key: value / len(item.data) if key.endswith(":mean") else value for key, value in sums_.items()},
        )
        for item, item_logprobs, sums_ in zip(items, logprobs, sums)
    ]


@torch.no_grad()
def commit_gradients(adapter: AdapterState) -> float:
    """Add this cycle's gradient into the step's gradient; return the L2 norm of the accumulated gradient."""
    adapter.grad.add_(adapter.pending_grad)
    adapter.pending_grad.zero_()
    return float(torch.linalg.vector_norm(adapter.grad))


@torch.no_grad()
def discard_gradients(adapter: AdapterState) -> None:
    """Drop this cycle's gradient contributions (an aborted cycle); the committed gradient is untouched."""
    adapter.pending_grad.zero_()


def optim_step(
    adapter: AdapterState, params: AdamParams | DimuonParams, *, grad_norm: float | None = None,
    split: list[bool] | None = None, reduce: Callable[[Tensor], None] | None = None,
) -> OptimStepResponse:
    """One step of the run's optimizer (AdamW, or Dimuon for `DimuonParams`) on the committed gradient, which
    is then cleared for the next step. When this adapter holds only a tensor-parallel shard: `grad_norm` is the
    whole gradient's norm, and for Dimuon `split` says which factors (in buffer order) are slices and `reduce`
    sums over the group."""
    adapter.step += 1
    if isinstance(params, DimuonParams):
        views = [adapter.pairs_in(buffer).values() for buffer in (adapter.params, adapter.grad, adapter.exp_avg)]
        flat = [[factor for pair in pairs for factor in pair] for pairs in views]
        split = split if split is not None else [False] * len(flat[0])
        factors = [DimuonFactor(param, grad, momentum, rank_rows=index % 2 == 0, split=sliced)
                   for index, (param, grad, momentum, sliced) in enumerate(zip(*flat, split, strict=True))]
        grad_norm = dimuon_step(factors, adapter.grad, rank=adapter.config.rank, lr=params.learning_rate,
                                beta1=params.beta1, damping=params.damping,
                                rank_lr_correction_exponent=params.rank_lr_correction_exponent,
                                grad_clip_norm=params.grad_clip_norm, grad_norm=grad_norm, reduce=reduce)
    else:
        grad_norm = adamw_step(
            adapter.params,
            adapter.grad,
            adapter.exp_avg,
            adapter.exp_avg_sq,
            step=adapter.step,
            lr=params.learning_rate,
            beta1=params.beta1,
            beta2=params.beta2,
            eps=params.eps,
            weight_decay=params.weight_decay,
            grad_clip_norm=params.grad_clip_norm,
            grad_norm=grad_norm,
        )
    adapter.grad.zero_()
    return OptimStepResponse(
        metrics={"learning_rate:mean": params.learning_rate, "grad_norm:mean": grad_norm, "step:max": adapter.step}
    )
