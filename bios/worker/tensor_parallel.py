"""Megatron-style tensor parallelism for Llama-family models, by hand over torch.distributed (gloo or NCCL).

Layout. In every decoder layer q/k/v/gate/up are split column-wise (by output rows; for attention by whole
heads, so a worker keeps query heads [r·nh/tp, (r+1)·nh/tp) and exactly the key/value heads they read: GQA
groups stay intact) and o/down row-wise (by input columns). Each block half (attention, MLP) starts with
`copy_to_group` (identity forward, all-reduce of the input gradient in backward) and ends with
`reduce_from_group` (all-reduce of the partial outputs forward, identity backward): one all-reduce per block
half each way. Embeddings, the output head and the norms are replicated: the simplest layout, at the cost of
one whole head and embedding per worker (a vocabulary-parallel head would need a distributed log-softmax).
Every worker of a group therefore computes the same hidden states, logits and losses; Hugging Face's attention
infers the head count from the projection size and keeps the GQA ratio, so the model code runs unchanged.

LoRA follows its base layer, so gathering the shards gives exactly the single-worker adapter:
- column-split layer: A [r, in] whole on every worker, B [out/tp, r] split with the output rows;
- row-split layer: A [r, in/tp] split with the input columns, B [out, r] whole;
- output head: A and B whole.
A whole factor's gradient on one worker is only its own shard's share of the true gradient: A of a column
layer (each worker backpropagates through its own output rows only) and B of a row layer (each worker saw its
own input columns only). `reduce_shared_grads` sums exactly those over the group. The split factors'
gradients are exact locally, and so are the head adapter's (every worker runs the whole head identically).

Why not `torch.distributed.tensor`: `parallelize_module(ColwiseParallel/RowwiseParallel)` does shard plain
`nn.Linear`s on gloo, but `LoraLinear` adds `(x Aᵀ) Bᵀ` with A/B plain tensors (views into the adapter's flat
fp32 buffer), and DTensor refuses mixed operands ("aten.mm.default got mixed torch.Tensor and DTensor").
Making A/B DTensors would make their `.grad` DTensors too, breaking the flat `pending_grad` aliasing that the
optimizer, all-reduce and checkpoints rely on. Plain slicing plus two autograd Functions is ~30 lines.

An adapter on a sharded model is an ordinary `AdapterState` whose targets carry the local shapes, so the
engine's `forward_backward`, `active_adapters` and `generate` run unchanged. What differs is around them:
`create_sharded_adapter` (same initial weights as a single worker), `reduce_shared_grads` before the commit,
`sharded_grad_norm`/`sharded_optim_step` (global norm for clipping), and `gather_full_adapter` /
`copy_full_into_shard` for checkpoints. `load_sharded_model` reads only a worker's slices from safetensors,
so a model too big for one worker never has to fit in one.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from bios.messages import CheckpointState
from bios.types import AdamParams, DimuonParams, LoraConfig, OptimizerName, OptimStepResponse
from bios.worker.adapter import AdapterState, LoraTarget, init_lora_weights, lora_targets, validate_lora_config
from bios.worker.checkpoint import load_into, restore_adapter
from bios.worker.engine import optim_step
from bios.worker.lora import LoraLinear, attach_lora
from bios.models.memory_plan import ModelShape

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ShardKind = Literal["column", "row"]

COLUMN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PROJECTIONS = ("o_proj", "down_proj")
_SHARD_FLAG = "_bios_tensor_parallel"
_GROUP_FLAG = "_bios_tensor_parallel_group"
_PEFT_PREFIX = "base_model.model."
_PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class ShardInfo:
    """Where a worker sits in its tensor-parallel group and how each LoRA-able linear of the model is split.

    `full_shapes` holds every LoRA-able linear's unsplit (in, out); `kinds` says how each split layer is cut
    (absent: replicated, i.e. the output head). Plain data: the process group is passed separately.
    """

    rank: int
    world: int
    full_shapes: dict[str, tuple[int, int]]
    kinds: dict[str, ShardKind]

    def full_target(self, module_name: str) -> LoraTarget:
        fan_in, fan_out = self.full_shapes[module_name]
        return LoraTarget(module_name, fan_in, fan_out)

    def whole_factors(self, module_name: str) -> tuple[bool, bool]:
        """(A whole, B whole): whether every worker holds all of that factor (else it holds a 1/world slice)."""
        kind = self.kinds.get(module_name)
        return kind != "row", kind != "column"


# ---------------------------------------------------------------------------------------------- collectives


class TensorParallelError(RuntimeError):
    """An all-reduce inside a sharded model failed (a peer of the group died or timed out): not the input's
    fault, so the cycle is aborted and re-run, not reported as a failed request."""


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as exc:
        raise TensorParallelError(f"tensor-parallel all-reduce failed: {exc}") from exc


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the input gradient, of which each worker computed its shard's share."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        _all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward sums the workers' partial outputs of a row-split layer; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        out = x.contiguous().clone()
        _all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_group(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    return _ReduceFromGroup.apply(x, group)


# ---------------------------------------------------------------------------------------------- the model


def shard_model(model: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> ShardInfo:
    """Keep only this worker's slice of every decoder layer's projections and insert the group's all-reduces.

    In place, on a model `attach_lora` was applied to; `group` is the tensor-parallel group (None: the default
    group). The replaced full weights are released. Raises ValueError when the model cannot be split `world`
    ways, or when it was already sharded differently.
    """
    existing: ShardInfo | None = getattr(model, _SHARD_FLAG, None)
    if existing is not None:
        if (existing.rank, existing.world) != (rank, world):
            raise ValueError(
                f"model is already split as rank {existing.rank} of {existing.world}; "
                f"cannot re-split it as {rank} of {world}"
            )
        return existing
    if not 0 <= rank < world:
        raise ValueError(f"tensor-parallel rank must be in [0, {world}), got {rank}")
    lora_layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}
    if not lora_layers:
        raise ValueError("shard_model needs attach_lora(model) first: the model has no LoRA layers")
    if problem := ModelShape.from_config(model.config).tensor_parallel_problem(world):
        raise ValueError(f"cannot split {type(model).__name__} over {world} workers: {problem}")
    head = model.get_output_embeddings()
    full_shapes = {name: (module.in_features, module.out_features) for name, module in lora_layers.items()}
    kinds: dict[str, ShardKind] = {}
    for name, module in lora_layers.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_PROJECTIONS:
            _keep_output_rows(module, rank, world)
            kinds[name] = "column"
        elif leaf in ROW_PROJECTIONS:
            _keep_input_columns(module, rank, world)
            kinds[name] = "row"
        elif module is not head:
            raise ValueError(f"tensor parallelism knows Llama-family projections; cannot split {name}")
    binding = _GroupBinding(group)
    blocks = 0
    for module in model.modules():
        children = {name for name, _ in module.named_children()}
        if {"q_proj", "o_proj"} <= children or {"gate_proj", "down_proj"} <= children:
            module.register_forward_pre_hook(_input_hook(binding), with_kwargs=True)
            module.register_forward_hook(_output_hook(binding))
            blocks += 1
    layers = model.config.get_text_config().num_hidden_layers
    if blocks != 2 * layers:
        raise ValueError(f"found {blocks} attention/MLP blocks in a {layers}-layer model; expected {2 * layers}")
    info = ShardInfo(rank, world, full_shapes, kinds)
    setattr(model, _SHARD_FLAG, info)
    setattr(model, _GROUP_FLAG, binding)
    return info


def shard_info(model: nn.Module) -> ShardInfo | None:
    """How `model` was split by `shard_model`, or None if it holds whole layers."""
    return getattr(model, _SHARD_FLAG, None)


def rebind_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Point a sharded model's all-reduces at a new process group (same rank and size, e.g. after the
    collective group of a new generation was formed); a different rank or size needs a new shard instead."""
    _require_sharded(model)
    getattr(model, _GROUP_FLAG).group = group


