"""Fused LM head + log-softmax + target gather, chunked over tokens.

Materialising `[N, V]` logits (and their gradient) is the largest allocation of a fine-tuning step: 4096
tokens over a 128k vocabulary is 2 GiB of fp32 logits before the backward doubles it. Here only one chunk of
rows exists at a time. With a frozen head (the LoRA case) the gradient w.r.t. `hidden` is computed inside
forward, so backward is a per-row scale and the logits are never recomputed. When a head parameter is
trainable its gradient depends on the caller's per-row `grad_output`, so backward recomputes each chunk's
logits instead (one extra head matmul, no stored logits), unless the caller's loss is a weighted sum of the
log-probs (`linear_weighted_loss`, cross-entropy): then every gradient is accumulated in forward too.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bios.kernels.c_kernels import c_library_for
from bios.kernels.frozen_matmul import frozen_input_grad, frozen_linear
from bios.kernels.grad_wanted import grad_wanted
from bios.kernels.lora import lora_b_grad

_LOGITS_PER_CHUNK = 1 << 26  # 256 MiB of fp32 logits at most
_MAX_ROWS_PER_CHUNK = 512  # enough rows that streaming the [V, H] head through the matmul is not the bottleneck


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk: 512 (below that, re-reading the head per chunk costs time), fewer for huge vocabularies.

    Measured on 2 CPU cores, N=1024, H=2048, V=128256 fwd+bwd: 64 rows 21 s (slower than naive), 256 rows 8.0 s,
    512 rows 6.7 s, naive 20 s.
    """
    return max(32, min(_MAX_ROWS_PER_CHUNK, _LOGITS_PER_CHUNK // max(vocab_size, 1)))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log p(targets[i] | hidden[i]) under logits = hidden @ weight.T + lora_scale * (hidden @ lora_a.T) @ lora_b.T.

    hidden [N, H], weight [V, H] (same dtype), targets [N] int64, optional LoRA factors lora_a [r, H] and
    lora_b [V, r] for an adapted LM head. Returns [N] log-probabilities in fp32 (fp64 for fp64 inputs).
    Differentiable w.r.t. hidden, weight and the LoRA factors; under `torch.no_grad()` (or when nothing
    requires grad) it is the forward-only path and does no gradient work. Callers drop weight-0 tokens first.
    """
    chunk, differentiable = _checked_call(hidden, weight, targets, lora_a, lora_b, chunk_size)
    if not differentiable:
        with torch.no_grad():
            return _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk)[0]
    return _LinearCrossEntropy.apply(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk)


def linear_weighted_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_weights: torch.Tensor,
    *,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) [N], `-(token_weights * log p).sum()`) for the head of `linear_cross_entropy`.

    The cross-entropy loss of a whole batch: its gradient w.r.t. each row's log-prob is `-token_weights`,
    known before any logits are, so every gradient (hidden, a trainable weight, the LoRA factors) is
    accumulated while each chunk's logits exist and backward only scales them by the loss's gradient. The
    head matmul runs once in forward and once for d hidden, where `linear_cross_entropy` with a trainable head
    must recompute the logits in backward. Only the loss is differentiable; the log-probs are for reporting.
    """
    if token_weights.shape != targets.shape:
        raise ValueError(f"linear_weighted_loss: token_weights has shape {tuple(token_weights.shape)} but targets "
                         f"{tuple(targets.shape)}; give one weight per target")
    chunk, differentiable = _checked_call(hidden, weight, targets, lora_a, lora_b, chunk_size)
    if not differentiable:
        with torch.no_grad():
            logprobs = _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk)[0]
        return logprobs, -(token_weights.to(logprobs.dtype) * logprobs).sum()
    return _LinearWeightedLoss.apply(hidden, weight, targets, token_weights, lora_a, lora_b, lora_scale, chunk)


def _checked_call(hidden, weight, targets, lora_a, lora_b, chunk_size) -> tuple[int, bool]:
    """Check the inputs; the chunk size to use and whether any gradient is wanted (else: forward only)."""
    lora = _check_inputs(hidden, weight, targets, lora_a, lora_b)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    trainable = (hidden, weight) + ((lora_a, lora_b) if lora else ())
    differentiable = grad_wanted(*trainable)
    return chunk_size or default_chunk_size(weight.shape[0]), differentiable


def _check_inputs(hidden, weight, targets, lora_a, lora_b) -> bool:
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            "linear_cross_entropy expects hidden [N, H], weight [V, H], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)} (flatten batch dims first)"
        )
    n, h = hidden.shape
    v = weight.shape[0]
    if weight.shape[1] != h or targets.shape[0] != n:
        raise ValueError(
            f"linear_cross_entropy: shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one to the other"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: targets must be int64, got {targets.dtype}")
    if n:
        lowest, highest = (int(x) for x in targets.aminmax())
        if lowest < 0 or highest >= v:
            raise ValueError(
                f"linear_cross_entropy: targets must lie in [0, {v}), got min {lowest} max {highest} "
                "(drop padding / ignored tokens before calling)"
            )
    if (lora_a is None) != (lora_b is None):
        raise ValueError("linear_cross_entropy: pass both lora_a and lora_b, or neither")
    if lora_a is None:
        return False
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[1] != h or lora_b.shape != (v, lora_a.shape[0]):
        raise ValueError(
            f"linear_cross_entropy: LoRA factors must be lora_a [r, {h}] and lora_b [{v}, r]; got "
            f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )
    return True


def _result_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in at least fp32: bf16 logits lose the tail of the distribution."""
    return torch.promote_types(dtype, torch.float32)


class _LogitsBuffer:
    """One chunk's worth of logits memory, reused by every chunk of a call and kept for the next call.

    A fresh 100+ MiB tensor per call is handed back to the OS on free and page-faulted in again by the next
    (on CPU ~25 ms per 100 MiB, as much as the chunk's elementwise work; SmolLM2's 512 x 49152 logits are 96 MiB
    in fp32). bf16/fp16 heads also get an fp32 buffer for the softmax where the C kernel does not take their
    logits as they are; the low-precision one is reused for the gradient matmul's input. `_logits_buffer` lends
    the one kept buffer to one call at a time.
    """

    def __init__(self, rows: int, weight: torch.Tensor):
        self.matmul = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        self.result_dtype = _result_dtype(weight.dtype)
        self._softmax: torch.Tensor | None = None  # a low-precision head's fp32 copy, made when first wanted

    def fits(self, rows: int, weight: torch.Tensor) -> bool:
        return (self.matmul.shape[0] >= rows and self.matmul.shape[1] == weight.shape[0]
                and self.matmul.dtype == weight.dtype and self.matmul.device == weight.device)

    def product(self, h, weight, lora_a, lora_b, lora_scale) -> torch.Tensor:
        """The chunk's logits in the head's dtype, in this buffer."""
        logits = frozen_linear(h, weight, out=self.matmul[: h.shape[0]])
        if lora_a is not None:
            logits.addmm_(h @ lora_a.to(h.dtype).T, lora_b.to(h.dtype).T, alpha=lora_scale)
        return logits

    def in_result_dtype(self, logits: torch.Tensor) -> torch.Tensor:
        """`product`'s logits in at least fp32, for the softmax."""
        if logits.dtype == self.result_dtype:
            return logits
        if self._softmax is None:
            self._softmax = torch.empty_like(self.matmul, dtype=self.result_dtype)
        return self._softmax[: logits.shape[0]].copy_(logits)

    def logits(self, h, weight, lora_a, lora_b, lora_scale) -> torch.Tensor:
        return self.in_result_dtype(self.product(h, weight, lora_a, lora_b, lora_scale))

    def in_matmul_dtype(self, dlogits: torch.Tensor) -> torch.Tensor:
        return dlogits if dlogits.dtype == self.matmul.dtype else self.matmul[: dlogits.shape[0]].copy_(dlogits)


_kept: list[_LogitsBuffer] = []  # the buffer of the last call, at most one (`pop` and slice assignment are atomic)


@contextmanager
def _logits_buffer(rows: int, weight: torch.Tensor) -> Iterator[_LogitsBuffer]:
    """The kept buffer if it fits `rows` rows of `weight`'s logits, else a new one (the old one freed first);
    kept again afterwards. Calls running at once get a buffer each, and the last to finish keeps its own."""
    try:
        buffer = _kept.pop()
    except IndexError:  # none kept, or lent to a call running meanwhile
        buffer = None
    if buffer is not None and not buffer.fits(rows, weight):
        buffer = None  # freed before the new one is made: never both at once
    if buffer is None:
        buffer = _LogitsBuffer(rows, weight)
    try:
        yield buffer
    finally:
        _kept[:] = [buffer]


def _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk, grads=None, row_scale=None):
    """Log-probs and row log-sum-exps, chunk by chunk.

    With `grads` (grad_hidden, grad_weight, grad_a, grad_b; any may be None) it also accumulates the gradient
    of `sum(row_scale * log p)` (row_scale None: of each row's own log p) into them, so no backward has to
    compute the logits again.
    """
    n = hidden.shape[0]
    dtype = _result_dtype(hidden.dtype)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    lse = torch.empty(n, dtype=dtype, device=hidden.device)
    with _logits_buffer(min(chunk, n), weight) as buffer:
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            chunk_grads = None if grads is None else _rows_of(grads, rows)
            _forward_chunk_(
                buffer, logprobs[rows], lse[rows], chunk_grads, hidden[rows], weight, targets[rows], lora_a, lora_b,
                lora_scale, None if row_scale is None else row_scale[rows],
            )
    return logprobs, lse


