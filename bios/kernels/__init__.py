"""Fused training ops in plain PyTorch (no Triton): the same code runs on CPU and CUDA."""

from bios.kernels.adamw import adamw_step
from bios.kernels.cross_entropy import linear_cross_entropy, linear_weighted_loss
from bios.kernels.lora import lora_linear, lora_linear_multi
from bios.kernels.norms import rms_norm, swiglu

__all__ = [
    "adamw_step", "linear_cross_entropy", "linear_weighted_loss", "lora_linear", "lora_linear_multi", "rms_norm",
    "swiglu",
]
