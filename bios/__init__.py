"""Bios: a self-hostable LoRA fine-tuning service with a Tinker-compatible API.

    import bios
    service = bios.ServiceClient()            # no address: an embedded local cluster
    tc = service.create_lora_training_client(base_model="bios/tiny-llama", rank=16)
"""

__version__ = "0.1.0"

from bios import exceptions, types  # noqa: E402
from bios.sdk import (  # noqa: E402
    APIFuture,
    LocalCluster,
    RestClient,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)

__all__ = [
    "APIFuture", "LocalCluster", "RestClient", "SamplingClient", "ServiceClient", "TrainingClient",
    "exceptions", "types", "__version__",
]