def _rows_of(grads, rows):
    """The chunk's share of (grad_hidden, grad_weight, grad_a, grad_b): rows of the first, all of the others."""
    grad_hidden, *parameter_grads = grads
    return (None if grad_hidden is None else grad_hidden[rows], *parameter_grads)


def _forward_chunk_(buffer, logprobs, lse, grads, h, weight, targets, lora_a, lora_b, lora_scale, row_scale) -> None:
    """One chunk; log-probs and log-sum-exps are written in place, gradients (if `grads`) accumulated."""
    logits = buffer.product(h, weight, lora_a, lora_b, lora_scale)
    wanted = grads is not None
    # bf16 logits go to the C kernel as they are (no fp32 copy), unless a trainable head sums an fp32 gradient
    if (wanted and grads[1] is not None) or not _c_log_softmax_(logits, targets, row_scale, logprobs, lse, wanted):
        logits = buffer.in_result_dtype(logits)
        if not _c_log_softmax_(logits, targets, row_scale, logprobs, lse, wanted):
            _log_softmax_(logits, targets, row_scale, logprobs, lse, wanted)
    if wanted:  # the logits now hold d (scaled) log p(t) / d logits
        _accumulate_grads_(grads, buffer, logits, h, weight, lora_a, lora_b, lora_scale)


