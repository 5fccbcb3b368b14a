"""A run's adapter as a cycle works on it: one interface, two kinds, chosen once when the pool makes the adapter.

`WholeAdapter` holds the whole LoRA adapter (no tensor parallelism). `ShardedAdapter` holds this worker's shard of
it on a tensor-parallel base model (`bios.worker.tensor_parallel` says how layers and factors are split,
`bios.worker.sharded_adapter` does the arithmetic): the k shard holders of a replica sum the gradients of the
factors each only saw a share of, clip by the whole adapter's norm, and gather the whole adapter to save it, so a
checkpoint is the one a single worker would write.

Both offer what a cycle does to an adapter: sum this cycle's gradient over the generation (`sum_grads`), then
`commit` it (returning the whole adapter's gradient norm) or `discard` it, take an optimizer step, gather the
whole adapter (`whole`: saves, exports), load a whole checkpoint into it, and take replica 0's copy when a new
generation forms (a shard: rank 0's whole adapter cut anew, when the last generation held it unsplit).
`adapter_kind` reads which kind a base model needs off the model itself; the executor calls the methods without
knowing the kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from bios import messages as m
from bios import types as t
from bios.models import LoadedModel

from . import engine
from .adapter import AdapterState, validate_lora_config
from .checkpoint import load_into, restore_adapter, sampler_adapter
from .sharded_adapter import (
    assemble_full_adapter,
    copy_full_into_shard,
    create_sharded_adapter,
    full_parameter_count,
    gather_full_adapter,
    reduce_shared_grads,
    restore_sharded_adapter,
    shard_buffers,
    shard_checkpoint,
    sharded_grad_norm,
    sharded_optim_step,
    shared_seed,
)
from .tensor_parallel import ShardInfo, TensorParallelError, require_sharded, shard_info

if TYPE_CHECKING:
    from .collectives import CollectiveGroup


@dataclass
class Adapter(ABC):
    """A training run's adapter (or a sampler's frozen copy) and the base model it sits on."""

    state: AdapterState
    base: LoadedModel
    base_model: str

    @classmethod
    @abstractmethod
    def create(cls, model_id: str, base: LoadedModel, base_model: str, op: m.CreateModel, *, seed: int | None,
               device: torch.device) -> Adapter:
        """A run's adapter: restored from `op.state`, or new from `op.lora`."""

    @classmethod
    @abstractmethod
    def sampler(cls, path: str, base: LoadedModel, base_model: str, checkpoint: m.CheckpointState, *,
                device: torch.device) -> Adapter:
        """A params-only copy of a checkpoint's weights, for sampling."""

    @abstractmethod
    def parameter_count(self) -> int:
        """Parameters of the whole adapter (what a single worker reports)."""

    @property
    @abstractmethod
    def checksum_key(self) -> str:
        """The name this member reports its checksum under: replicas of the same state must agree on it."""

    @abstractmethod
    def whole_checksum(self) -> float | None:
        """The whole adapter's checksum if this worker holds all of it, else None."""

    @abstractmethod
    def sum_grads(self, group: CollectiveGroup) -> None:
        """Sum this cycle's gradient contributions (`pending_grad`) over the generation; collectives only."""

    @abstractmethod
    def commit(self) -> float:
        """Add the summed contributions into the step's gradient; the whole adapter's gradient norm. No collective."""

    @abstractmethod
    def optim_step(self, params: t.AdamParams | t.DimuonParams, group: CollectiveGroup) -> t.OptimStepResponse:
        """One step of the run's optimizer on the committed gradient, clipped by the whole adapter's norm."""

    @abstractmethod
    def whole(self, group: CollectiveGroup) -> AdapterState:
        """The whole adapter (params, moments, step), as a single worker would hold it."""

    @abstractmethod
    def load(self, checkpoint: m.CheckpointState, *, with_optimizer: bool) -> None:
        """Replace the weights (and optimizer state, or reset it) with a whole adapter's checkpoint; all or nothing."""

    def discard(self) -> None:
        """Drop this cycle's gradient contributions (an aborted cycle); the committed gradient is untouched."""
        engine.discard_gradients(self.state)

    def take_from_replica(self, group: CollectiveGroup, replica: int = 0) -> None:
        """Become `replica`'s copy (its holder of the same state): params, committed gradient, moments, step."""
        _broadcast_state(self.state, lambda buffer: group.broadcast_from_replica_(buffer, replica))

    def held(self) -> HeldState:
        """What this member holds of the adapter, kept past a new generation's `configure` for `whole_on_rank_zero`."""
        return HeldState(self.state, None)

    def cut_from_whole(self, group: CollectiveGroup, whole: AdapterState | None) -> None:
        """Become this member's part of the whole adapter rank 0 has (`whole`, there: `whole_on_rank_zero`; the
        last generation held it split another way): params, committed gradient, moments and step, broadcast
        whole and kept as this member holds it."""
        full = self._whole_layout()
        if group.rank == 0:
            if whole is None or whole.params.numel() != full.params.numel():
                raise RuntimeError(f"rank 0 holds no whole adapter {self.state.model_id} to cut anew")
            full = whole
        _broadcast_state(full, lambda buffer: group.broadcast_(buffer, 0))
        self._keep(full)

    def _whole_layout(self) -> AdapterState:
        """An empty whole adapter of this one's targets (to receive one)."""
        state = self.state
        return AdapterState(state.model_id, state.config, state.targets, state.seed, state.params.device)

    @torch.no_grad()
    def _keep(self, full: AdapterState) -> None:
        """Hold `full` (a whole adapter of this one's targets)."""
        state = self.state
        if full is not state:
            for mine, theirs in zip(shard_buffers(state, with_grad=True), shard_buffers(full, with_grad=True)):
                mine.copy_(theirs)
        state.step = full.step


