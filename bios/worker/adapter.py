"""One LoRA adapter's trainable state: where it attaches, how it starts, and its flat fp32 buffers.

Every adapter keeps five flat fp32 buffers of the same length: `params`, `grad` (committed gradient of the
current optimizer step), `pending_grad` (this cycle's contributions, added to `grad` only on commit so an
aborted cycle can be dropped), `exp_avg` and `exp_avg_sq`. The per-layer LoRA matrices are views into
`params`; each view is a leaf with `requires_grad=True` whose `.grad` is the matching view of `pending_grad`,
so autograd's in-place accumulation writes straight into the flat buffer, and the optimizer, all-reduce and
checkpoint code each see a single tensor.
"""

from __future__ import annotations

import math
import secrets

import torch
from torch import Tensor, nn

from bios import spec
from bios.exceptions import BadRequestError
from bios.types import LoraConfig, OptimizerName
from bios.worker.targets import LoraTarget, from_peft_layout, lora_targets, peft_keys, to_peft_layout

__all__ = ["AdapterState", "LoraTarget", "init_lora_weights", "lora_targets", "validate_lora_config"]

# LoRA output scale = LORA_ALPHA / rank (the PEFT `lora_alpha` convention, Tinker's alpha). With this
# scaling and Adam, the first steps of training look the same at every rank, so a learning rate found at one
# rank carries over to another.
LORA_ALPHA = 32

_MAX_SEED = 2**63 - 1

# Parameters per fp64 chunk of `AdapterState.checksum`: 512 KiB, so each chunk's copy stays in the L2 cache.
_CHECKSUM_CHUNK = 1 << 16


def validate_lora_config(model: nn.Module, config: LoraConfig, *, targets: list[LoraTarget] | None = None) -> None:
    """Raise `BadRequestError` naming the offending field if `config` cannot build an adapter on `model`.

    `targets` overrides `lora_targets(model, config)`: a tensor-parallel shard validates against the full
    layer shapes, not its slices.
    """
    for flag in spec.LORA_FLAGS:
        if not isinstance(getattr(config, flag), bool):
            raise BadRequestError(f"LoRA {flag} must be true or false, got {getattr(config, flag)!r}", field=flag)
    if config.seed is not None and (
        isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed <= _MAX_SEED
    ):
        raise BadRequestError(
            f"LoRA seed must be an integer between 0 and {_MAX_SEED} (or None for a random seed), "
            f"got {config.seed!r}",
            field="seed",
        )
    if targets is None:
        targets = lora_targets(model, config)
    if not targets:
        raise BadRequestError(
            f"LoRA config trains no layer of this model: set at least one of {', '.join(spec.LORA_FLAGS)} to "
            "true",
            field="train_attn",
        )
    smallest = min(min(t.in_features, t.out_features) for t in targets)
    max_rank = 1 << (smallest.bit_length() - 1)
    rank = config.rank
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int)
        or rank < 1
        or rank > smallest
        or rank & (rank - 1)
    ):
        raise BadRequestError(
            f"LoRA rank must be a power of two between 1 and {max_rank} for this model (its smallest target "
            f"layer has min(in, out) = {smallest}), got {rank!r}",
            field="rank",
        )


