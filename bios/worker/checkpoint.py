"""AdapterState <-> CheckpointState: what save_state, load_state and sampler swaps move between processes.

A checkpoint holds the LoRA matrices as numpy arrays under PEFT's key names (so an export is a file copy),
optionally the Adam moments and step count, and metadata that says how to rebuild the adapter: rank, alpha,
seed, which layers it trains, and which base model it was trained on.

The optimizer state is AdamW's moments or Dimuon's momentum (in `exp_avg`), as the metadata's `optimizer` says;
it loads only into a run of the same optimizer. Loading without the optimizer resets it: zero moments and step 0, so the next step is a bias-corrected
first step from the loaded weights, as in a fresh run. Loading with it continues exactly where the saved run
stopped. Either way a load drops any gradient accumulated but not yet applied.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from bios.exceptions import BadRequestError
from bios.messages import CheckpointState
from bios.types import BaseModelInfo, LoraConfig, OptimizerName
from bios.worker.adapter import AdapterState, lora_targets

FORMAT = "bios-lora"
FORMAT_VERSION = 1
_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")


def export_state(
    adapter: AdapterState, *, base_model: str, base_info: BaseModelInfo, with_optimizer: bool
) -> CheckpointState:
    """A copy of `adapter` as numpy arrays (PEFT key names) plus metadata; the Adam state if `with_optimizer`."""
    if with_optimizer and not adapter.trainable:
        raise ValueError(f"adapter {adapter.model_id} is a params-only (sampler) copy: it has no optimizer state")
    tensors = {key: value.cpu().numpy() for key, value in adapter.state_dict().items()}
    optimizer = None
    if with_optimizer:
        optimizer = {key: value.cpu().numpy() for key, value in adapter.optimizer_state().items()}
    alpha = adapter.scale * adapter.config.rank
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model": base_model,
        "base_model_dir": base_info.local_dir,
        "arch": base_info.arch,
        "rank": adapter.config.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "seed": adapter.seed,
        "train_mlp": adapter.config.train_mlp,
        "train_attn": adapter.config.train_attn,
        "train_unembed": adapter.config.train_unembed,
        "train_vision": adapter.config.train_vision,
        "target_modules": [target.module_name for target in adapter.targets],
        # for export: which targets are 3D expert parameters (PEFT `target_parameters`), and whether some are
        # Conv1D layers, whose weights PEFT reads transposed (`fan_in_fan_out`)
        "target_parameters": [target.module_name for target in adapter.targets if target.kind == "experts"],
        "fan_in_fan_out": any(target.kind == "conv1d" for target in adapter.targets),
        "step": adapter.step,
        "optimizer": adapter.optimizer,
        "created": time.time(),
    }
    return CheckpointState(adapter=tensors, optimizer=optimizer, metadata=metadata)


def restore_adapter(
    model_id: str, model: nn.Module, state: CheckpointState, *, with_optimizer: bool, device: torch.device | str,
    optimizer: OptimizerName = "adamw",
) -> AdapterState:
    """A trainable adapter of the run's `optimizer` for `model` rebuilt from a checkpoint (see the module
    docstring for the optimizer state).

    Raises `BadRequestError` (field "path") if the checkpoint does not fit `model`.
    """
    adapter = _empty_adapter(model_id, model, state, device, trainable=True)
    adapter.optimizer = optimizer
    load_into(adapter, state, with_optimizer=with_optimizer)
    return adapter


def sampler_adapter(
    model_id: str, model: nn.Module, state: CheckpointState, *, device: torch.device | str
) -> AdapterState:
    """A params-only adapter for sampling (no gradient or moment buffers), rebuilt from a checkpoint."""
    adapter = _empty_adapter(model_id, model, state, device, trainable=False)
    _load_params(adapter, state)
    return adapter


def load_into(adapter: AdapterState, state: CheckpointState, *, with_optimizer: bool) -> None:
    """Replace a live adapter's weights (and Adam state, or reset it) with a checkpoint's; all or nothing.

    The checkpoint must match the adapter's rank and target layers. Any gradient accumulated since the
    last optimizer step is dropped: it was computed for the weights being replaced.
    """
    if with_optimizer and not adapter.trainable:
        raise ValueError(f"adapter {adapter.model_id} is a params-only (sampler) copy: it cannot hold optimizer state")
    _check_format(state)
    metadata = state.metadata
    if metadata["rank"] != adapter.config.rank or list(metadata["target_modules"]) != [
        target.module_name for target in adapter.targets
    ]:
        raise BadRequestError(
            f"checkpoint (rank {metadata['rank']}, {len(metadata['target_modules'])} target layers) does not fit "
            f"run {adapter.model_id} (rank {adapter.config.rank}, {len(adapter.targets)} target layers): load it "
            "into a run created with the same LoRA config, or create a new run from it",
            field="path",
        )
    saved_optimizer = metadata.get("optimizer", "adamw")
    if with_optimizer and saved_optimizer != adapter.optimizer:
        raise BadRequestError(
            f"checkpoint holds {saved_optimizer} optimizer state, but run {adapter.model_id} trains with "
            f"{adapter.optimizer}: load its weights only (load_state), or create a run from it with its optimizer",
            field="path",
        )
    optimizer = _optimizer_tensors(adapter, state) if with_optimizer else None
    _load_params(adapter, state)
    adapter.scale = float(metadata["lora_alpha"]) / adapter.config.rank
    with torch.no_grad():
        adapter.grad.zero_()
        adapter.pending_grad.zero_()
        if optimizer is None:
            adapter.exp_avg.zero_()
            adapter.exp_avg_sq.zero_()
            adapter.step = 0
        else:
            adapter.load_optimizer_state(optimizer)


def _check_format(state: CheckpointState) -> None:
    metadata = state.metadata
    if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise BadRequestError(
            f"checkpoint format {metadata.get('format')!r} version {metadata.get('format_version')!r} is not one "
            f"this worker reads ({FORMAT!r} version {FORMAT_VERSION})",
            field="path",
        )
    missing = [key for key in ("arch", "rank", "lora_alpha", "seed", "target_modules") if key not in metadata]
    if missing:
        raise BadRequestError(f"checkpoint metadata lacks {missing}: the checkpoint is damaged", field="path")


def _empty_adapter(
    model_id: str, model: nn.Module, state: CheckpointState, device: torch.device | str, *, trainable: bool
) -> AdapterState:
    """A zero adapter with the checkpoint's config on `model`, after checking the checkpoint fits it."""
    _check_format(state)
    metadata = state.metadata
    arch = model.config.model_type
    if metadata["arch"] != arch:
        raise BadRequestError(
            f"checkpoint was trained on a {metadata['arch']} model ({metadata.get('base_model')}), this base model "
            f"is a {arch}: sample or train it on its own base model",
            field="path",
        )
    config = LoraConfig(
        rank=int(metadata["rank"]),
        seed=int(metadata["seed"]),
        train_mlp=bool(metadata.get("train_mlp", True)),
        train_attn=bool(metadata.get("train_attn", True)),
        train_unembed=bool(metadata.get("train_unembed", True)),
        train_vision=bool(metadata.get("train_vision", False)),
    )
    targets = lora_targets(model, config)
    names = [target.module_name for target in targets]
    if names != list(metadata["target_modules"]):
        unknown = sorted(set(metadata["target_modules"]) - set(names))
        raise BadRequestError(
            f"checkpoint targets layers this base model does not have or does not train the same way "
            f"(checkpoint: {len(metadata['target_modules'])} layers, model: {len(names)}; e.g. {unknown[:3]}): "
            f"was it saved from another base model than {metadata.get('base_model')}?",
            field="path",
        )
    adapter = AdapterState(model_id, config, targets, int(metadata["seed"]), device, trainable=trainable)
    adapter.scale = float(metadata["lora_alpha"]) / config.rank
    return adapter


