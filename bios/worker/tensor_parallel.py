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
own input columns only). `sharded_adapter.reduce_shared_grads` sums exactly those over the group. The split factors'
gradients are exact locally, and so are the head adapter's (every worker runs the whole head identically).

Why not `torch.distributed.tensor`: `parallelize_module(ColwiseParallel/RowwiseParallel)` does shard plain
`nn.Linear`s on gloo, but `LoraLinear` adds `(x Aᵀ) Bᵀ` with A/B plain tensors (views into the adapter's flat
fp32 buffer), and DTensor refuses mixed operands ("aten.mm.default got mixed torch.Tensor and DTensor").
Making A/B DTensors would make their `.grad` DTensors too, breaking the flat `pending_grad` aliasing that the
optimizer, all-reduce and checkpoints rely on. Plain slicing plus two autograd Functions is ~30 lines.

MoE layers split by experts instead (`bios.worker.expert_parallel`): each worker keeps 1/tp of every layer's
routed experts, with the same pair of all-reduces around the MoE block.

`load_sharded_model` reads only a worker's slices from safetensors, so a model too big for one worker never
has to fit in one. The adapters on a sharded model live in `bios.worker.sharded_adapter`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bios.models.memory_plan import ModelShape
from bios.worker.collectives import completed
from bios.worker.adapter import LoraTarget
from bios.worker.expert_parallel import (
    checkpoint_renamings,
    experts_modules,
    holds_experts,
    read_local_experts,
    split_experts,
    stored_name,
)
from bios.worker.fused_llama import fuse_llama_modules
from bios.worker.lora import LoraLinear, attach_lora
from bios.worker.targets import all_targets

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ShardKind = Literal["column", "row", "experts"]

COLUMN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PROJECTIONS = ("o_proj", "down_proj")
_SHARD_FLAG = "_bios_tensor_parallel"
_GROUP_FLAG = "_bios_tensor_parallel_group"


@dataclass(frozen=True)
class ShardInfo:
    """Where a worker sits in its tensor-parallel group and how each LoRA target of the model is split.

    `full_targets` holds every LoRA target unsplit; `kinds` says how each split target (and experts module) is
    cut (absent: replicated, i.e. the output head). Plain data: the process group is passed separately.
    """

    rank: int
    world: int
    full_targets: dict[str, LoraTarget]
    kinds: dict[str, ShardKind]

    def full_target(self, module_name: str) -> LoraTarget:
        return self.full_targets[module_name]

    def whole_factors(self, module_name: str) -> tuple[bool, bool]:
        """(A whole, B whole): whether every worker holds all of that factor (else it holds a 1/world slice)."""
        kind = self.kinds.get(module_name)
        return kind not in ("row", "experts"), kind not in ("column", "experts")


# ---------------------------------------------------------------------------------------------- collectives


class TensorParallelError(RuntimeError):
    """An all-reduce inside a sharded model failed (a peer of the group died or timed out): not the input's
    fault, so the cycle is aborted and re-run, not reported as a failed request."""


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    try:
        completed(dist.all_reduce(tensor, group=group, async_op=True))
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
    full_targets = {target.module_name: target for target in all_targets(model)}
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
    for name, module in experts_modules(model).items():
        split_experts(module, rank, world)
        kinds[name] = "experts"
        kinds.update({target: "experts" for target in full_targets if target.startswith(f"{name}.")})
    binding = _GroupBinding(group)
    blocks = 0
    for module in model.modules():
        children = {name for name, _ in module.named_children()}
        if {"q_proj", "o_proj"} <= children or {"gate_proj", "down_proj"} <= children or holds_experts(module):
            module.register_forward_pre_hook(_input_hook(binding), with_kwargs=True)
            module.register_forward_hook(_output_hook(binding))
            blocks += 1
    layers = model.config.get_text_config().num_hidden_layers
    if blocks != 2 * layers:
        raise ValueError(f"found {blocks} attention/MLP blocks in a {layers}-layer model; expected {2 * layers}")
    fuse_llama_modules(model)  # the shards of projections that share an input laid out end to end again
    info = ShardInfo(rank, world, full_targets, kinds)
    setattr(model, _SHARD_FLAG, info)
    setattr(model, _GROUP_FLAG, binding)
    return info


def shard_info(model: nn.Module) -> ShardInfo | None:
    """How `model` was split by `shard_model`, or None if it holds whole layers."""
    return getattr(model, _SHARD_FLAG, None)


def require_sharded(model: nn.Module) -> ShardInfo:
    info = shard_info(model)
    if info is None:
        raise ValueError("this model is not tensor-parallel: call shard_model(model, rank, world, group) first")
    return info


def rebind_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Point a sharded model's all-reduces at a new process group (same rank and size, e.g. after the
    collective group of a new generation was formed); a different rank or size needs a new shard instead."""
    require_sharded(model)
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
    with contextlib.ExitStack() as open_files, torch.no_grad():
        stored = {}  # stored name -> the open file holding it
        for file in files:
            handle = open_files.enter_context(safe_open(file, framework="pt"))
            stored.update(dict.fromkeys(handle.keys(), handle))
        renamings, names = checkpoint_renamings(config.model_type), set(stored)
        for name, tensor in wanted.items():
            if (key := stored_name(name, names, renamings)) is not None:
                value = _stored_slice(stored[key].get_slice(key), name, info, tuple(tensor.shape))
            elif info.kinds.get(name.rpartition(".")[0]) == "experts":  # stored one matrix per expert
                count = tensor.shape[0]
                value = read_local_experts(lambda key: stored[key].get_tensor(key), names, config.model_type,
                                           renamings, name, info.rank * count, count)
                if value is None:
                    continue
            else:
                continue
            tensor.copy_(value)
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
    a row-split one's weight, its own experts of an experts module, everything else whole."""
    module, _, leaf = name.rpartition(".")
    kind = info.kinds.get(module)
    if kind == "column" or kind == "experts":
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
