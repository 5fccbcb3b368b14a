"""The two matmuls against a frozen base weight W [out, in]: `x Wᵀ (+ b)` forward and `g W` for the input's
gradient, on the faster of the CPU's two GEMM libraries.

PyTorch's CPU build sends fp32 matmuls to MKL's sgemm and bf16 ones to oneDNN. On an AMD EPYC (AVX-512,
torch 2.13.0+cpu, 2 threads) oneDNN's fp32 GEMM ran 1.1-1.2x MKL's on a training step's shapes (512 x 1536 x
576: 207 vs 178 GFLOP/s; 2048^3: 212 vs 177) and 1.2-2.3x on a decode step's few rows (16 rows through
SmolLM2's 49152 x 576 head: 103 vs 44 GFLOP/s); bf16 runs oneDNN either way. With oneDNN held to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`, as on an AVX2-only CPU) the decode step's wide products still gained (1.1-1.7x) but
a training step lost (0.93x). MKL picks its kernels by the CPU's vendor, though: on an Intel Xeon (AMX, AVX-512,
2 threads) its sgemm beat oneDNN's on every training shape (0.81-0.95x for oneDNN, the head's logits into the
loss's buffer 0.94x; with both held to AVX2 0.77-1.00x; a whole fp32 step 1.56 s on MKL against 1.67 s) and on
a decode step's one row (1 x 576 -> 1536: 45 vs 27 GFLOP/s; the head alike). So on CPUs other than Intel's, fp32
CPU tensors go through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the op Inductor uses for CPU
linear layers) for a decode step's few rows through a large weight, a training pass's products where oneDNN
runs AVX-512, and a head's logits into the loss's buffer; everything else (MKL's lower call cost wins on small
products; every product on Intel's CPUs; GPUs, bf16, a build without oneDNN) through
`torch.nn.functional.linear` and `torch.mm` as before. (Decode steps on CPU mostly multiply by prepacked copies
instead: `bios.kernels.prepacked`.)
Results agree to fp32 rounding (another summation order).

`BIOS_GEMM` (`bios.kernels.gemm_choice`) is `auto` (unset: the rule above), `onednn` (every fp32 CPU product) or
`aten` (PyTorch's own choice everywhere). These are plain functions without autograd: their callers are
`torch.autograd.Function` forwards and backwards, and no-grad code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bios.kernels import gemm_choice
from bios.kernels.gemm_choice import gemm_backend
from bios.kernels.prepacked import LoraUpdate, MklPack, merges, prepacked, prepacked_stack
from bios.kernels.row_gemm import RowGemmPack

def gemm_library(weight: torch.Tensor) -> str:
    """Which library multiplies by `weight` (a frozen base weight), for the worker's log: `_onednn`'s rule asked
    for a training pass's rows and for a decode step's few rows through a wide weight."""
    if weight.device.type != "cpu":
        return f"PyTorch's {weight.device.type} matmul"
    if _onednn(weight.device, weight.dtype, _DECODE_ROWS + 1, weight.numel()):
        return f"oneDNN (BIOS_GEMM={gemm_backend()}; aten keeps PyTorch's MKL)"
    if _onednn(weight.device, weight.dtype, 1, _ONEDNN_MIN_WEIGHT):
        return ("MKL, and oneDNN for a decode step's wide products and a head's logits "
                "(BIOS_GEMM=onednn: oneDNN for all)")
    if weight.dtype == torch.float32 and gemm_backend() == "auto" and gemm_choice.intel_cpu():
        return "MKL, on an Intel CPU (BIOS_GEMM=onednn: oneDNN for all)"
    return "PyTorch's CPU matmul (oneDNN for bf16, MKL for fp32)"


# A decode step's few rows: oneDNN only through a large weight (16 rows through a 576 -> 192 projection: 0.74x,
# through the 49152 x 576 head: 2.07x; with oneDNN held to AVX2 0.64x and 1.69x).
_DECODE_ROWS = 64
_ONEDNN_MIN_WEIGHT = 1 << 19  # elements
# A training pass's rows through a wide weight into a buffer (the head's logits for the loss): oneDNN in blocks of
# output features, each result small enough to stay in cache and in the allocator's reused memory, then copied.
# SmolLM2's 512 x 576 -> 49152 (AMD EPYC): 150-153 ms against 176 ms in one oneDNN call plus its copy and 222 ms
# for MKL into the buffer; with oneDNN held to AVX2 162-168 against 208 ms for MKL (whose win elsewhere keeps it
# there). On an Intel Xeon MKL into the buffer took 99 ms against 105 (AVX2: 146 against 147), so MKL keeps it.
_OUT_BLOCK = 4096
_WIDE_OUT = 4 * _OUT_BLOCK


def _onednn(device: torch.device, dtype: torch.dtype, rows: int, weight_elements: int,
            wide_into_buffer: bool = False) -> bool:
    """Whether a product of `rows` rows by a weight of `weight_elements` goes to oneDNN (see the module docstring
    and the notes above); `wide_into_buffer`: the weight has `_WIDE_OUT`+ output features and the result goes
    into a caller's buffer."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    setting = gemm_backend()
    if setting == "aten" or not torch.backends.mkldnn.is_available():
        return False
    if setting == "onednn":
        return True
    if gemm_choice.intel_cpu():
        return False
    if rows <= _DECODE_ROWS:
        return weight_elements >= _ONEDNN_MIN_WEIGHT
    return _avx512() or wide_into_buffer


