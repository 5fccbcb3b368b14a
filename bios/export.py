"""Export a checkpoint to standard Hugging Face formats, on the client: a PEFT adapter or a merged model.

A Bios checkpoint already stores the LoRA matrices under PEFT's key names with PEFT's scaling convention
(`lora_alpha / r`), so a PEFT adapter directory is the tensors plus an `adapter_config.json`; a merged model
is the base model with that adapter folded into its weights.

An adapter names its base model the way vLLM and PEFT users look it up: by its Hugging Face hub id when it has
one (SmolLM2, any name mapped to a local directory), else by the local directory. The directory the exporting
host resolved goes into `bios-export.json` beside it: PEFT warns about keys it does not know in its own config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

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
    import peft
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
    peft_model = peft.get_peft_model(model, _lora_config(state, str(loaded.info.local_dir)))
    tensors = {key: torch.tensor(np.asarray(value), dtype=torch.float32) for key, value in state.adapter.items()}
    result = peft.set_peft_model_state_dict(peft_model, tensors)
    missing_lora = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing_lora:
        raise ValueError(
            f"checkpoint tensors do not fit {base_model}: unexpected {result.unexpected_keys[:3]}, "
            f"missing {missing_lora[:3]}"
        )
    merged = peft_model.merge_and_unload()
    out_dir = Path(out_dir)
    save_model_files(merged, out_dir)
    loaded.tokenizer.save_pretrained(str(out_dir))
    return out_dir


def _lora_config(state: CheckpointState, base_model_dir: str) -> peft.LoraConfig:
    import peft

    metadata: dict[str, Any] = state.metadata
    missing = [key for key in _NEEDED_METADATA if key not in metadata]
    if missing or metadata["format"] != _FORMAT:
        raise ValueError(
            f"not a Bios LoRA checkpoint (format {metadata.get('format')!r}, missing metadata {missing}): export "
            "needs a checkpoint saved by save_state or save_weights_for_sampler"
        )
    return peft.LoraConfig(
        r=int(metadata["rank"]),
        lora_alpha=metadata["lora_alpha"],
        target_modules=list(metadata["target_modules"]),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_dir,
    )
