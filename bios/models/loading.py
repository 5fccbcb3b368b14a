"""Load a base model and its tokenizer by name, frozen and ready to carry LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bios.models.registry import base_model_info, resolve_model_dir
from bios.types import BaseModelInfo

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, every parameter frozen, on the requested device
    tokenizer: PreTrainedTokenizerBase
    info: BaseModelInfo
    image_processor: Any = None  # a vision-language model's (`info.vision` is set too); None for text only


def load_base_model(
    name: str, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> LoadedModel:
    """Resolve `name` (writing or pulling it on first use) and load it; `dtype` defaults to float32."""
    import torch

    directory = resolve_model_dir(name)
    model = model_class(directory).from_pretrained(
        directory, dtype=torch.float32 if dtype is None else dtype, local_files_only=True
    )
    model.to(torch.device(device))
    model.eval()
    model.requires_grad_(False)
    num_parameters = sum(p.numel() for p in model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=_tokenizer_from(directory),
        info=base_model_info(name, directory, model.config, num_parameters),
        image_processor=_image_processor_from(directory),
    )


def model_class(directory: Path) -> Any:
    """The Transformers auto class of the model in `directory`: image-text-to-text for a vision-language model
    (its config has a `vision_config`), else causal LM."""
    import json

    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = json.loads((directory / "config.json").read_text())
    return AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM


def _image_processor_from(directory: Path) -> Any:
    if not (directory / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(directory, local_files_only=True)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    return _tokenizer_from(resolve_model_dir(name))


def _tokenizer_from(directory: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {directory}: {exc}; a base model directory needs its tokenizer "
            f"files (tokenizer.json and tokenizer_config.json, as save_pretrained writes them)"
        ) from exc