def _avx512() -> bool:
    """Whether oneDNN runs its AVX-512 kernels: a training step's products gained 1.10x from them, where its AVX2
    ones (`ONEDNN_MAX_CPU_ISA=AVX2` on the same CPU) lost to MKL's (the step 0.93x)."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and (limit in ("", "ALL") or "AVX512" in limit
                                                                     or limit.startswith("AVX10"))


def _routes_to_onednn(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    return x.dtype == weight.dtype and _onednn(x.device, x.dtype, x.numel() // x.shape[-1], weight.numel(),
                                               out is not None and weight.shape[0] >= _WIDE_OUT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`x Wᵀ + b` through oneDNN's linear, whatever the setting (the benches time it against PyTorch's); into
    `out` if given, `_OUT_BLOCK` output features at a time (oneDNN's op has no out= form: each block's result is
    copied, which costs less than its gain on a head's chunk). `weight` is a plain [out, in] tensor or view (a
    prepacked copy: `prepacked_linear`)."""
    if out is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    for start in range(0, weight.shape[0], _OUT_BLOCK):
        block = slice(start, start + _OUT_BLOCK)
        block_bias = None if bias is None else bias[block]
        out[..., block].copy_(torch.ops.mkldnn._linear_pointwise(x, weight[block], block_bias, "none", [], ""))
    return out


def prepacked_linear(x: torch.Tensor, copy: torch.Tensor | MklPack | RowGemmPack, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`x Wᵀ + b` by W's prepacked copy (`bios.kernels.prepacked`: oneDNN's blocked layout, which cannot be
    sliced, or an MKL pack), into `out` if given."""
    result = _copy_product(copy, bias)(x)
    return result if out is None else out.copy_(result)


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`x Wᵀ + b` for x [..., in], weight [out, in] (any strides), bias [out] or None; into `out` if given.
    Inside a `PrepackedWeights.using()` block (decode steps) through the weight's prepacked copy if it has one."""
    copy = _prepacked_copy(x, weight)
    if copy is not None:
        return prepacked_linear(x, copy, bias, out=out)
    if _routes_to_onednn(x, weight, out):
        return onednn_linear(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.addmm(bias, x, weight.T, out=out) if bias is not None else torch.mm(x, weight.T, out=out)


Product = Callable[[torch.Tensor], torch.Tensor]


def frozen_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Product:
    """`frozen_linear(·, weight, bias)` for inputs like `x` as a function of the input, the prepacked copy looked up
    now rather than at every call: a decode step resolves each projection once (the lookup and the settings it
    reads cost more than a small product's own call)."""
    copy = _prepacked_copy(x, weight)
    return partial(frozen_linear, weight=weight, bias=bias) if copy is None else _copy_product(copy, bias)


def _copy_product(copy: torch.Tensor | MklPack | RowGemmPack, bias: torch.Tensor | None) -> Product:
    if isinstance(copy, (MklPack, RowGemmPack)):
        return partial(copy.linear, bias=bias)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")


def adapter_copy_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                         lora_b: torch.Tensor, scale: float) -> Product | None:
    """`x Wᵀ + b + scale·(x Aᵀ) Bᵀ` for inputs like x [rows, in] through a prepacked copy with the adapter in it,
    inside a `PrepackedWeights.using(adapter=True)` block, as a function of the input: `merged_product` where the
    weight's dtype keeps a merged update (`prepacked.merges`), else `stacked_product`; None where there is no such
    copy."""
    product = merged_product if merges(weight.dtype) else stacked_product
    return product(x, weight, bias, lora_a, lora_b, scale)