def load_sharded_model(
    directory: str | Path,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel, ShardInfo]:
    """A Hugging Face model directory loaded as this worker's shard, ready for adapters (`attach_lora` done).

    The model is built on the meta device and split first, then each parameter is read from the safetensors
    files as just the slice this worker keeps, so the worker never holds the whole model: what lets a model
    too big for one worker load at all. Non-persistent buffers (rotary tables) are recomputed from the config.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    attach_lora(model)
    info = shard_model(model, rank, world, group)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every module its own new parameter, untying a shared head
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors files to load a tensor-parallel shard from")
    # Every name of a tied parameter: a file may store a tied head under either name.
    wanted = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    if name in wanted:
                        tensor = wanted[name]
                        tensor.copy_(_stored_slice(handle.get_slice(name), name, info, tuple(tensor.shape)))
                        loaded |= {alias for alias, other in wanted.items() if other is tensor}
        for name, module in list(model.named_modules()):
            if _is_rotary(module):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, type(module)(config=module.config).to(device))
    missing = [name for name in wanted if name not in loaded and not _is_recomputed(model, name)]
    if missing:
        raise ValueError(f"{directory} has no weights for {missing[:3]}{'...' if len(missing) > 3 else ''}")
    return model, info


def _is_rotary(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding")


def _is_recomputed(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rpartition(".")[0])
    return _is_rotary(owner) and name.rpartition(".")[2] not in dict(owner.named_parameters(recurse=False))


def _stored_slice(stored, name: str, info: ShardInfo, shape: tuple[int, ...]) -> Tensor:
    """The part of a stored tensor this worker keeps: output rows of a column-split layer, input columns of
    a row-split one's weight, everything else whole."""
    module, _, leaf = name.rpartition(".")
    kind = info.kinds.get(module)
    if kind == "column":
        return stored[info.rank * shape[0] : (info.rank + 1) * shape[0]]
    if kind == "row" and leaf == "weight":
        return stored[:, info.rank * shape[1] : (info.rank + 1) * shape[1]]
    return stored[:]


