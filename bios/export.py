"""Export a checkpoint to standard Hugging Face formats, on the client: a PEFT adapter or a merged model.

A Bios checkpoint already stores the LoRA matrices under PEFT's key names and layouts with PEFT's scaling
convention (`lora_alpha / r`), so a PEFT adapter directory is the tensors plus an `adapter_config.json`
(`target_modules` for linear and Conv1D layers, `target_parameters` for 3D routed-expert weights); a merged
model is the base model with that adapter folded into its weights.

An adapter names its base model the way vLLM and PEFT users look it up: by its Hugging Face hub id when it has
one (SmolLM2, any name mapped to a local directory), else by the local directory. The directory the exporting
host resolved goes into `bios-export.json` beside it: PEFT warns about keys it does not know in its own config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bios.merge import merge_adapter
from bios.messages import CheckpointState
from bios.models.cache import save_model_files
from bios.models.registry import BUILTIN_NAMES, PULLABLE_NAMES, canonical_name, model_map

if TYPE_CHECKING:
    import peft

_FORMAT = "bios-lora"
_NEEDED_METADATA = ("format", "arch", "rank", "lora_alpha", "target_modules")
EXPORT_INFO = "bios-export.json"


def hub_model_id(name: str) -> str | None:
    """The Hugging Face hub id base model `name` stands for: a pulled model's, or a mapped `org/name`; None for
    built-ins and directories, which have none."""
    name = canonical_name(name)
    if name in PULLABLE_NAMES:
        return name
    if name in BUILTIN_NAMES or name not in model_map():
        return None
    org, _, repo = name.partition("/")
    return name if org and repo and "/" not in repo and not name.startswith((".", "~")) else None


def write_peft_adapter(state: CheckpointState, out_dir: Path, *, base_model_dir: str,
                       base_model: str | None = None) -> Path:
    """Write `adapter_config.json`, `adapter_model.safetensors` and `bios-export.json` into `out_dir`.

    `peft.PeftModel.from_pretrained(base, out_dir)` loads the result. Its `base_model_name_or_path` is the hub id
    of `base_model` when it has one, else `base_model_dir` (the base model's local directory, `bios models path
    NAME`); `bios-export.json` records both names and that directory. Returns `out_dir`.
    """
    from safetensors.numpy import save_file

    hub_id = hub_model_id(base_model) if base_model else None
    config = _lora_config(state, hub_id or base_model_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    info = {"base_model": base_model, "hub_model_id": hub_id, "base_model_dir": base_model_dir}
    (out_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    tensors = {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in state.adapter.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out_dir


def write_merged_model(state: CheckpointState, out_dir: Path, *, base_model: str) -> Path:
    """Write the base model with the adapter merged in (safetensors, float32) plus its tokenizer; returns `out_dir`.

    `AutoModelForCausalLM.from_pretrained(out_dir)` loads it with no PEFT needed. When the base model ties its
    output head to its input embeddings and the adapter trains the head, the merged model unties them:
    merging into a shared matrix would change the input embeddings too.
    """
    import torch

    from bios.models import load_base_model

    loaded = load_base_model(base_model)
    model = loaded.model
    arch = model.config.model_type
    if state.metadata.get("arch") != arch:
        raise ValueError(
            f"checkpoint was trained on a {state.metadata.get('arch')} model ({state.metadata.get('base_model')}), "
            f"{base_model} is a {arch}: merge it into the base model it was trained on"
        )
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    head_name = next(name for name, module in model.named_modules() if module is head)
    if head_name in state.metadata["target_modules"] and head.weight is embeddings.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.get_text_config().tie_word_embeddings = False
        model.config.tie_word_embeddings = False
    try:
        merge_adapter(model, state.adapter, _bios_metadata(state))
    except ValueError as error:
        raise ValueError(f"cannot merge into {base_model}: {error}") from None
    out_dir = Path(out_dir)
    save_model_files(model, out_dir)
    loaded.tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _bios_metadata(state: CheckpointState) -> dict[str, Any]:
    metadata: dict[str, Any] = state.metadata
    missing = [key for key in _NEEDED_METADATA if key not in metadata]
    if missing or metadata["format"] != _FORMAT:
        raise ValueError(
            f"not a Bios LoRA checkpoint (format {metadata.get('format')!r}, missing metadata {missing}): export "
            "needs a checkpoint saved by save_state or save_weights_for_sampler"
        )
    return metadata


def _lora_config(state: CheckpointState, base_model_dir: str) -> peft.LoraConfig:
    import peft

    metadata = _bios_metadata(state)
    parameters = list(metadata.get("target_parameters", []))
    modules = [name for name in metadata["target_modules"] if name not in set(parameters)]
    return peft.LoraConfig(
        r=int(metadata["rank"]),
        lora_alpha=metadata["lora_alpha"],
        target_modules=modules or None,
        target_parameters=parameters or None,
        fan_in_fan_out=bool(metadata.get("fan_in_fan_out", False)),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_dir,
    )