def merged_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scale: float) -> Product | None:
    """`x (W + scale·B·A)ᵀ + b` through a prepacked copy of the merged weight inside a `PrepackedWeights.using()`
    block (a decode step whose rows all use one adapter); None where there is no such copy (outside a block,
    not fp32, `BIOS_GEMM=aten`, no room): the caller then adds the low-rank product itself."""
    copy = _prepacked_copy(x, weight, lora_a=lora_a, lora_b=lora_b, scale=scale)
    return None if copy is None else _copy_product(copy, bias)


def stacked_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scale: float) -> Product | None:
    """`x Wᵀ + b + scale·(x Aᵀ) Bᵀ` for x [rows, in] with `x Wᵀ` and `x Aᵀ` from one product by a prepacked copy of
    `[W; A]` inside a `PrepackedWeights.using()` block (a decode step whose rows all use one adapter); None where
    there is no such copy, and for a layer with a bias (added apart it would round a bf16 output once more): the
    caller then makes both products itself."""
    copy = None if bias is not None else _prepacked_copy(x, weight, lora_a=lora_a)
    if copy is None:
        return None
    both_product, out_features = _copy_product(copy, None), weight.shape[0]

    def stacked(x: torch.Tensor) -> torch.Tensor:
        both = both_product(x)
        return torch.addmm(both[:, :out_features], both[:, out_features:], lora_b.T, alpha=scale)

    return stacked


def stacked_weights_product(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                            updates: list[LoraUpdate | None]) -> Product | None:
    """The outputs of several frozen weights that multiply the same x [rows, in] (q, k and v; gate and up), side by
    side [rows, sum of outs], from one product by their stacked prepacked copy (`prepacked_stack`) inside a
    `PrepackedWeights.using()` block, each with its LoRA update (or none): merged into the copy where the dtype
    keeps a merged update (`merges`), else A stacked in it and `scale·(x Aᵀ) Bᵀ` added to its part. None where
    there is no such copy (the caller multiplies each weight on its own), and for stacked A factors with a bias
    (`stacked_product`)."""
    merge = merges(weights[0].dtype)
    stacked = [] if merge else [update for update in updates if update is not None]
    if gemm_backend() == "aten" or (stacked and any(bias is not None for bias in biases)):
        return None
    in_copy = updates if merge else [None if u is None else LoraUpdate(u.lora_a, None, u.scale) for u in updates]
    copy = prepacked_stack(x, weights, in_copy)
    if copy is None:
        return None
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    product = _copy_product(copy, bias)
    if not stacked:
        return product
    outs = [weight.shape[0] for weight in weights]
    total = sum(outs)

    def with_low_rank(x: torch.Tensor) -> torch.Tensor:
        both = product(x)
        result, low_rank = both[:, :total], total
        start = 0
        for out, update in zip(outs, updates):
            if update is not None:
                rank = update.lora_a.shape[0]
                result[:, start : start + out].addmm_(both[:, low_rank : low_rank + rank], update.lora_b.T,
                                                      alpha=update.scale)
                low_rank += rank
            start += out
        return result

    return with_low_rank


def _prepacked_copy(x: torch.Tensor, weight: torch.Tensor, **lora) -> torch.Tensor | None:
    """`prepacked(x, weight, **lora)`, except under `BIOS_GEMM=aten`, which keeps every product on PyTorch's own
    matmul: the one place the three products above ask for a copy."""
    return None if gemm_backend() == "aten" else prepacked(x, weight, **lora)


def frozen_input_grad(grad: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`grad W` for grad [rows, out], weight [out, in]: the gradient of `x Wᵀ` with respect to x."""
    if _routes_to_onednn(grad, weight):
        return onednn_linear(grad, weight.T, out=out)
    return torch.mm(grad, weight, out=out) if out is not None else grad @ weight
