"""Rows longer than a pass, split by sequence over a group's replicas (`context_parallel`), as the executor runs
them: which rows split, each replica's share of one, and the whole row's output put together from the shares.

A row splits when it is longer than its base model's pass (`tokens_per_pass`), the group has several replicas
(each of one worker, or of a tensor-parallel group: then each shard holder takes its heads' keys and values
from the same shard's holders of the other replicas), the model runs Bios's attention, and the request allows
(`spec.splits_rows`: a loss that sums per-token terms, no images). The planner sizes the longest row it
accepts the same way (`bios.models.long_rows.longest_row`). Every member walks the split rows in the same order,
since each layer of each row takes keys and values from all of them. A long row that does not split runs alone
on one worker (one tensor-parallel replica), checkpointed.
"""

from __future__ import annotations

import dataclasses

import torch

from bios import spec
from bios import types as t

from . import engine
from .attention import use_bios_attention
from .context_parallel import SequenceShare, share_positions, splitting
from .lora import attach_lora
from .memory_plan import checkpointed

Share = tuple[torch.Tensor, float, dict[str, float]]  # a replica's log-probs at its positions, loss, metrics


def splits(model: torch.nn.Module, item: engine.ForwardItem, index: int, tokens_per_pass: int,
           replicas: int) -> bool:
    """Whether datum `index` of `item` runs split over the replicas (see the module docstring)."""
    datum = item.data[index].model_input
    return (replicas > 1 and datum.length > tokens_per_pass and use_bios_attention(model)
            and spec.splits_rows(item.loss_fn, item.custom_loss, datum))


def forward_backward_share(model: torch.nn.Module, item: engine.ForwardItem, index: int,
                           share: SequenceShare) -> Share:
    """This replica's share of datum `index` of `item`: the log-probs at its positions (`share.positions`), its
    part of the loss and of the metrics; gradients into the adapter's pending_grad unless forward-only. The
    pass is checkpointed, with chunked MLPs, as a long row's pass alone on one worker is (forward-only too: the
    planner sized its rows with chunked MLPs, `bios.models.long_rows`)."""
    one = dataclasses.replace(item, data=[item.data[index]])
    [row] = engine.prepare_rows([one], None)
    positions, length = share.positions, row.tokens.numel()
    inputs = {key: value[positions] if value.dim() and value.shape[0] == length else value
              for key, value in row.inputs.items()}
    mine = dataclasses.replace(row, item=0, tokens=row.tokens[positions], targets=row.targets[positions],
                               inputs=inputs)
    backward = not item.forward_only
    attach_lora(model)
    with splitting(share), checkpointed(model):
        logprobs, losses, metrics = engine.run_pass(model, [mine], [one], backward=backward, reader=None,
                                                    packs=False, positions=positions)
    return logprobs[0], losses[0], metrics[0]


def with_split_rows(output: t.ForwardBackwardOutput, split: dict[int, list[Share]],
                    lengths: dict[int, int]) -> t.ForwardBackwardOutput:
    """An item's output over its other rows (`output`) with its split rows put in at their datum indices: each
    row's log-probs from every replica's share (in replica order), its loss and metrics the sums of the shares'
    (a loss that splits is a sum over tokens)."""
    records = list(output.loss_fn_outputs)
    metrics = dict(output.metrics)
    for index in sorted(split):
        shares = split[index]
        logprobs = torch.zeros(lengths[index], dtype=shares[0][0].dtype)
        for rank, (part, loss, part_metrics) in enumerate(shares):
            logprobs[share_positions(lengths[index], len(shares), rank)] = part
            metrics["loss:sum"] = metrics.get("loss:sum", 0.0) + loss
            for key, value in part_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        records.insert(index, {"logprobs": t.TensorData.from_torch(logprobs)})
    return dataclasses.replace(output, loss_fn_outputs=records, metrics=metrics)
