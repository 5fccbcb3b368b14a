"""RMSNorm and SwiGLU with backwards that keep only their inputs.

`F.rms_norm` exists in this torch, but on CPU its autograd is the composite decomposition (six saved tensors,
three of them activation-sized) and the fused `_fused_rms_norm_backward` has no CPU kernel, so RMSNorm is a
hand-written Function that saves `x` and the per-row inverse RMS only. (On a GPU `F.rms_norm` runs fused
kernels, one launch each way where the Function's ops take a dozen, but it scales by the weight before its one
rounding to bf16: on an H100 a 3-step bf16 run then strayed 5.4% from fp32's adapter, past tests/test_cuda.py's
5%, where Hugging Face's rounding stays within it.) Its forward follows Hugging Face's
LlamaRMSNorm rounding (normalise in fp32, cast, then scale by the weight), so swapping it in changes no numbers.

Autograd on `silu(gate) * up` saves gate, up and silu(gate); `swiglu` saves gate and up and recomputes the
activation in backward. `swiglu_stacked` takes gate and up side by side, as one stacked layer computes them
(`bios.kernels.stacked_lora`), and gives their gradients side by side, which that layer's backward takes whole;
on fp32 CPU tensors it and RMSNorm run Bios's C kernels where they are built (`bios.kernels.c_kernels`), one
pass over memory each way instead of three to six ops: SmolLM2's 512 tokens with AVX2 code on 2 threads (Intel
Xeon), forward and backward of SwiGLU 1.2 against 2.8 ms, of RMSNorm 0.25 against 0.70 ms (each with its input's
copy), fp32 rounding apart from PyTorch's ops (tests/test_training_ops.py). A bf16 RMSNorm runs in C too (with
AVX-512, 1.01 -> 0.30 ms): its forward in Hugging Face's roundings, its backward in fp32, rounded once.

When no gradient is wanted (`grad_wanted`) both compute the same ops directly: the Function's call costs more
than the norm of a decode step's few rows itself (75 vs 28 us for 16 x 576). An fp32 norm on CPU then calls
`F.rms_norm`, whose CPU forward is that same composition of ops in one call (bit for bit the same, 11 vs 16 us
for 16 x 576; a decode step has two a layer).
"""

import ctypes

import torch
import torch.nn.functional as F

from bios.kernels.c_kernels import c_library_for
from bios.kernels.grad_wanted import grad_wanted


