"""Expert parallelism: the workers of a tensor-parallel group each hold 1/world of every MoE layer's experts.

Layout. Worker r of `world` keeps routed experts [r·E/world, (r+1)·E/world) of every MoE layer (weights,
biases and their LoRA factors, cut on the expert axis); attention splits as `bios.worker.tensor_parallel`
splits it, and the router, norms, embeddings and head are replicated, so every worker routes every token the
same way. A worker runs only the (token, expert) pairs of its own experts (`bios.worker.lora_experts` turns
the other routes into sentinels), and the MoE block ends with `reduce_from_group` (the workers' partial sums
add up to the layer's output) and starts with `copy_to_group` (each worker's input gradient is its experts'
and its routes' share): the same pair of all-reduces a dense MLP block uses.

Why all-reduce and not all-to-all: inside a tensor-parallel group every worker already has every token's
hidden state, so no token has to travel to its experts; the one exchange is the block's output, [tokens,
hidden] summed each way, what a dense layer costs. All-to-all pays when tokens are spread over workers (large
expert-parallel groups fed by different data), at the price of uneven splits and a second exchange back.

An expert's A [E, r, in] and B [E, out, r] split with it, so both are exact locally: unlike a column or row
split, no gradient needs a sum over the group.

Routed experts stored the way transformers 5 keeps them (3D `mlp.experts.gate_up_proj`) are read as slices;
checkpoints that store one matrix per expert (`mlp.experts.7.gate_proj.weight`, what `save_pretrained` and the
hub's Qwen3-MoE / Mixtral / DeepSeek files hold) are read expert by expert through transformers' own
conversion mapping for the model type, so a worker reads only its experts either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from bios.worker.lora_experts import LoraExperts
from bios.worker.targets import is_experts


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed-experts module of `model`, by name."""
    return {name: module for name, module in model.named_modules() if is_experts(module)}


def holds_experts(module: nn.Module) -> bool:
    """A MoE block: a module with a routed-experts child (the block whose output the group sums)."""
    return any(is_experts(child) for child in module.children())


def split_experts(module: nn.Module, rank: int, world: int) -> None:
    """Keep only worker `rank`'s experts of `module` (every parameter with the expert axis first) and make it
    route the others' pairs nowhere. `attach_lora` must have run (the module computes with Bios's kernels)."""
    if not isinstance(module, LoraExperts):
        raise ValueError(f"split_experts needs attach_lora(model) first: {type(module).__name__} has no LoRA slots")
    experts = module.down_proj.shape[0]
    if experts % world:
        raise ValueError(f"{experts} experts do not split evenly over {world} workers")
    count = experts // world
    kept = slice(rank * count, (rank + 1) * count)
    for name, param in list(module.named_parameters(recurse=False)):
        if param.shape[0] == experts:
            setattr(module, name, nn.Parameter(param.data[kept].clone(), requires_grad=False))
    if hasattr(module, "num_experts"):
        module.num_experts = count
    module.bios_local_experts = (rank * count, count)


def per_expert_reader(model_type: str, name: str) -> list[str] | None:
    """How a checkpoint storing one matrix per expert holds 3D expert parameter `name`: the stored names (with
    `{}` for the expert index) whose matrices, concatenated on their rows, make one expert's slice; None when
    transformers' conversion mapping for `model_type` has no such rule for it."""
    from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping

    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(rule, WeightConverter) or len(rule.target_patterns) != 1:
            continue
        target = rule.target_patterns[0].strip(".")
        if not name.endswith("." + target):
            continue
        steps = [(type(op).__name__, getattr(op, "dim", None)) for op in rule.operations]
        if steps not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            return None
        prefix = name[: -len(target)]
        return [prefix + source.strip(".").replace("*", "{}") for source in rule.source_patterns]
    return None


def checkpoint_renamings(model_type: str) -> list[tuple[str, str]]:
    """(model's name part, checkpoint's name part) of transformers' renamings for `model_type`, e.g. Mixtral's
    (`.mlp.`, `.block_sparse_moe.`)."""
    from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping

    return [(rule.target_patterns[0], rule.source_patterns[0])
            for rule in get_checkpoint_conversion_mapping(model_type) or []
            if isinstance(rule, WeightRenaming) and len(rule.source_patterns) == len(rule.target_patterns) == 1]


def stored_name(name: str, stored: set[str], renamings: list[tuple[str, str]]) -> str | None:
    """The name a checkpoint stores the model's `name` under: itself, or a renamed form; None if neither."""
    for candidate in (name, *(name.replace(ours, theirs) for ours, theirs in renamings)):
        if candidate in stored:
            return candidate
    return None


def read_local_experts(read: Callable[[str], Tensor], stored: set[str], model_type: str,
                       renamings: list[tuple[str, str]], name: str, first: int, count: int) -> Tensor | None:
    """Experts [first, first + count) of 3D parameter `name` from a checkpoint storing one matrix per expert
    (`read(stored_name)` gives a tensor, `stored` holds every stored name, `renamings` are
    `checkpoint_renamings(model_type)`); None when it stores them otherwise."""
    sources = per_expert_reader(model_type, name)
    if sources is None:
        return None
    slices = []
    for expert in range(first, first + count):
        names = [stored_name(pattern.format(expert), stored, renamings) for pattern in sources]
        if None in names:
            return None
        slices.append(torch.cat([read(found) for found in names]))
    return torch.stack(slices)
