"""Bios: a self-hostable LoRA fine-tuning service with a Tinker-compatible API.

    import bios
    service = bios.ServiceClient()            # no address: an embedded local cluster
    tc = service.create_lora_training_client(base_model="bios/tiny-llama", rank=16)

The client classes load on first use, so `import bios` stays cheap and the daemons never load the SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SDK_NAMES = ("APIFuture", "LocalCluster", "RestClient", "SamplingClient", "ServiceClient", "TrainingClient")
_MODULES = ("exceptions", "types")

__all__ = [*_SDK_NAMES, *_MODULES, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        return getattr(importlib.import_module("bios.sdk"), name)
    if name in _MODULES:
        return importlib.import_module(f"bios.{name}")
    raise AttributeError(f"module 'bios' has no attribute {name!r}")