# RMSNorm's C kernels take fp32, and bf16 rounded as Hugging Face's norm rounds (a frozen weight's backward only).
_NORM_DTYPES = (torch.float32, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2, -1) + eps)) over the last dim, statistics in at least fp32."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must match the last dim of x {tuple(x.shape)}")
    if not grad_wanted(x, weight):
        library = c_library_for(x, weight, dtypes=_NORM_DTYPES)
        if library is None and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
            return F.rms_norm(x, x.shape[-1:], weight, eps)  # the same ops in one call (its CPU forward composes them)
        return _rms_norm_forward(x, weight, eps, library)[0]
    return _RMSNorm.apply(x, weight, eps)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, library: ctypes.CDLL | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm, the per-row inverse RMS) in Hugging Face's LlamaRMSNorm rounding: Bios's C kernel (`library`,
    `c_library_for`'s answer for x and weight) with or without a gradient, so a forward pass and a training pass give
    the same numbers, else PyTorch's ops."""
    if library is not None:
        n = x.shape[-1]
        y, inv_rms = torch.empty_like(x), x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)
        if x.dtype == torch.bfloat16:
            library.bios_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), inv_rms.data_ptr(),
                                       x.numel() // n, n, eps, torch.get_num_threads())
        else:
            library.bios_add_rms_norm(x.data_ptr(), n, None, 0, weight.data_ptr(), y.data_ptr(), n,
                                      inv_rms.data_ptr(), x.numel() // n, n, eps, torch.get_num_threads())
        return y, inv_rms
    x32 = x.to(_compute_dtype(x.dtype))
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * (x32 * inv_rms).to(x.dtype), inv_rms


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, inv_rms = _rms_norm_forward(x, weight, eps, c_library_for(x, weight, dtypes=_NORM_DTYPES))
        ctx.save_for_backward(x, weight, inv_rms)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, inv_rms = ctx.saved_tensors
        library = c_library_for(x, weight, grad_y, dtypes=_NORM_DTYPES)
        # the bf16 kernel gives grad_x only (a trainable bf16 norm weight takes PyTorch's ops below)
        if library is not None and (x.dtype == torch.float32 or not ctx.needs_input_grad[1]):
            n = x.shape[-1]
            grad_x = torch.empty_like(x)
            pointers = (x.data_ptr(), weight.data_ptr(), inv_rms.data_ptr(), grad_y.data_ptr(), grad_x.data_ptr())
            if x.dtype == torch.bfloat16:
                library.bios_rms_norm_backward_bf16(*pointers, x.numel() // n, n, torch.get_num_threads())
                return grad_x, None, None
            grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
            library.bios_rms_norm_backward(*pointers, None if grad_weight is None else grad_weight.data_ptr(),
                                           x.numel() // n, n, torch.get_num_threads())
            return grad_x if ctx.needs_input_grad[0] else None, grad_weight, None
        dtype = _compute_dtype(x.dtype)
        x_hat = x.to(dtype) * inv_rms
        grad_times_x_hat = (grad_y * x_hat.to(x.dtype)).to(dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_times_x_hat.reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r(x), r = mean(x^2)^-1/2, with upstream h = grad_y * weight: r * (h - x_hat * mean(h * x_hat))
            projection = grad_times_x_hat.mul_(weight).mean(-1, keepdim=True)
            grad_x_hat = (grad_y * weight).to(dtype)
            grad_x = grad_x_hat.addcmul_(x_hat, projection, value=-1).mul_(inv_rms).to(x.dtype)
        return grad_x, grad_weight, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the Llama MLP activation, recomputing silu(gate) in backward instead of saving it."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    if not grad_wanted(gate, up):
        return swiglu_value(gate, up)
    return _SwiGLU.apply(gate, up)


def swiglu_value(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up without autograd: `swiglu`'s forward, bit for bit (it is how `swiglu` computes it)."""
    with torch.no_grad():
        return F.silu(gate).mul_(up)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_value(gate, up)

    @staticmethod
    def backward(ctx, grad_y):
        gate, up = ctx.saved_tensors
        grad_up = F.silu(gate).mul_(grad_y) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            # the same rounding steps as autograd through `silu(gate) * up`: grad_y * up, then silu's backward
            grad_gate = grad_y * up
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


def swiglu_stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2n], gate then up side by side; recomputes silu(gate) in backward, and
    gives the gradient of gate_up as one tensor."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_stacked: gate_up must hold gate and up side by side, got {tuple(gate_up.shape)}")
    if not grad_wanted(gate_up):
        return swiglu_stacked_value(gate_up)
    return _StackedSwiGLU.apply(gate_up)


def swiglu_stacked_value(gate_up: torch.Tensor) -> torch.Tensor:
    """`swiglu_stacked`'s forward without autograd, bit for bit."""
    library = c_library_for(gate_up)
    with torch.no_grad():
        if library is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate).mul_(up)
        n = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], n)
        library.bios_swiglu(gate_up.data_ptr(), 2 * n, out.data_ptr(), gate_up.numel() // (2 * n), n,
                            torch.get_num_threads())
        return out


class _StackedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return swiglu_stacked_value(gate_up)

    @staticmethod
    def backward(ctx, grad_y):
        (gate_up,) = ctx.saved_tensors
        grad = torch.empty_like(gate_up)
        library = c_library_for(gate_up, grad_y)
        n = gate_up.shape[-1] // 2
        if library is not None:
            library.bios_swiglu_backward(gate_up.data_ptr(), 2 * n, grad_y.data_ptr(), n, grad.data_ptr(), 2 * n,
                                         gate_up.numel() // (2 * n), n, torch.get_num_threads())
            return grad
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.mul(F.silu(gate), grad_y, out=grad_up)
        torch.mul(grad_y, up, out=grad_gate)  # then silu's backward, as autograd through `silu(gate) * up` rounds
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad
