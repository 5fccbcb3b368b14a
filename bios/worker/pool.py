"""What a worker holds: one copy of each base model, shared by any number of LoRA adapters.

Under tensor parallelism (`configure` with tp > 1) each base model is held as this worker's shard, loaded
slice by slice so the whole model never has to fit, and adapters are shards of the whole adapter: the kind of
each adapter (`adapter_kinds`) is read off its base model when it is made. Each base model is held as its
memory plan says (activation checkpointing, tokens per pass).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from bios import messages as m
from bios.exceptions import BadRequestError, NotFoundError
from bios.models import LoadedModel, UnknownModelError, load_base_model, load_tokenizer, model_info
from bios.models import resolve_model_dir

from .adapter_kinds import Adapter, adapter_kind
from .attention import can_use_bios_attention
from .lora import attach_lora
from .memory_plan import disable_activation_checkpointing, enable_activation_checkpointing
from .targets import target_groups
from .tensor_parallel import load_sharded_model, rebind_group, shard_info

__all__ = ["Adapter", "ModelPool"]

log = logging.getLogger(__name__)


@dataclass
class ModelPool:
    device: torch.device
    bases: dict[str, LoadedModel] = field(default_factory=dict)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    samplers: dict[str, Adapter] = field(default_factory=dict)  # sampler checkpoints by path
    tp: int = 1  # tensor-parallel size: base models are held as shard `tp_rank` of `tp`
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    plans: dict[str, m.ModelPlan] = field(default_factory=dict)
    _shards: dict[str, tuple[int, int]] = field(default_factory=dict)  # each base's shard: (tp, tp_rank)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def configure(self, tp: int, tp_rank: int, plans: list[m.ModelPlan]) -> None:
        """Hold base models as shard `tp_rank` of `tp` with these plans from now on. A base held otherwise is
        dropped, with its adapters and samplers: the caller re-creates them (and receives their state). With
        `plans`, a base none of them names is dropped too: the worker's group holds other models now."""
        self.tp, self.tp_rank = tp, tp_rank
        self.plans = {plan.base_model: plan for plan in plans}
        for name in list(self.bases):
            if self.plans and name not in self.plans:
                log.info("dropping base model %s: this worker's group holds other models now", name)
            elif self._shards[name] != (tp, tp_rank):
                log.info("dropping base model %s: it is now held as shard %d of %d", name, tp_rank, tp)
            else:  # the same shard: a new plan may switch activation checkpointing, in place; the adapters stay
                self._checkpoint_as_planned(name)
                continue
            del self.bases[name]
            del self._shards[name]
            for table in (self.adapters, self.samplers):
                for key in [key for key, adapter in table.items() if adapter.base_model == name]:
                    del table[key]

    def bind_group(self, group: dist.ProcessGroup | None) -> None:
        """Point every sharded base model's all-reduces at this generation's tensor-parallel group."""
        self.tp_group = group
        for loaded in self.bases.values():
            if shard_info(loaded.model) is not None:
                rebind_group(loaded.model, group)

    def _checkpoint_as_planned(self, name: str) -> None:
        """Checkpoint `name`'s activations or not, as its plan says (both switches are idempotent). Neither this
        nor the pass size (`tokens_per_pass`, read at each pass) reloads the base, so every adapter stays."""
        checkpointing = self.plans.get(name, m.ModelPlan(name)).activation_checkpointing
        (enable_activation_checkpointing if checkpointing else disable_activation_checkpointing)(self.bases[name].model)

    def tokens_per_pass(self, name: str) -> int:
        return self.plans.get(name, m.ModelPlan(name)).tokens_per_pass

    def base(self, name: str) -> LoadedModel:
        with self._lock:
            loaded = self.bases.get(name)
            if loaded is None:
                started = time.monotonic()
                plan = self.plans.get(name, m.ModelPlan(name))
                try:
                    loaded, held_as = self._load(name)
                except UnknownModelError as exc:
                    raise BadRequestError(str(exc), field="base_model") from None
                attach_lora(loaded.model)
                weights = loaded.model.get_input_embeddings().weight
                loaded.info = replace(loaded.info, base_dtype=str(weights.dtype).removeprefix("torch."),
                                      splits_long_rows=can_use_bios_attention(loaded.model))
                self.bases[name] = loaded
                self._shards[name] = (self.tp, self.tp_rank)
                self._checkpoint_as_planned(name)
                log.info("loaded base model %s (%d parameters%s) in %.1fs, plan %s", name,
                         loaded.info.num_parameters, held_as, time.monotonic() - started, plan)
            return loaded

    def _load(self, name: str) -> tuple[LoadedModel, str]:
        """The base model as this worker holds it (whole, or its shard), and how, for the log."""
        if self.tp == 1:
            return load_base_model(name, device=self.device), ""
        model, _ = load_sharded_model(resolve_model_dir(name), self.tp_rank, self.tp, self.tp_group,
                                      device=self.device)
        return LoadedModel(model, load_tokenizer(name), model_info(name)), f", shard {self.tp_rank} of {self.tp}"

    def create(self, op: m.CreateModel, *, model_id: str | None = None, seed: int | None = None) -> m.ModelCreated:
        """A run's adapter, of the kind its base model takes (`adapter_kind`). Sharded, every member of the
        generation must call this in the same order (the adapter's seed is agreed on by broadcast) unless `seed`
        is given (a placeholder whose state is sent)."""
        model_id = model_id or op.target
        base = self.base(op.base_model)
        adapter = adapter_kind(base).create(model_id, base, op.base_model, op, seed=seed, device=self.device)
        self.adapters[model_id] = adapter
        return m.ModelCreated(model_id, base.info, op.lora.rank, adapter.parameter_count(),
                              target_groups(base.model, op.lora))

    def add_sampler(self, path: str, base_model: str, checkpoint: m.CheckpointState) -> None:
        base = self.base(base_model)
        self.samplers[path] = adapter_kind(base).sampler(path, base, base_model, checkpoint, device=self.device)

    def sampler(self, path: str) -> Adapter:
        adapter = self.samplers.get(path)
        if adapter is None:
            raise NotFoundError(f"this worker holds no sampler weights for {path}")
        return adapter

    def adapter(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise NotFoundError(f"this worker holds no adapter for {model_id}")
        return adapter
