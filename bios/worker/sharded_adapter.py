"""LoRA adapters on a tensor-parallel model (`bios.worker.tensor_parallel` says how layers and factors are split).

An adapter on a sharded model is an ordinary `AdapterState` whose targets carry the local shapes, so the
engine's `forward_backward`, `active_adapters` and `generate` run unchanged. What differs is around them:
`create_sharded_adapter` (same initial weights as a single worker), `reduce_shared_grads` before the commit,
`sharded_grad_norm`/`sharded_optim_step` (global norm for clipping), and `gather_full_adapter` /
`copy_full_into_shard` / `restore_sharded_adapter` for checkpoints.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from bios.messages import CheckpointState
from bios.peft_layout import experts_from_peft, experts_to_peft
from bios.types import AdamParams, DimuonParams, LoraConfig, OptimizerName, OptimStepResponse
from bios.worker.adapter import AdapterState, init_lora_weights, lora_targets, validate_lora_config
from bios.worker.checkpoint import load_into, restore_adapter
from bios.worker.collectives import completed
from bios.worker.engine import optim_step
from bios.worker.targets import peft_keys
from bios.worker.tensor_parallel import ShardInfo, require_sharded

def shared_seed(config: LoraConfig, group: dist.ProcessGroup | None = None) -> int:
    """The adapter's seed, the same on every worker of the group: `config.seed`, or group rank 0's random draw."""
    if config.seed is not None:
        return config.seed
    seed = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
    completed(dist.broadcast(seed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                              async_op=True))
    return int(seed.item())

def create_sharded_adapter(
    model_id: str, model: nn.Module, config: LoraConfig, *, seed: int, device: torch.device | str
) -> AdapterState:
    """This worker's shard of the adapter `AdapterState.create` would build on the whole model with `seed`.

    The config is validated against the full layer shapes, the full initial weights are drawn (same generator,
    same order as a single worker) and only this worker's slices are kept. Every worker of the group must
    pass the same seed (`shared_seed`).
    """
    info = require_sharded(model)
    local = lora_targets(model, config)
    full = [info.full_target(target.module_name) for target in local]
    validate_lora_config(model, config, targets=full)
    state = AdapterState(model_id, config, local, seed, device)
    with torch.no_grad():
        for name, (lora_a, lora_b) in init_lora_weights(full, config.rank, seed).items():
            shard_a, shard_b = _shard_pair(info, name, lora_a, lora_b)
            view_a, view_b = state.lora_pair(name)
            view_a.copy_(shard_a)
            view_b.copy_(shard_b)
    return state

def reduce_shared_grads(adapter: AdapterState, info: ShardInfo, group: dist.ProcessGroup | None = None) -> None:
    """Sum over the group the pending gradients of the whole factors each worker only saw a share of.

    Those are A of column-split layers and B of row-split layers (see the module docstring); they are packed
    into one buffer, so this is one all-reduce per adapter. Call once per cycle before the data-parallel
    all-reduce and the commit (the sum is linear, so after accumulating all micro-batches is enough).
    """
    parts = []
    for target in adapter.targets:
        kind = info.kinds.get(target.module_name)
        if kind in ("column", "row"):  # experts' factors split with their experts: exact locally
            lora_a, lora_b = adapter.lora_pair(target.module_name)
            parts.append((lora_a if kind == "column" else lora_b).grad)
    if not parts or info.world == 1:
        return
    packed = torch.cat([part.reshape(-1) for part in parts])
    completed(dist.all_reduce(packed, group=group, async_op=True))
    offset = 0
    for part in parts:
        part.copy_(packed[offset : offset + part.numel()].view_as(part))
        offset += part.numel()

def sharded_grad_norm(
    adapter: AdapterState, info: ShardInfo, group: dist.ProcessGroup | None = None, grad: Tensor | None = None
) -> float:
    """L2 norm of the whole adapter's gradient (`adapter.grad` unless given), the same on every worker.

    Split factors contribute their slices from every worker (summed over the group); whole factors, identical
    everywhere once `reduce_shared_grads` ran, count once.
    """
    grad = adapter.grad if grad is None else grad
    split_sq = torch.zeros((), dtype=torch.float64, device=grad.device)
    whole_sq = torch.zeros((), dtype=torch.float64, device=grad.device)
    for span, whole in _factor_spans(adapter, info):
        squares = grad[span].double().square().sum()
        if whole:
            whole_sq += squares
        else:
            split_sq += squares
    if info.world > 1:
        completed(dist.all_reduce(split_sq, group=group, async_op=True))
    return math.sqrt(float(split_sq + whole_sq))

@torch.no_grad()
def commit_sharded_gradients(adapter: AdapterState, info: ShardInfo, group: dist.ProcessGroup | None = None) -> float:
    """`engine.commit_gradients` for a shard: add this cycle's gradient, return the whole gradient's norm."""
    adapter.grad.add_(adapter.pending_grad)
    adapter.pending_grad.zero_()
    return sharded_grad_norm(adapter, info, group)

def sharded_optim_step(
    adapter: AdapterState,
    params: AdamParams | DimuonParams,
    info: ShardInfo,
    group: dist.ProcessGroup | None = None,
    *,
    grad_norm: float | None = None,
) -> OptimStepResponse:
    """`engine.optim_step` for a shard: clip by the whole adapter's gradient norm, then AdamW on the shard.

    AdamW is elementwise, so each worker updating its slices (and every worker updating the whole factors
    identically) is the single-worker update; only the clipping norm needs the group, and it is taken before
    anything changes, so a failed collective leaves the adapter as it was (the step can run again).
    `grad_norm`, when the caller already has that norm (taken when the gradient was committed), skips it.
    Dimuon also sums the Gram matrices of the factors split over the group (see `bios.kernels.dimuon`).
    """
    norm = sharded_grad_norm(adapter, info, group) if grad_norm is None else grad_norm
    if isinstance(params, DimuonParams):
        split = [not whole for _, whole in _factor_spans(adapter, info)]
        return optim_step(adapter, params, grad_norm=norm, split=split,
                          reduce=(lambda tensor: completed(dist.all_reduce(tensor, group=group, async_op=True)))
                          if info.world > 1 else None)
    return optim_step(adapter, params, grad_norm=norm)

def gather_full_adapter(
    adapter: AdapterState, info: ShardInfo, group: dist.ProcessGroup | None = None
) -> AdapterState:
    """The whole adapter (params, Adam moments, step) a single worker would hold, on every worker of the group.

    One all-gather of the stacked flat buffers. The result is an ordinary `AdapterState` on the full targets,
    so `export_state`, `state_dict` and the checkpoint code work on it unchanged.
    """
    stacked = torch.stack(shard_buffers(adapter, with_grad=False))
    parts = [torch.empty_like(stacked) for _ in range(info.world)]
    if info.world > 1:
        completed(dist.all_gather(parts, stacked, group=group, async_op=True))
    else:
        parts = [stacked]
    return assemble_full_adapter(adapter, info, parts)


def shard_buffers(adapter: AdapterState, *, with_grad: bool) -> list[Tensor]:
    """A shard's flat buffers as `assemble_full_adapter` takes them: params, (committed gradient,) moments."""
    if not adapter.trainable:
        return [adapter.params]
    return [adapter.params, *([adapter.grad] if with_grad else []), adapter.exp_avg, adapter.exp_avg_sq]