def _keep_output_rows(module: nn.Linear, rank: int, world: int) -> None:
    size = module.out_features // world
    rows = slice(rank * size, (rank + 1) * size)
    module.weight = nn.Parameter(module.weight.data[rows].clone(memory_format=torch.contiguous_format),
                                 requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
    module.out_features = size


def _keep_input_columns(module: nn.Linear, rank: int, world: int) -> None:
    """The bias of a row-split layer is added once, after the sum: rank 0 keeps it."""
    size = module.in_features // world
    columns = slice(rank * size, (rank + 1) * size)
    module.weight = nn.Parameter(module.weight.data[:, columns].clone(memory_format=torch.contiguous_format),
                                 requires_grad=False)
    if module.bias is not None and rank != 0:
        module.bias = None
    module.in_features = size


@dataclass
class _GroupBinding:
    """The process group a sharded model's hooks use, replaceable when the collective group is rebuilt."""

    group: dist.ProcessGroup | None


def _input_hook(binding: _GroupBinding):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (copy_to_group(args[0], binding.group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_group(kwargs["hidden_states"], binding.group)}

    return hook


def _output_hook(binding: _GroupBinding):
    def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> Tensor | tuple:
        if isinstance(output, tuple):
            return (reduce_from_group(output[0], binding.group), *output[1:])
        return reduce_from_group(output, binding.group)

    return hook


# ---------------------------------------------------------------------------------------------- adapters


def shared_seed(config: LoraConfig, group: dist.ProcessGroup | None = None) -> int:
    """The adapter's seed, the same on every worker of the group: `config.seed`, or group rank 0's random draw."""
    if config.seed is not None:
        return config.seed
    seed = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
    dist.broadcast(seed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(seed.item())


def create_sharded_adapter(
    model_id: str, model: nn.Module, config: LoraConfig, *, seed: int, device: torch.device | str
) -> AdapterState:
    """This worker's shard of the adapter `AdapterState.create` would build on the whole model with `seed`.

    The config is validated against the full layer shapes, the full initial weights are drawn (same generator,
    same order as a single worker) and only this worker's slices are kept. Every worker of the group must
    pass the same seed (`shared_seed`).
    """
    info = _require_sharded(model)
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
        if target.module_name not in info.kinds:
            continue
        column = info.kinds[target.module_name] == "column"
        lora_a, lora_b = adapter.lora_pair(target.module_name)
        parts.append((lora_a if column else lora_b).grad)
    if not parts or info.world == 1:
        return
    packed = torch.cat([part.reshape(-1) for part in parts])
    dist.all_reduce(packed, group=group)
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
        dist.all_reduce(split_sq, group=group)
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
                          reduce=(lambda tensor: dist.all_reduce(tensor, group=group)) if info.world > 1 else None)
    return optim_step(adapter, params, grad_norm=norm)


def gather_full_adapter(
    adapter: AdapterState, info: ShardInfo, group: dist.ProcessGroup | None = None
) -> AdapterState:
    """The whole adapter (params, Adam moments, step) a single worker would hold, on every worker of the group.

    One all-gather of the stacked flat buffers. The result is an ordinary `AdapterState` on the full targets,
    so `export_state`, `state_dict` and the checkpoint code work on it unchanged.
    """
    buffers = [adapter.params, adapter.exp_avg, adapter.exp_avg_sq] if adapter.trainable else [adapter.params]
    stacked = torch.stack(buffers)
    parts = [torch.empty_like(stacked) for _ in range(info.world)]
    if info.world > 1:
        dist.all_gather(parts, stacked, group=group)
    else:
        parts = [stacked]
    full_targets = [info.full_target(target.module_name) for target in adapter.targets]
    full = AdapterState(
        adapter.model_id, adapter.config, full_targets, adapter.seed, adapter.params.device, trainable=adapter.trainable
    )
    full_buffers = [full.params, full.exp_avg, full.exp_avg_sq] if adapter.trainable else [full.params]
    with torch.no_grad():
        for index, full_buffer in enumerate(full_buffers):
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
    return sum(rank * sum(info.full_shapes[target.module_name]) for target in adapter.targets)


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
    info = _require_sharded(model)
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
    for name, (key_a, key_b) in _peft_pairs(full_state).items():
        result[key_a], result[key_b] = (
            t.clone() for t in _shard_pair(info, name, full_state[key_a], full_state[key_b])
        )
    return result


def gather_adapter_state(shard_states: Sequence[dict[str, Tensor]], info: ShardInfo) -> dict[str, Tensor]:
    """The whole PEFT-named adapter state dict from every worker's `state_dict()`, listed in group-rank order."""
    if len(shard_states) != info.world:
        raise ValueError(f"need one state dict per worker of the group ({info.world}), got {len(shard_states)}")
    result = {}
    for name, (key_a, key_b) in _peft_pairs(shard_states[0]).items():
        pairs = [(state[key_a], state[key_b]) for state in shard_states]
        result[key_a], result[key_b] = _gather_pairs(info, name, pairs)
    return result


# ---------------------------------------------------------------------------------------------- layout


def _require_sharded(model: nn.Module) -> ShardInfo:
    info = shard_info(model)
    if info is None:
        raise ValueError("this model is not tensor-parallel: call shard_model(model, rank, world, group) first")
    return info


def _shard_pair(info: ShardInfo, name: str, lora_a: Tensor, lora_b: Tensor) -> tuple[Tensor, Tensor]:
    kind = info.kinds.get(name)
    if kind == "column":
        return lora_a, lora_b.chunk(info.world, dim=0)[info.rank]
    if kind == "row":
        return lora_a.chunk(info.world, dim=1)[info.rank], lora_b
    return lora_a, lora_b


def _gather_pairs(info: ShardInfo, name: str, pairs: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    kind = info.kinds.get(name)
    if kind == "column":
        return pairs[0][0].clone(), torch.cat([lora_b for _, lora_b in pairs], dim=0)
    if kind == "row":
        return torch.cat([lora_a for lora_a, _ in pairs], dim=1), pairs[0][1].clone()
    return pairs[0][0].clone(), pairs[0][1].clone()


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


def _peft_pairs(state: dict[str, Tensor]) -> dict[str, tuple[str, str]]:
    """Module name -> (A key, B key) of a PEFT-named adapter state dict."""
    pairs = {}
    for key in state:
        if key.endswith(_PEFT_SUFFIXES[0]):
            name = key[: -len(_PEFT_SUFFIXES[0])].removeprefix(_PEFT_PREFIX)
            key_b = key[: -len(_PEFT_SUFFIXES[0])] + _PEFT_SUFFIXES[1]
            if key_b not in state:
                raise ValueError(f"adapter state has {key} but no {key_b}")
            pairs[name] = (key, key_b)
    if len(pairs) * 2 != len(state):
        raise ValueError("adapter state has keys that are not PEFT LoRA A/B pairs")
    return pairs
