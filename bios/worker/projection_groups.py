"""Sibling projections that read the same input run as one GEMM each way (`bios.kernels.lora_linear_blocks`).

In Llama-family attention `q_proj`, `k_proj` and `v_proj` all read the normed hidden states, and in the MLP
`gate_proj` and `up_proj` do. `group_projections` stacks each such group's frozen weights into one tensor
(the layers' weights become views of it, so no memory is added) and hands the layers one `ProjectionGroup`.
The first member called with an input computes every member's output, base and LoRA, in one pass; the
others, called with that same tensor, take theirs. Any other call pattern (a member called alone, or with
another input) computes again, so grouping never changes a result, only how many matmuls run: one frozen
GEMM forward and one backward per group instead of one per layer, and one `x [A_q; A_k; A_v]ᵀ` per adapter.
"""

from __future__ import annotations

from torch import Tensor, nn

from bios.kernels.lora import BlockSegment, lora_linear_blocks

# The Transformers classes whose forwards feed these projections one and the same input tensor
_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_GROUPS = {
    **{(f"transformers.models.{m}.modeling_{m}", f"{p}Attention"): ("q_proj", "k_proj", "v_proj")
       for m, p in _FAMILIES.items()},
    **{(f"transformers.models.{m}.modeling_{m}", f"{p}MLP"): ("gate_proj", "up_proj") for m, p in _FAMILIES.items()},
}


class ProjectionGroup:
    """Linear layers (LoRA layers of `bios.worker.lora`) that read one input; see the module docstring."""

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self._stack()
        self._input: Tensor | None = None
        self._waiting: dict[int, Tensor] = {}  # outputs computed for `_input`, not yet taken by their layer

    def output(self, member: nn.Linear, x: Tensor) -> Tensor:
        """`member`'s output for `x`: computed with its siblings' unless they already computed it."""
        index = next(i for i, other in enumerate(self.members) if other is member)
        if x is self._input and index in self._waiting:
            out = self._waiting.pop(index)
            if not self._waiting:
                self._input = None
            return out
        outputs = lora_linear_blocks(x, *self._stacked(), self._sizes, self._segments())
        self._input = x
        self._waiting = {i: out for i, out in enumerate(outputs) if i != index}
        return outputs[index]

    def _stack(self) -> None:
        """One weight (and bias) tensor for the group; each layer's parameter becomes a view of its rows."""
        self._sizes = [member.weight.shape[0] for member in self.members]
        self._weight = _stacked_views([member.weight for member in self.members])
        biases = [member.bias for member in self.members]
        self._bias = None if biases[0] is None else _stacked_views(biases)

    def _stacked(self) -> tuple[Tensor, Tensor | None]:
        """The stacked weight and bias, stacked again if a layer's parameters were replaced since (a
        tensor-parallel split replaces them with its shard)."""
        params = [(member.weight, member.bias) for member in self.members]
        if not all(_is_view_of(weight, self._weight) and (bias is None or _is_view_of(bias, self._bias))
                   for weight, bias in params) or [w.shape[0] for w, _ in params] != self._sizes:
            self._stack()
        return self._weight, self._bias

    def _segments(self) -> list[BlockSegment]:
        """The members' LoRA segments merged by row range: an adapter's factors of every member it trains."""
        merged: dict[tuple[int, int], tuple[float, list]] = {}
        for block, member in enumerate(self.members):
            for segment in member.lora_segments:
                scale, factors = merged.setdefault((segment.start, segment.end), (segment.scale, []))
                if scale != segment.scale:
                    raise ValueError(f"rows [{segment.start}, {segment.end}) have LoRA scale {scale} on one "
                                     f"projection and {segment.scale} on another; one adapter has one scale")
                factors.append((block, segment.lora_a, segment.lora_b))
        return [BlockSegment(start, end, scale, tuple(factors))
                for (start, end), (scale, factors) in sorted(merged.items())]


def _stacked_views(params: list[nn.Parameter]) -> Tensor:
    stacked = params[0].data.new_empty((sum(p.shape[0] for p in params), *params[0].shape[1:]))
    row = 0
    for param in params:
        stacked[row : row + param.shape[0]].copy_(param.data)
        param.data = stacked[row : row + param.shape[0]]
        row += param.shape[0]
    return stacked


def _is_view_of(param: Tensor, stacked: Tensor | None) -> bool:
    return stacked is not None and param.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def group_projections(model: nn.Module, is_lora_layer) -> int:
    """Give the q/k/v and gate/up layers of every known Llama-family block one `ProjectionGroup` each (in
    place; their weights become views of the group's stacked weight). Returns how many groups exist.

    Only layers `is_lora_layer` accepts, with one dtype and all or none with a bias, are grouped."""
    groups = 0
    for module in model.modules():
        names = next((_GROUPS[key] for cls in type(module).__mro__  # fused_llama subclasses the stock MLPs
                      if (key := (cls.__module__, cls.__qualname__)) in _GROUPS), None)
        if names is None:
            continue
        members = [getattr(module, name, None) for name in names]
        if not all(member is not None and is_lora_layer(member) for member in members):
            continue
        if len({m.weight.dtype for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
            continue
        if getattr(members[0], "projection_group", None) is None:
            group = ProjectionGroup(members)
            for member in members:
                member.projection_group = group
        groups += 1
    return groups