def _load_params(adapter: AdapterState, state: CheckpointState) -> None:
    tensors = {key: torch.tensor(np.asarray(value), dtype=torch.float32) for key, value in state.adapter.items()}
    try:
        adapter.load_state_dict(tensors)
    except ValueError as error:
        raise BadRequestError(f"checkpoint does not fit this adapter: {error}", field="path") from None


def _optimizer_tensors(adapter: AdapterState, state: CheckpointState) -> dict[str, torch.Tensor]:
    """The checkpoint's Adam state as tensors, checked against `adapter` before anything is loaded."""
    if state.optimizer is None:
        raise BadRequestError(
            "checkpoint holds no optimizer state (sampler weights are saved without it): load it without the "
            "optimizer (load_state), or load a save_state checkpoint",
            field="path",
        )
    if set(state.optimizer) != set(_OPTIMIZER_KEYS):
        raise BadRequestError(
            f"checkpoint optimizer state has keys {sorted(state.optimizer)}, expected {list(_OPTIMIZER_KEYS)}",
            field="path",
        )
    for key in ("exp_avg", "exp_avg_sq"):
        if tuple(np.shape(state.optimizer[key])) != tuple(adapter.params.shape):
            raise BadRequestError(
                f"checkpoint optimizer {key} has shape {tuple(np.shape(state.optimizer[key]))}, this adapter needs "
                f"{tuple(adapter.params.shape)}",
                field="path",
            )
    step = np.asarray(state.optimizer["step"])
    if step.size != 1 or int(step.reshape(-1)[0]) < 0:
        raise BadRequestError(f"checkpoint optimizer step must be one integer >= 0, got {step!r}", field="path")
    return {
        "exp_avg": torch.tensor(np.asarray(state.optimizer["exp_avg"]), dtype=torch.float32),
        "exp_avg_sq": torch.tensor(np.asarray(state.optimizer["exp_avg_sq"]), dtype=torch.float32),
        "step": torch.tensor(int(step.reshape(-1)[0]), dtype=torch.int64),
    }