@torch.no_grad()
def assemble_full_adapter(adapter: AdapterState, info: ShardInfo, parts: Sequence[Tensor], *,
                          with_grad: bool = False) -> AdapterState:
    """The whole adapter from every shard's stacked `shard_buffers(..., with_grad=with_grad)` (`parts`, in shard
    order), `adapter` being one of the shards (for the layout, step and scale)."""
    full_targets = [info.full_target(target.module_name) for target in adapter.targets]
    full = AdapterState(
        adapter.model_id, adapter.config, full_targets, adapter.seed, adapter.params.device, trainable=adapter.trainable
    )
    for index, full_buffer in enumerate(shard_buffers(full, with_grad=with_grad)):
        shard_views = [_pairs_in(part[index], adapter) for part in parts]
        for name, (full_a, full_b) in _pairs_in(full_buffer, full).items():
            lora_a, lora_b = _gather_pairs(info, name, [views[name] for views in shard_views])
            full_a.copy_(lora_a)
            full_b.copy_(lora_b)
    full.scale = adapter.scale
    full.step = adapter.step
    full.optimizer = adapter.optimizer
    return full

@torch.no_grad()
def copy_full_into_shard(full: AdapterState, shard: AdapterState, info: ShardInfo) -> None:
    """Load a whole adapter (e.g. restored from a checkpoint) into this worker's shard: params, committed
    gradient, moments, step, scale."""
    names = [target.module_name for target in shard.targets]
    if [target.module_name for target in full.targets] != names:
        raise ValueError(f"adapter {full.model_id} trains other layers than the shard {shard.model_id}")
    pairs = [(full.params, shard.params)]
    if shard.trainable:
        pairs += [(full.grad, shard.grad), (full.exp_avg, shard.exp_avg), (full.exp_avg_sq, shard.exp_avg_sq)]
    for full_buffer, shard_buffer in pairs:
        full_views = _pairs_in(full_buffer, full)
        for name, (shard_a, shard_b) in _pairs_in(shard_buffer, shard).items():
            lora_a, lora_b = _shard_pair(info, name, *full_views[name])
            shard_a.copy_(lora_a)
            shard_b.copy_(lora_b)
    shard.step = full.step
    shard.scale = full.scale

