"""The cross-entropy head (`linear_weighted_loss`, `lora_target_loss`, the engine's use of it) equals the
log-probs path followed by the loss, and computes the head's logits once where that path computes them twice.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_kernels import TOLERANCE, LargestTensor, _bf16_close, _ce_inputs, _close, _grads, _naive_logprobs
from torch.utils._python_dispatch import TorchDispatchMode

from bios import types
from bios.kernels import cross_entropy, linear_cross_entropy, linear_weighted_loss
from bios.kernels.c_kernels import c_kernels
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora
from test_engine import tiny_llama


def _naive_loss(hidden, weight, targets, token_weights, lora_a=None, lora_b=None, scale=1.0):
    logprobs = _naive_logprobs(hidden, weight, targets, lora_a, lora_b, scale)
    return logprobs, -(token_weights.to(logprobs.dtype) * logprobs).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 7, 500])
@pytest.mark.parametrize("train_weight", [False, True])
def test_weighted_loss_matches_naive_in_value_and_every_gradient(dtype, chunk_size, train_weight):
    hidden, weight, targets, token_weights, lora_a, lora_b = _ce_inputs(37, 16, 101, dtype, rank=4)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    inputs += [weight.requires_grad_()] if train_weight else []
    logprobs, loss = linear_weighted_loss(hidden, weight, targets, token_weights, lora_a=lora_a, lora_b=lora_b,
                                          lora_scale=0.5, chunk_size=chunk_size)
    expected_logprobs, expected_loss = _naive_loss(hidden, weight, targets, token_weights, lora_a, lora_b, 0.5)
    assert logprobs.grad_fn is None and loss.grad_fn is not None
    _close(logprobs, expected_logprobs.detach(), TOLERANCE[dtype])
    _close(loss, expected_loss.detach(), TOLERANCE[dtype] * 10)
    upstream = torch.tensor(2.5, dtype=loss.dtype)  # backward scales every precomputed gradient by it
    for actual, reference in zip(_grads(loss, inputs, upstream), _grads(expected_loss, inputs, upstream)):
        _close(actual, reference, TOLERANCE[dtype] * 10)


def test_weighted_loss_without_a_lora_head_and_under_no_grad():
    hidden, weight, targets, token_weights, _, _ = _ce_inputs(20, 8, 40, torch.float64)
    hidden.requires_grad_()
    _, loss = linear_weighted_loss(hidden, weight, targets, token_weights, chunk_size=6)
    _, expected = _naive_loss(hidden, weight, targets, token_weights)
    _close(_grads(loss, [hidden], None)[0], _grads(expected, [hidden], None)[0], 1e-7)
    with torch.no_grad():
        logprobs, loss = linear_weighted_loss(hidden, weight, targets, token_weights)
    assert loss.grad_fn is None
    _close(loss, expected.detach(), 1e-7)


def test_weighted_loss_bf16_keeps_parameter_dtypes():
    hidden, weight, targets, token_weights, lora_a, lora_b = _ce_inputs(40, 32, 300, torch.bfloat16, rank=4)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    _, loss = linear_weighted_loss(hidden, weight, targets, token_weights, lora_a=lora_a, lora_b=lora_b,
                                   lora_scale=0.5, chunk_size=16)
    grads = _grads(loss, inputs, None)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.bfloat16] * 3
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _, expected = _naive_loss(exact[0], weight.double(), targets, token_weights, exact[1], exact[2], 0.5)
    for actual, reference in zip(grads, _grads(expected, exact, None)):
        _bf16_close(actual, reference)


def test_the_logits_buffer_is_kept_for_the_next_call_and_replaced_when_it_does_not_fit():
    """One chunk's logits memory outlives a call (a fresh one per step costs its page faults), is lent to one
    call at a time, and a call that needs more rows or another vocabulary replaces it."""

    def buffer_after(rows: int, vocab: int, dtype=torch.float32):
        hidden, weight, targets, token_weights, _, _ = _ce_inputs(rows, 8, vocab, dtype)
        linear_weighted_loss(hidden.requires_grad_(), weight, targets, token_weights, chunk_size=16)[1].backward()
        (kept,) = cross_entropy._kept
        return kept

    first = buffer_after(12, 40)
    assert first.matmul.shape == (12, 40)
    assert buffer_after(10, 40) is first  # fewer rows: the same memory
    assert buffer_after(16, 40) is not first  # more rows (up to the chunk): a bigger one
    bf16 = buffer_after(40, 30, torch.bfloat16)
    assert bf16.matmul.shape == (16, 30) and bf16.matmul.dtype == torch.bfloat16
    assert bf16.result_dtype == torch.float32  # a low-precision head's softmax runs in fp32: in the C kernel on
    assert (bf16._softmax is None) == (c_kernels() is not None)  # its logits as they are, else on an fp32 copy
    with cross_entropy._logits_buffer(4, torch.empty(30, 8, dtype=torch.bfloat16)) as lent:
        assert lent is bf16 and not cross_entropy._kept  # lent out: a call running meanwhile gets its own
        with cross_entropy._logits_buffer(4, torch.empty(30, 8, dtype=torch.bfloat16)) as other:
            assert other is not lent
    assert cross_entropy._kept == [lent]  # the last to finish keeps its own


def test_calls_from_several_threads_get_a_buffer_each_and_the_same_numbers():
    hidden, weight, targets, token_weights, _, _ = _ce_inputs(24, 8, 50, torch.float32)
    expected = linear_weighted_loss(hidden, weight, targets, token_weights, chunk_size=16)[0]

    def calls() -> list[torch.Tensor]:
        return [linear_weighted_loss(hidden, weight, targets, token_weights, chunk_size=16)[0] for _ in range(200)]

    with ThreadPoolExecutor(4) as pool:
        results = [r for future in [pool.submit(calls) for _ in range(4)] for r in future.result()]
    assert all(torch.equal(result, expected) for result in results)
    assert len(cross_entropy._kept) == 1


def test_weighted_loss_refuses_weights_of_another_length():
    hidden, weight, targets, token_weights, _, _ = _ce_inputs(10, 8, 20, torch.float32)
    with pytest.raises(ValueError, match=r"token_weights has shape \(9,\) but targets \(10,\)"):
        linear_weighted_loss(hidden, weight, targets, token_weights[:9])


class HeadMatmuls(TorchDispatchMode):
    """Counts matmuls that read the whole [V, H] head weight: the logits, and the gradient of the hidden states
    (ATen's, or oneDNN's linear that `bios.kernels.frozen_matmul` runs for fp32 on CPU)."""

    def __init__(self, head_shape: tuple[int, int]):
        super().__init__()
        self.shapes, self.count = {head_shape, head_shape[::-1]}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                   torch.ops.mkldnn._linear_pointwise):
            self.count += any(isinstance(a, torch.Tensor) and tuple(a.shape) in self.shapes for a in args)
        return func(*args, **(kwargs or {}))


def test_a_trainable_lora_head_costs_two_head_matmuls_not_three():
    n, h, v = 64, 16, 300
    hidden, weight, targets, token_weights, lora_a, lora_b = _ce_inputs(n, h, v, torch.float32, rank=4)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    with HeadMatmuls((v, h)) as recompute:
        logprobs = linear_cross_entropy(hidden, weight, targets, lora_a=lora_a, lora_b=lora_b, chunk_size=n)
        torch.autograd.grad(-(token_weights.float() * logprobs).sum(), inputs)
    with HeadMatmuls((v, h)) as fused:
        _, loss = linear_weighted_loss(hidden, weight, targets, token_weights, lora_a=lora_a, lora_b=lora_b,
                                       chunk_size=n)
        torch.autograd.grad(loss, inputs)
    assert (recompute.count, fused.count) == (3, 2)
    hidden, weight, targets, token_weights, lora_a, lora_b = _ce_inputs(64, 4, 50, torch.float32, rank=2)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]  # all smaller than a chunk of logits
    with LargestTensor() as largest:
        _, loss = linear_weighted_loss(hidden, weight, targets, token_weights, lora_a=lora_a, lora_b=lora_b,
                                       chunk_size=8)
        torch.autograd.grad(loss, inputs)
    assert largest.numel == 8 * 50  # one chunk of logits at a time, as linear_cross_entropy


def test_the_engine_gives_the_same_losses_and_gradients_with_and_without_the_fused_head():
    """cross_entropy rows take `lora_target_loss`; the same rows under a loss that is not a fixed weighting
    (importance_sampling with advantages = weights and sampler log-probs = the learner's, whose gradient is
    then the same) take the log-probs path: log-probs, losses and gradients agree, head LoRA included."""
    model = tiny_llama()
    attach_lora(model)
    lora = types.LoraConfig(rank=4, seed=0, train_unembed=True)
    gen = torch.Generator().manual_seed(0)
    fused = AdapterState.create("fused", model, lora, device=torch.device("cpu"))
    plain = AdapterState.create("plain", model, lora, device=torch.device("cpu"))
    with torch.no_grad():  # B starts at zero: move off it so every LoRA factor's gradient is non-trivial
        fused.params.add_(0.05 * torch.randn(fused.params.shape, generator=gen))
        plain.params.copy_(fused.params)
    lengths = (9, 14, 5)
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    weights = [torch.rand(n, generator=gen) for n in lengths]

    def data(**extra):
        return [types.Datum(model_input=types.ModelInput.from_ints(ids.tolist()), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.roll(ids, -1)),
            "weights": types.TensorData.from_torch(w), **{k: v[i] for k, v in extra.items()}})
            for i, (ids, w) in enumerate(zip(tokens, weights))]

    ce = forward_backward(model, [ForwardItem(fused, data(), "cross_entropy")])[0]
    forward_only = forward_backward(model, [ForwardItem(plain, data(), "cross_entropy", forward_only=True)])[0]
    sampler = [out["logprobs"] for out in forward_only.loss_fn_outputs]
    advantages = [types.TensorData.from_torch(w) for w in weights]
    reference = forward_backward(model, [ForwardItem(plain, data(advantages=advantages, logprobs=sampler),
                                                     "importance_sampling")])[0]
    for mine, theirs in zip(ce.loss_fn_outputs, reference.loss_fn_outputs):
        torch.testing.assert_close(mine["logprobs"].to_torch(), theirs["logprobs"].to_torch(), atol=1e-6, rtol=0)
    expected_loss = -sum(float((w * q.to_torch()).sum()) for w, q in zip(weights, sampler))
    assert ce.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert fused.pending_grad.abs().sum() > 0
    # a few fp32 ulps at the gradients' scale (up to ~12 here): the two heads' sums round apart, and that
    # difference goes back through every layer's attention and products
    scale = float(plain.pending_grad.abs().max())
    torch.testing.assert_close(fused.pending_grad, plain.pending_grad, atol=4 * torch.finfo(torch.float32).eps * scale,
                               rtol=1e-4)
