"""What a worker holds: one copy of each base model, shared by any number of LoRA adapters."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError, NotFoundError
from bios.models import LoadedModel, UnknownModelError, load_base_model

from .adapter import AdapterState, validate_lora_config
from .checkpoint import restore_adapter, sampler_adapter
from .lora import attach_lora

log = logging.getLogger(__name__)


@dataclass
class Adapter:
    """A training run's adapter and the base model it sits on."""

    state: AdapterState
    base: LoadedModel
    base_model: str


@dataclass
class ModelPool:
    device: torch.device
    bases: dict[str, LoadedModel] = field(default_factory=dict)
    adapters: dict[str, Adapter] = field(default_factory=dict)
    samplers: dict[str, Adapter] = field(default_factory=dict)  # sampler checkpoints by path
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def base(self, name: str) -> LoadedModel:
        with self._lock:
            loaded = self.bases.get(name)
            if loaded is None:
                started = time.monotonic()
                try:
                    loaded = load_base_model(name, device=self.device)
                except UnknownModelError as exc:
                    raise BadRequestError(str(exc), field="base_model") from None
                attach_lora(loaded.model)
                self.bases[name] = loaded
                log.info("loaded base model %s (%d parameters) in %.1fs",
                         name, loaded.info.num_parameters, time.monotonic() - started)
            return loaded

    def create(self, op: m.CreateModel, *, model_id: str | None = None) -> m.ModelCreated:
        model_id = model_id or f"{op.session_id}:train:{op.model_seq_id}"
        base = self.base(op.base_model)
        validate_lora_config(base.model, op.lora)
        if op.state is not None:
            state = restore_adapter(model_id, base.model, op.state, with_optimizer=op.with_optimizer,
                                    device=self.device)
        else:
            state = AdapterState.create(model_id, base.model, op.lora, device=self.device)
        self.adapters[model_id] = Adapter(state, base, op.base_model)
        return m.ModelCreated(model_id, base.info, op.lora.rank, state.num_parameters())

    def add_sampler(self, path: str, base_model: str, checkpoint: m.CheckpointState) -> None:
        base = self.base(base_model)
        self.samplers[path] = Adapter(sampler_adapter(path, base.model, checkpoint, device=self.device), base,
                                      base_model)

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