def full_parameter_count(adapter: AdapterState, info: ShardInfo) -> int:
    """Parameters of the whole adapter a shard belongs to (what a single worker would report)."""
    rank = adapter.config.rank
    return sum(rank * (full.in_features + full.out_features) * max(1, full.num_experts)
               for full in map(info.full_target, (target.module_name for target in adapter.targets)))

def shard_checkpoint(state: CheckpointState, info: ShardInfo) -> CheckpointState:
    """A checkpoint's adapter tensors cut to this worker's slices (no optimizer state): for sampler weights."""
    full = {key: torch.from_numpy(np.asarray(value)) for key, value in state.adapter.items()}
    tensors = {key: value.numpy() for key, value in shard_adapter_state(full, info).items()}
    return CheckpointState(adapter=tensors, optimizer=None, metadata=state.metadata)

def restore_sharded_adapter(
    model_id: str, model: nn.Module, state: CheckpointState, *, with_optimizer: bool, device: torch.device | str,
    optimizer: OptimizerName = "adamw",
) -> AdapterState:
    """`checkpoint.restore_adapter` for a sharded model: this worker's slice of a whole-adapter checkpoint,
    with its slice of the optimizer state when `with_optimizer`."""
    info = require_sharded(model)
    shard = restore_adapter(model_id, model, shard_checkpoint(state, info), with_optimizer=False, device=device,
                            optimizer=optimizer)
    if with_optimizer:
        full = AdapterState(model_id, shard.config, [info.full_target(t.module_name) for t in shard.targets],
                            shard.seed, device)
        full.optimizer = optimizer
        load_into(full, state, with_optimizer=True)
        copy_full_into_shard(full, shard, info)
    return shard

def shard_adapter_state(full_state: dict[str, Tensor], info: ShardInfo) -> dict[str, Tensor]:
    """A PEFT-named adapter state dict (whole matrices) cut down to this worker's slices, same keys."""
    result = {}
    for name, (key_a, key_b) in _peft_pairs(full_state, info).items():
        result[key_a], result[key_b] = (
            t.clone() for t in _shard_pair(info, name, full_state[key_a], full_state[key_b])
        )
    return result