def _broadcast_state(state: AdapterState, broadcast: Callable[[torch.Tensor], None]) -> None:
    """Send or take (`broadcast`: one collective, the same source on every member) an adapter's params,
    committed gradient, moments and step."""
    step = torch.tensor([state.step], dtype=torch.int64)
    for buffer in (*shard_buffers(state, with_grad=True), step):
        broadcast(buffer)
    state.step = int(step.item())


@dataclass(frozen=True)
class HeldState:
    """An adapter as a member held it in the last generation: its state and, for a shard, the layout."""

    state: AdapterState
    info: ShardInfo | None  # None: held whole


def whole_on_rank_zero(group: CollectiveGroup, held: HeldState | None, source_tp: int) -> AdapterState | None:
    """The whole adapter on rank 0 of a new generation whose ranks 0 .. `source_tp`-1 held its shards 0 ..
    `source_tp`-1 in the last (rank 0 held it whole if `source_tp` is 1): each sends its shard's buffers (params,
    committed gradient, moments) by broadcast, rank 0 puts them together. None on the other ranks."""
    if source_tp == 1:
        return held.state if group.rank == 0 and held is not None else None
    parts = []
    for rank in range(source_tp):
        if group.rank == rank:
            if held is None or held.info is None or held.info.rank != rank:
                raise RuntimeError(f"rank {rank} of the new generation holds no shard {rank} of an adapter to send")
            part = torch.stack(shard_buffers(held.state, with_grad=True))
            size = torch.tensor(part.shape, dtype=torch.int64)
        else:
            size = torch.zeros(2, dtype=torch.int64)
        group.broadcast_(size, rank)
        if group.rank != rank:
            part = torch.empty(*size.tolist())
        group.broadcast_(part, rank)
        parts.append(part)
    if group.rank != 0:
        return None
    return assemble_full_adapter(held.state, held.info, parts, with_grad=True)


def adapter_kind(base: LoadedModel) -> type[Adapter]:
    """The kind of adapter `base` takes: sharded on a tensor-parallel shard of a model, else whole."""
    return WholeAdapter if shard_info(base.model) is None else ShardedAdapter


class WholeAdapter(Adapter):
    """The whole adapter: gradients summed across replicas, everything else local."""

    @classmethod
    def create(cls, model_id: str, base: LoadedModel, base_model: str, op: m.CreateModel, *, seed: int | None,
               device: torch.device) -> WholeAdapter:
        """`seed` is unused: an unseeded adapter draws its own (a placeholder's state is sent to it anyway)."""
        validate_lora_config(base.model, op.lora)
        if op.state is not None:
            state = restore_adapter(model_id, base.model, op.state, with_optimizer=op.with_optimizer, device=device,
                                    optimizer=op.optimizer)
        else:
            state = AdapterState.create(model_id, base.model, op.lora, device=device)
            state.optimizer = op.optimizer
        return cls(state, base, base_model)

    @classmethod
    def sampler(cls, path: str, base: LoadedModel, base_model: str, checkpoint: m.CheckpointState, *,
                device: torch.device) -> WholeAdapter:
        return cls(sampler_adapter(path, base.model, checkpoint, device=device), base, base_model)

    def parameter_count(self) -> int:
        return self.state.num_parameters()

    @property
    def checksum_key(self) -> str:
        return self.state.model_id

    def whole_checksum(self) -> float | None:
        return self.state.checksum()

    def sum_grads(self, group: CollectiveGroup) -> None:
        group.all_reduce_replicas_(self.state.pending_grad)

    def commit(self) -> float:
        return engine.commit_gradients(self.state)

    def optim_step(self, params: t.AdamParams | t.DimuonParams, group: CollectiveGroup) -> t.OptimStepResponse:
        return engine.optim_step(self.state, params)

    def whole(self, group: CollectiveGroup) -> AdapterState:
        return self.state

    def load(self, checkpoint: m.CheckpointState, *, with_optimizer: bool) -> None:
        load_into(self.state, checkpoint, with_optimizer=with_optimizer)