def init_lora_weights(targets: list[LoraTarget], rank: int, seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """The starting (A, B) of every target, as fp32 CPU tensors, from one generator seeded with `seed`.

    A ~ U(-1/sqrt(in), 1/sqrt(in)), which is PEFT's `kaiming_uniform_(a=sqrt(5))`; B = 0 so the adapter starts
    as the identity. Targets draw in list order, so the same seed and targets always give the same start on
    any device.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for target in targets:
        shape_a, shape_b = (tuple(rank if n == -1 else n for n in shape) for shape in target.factor_shapes)
        bound = 1.0 / math.sqrt(target.in_features)
        lora_a = torch.empty(shape_a).uniform_(-bound, bound, generator=generator)
        weights[target.module_name] = (lora_a, torch.zeros(shape_b))
    return weights


class AdapterState:
    """One LoRA adapter: flat fp32 buffers for params, gradients and Adam moments, plus its step count."""

    def __init__(
        self,
        model_id: str,
        config: LoraConfig,
        targets: list[LoraTarget],
        seed: int,
        device: torch.device | str,
        *,
        trainable: bool = True,
    ) -> None:
        """`trainable=False` builds a params-only adapter (for samplers): its gradient and moment buffers are
        empty and its LoRA views need no grad, so a frozen snapshot costs one buffer, not five."""
        self.model_id = model_id
        self.config = config
        self.targets = targets
        self.seed = seed
        self.scale = LORA_ALPHA / config.rank
        self.step = 0
        self.trainable = trainable
        self.optimizer: OptimizerName = "adamw"  # which optimizer's state `exp_avg`/`exp_avg_sq` hold
        rank = config.rank
        total = sum(rank * (t.in_features + t.out_features) * max(1, t.num_experts) for t in targets)
        self.params = torch.zeros(total, dtype=torch.float32, device=device)
        size_of_state = total if trainable else 0
        self.grad = torch.zeros(size_of_state, dtype=torch.float32, device=device)
        self.pending_grad = torch.zeros_like(self.grad)
        self.exp_avg = torch.zeros_like(self.grad)
        self.exp_avg_sq = torch.zeros_like(self.grad)
        self._pairs: dict[str, tuple[Tensor, Tensor]] = {}
        self._casts: dict[str, tuple[Tensor, Tensor]] = {}  # `lora_pair_in`'s copies, for `_casts_of`
        self._casts_of: tuple[torch.dtype, int] | None = None  # (their dtype, the params' version they were cast at)
        offset = 0
        for target in targets:
            pair = []
            for shape in target.factor_shapes:
                shape = tuple(rank if n == -1 else n for n in shape)
                size = math.prod(shape)
                view = self.params[offset : offset + size].view(shape)
                if trainable:
                    view.requires_grad_(True)
                    view.grad = self.pending_grad[offset : offset + size].view(shape)
                pair.append(view)
                offset += size
            self._pairs[target.module_name] = (pair[0], pair[1])

    @classmethod
    def create(
        cls, model_id: str, model: nn.Module, config: LoraConfig, *, device: torch.device | str
    ) -> AdapterState:
        """A fresh adapter for `model`: validated config, weights from `init_lora_weights` (random seed if None)."""
        validate_lora_config(model, config)
        seed = config.seed if config.seed is not None else secrets.randbits(63)
        targets = lora_targets(model, config)
        state = cls(model_id, config, targets, seed, device)
        with torch.no_grad():
            for name, (lora_a, lora_b) in init_lora_weights(targets, config.rank, seed).items():
                view_a, view_b = state._pairs[name]
                view_a.copy_(lora_a)
                view_b.copy_(lora_b)
        return state

    def frozen_copy(self, model_id: str | None = None) -> AdapterState:
        """A params-only snapshot (same config, scale and step) for sampling: training this adapter later
        leaves the copy unchanged."""
        copy = AdapterState(
            model_id or self.model_id, self.config, self.targets, self.seed, self.params.device, trainable=False
        )
        with torch.no_grad():
            copy.params.copy_(self.params)
        copy.scale = self.scale
        copy.step = self.step
        return copy

    def lora_pair(self, module_name: str) -> tuple[Tensor, Tensor]:
        """The (A [rank, in], B [out, rank]) views of `module_name`; KeyError if this adapter does not train it."""
        return self._pairs[module_name]

    def lora_pair_in(self, module_name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`lora_pair` in `dtype`, for reading without gradients: the pair itself, or copies cast once and kept
        until the parameters change. The sampler reads every pair in the model's dtype at each decode step and
        after each compaction of its batch; prepacked copies made from them last as long as they do."""
        pair = self._pairs[module_name]
        if pair[0].dtype == dtype:
            return pair
        if self._casts_of != (dtype, self.params._version):
            self._casts, self._casts_of = {}, (dtype, self.params._version)
        if module_name not in self._casts:
            self._casts[module_name] = (pair[0].detach().to(dtype), pair[1].detach().to(dtype))
        return self._casts[module_name]

    def pairs_in(self, flat: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """Views of `flat` (a buffer laid out like `params`: `grad`, `exp_avg`, ...) shaped as each target's (A, B)."""
        base = self.params.storage_offset()
        views = {}
        for name, pair in self._pairs.items():
            a, b = (flat[f.storage_offset() - base : f.storage_offset() - base + f.numel()].view(f.shape) for f in pair)
            views[name] = (a, b)
        return views

    def has_target(self, module_name: str) -> bool:
        return module_name in self._pairs

    def grad_views_intact(self) -> bool:
        """True while every A/B `.grad` still aliases `pending_grad` (autograd only ever adds into it)."""
        start, end = self.pending_grad.data_ptr(), self.pending_grad.data_ptr() + self.pending_grad.nbytes
        return all(
            view.grad is not None and start <= view.grad.data_ptr() < end
            for pair in self._pairs.values()
            for view in pair
        )

    def num_parameters(self) -> int:
        return self.params.numel()

    def checksum(self) -> float:
        """A cheap fingerprint of the parameters: replicas that applied the same updates report the same value.

        The sum of the values and of their squares in fp64, taken chunk by chunk through one cache-sized fp64
        buffer: workers take it twice a cycle, and fp64 copies of the whole buffer took ~30 ms for SmolLM2's
        rank-16 adapter (5.7M parameters) on 2 CPU cores, ~5% of a training step; chunks, ~4 ms."""
        flat = self.params.detach()
        values = torch.empty(min(_CHECKSUM_CHUNK, flat.numel()), dtype=torch.float64, device=flat.device)
        squares = torch.empty_like(values)
        sums = []
        for chunk in flat.split(_CHECKSUM_CHUNK):
            value, square = values[: chunk.numel()], squares[: chunk.numel()]
            value.copy_(chunk)
            sums += [value.sum(), torch.mul(value, value, out=square).sum()]
        return float(torch.stack(sums).sum()) if sums else 0.0

    def state_dict(self) -> dict[str, Tensor]:
        """Copies of the LoRA matrices under PEFT's key names, so the dict saves as a loadable PEFT adapter."""
        result = {}
        keys = peft_keys(self.targets)
        for target in self.targets:
            key_a, key_b = keys[target.module_name]
            lora_a, lora_b = to_peft_layout(target, *self._pairs[target.module_name])
            result[key_a] = lora_a.detach().clone()
            result[key_b] = lora_b.detach().clone()
        return result

    def load_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Copy LoRA matrices in (strict: exactly this adapter's keys and shapes); nothing changes on error."""
        peft_shapes, pairs = {}, {}
        keys = peft_keys(self.targets)
        for target in self.targets:
            key_a, key_b = keys[target.module_name]
            peft_a, peft_b = to_peft_layout(target, *self._pairs[target.module_name])
            peft_shapes[key_a], peft_shapes[key_b] = tuple(peft_a.shape), tuple(peft_b.shape)
            pairs[target.module_name] = (key_a, key_b)
        missing = sorted(peft_shapes.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - peft_shapes.keys())
        if missing or unexpected:
            raise ValueError(
                f"adapter state does not match this adapter ({len(self.targets)} target layers, rank "
                f"{self.config.rank}): missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected keys {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
            )
        for key, shape in peft_shapes.items():
            if tuple(state_dict[key].shape) != shape:
                raise ValueError(
                    f"adapter state key {key} has shape {tuple(state_dict[key].shape)}, this adapter needs "
                    f"{shape} (rank {self.config.rank}): was it saved from a different rank or model?"
                )
        with torch.no_grad():
            for target in self.targets:
                key_a, key_b = pairs[target.module_name]
                lora_a, lora_b = from_peft_layout(target, state_dict[key_a], state_dict[key_b])
                view_a, view_b = self._pairs[target.module_name]
                view_a.copy_(lora_a)
                view_b.copy_(lora_b)

    def optimizer_state(self) -> dict[str, Tensor]:
        """Copies of the Adam moments (flat, in `params` layout) and the step count."""
        return {
            "exp_avg": self.exp_avg.detach().clone(),
            "exp_avg_sq": self.exp_avg_sq.detach().clone(),
            "step": torch.tensor(self.step, dtype=torch.int64),
        }

    def load_optimizer_state(self, state_dict: dict[str, Tensor]) -> None:
        """Restore the Adam moments and step count saved by `optimizer_state`; nothing changes on error."""
        keys = {"exp_avg", "exp_avg_sq", "step"}
        if state_dict.keys() != keys:
            raise ValueError(f"optimizer state needs exactly the keys {sorted(keys)}, got {sorted(state_dict)}")
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(state_dict[key].shape) != tuple(self.params.shape):
                raise ValueError(
                    f"optimizer state {key} has shape {tuple(state_dict[key].shape)}, this adapter needs "
                    f"{tuple(self.params.shape)}: was it saved from a different rank or model?"
                )
        step = int(state_dict["step"])
        if step < 0:
            raise ValueError(f"optimizer state step must be >= 0, got {step}")
        self.exp_avg.copy_(state_dict["exp_avg"])
        self.exp_avg_sq.copy_(state_dict["exp_avg_sq"])
        self.step = step