def _log_softmax_(logits, targets, row_scale, logprobs, lse, grads: bool) -> None:
    """Each row's log-sum-exp and target log-prob; with `grads`, the logits overwritten by the gradient of
    row_scale * log p(target) (row_scale None: 1) with respect to them."""
    t = targets[:, None]
    target_logit = logits.gather(1, t).squeeze(1)
    row_max = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(row_max).exp_()  # unnormalised softmax, in the logits' memory
    row_sum = probs.sum(dim=1, keepdim=True)
    torch.add(row_max.squeeze(1), row_sum.log().squeeze(1), out=lse)
    torch.sub(target_logit, lse, out=logprobs)
    if not grads:
        return
    if row_scale is None:  # d log p(t) / d logits = onehot(t) - softmax
        probs.mul_(row_sum.reciprocal_().neg_())
        probs.scatter_add_(1, t, torch.ones_like(t, dtype=probs.dtype))
    else:  # times each row's scale
        scale = row_scale[:, None].to(probs.dtype)
        probs.mul_(row_sum.reciprocal_().mul_(scale).neg_())
        probs.scatter_add_(1, t, scale)


def _c_log_softmax_(logits, targets, row_scale, logprobs, lse, grads: bool) -> bool:
    """`_log_softmax_` in one C call (`bios_log_softmax_rows`: each row read from memory once, where PyTorch's
    ops make four passes over the chunk's logits; SmolLM2's 512 x 49152 fp32, 23 -> 14 ms with AVX2 code) for
    fp32 or bf16 logits on CPU (bf16: statistics in fp32, the gradient rounded once, as a cast of the fp32 one:
    no fp32 copy of the logits); whether it ran (not: other dtypes or devices, no C kernels)."""
    library = c_library_for(logits, dtypes=(torch.float32, torch.bfloat16), whole=False) \
        if logprobs.dtype == torch.float32 else None
    if library is None:
        return False
    targets = targets.to(torch.int64).contiguous()  # (held: the kernel reads their memory)
    scale = None if row_scale is None else row_scale.to(torch.float32).contiguous()
    library.bios_log_softmax_rows(
        logits.data_ptr(), logits.stride(0), int(logits.dtype == torch.bfloat16), targets.data_ptr(),
        None if scale is None else scale.data_ptr(),
        logprobs.data_ptr(), lse.data_ptr(), logits.shape[0], logits.shape[1], int(grads), torch.get_num_threads())
    return True