def gather_adapter_state(shard_states: Sequence[dict[str, Tensor]], info: ShardInfo) -> dict[str, Tensor]:
    """The whole PEFT-named adapter state dict from every worker's `state_dict()`, listed in group-rank order."""
    if len(shard_states) != info.world:
        raise ValueError(f"need one state dict per worker of the group ({info.world}), got {len(shard_states)}")
    result = {}
    for name, (key_a, key_b) in _peft_pairs(shard_states[0], info).items():
        pairs = [(state[key_a], state[key_b]) for state in shard_states]
        result[key_a], result[key_b] = _gather_pairs(info, name, pairs)
    return result

# ---------------------------------------------------------------------------------------------- layout

def _shard_pair(info: ShardInfo, name: str, lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    kind = info.kinds.get(name)
    if kind == "column":
        return lora_a, lora_b.chunk(info.world, dim=0)[info.rank]
    if kind == "row":
        return lora_a.chunk(info.world, dim=1)[info.rank], lora_b
    if kind == "experts":
        per_a, per_b = _per_expert(lora_a, lora_b, info.full_target(name).num_experts)
        return _as_given(per_a.chunk(info.world)[info.rank], per_b.chunk(info.world)[info.rank], like=lora_a)
    return lora_a, lora_b

def _gather_pairs(info: ShardInfo, name: str, pairs: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    kind = info.kinds.get(name)
    if kind == "column":
        return pairs[0][0].clone(), torch.cat([lora_b for _, lora_b in pairs], dim=0)
    if kind == "row":
        return torch.cat([lora_a for lora_a, _ in pairs], dim=1), pairs[0][1].clone()
    if kind == "experts":
        local = info.full_target(name).num_experts // info.world
        experts = [_per_expert(lora_a, lora_b, local) for lora_a, lora_b in pairs]
        lora_a = torch.cat([lora_a for lora_a, _ in experts])
        return _as_given(lora_a, torch.cat([lora_b for _, lora_b in experts]), like=pairs[0][0])
    return pairs[0][0].clone(), pairs[0][1].clone()

def _per_expert(lora_a: Tensor, lora_b: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """Experts' factors as A [E, r, in], B [E, out, r], whether given so or in PEFT's stacked 2D layout."""
    return (lora_a, lora_b) if lora_a.ndim == 3 else experts_from_peft(lora_a, lora_b, experts)

def _as_given(lora_a: Tensor, lora_b: Tensor, *, like: Tensor) -> tuple[Tensor, Tensor]:
    """Per-expert factors back in the layout `like` came in (3D, or PEFT's stacked 2D)."""
    return (lora_a, lora_b) if like.ndim == 3 else experts_to_peft(lora_a, lora_b)

def _pairs_in(flat: Tensor, adapter: AdapterState) -> dict[str, tuple[Tensor, Tensor]]:
    """Views of `flat` (a buffer laid out like `adapter.params`) shaped as each target's (A, B)."""
    return adapter.pairs_in(flat)

def _factor_spans(adapter: AdapterState, info: ShardInfo) -> list[tuple[slice, bool]]:
    """(slice of the flat buffers, whole on every worker?) for every LoRA factor, in buffer order."""
    base = adapter.params.storage_offset()
    spans = []
    for target in adapter.targets:
        for factor, whole in zip(adapter.lora_pair(target.module_name), info.whole_factors(target.module_name)):
            start = factor.storage_offset() - base
            spans.append((slice(start, start + factor.numel()), whole))
    return spans

def _peft_pairs(state: dict[str, Tensor], info: ShardInfo) -> dict[str, tuple[str, str]]:
    """Target name -> (A key, B key) of a PEFT-named adapter state dict (experts' keys name their module, not
    their parameter: `bios.peft_layout`)."""
    pairs = {name: keys for name, keys in peft_keys(list(info.full_targets.values())).items() if keys[0] in state}
    for key_a, key_b in pairs.values():
        if key_b not in state:
            raise ValueError(f"adapter state has {key_a} but no {key_b}")
    if len(pairs) * 2 != len(state):
        unknown = sorted(set(state) - {key for keys in pairs.values() for key in keys})
        raise ValueError(f"adapter state has keys that are not LoRA factors of this model: {unknown[:3]}")
    return pairs
