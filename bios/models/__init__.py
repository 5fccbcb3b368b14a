"""Base-model registry: names -> local Hugging Face directories -> frozen models and tokenizers."""

from bios.models.cache import cache_dir
from bios.models.loading import LoadedModel, load_base_model, load_tokenizer
from bios.models.registry import (
    ModelEntry,
    UnknownModelError,
    list_models,
    model_info,
    pull,
    resolve_model_dir,
    set_model_map,
)

__all__ = [
    "LoadedModel",
    "ModelEntry",
    "UnknownModelError",
    "cache_dir",
    "list_models",
    "load_base_model",
    "load_tokenizer",
    "model_info",
    "pull",
    "resolve_model_dir",
    "set_model_map",
]