def _accumulate_grads_(grads, buffer, dlogits, h, weight, lora_a, lora_b, lora_scale) -> None:
    """Given one chunk's d loss / d logits: write its rows of grad_hidden, add to the parameters' gradients."""
    grad_hidden, grad_weight, grad_a, grad_b = grads
    if grad_weight is not None:  # a trainable head (full fine-tuning): its [V, H] gradient summed in fp32
        grad_weight.addmm_(dlogits.T, h.to(dlogits.dtype))
    if grad_hidden is None and grad_a is None and grad_b is None:
        return
    # The low-rank products in the head's dtype, as every other LoRA layer of the model makes them: in bf16 they
    # run ~2x faster than in fp32 (SmolLM2's [49152 x 512] x [512 x 16], 7 vs 18 ms a chunk).
    dlogits = buffer.in_matmul_dtype(dlogits)
    if grad_hidden is not None:
        frozen_input_grad(dlogits, weight, out=grad_hidden)
    if lora_a is None:
        return
    a, b = lora_a.to(h.dtype), lora_b.to(h.dtype)
    if grad_hidden is not None or grad_a is not None:
        g_b = dlogits @ b  # d loss / d (h Aᵀ), over `lora_scale`: made once for grad_hidden and grad_a
        if grad_hidden is not None:
            grad_hidden.addmm_(g_b, a, alpha=lora_scale)
        if grad_a is not None:
            grad_a.add_(g_b.T @ h, alpha=lora_scale)
    if grad_b is not None:
        grad_b.add_(lora_b_grad(dlogits, h @ a.T), alpha=lora_scale)


def _chunk_backward_(buffer, grads, grad_logprobs, h, weight, targets, lse, lora_a, lora_b, lora_scale) -> None:
    """One chunk of the trainable-head backward: recomputes the logits and accumulates into `grads` in place."""
    g = grad_logprobs[:, None]
    logits = buffer.logits(h, weight, lora_a, lora_b, lora_scale)
    dlogits = logits.sub_(lse[:, None]).exp_().mul_(-g.to(logits.dtype))  # g * (onehot(t) - softmax)
    dlogits.scatter_add_(1, targets[:, None], g.to(logits.dtype))
    _accumulate_grads_(grads, buffer, dlogits, h, weight, lora_a, lora_b, lora_scale)


