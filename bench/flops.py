"""Matmul FLOPs of one LoRA training step, counted from the model's shapes, and the GEMM peak they are measured
against ("MFU": achieved matmul FLOP/s over the measured FLOP/s of one large GEMM in the same dtype, same device,
same threads).

The count is the matmul work a step cannot avoid, 2 FLOPs per multiply-add, for T tokens in rows of lengths s_i:

- frozen linear layers (every `nn.Linear` of the model, the output head included, weights W [out, in]):
  forward x W^T and the input gradient dy W, no weight gradient: 4 * in * out per token;
- each LoRA target (in, out) of rank r: forward (x A^T) B^T, 2r(in + out); backward dB, d(xA), dA, dx,
  4r(in + out): 6r(in + out) per token;
- attention, per layer and row of length s with causal masking (the s(s+1)/2 query-key pairs that are needed):
  QK^T and PV forward, 2 * 2 * heads * head_dim per pair, and twice that in backward (dQ, dK from dS; dP, dV):
  12 * heads * head_dim * s(s+1)/2 per row.

Norms, activations, softmax, the loss and the optimizer are not matmuls and are left out (they are memory-bound
and small next to the above), so MFU here reads as "how close the step's matmuls run to the GEMM peak".
A padded batch does the same useful work as a packed one: padding is counted as waste, not as FLOPs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from bios import types
from bios.kernels.frozen_matmul import onednn_linear
from bios.worker.adapter import lora_targets


@dataclass(frozen=True)
class StepFlops:
    frozen: float
    lora: float
    attention: float

    @property
    def total(self) -> float:
        return self.frozen + self.lora + self.attention


def training_step_flops(model: nn.Module, row_lengths: list[int], rank: int) -> StepFlops:
    """Matmul FLOPs of forward + backward over rows of `row_lengths` tokens with LoRA of `rank` on every target
    the default `LoraConfig` trains (the formula is in the module docstring)."""
    tokens = sum(row_lengths)
    frozen = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    adapted = sum(t.in_features + t.out_features for t in lora_targets(model, types.LoraConfig(rank=rank)))
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    pairs = sum(s * (s + 1) // 2 for s in row_lengths)
    return StepFlops(
        frozen=4.0 * frozen * tokens,
        lora=6.0 * rank * adapted * tokens,
        attention=12.0 * config.num_hidden_layers * heads * head_dim * pairs,
    )


def gemm_peak(dtype: torch.dtype, device: torch.device, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of one `size`^3 matmul in `dtype` on `device` with the current threads (median of `repeats`,
    after a warm-up), on random data: the ceiling a training step's matmuls are compared with. On CPU the
    faster of PyTorch's own matmul and oneDNN's (`bios.kernels.frozen_matmul`; for fp32 PyTorch calls MKL),
    so MFU is measured against the best GEMM the machine has, not the one the reference happens to use."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    candidates = [lambda: torch.mm(a, b)]
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        candidates.append(lambda: onednn_linear(a, b))
    return max(_flops_per_second(matmul, 2.0 * size**3, device, repeats) for matmul in candidates)


def _flops_per_second(matmul, flops: float, device: torch.device, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        matmul()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return flops / statistics.median(times)