@dataclass
class ShardedAdapter(Adapter):
    """This worker's shard of the adapter on a tensor-parallel base model (`bios.worker.sharded_adapter`).

    The whole adapter's gradient norm needs the replica's group; it is taken when the gradient is summed, so
    neither the commit nor the optimizer step that follows it runs a collective of its own (one that could
    half-succeed after its request was reported done)."""

    grad_norm: float | None = field(default=None, repr=False)  # the whole norm of the committed gradient
    _summed_norm: float | None = field(default=None, repr=False)  # ... of the gradient `commit` is about to make

    @property
    def info(self) -> ShardInfo:
        return require_sharded(self.base.model)

    @classmethod
    def create(cls, model_id: str, base: LoadedModel, base_model: str, op: m.CreateModel, *, seed: int | None,
               device: torch.device) -> ShardedAdapter:
        """This worker's shard of the adapter a single worker would create. Every member of the generation must
        call this in the same order: an unseeded adapter's seed is agreed on by broadcast, unless `seed` is given
        (a placeholder whose state is sent)."""
        if op.state is not None:
            state = restore_sharded_adapter(model_id, base.model, op.state, with_optimizer=op.with_optimizer,
                                            device=device, optimizer=op.optimizer)
        else:
            state = create_sharded_adapter(model_id, base.model, op.lora, device=device,
                                           seed=_shared_seed(op.lora) if seed is None else seed)
            state.optimizer = op.optimizer
        return cls(state, base, base_model)

    @classmethod
    def sampler(cls, path: str, base: LoadedModel, base_model: str, checkpoint: m.CheckpointState, *,
                device: torch.device) -> ShardedAdapter:
        shard = shard_checkpoint(checkpoint, require_sharded(base.model))
        return cls(sampler_adapter(path, base.model, shard, device=device), base, base_model)

    def parameter_count(self) -> int:
        return full_parameter_count(self.state, self.info)

    @property
    def checksum_key(self) -> str:
        """Replicas of the same shard must agree; different shards of one adapter differ by nature."""
        return f"{self.state.model_id}/shard{self.info.rank}"

    def whole_checksum(self) -> float | None:
        return None

    def sum_grads(self, group: CollectiveGroup) -> None:
        """The factors each holder only saw a share of summed in the replica's group (`reduce_shared_grads`),
        then everything across replicas; then the whole adapter's norm of the gradient the commit will make."""
        state, info = self.state, self.info
        group.guard(lambda: reduce_shared_grads(state, info, group.tp_group))
        group.all_reduce_replicas_(state.pending_grad)
        total = state.grad + state.pending_grad
        self._summed_norm = group.guard(lambda: sharded_grad_norm(state, info, group.tp_group, grad=total))

    def commit(self) -> float:
        engine.commit_gradients(self.state)  # its norm is the shard's, not the whole adapter's
        self.grad_norm, self._summed_norm = self._summed_norm, None
        return self.grad_norm

    def discard(self) -> None:
        super().discard()
        self._summed_norm = None

    def optim_step(self, params: t.AdamParams | t.DimuonParams, group: CollectiveGroup) -> t.OptimStepResponse:
        """Clipped by the norm taken at the commit; without one (after a load or a new generation) the step
        takes it itself, in the replica's group."""
        norm, self.grad_norm = self.grad_norm, None
        return group.guard(lambda: sharded_optim_step(self.state, params, self.info, group.tp_group, grad_norm=norm))

    def whole(self, group: CollectiveGroup) -> AdapterState:
        """Gathered from the shard holders of this member's replica."""
        return group.guard(lambda: gather_full_adapter(self.state, self.info, group.tp_group))

    def load(self, checkpoint: m.CheckpointState, *, with_optimizer: bool) -> None:
        """The checkpoint loads into a whole adapter first, which is then cut into this shard."""
        self.grad_norm = None  # the load drops the committed gradient
        shard, info = self.state, self.info
        targets = [info.full_target(target.module_name) for target in shard.targets]
        full = AdapterState(shard.model_id, shard.config, targets, shard.seed, shard.params.device)
        full.optimizer = shard.optimizer
        load_into(full, checkpoint, with_optimizer=with_optimizer)
        copy_full_into_shard(full, shard, info)

    def take_from_replica(self, group: CollectiveGroup, replica: int = 0) -> None:
        self.grad_norm = None  # every holder takes the norm afresh, in the same collectives
        super().take_from_replica(group, replica)

    def held(self) -> HeldState:
        return HeldState(self.state, self.info)

    def cut_from_whole(self, group: CollectiveGroup, whole: AdapterState | None) -> None:
        self.grad_norm = None  # every holder takes the norm afresh
        super().cut_from_whole(group, whole)

    def _whole_layout(self) -> AdapterState:
        shard, info = self.state, self.info
        return AdapterState(shard.model_id, shard.config, [info.full_target(t.module_name) for t in shard.targets],
                            shard.seed, shard.params.device)

    def _keep(self, full: AdapterState) -> None:
        copy_full_into_shard(full, self.state, self.info)


def _shared_seed(lora: t.LoraConfig) -> int:
    try:
        return shared_seed(lora)
    except Exception as exc:
        raise TensorParallelError(f"could not agree on an adapter seed: {exc}") from exc