def _gradient_buffers(hidden, weight, lora_a, lora_b, needs):
    """Zeroed (grad_hidden, grad_weight, grad_a, grad_b) for the inputs that need one; parameter gradients in
    at least fp32, as bf16 ones accumulated over chunks would lose precision."""
    acc = _result_dtype(weight.dtype)

    def zeros(like, needed):
        return torch.zeros(like.shape, dtype=acc, device=like.device) if needed else None

    need_h, need_w, need_a, need_b = needs
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
    return grad_hidden, zeros(weight, need_w), zeros(lora_a, need_a), zeros(lora_b, need_b)


def _in_input_dtypes(grads, weight, lora_a, lora_b):
    """(grad_hidden, grad_weight, grad_a, grad_b) with the parameters' gradients cast back to their dtypes."""
    grad_hidden, *parameter_grads = grads
    return grad_hidden, *(None if grad is None else grad.to(like.dtype)
                          for grad, like in zip(parameter_grads, (weight, lora_a, lora_b)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, lora_a, lora_b, lora_scale, chunk):
        ctx.lora_scale, ctx.chunk = lora_scale, chunk
        ctx.precomputed = not any(ctx.needs_input_grad[i] for i in (1, 3, 4))
        if ctx.precomputed:
            grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
            grads = (grad_hidden, None, None, None)
            logprobs, _ = _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk, grads)
            ctx.save_for_backward(grad_hidden)
        else:
            logprobs, lse = _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk)
            ctx.save_for_backward(hidden, weight, targets, lora_a, lora_b, lse)
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        if ctx.precomputed:
            (grad_hidden,) = ctx.saved_tensors
            return grad_hidden * grad_logprobs[:, None].to(grad_hidden.dtype), None, None, None, None, None, None
        hidden, weight, targets, lora_a, lora_b, lse = ctx.saved_tensors
        need_h, need_w, _, need_a, need_b = ctx.needs_input_grad[:5]
        grads = _gradient_buffers(hidden, weight, lora_a, lora_b, (need_h, need_w, need_a, need_b))
        n = hidden.shape[0]
        with _logits_buffer(min(ctx.chunk, n), weight) as buffer:
            for start in range(0, n, ctx.chunk):
                rows = slice(start, min(start + ctx.chunk, n))
                _chunk_backward_(buffer, _rows_of(grads, rows), grad_logprobs[rows], hidden[rows], weight,
                                 targets[rows], lse[rows], lora_a, lora_b, ctx.lora_scale)
        grad_hidden, grad_weight, grad_a, grad_b = _in_input_dtypes(grads, weight, lora_a, lora_b)
        return grad_hidden, grad_weight, None, grad_a, grad_b, None, None


class _LinearWeightedLoss(torch.autograd.Function):
    """`-(token_weights * log p).sum()`, every gradient computed in the forward chunks (its d loss / d log p is
    known before the logits are), so backward only scales them: no head matmul is done twice."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_weights, lora_a, lora_b, lora_scale, chunk):
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 4, 5))
        grads = _gradient_buffers(hidden, weight, lora_a, lora_b, needs)
        row_scale = -token_weights.to(_result_dtype(hidden.dtype))
        logprobs, _ = _forward_chunks(hidden, weight, targets, lora_a, lora_b, lora_scale, chunk, grads, row_scale)
        grads = _in_input_dtypes(grads, weight, lora_a, lora_b)
        ctx.save_for_backward(*(grad for grad in grads if grad is not None))
        ctx.needs = needs
        ctx.mark_non_differentiable(logprobs)
        return logprobs, (row_scale * logprobs).sum()

    @staticmethod
    def backward(ctx, _grad_logprobs, grad_loss):
        saved = iter(ctx.saved_tensors)
        grads = tuple(next(saved) if needed else None for needed in ctx.needs)
        grad_hidden, grad_weight, grad_a, grad_b = (None if grad is None else grad * grad_loss.to(grad.dtype)
                                                    for grad in grads)
        return grad_hidden, grad_weight, None, None, grad_a, grad_b, None, None
