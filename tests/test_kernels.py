"""bios.kernels equal their naive references (outputs and gradients), on edge shapes, and keep what they claim.

Tolerances: float64 1e-7 and float32 1e-5 (absolute, values are O(1)). bfloat16 kernels are compared with a
float64 reference evaluated on the same bf16-rounded inputs: bf16 keeps 8 mantissa bits, so we allow 3e-2
absolute error on log-probabilities and 2e-2 relative (to the largest entry) on outputs and gradients.
"""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from peft.tuners.lora import Linear as PeftLoraLinear
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bios.kernels import cross_entropy as cross_entropy_module
from bios.kernels import linear_cross_entropy, lora_linear, lora_linear_multi, rms_norm, swiglu

TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-5}
BF16_LOGPROB_ATOL = 3e-2
BF16_RELATIVE = 2e-2


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=0)


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() or 1.0
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= BF16_RELATIVE * scale, f"bf16 error {error:.3g} > {BF16_RELATIVE} x max |expected| {scale:.3g}"


def _grads(output, inputs, grad_output):
    return torch.autograd.grad(output, inputs, grad_output, allow_unused=True)


# ------------------------------------------------------------------------------------ linear_cross_entropy


def _naive_logprobs(hidden, weight, targets, lora_a=None, lora_b=None, scale=1.0):
    logits = hidden @ weight.T
    if lora_a is not None:
        logits = logits + scale * (hidden @ lora_a.T) @ lora_b.T
    return torch.log_softmax(logits.to(torch.promote_types(hidden.dtype, torch.float32)), -1).gather(
        1, targets[:, None]
    ).squeeze(1)


def _ce_inputs(n, h, v, dtype, rank=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    # per-token loss weights, some zero, as a loss function would apply them to the log-probs
    grad_output = torch.randn(n, generator=gen, dtype=torch.float64) * (torch.arange(n) % 3 != 0)
    if rank is None:
        return hidden, weight, targets, grad_output, None, None
    lora_a = (torch.randn(rank, h, generator=gen, dtype=torch.float64) / h**0.5).to(dtype)
    lora_b = torch.randn(v, rank, generator=gen, dtype=torch.float64).to(dtype)
    return hidden, weight, targets, grad_output, lora_a, lora_b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("n", "v", "chunk_size"),
    [(37, 101, 7), (37, 101, 1), (37, 101, 37), (37, 101, 500), (1, 101, None), (64, 64, 10), (37, 97, None)],
)
@pytest.mark.parametrize("train_weight", [False, True])
def test_linear_cross_entropy_matches_naive(dtype, n, v, chunk_size, train_weight):
    hidden, weight, targets, grad_output, _, _ = _ce_inputs(n, 16, v, dtype)
    hidden.requires_grad_()
    weight.requires_grad_(train_weight)
    inputs = [hidden, weight] if train_weight else [hidden]
    logprobs = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size)
    expected = _naive_logprobs(hidden, weight, targets)
    assert logprobs.dtype == torch.promote_types(dtype, torch.float32)
    _close(logprobs, expected, TOLERANCE[dtype])
    g = grad_output.to(logprobs.dtype)
    for actual, reference in zip(_grads(logprobs, inputs, g), _grads(expected, inputs, g)):
        _close(actual, reference, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("train_weight", [False, True])
def test_linear_cross_entropy_with_lora_head(dtype, train_weight):
    hidden, weight, targets, grad_output, lora_a, lora_b = _ce_inputs(29, 16, 83, dtype, rank=4)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    inputs += [weight.requires_grad_()] if train_weight else []
    logprobs = linear_cross_entropy(hidden, weight, targets, lora_a=lora_a, lora_b=lora_b, lora_scale=0.5, chunk_size=8)
    expected = _naive_logprobs(hidden, weight, targets, lora_a, lora_b, 0.5)
    _close(logprobs, expected, TOLERANCE[dtype])
    g = grad_output.to(logprobs.dtype)
    for actual, reference in zip(_grads(logprobs, inputs, g), _grads(expected, inputs, g)):
        _close(actual, reference, TOLERANCE[dtype])


def test_linear_cross_entropy_non_contiguous_inputs():
    hidden, weight, targets, grad_output, lora_a, lora_b = _ce_inputs(23, 16, 71, torch.float64, rank=3)
    hidden_t = hidden.T.contiguous().T.requires_grad_()  # column-major
    weight_strided = torch.stack([weight, weight], dim=2).flatten(1)[:, ::2]  # stride 2 along H
    targets_strided = torch.stack([targets, targets], dim=1)[:, 0]
    lora_b_t = lora_b.T.contiguous().T.requires_grad_()
    lora_a.requires_grad_()
    assert not (hidden_t.is_contiguous() or weight_strided.is_contiguous() or targets_strided.is_contiguous())
    inputs = [hidden_t, lora_a, lora_b_t]
    logprobs = linear_cross_entropy(
        hidden_t, weight_strided, targets_strided, lora_a=lora_a, lora_b=lora_b_t, lora_scale=2.0, chunk_size=5
    )
    expected = _naive_logprobs(hidden_t, weight, targets, lora_a, lora_b_t, 2.0)
    _close(logprobs, expected, 1e-7)
    for actual, reference in zip(_grads(logprobs, inputs, grad_output), _grads(expected, inputs, grad_output)):
        _close(actual, reference, 1e-7)


def test_linear_cross_entropy_empty_batch_and_zero_weights():
    hidden, weight, targets, _, _, _ = _ce_inputs(0, 16, 50, torch.float32)
    hidden.requires_grad_()
    logprobs = linear_cross_entropy(hidden, weight, targets)
    assert logprobs.shape == (0,)
    (grad_hidden,) = _grads(logprobs.sum(), [hidden], None)
    assert grad_hidden.shape == (0, 16)

    hidden, weight, targets, _, _, _ = _ce_inputs(9, 16, 50, torch.float32)
    hidden.requires_grad_()
    logprobs = linear_cross_entropy(hidden, weight, targets, chunk_size=4)
    (grad_hidden,) = _grads(logprobs, [hidden], torch.zeros(9))
    assert torch.equal(grad_hidden, torch.zeros_like(hidden))


def test_linear_cross_entropy_no_grad_path_does_no_gradient_work(monkeypatch):
    hidden, weight, targets, _, lora_a, lora_b = _ce_inputs(20, 16, 60, torch.float64, rank=2)
    hidden.requires_grad_()
    expected = _naive_logprobs(hidden, weight, targets, lora_a, lora_b, 0.5).detach()

    def fail(*args, **kwargs):
        raise AssertionError("the forward-only path computed a gradient")

    monkeypatch.setattr(cross_entropy_module, "_accumulate_grads_", fail)
    with torch.no_grad():
        logprobs = linear_cross_entropy(hidden, weight, targets, lora_a=lora_a, lora_b=lora_b, lora_scale=0.5)
    assert logprobs.grad_fn is None
    _close(logprobs, expected, 1e-7)
    frozen = linear_cross_entropy(hidden.detach(), weight, targets, lora_a=lora_a, lora_b=lora_b, lora_scale=0.5)
    assert frozen.grad_fn is None
    _close(frozen, expected, 1e-7)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("train_weight", [False, True])
def test_linear_cross_entropy_never_holds_more_than_one_chunk_of_logits(train_weight):
    n, h, v, chunk = 64, 4, 50, 8  # hidden [n, h] and head [v, h] are smaller than a chunk of logits
    hidden, weight, targets, grad_output, lora_a, lora_b = _ce_inputs(n, h, v, torch.float32, rank=2)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    inputs += [weight.requires_grad_()] if train_weight else []
    with LargestTensor() as largest:
        logprobs = linear_cross_entropy(hidden, weight, targets, lora_a=lora_a, lora_b=lora_b, chunk_size=chunk)
        torch.autograd.grad(logprobs, inputs, grad_output.float())
    assert largest.numel == chunk * v
    with LargestTensor() as naive:
        _naive_logprobs(hidden, weight, targets, lora_a, lora_b)
    assert naive.numel == n * v


def test_linear_cross_entropy_backward_twice_with_retained_graph():
    hidden, weight, targets, grad_output, _, _ = _ce_inputs(12, 8, 30, torch.float64)
    hidden.requires_grad_()
    logprobs = linear_cross_entropy(hidden, weight, targets, chunk_size=5)
    (first,) = torch.autograd.grad(logprobs, [hidden], grad_output, retain_graph=True)
    (second,) = torch.autograd.grad(logprobs, [hidden], grad_output)
    assert torch.equal(first, second)


@pytest.mark.parametrize("train_weight", [False, True])
def test_linear_cross_entropy_bf16(train_weight):
    hidden, weight, targets, grad_output, lora_a, lora_b = _ce_inputs(40, 32, 300, torch.bfloat16, rank=4)
    inputs = [t.requires_grad_() for t in (hidden, lora_a, lora_b)]
    inputs += [weight.requires_grad_()] if train_weight else []
    logprobs = linear_cross_entropy(
        hidden, weight, targets, lora_a=lora_a, lora_b=lora_b, lora_scale=0.5, chunk_size=16
    )
    assert logprobs.dtype == torch.float32
    grads = _grads(logprobs, inputs, grad_output.float())
    assert [g.dtype for g in grads] == [torch.bfloat16] * len(inputs)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    weight64 = exact[3] if train_weight else weight.double()
    expected = _naive_logprobs(exact[0], weight64, targets, exact[1], exact[2], 0.5)
    assert (logprobs.double() - expected).abs().max().item() <= BF16_LOGPROB_ATOL
    for actual, reference in zip(grads, _grads(expected, exact, grad_output)):
        _bf16_close(actual, reference)


def test_linear_cross_entropy_gradcheck():
    hidden, weight, targets, _, lora_a, lora_b = _ce_inputs(7, 5, 11, torch.float64, rank=2)
    hidden.requires_grad_()
    assert torch.autograd.gradcheck(lambda h: linear_cross_entropy(h, weight, targets, chunk_size=3), (hidden,))
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, targets, chunk_size=3), (hidden, weight.clone().requires_grad_())
    )
    assert torch.autograd.gradcheck(
        lambda h, a, b: linear_cross_entropy(h, weight, targets, lora_a=a, lora_b=b, lora_scale=0.7, chunk_size=3),
        (hidden, lora_a.requires_grad_(), lora_b.requires_grad_()),
    )


def test_linear_cross_entropy_rejects_bad_inputs():
    hidden, weight, targets, _, lora_a, _ = _ce_inputs(4, 8, 10, torch.float32, rank=2)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\)"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="hidden is torch.float32 but weight is torch.float64"):
        linear_cross_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="both lora_a and lora_b"):
        linear_cross_entropy(hidden, weight, targets, lora_a=lora_a)
    with pytest.raises(ValueError, match="flatten batch dims"):
        linear_cross_entropy(hidden[None], weight, targets)


# --------------------------------------------------------------------------------------------- lora_linear


def _peft_layer(weight, bias, lora_a, lora_b, alpha):
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    base = torch.nn.Linear(in_features, out_features, bias=bias is not None, dtype=weight.dtype)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0)
    layer = PeftLoraLinear(base, "default", config=config, r=rank, lora_alpha=alpha, lora_dropout=0.0).to(weight.dtype)
    with torch.no_grad():
        base.weight.copy_(weight)
        if bias is not None:
            base.bias.copy_(bias)
        layer.lora_A["default"].weight.copy_(lora_a)
        layer.lora_B["default"].weight.copy_(lora_b)
    return layer


def _lora_inputs(shape, out_features, ranks, dtype, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    in_features = shape[-1]

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x = randn(*shape)
    weight = randn(out_features, in_features, scale=in_features**-0.5)
    b = randn(out_features) if bias else None
    lora_as = [randn(r, in_features, scale=in_features**-0.5) for r in ranks]
    lora_bs = [randn(out_features, r) for r in ranks]
    grad_y = randn(*shape[:-1], out_features)
    return x, weight, b, lora_as, lora_bs, grad_y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 12), (1, 12), (7, 12)])
def test_lora_linear_matches_peft(dtype, bias, shape):
    x, weight, b, (lora_a,), (lora_b,), grad_y = _lora_inputs(shape, 10, [4], dtype, bias)
    layer = _peft_layer(weight, b, lora_a, lora_b, alpha=8)
    peft_a, peft_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x.requires_grad_()
    expected = layer(x)
    lora_a.requires_grad_(), lora_b.requires_grad_()
    y = lora_linear(x, weight, b, lora_a, lora_b, 8 / 4)
    _close(y, expected, TOLERANCE[dtype])
    grads = _grads(y, [x, lora_a, lora_b], grad_y)
    for actual, reference in zip(grads, _grads(expected, [x, peft_a, peft_b], grad_y)):
        _close(actual, reference, TOLERANCE[dtype])


def _naive_lora(x, weight, b, lora_a, lora_b, scale):
    return F.linear(x, weight, b) + scale * (x @ lora_a.T) @ lora_b.T


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lora_linear_trainable_base_and_non_contiguous(dtype):
    x, weight, b, (lora_a,), (lora_b,), grad_y = _lora_inputs((9, 6), 8, [3], dtype)
    x = x.T.contiguous().T  # column-major
    lora_b = lora_b.T.contiguous().T
    assert not x.is_contiguous() and not lora_b.is_contiguous()
    inputs = [t.requires_grad_() for t in (x, weight, b, lora_a, lora_b)]
    y = lora_linear(*inputs, 0.25)
    expected = _naive_lora(*inputs, 0.25)
    _close(y, expected, TOLERANCE[dtype])
    for actual, reference in zip(_grads(y, inputs, grad_y), _grads(expected, inputs, grad_y)):
        _close(actual, reference, TOLERANCE[dtype])


def test_lora_linear_frozen_base_gets_no_gradient_and_saves_only_x_and_xa():
    x, weight, b, (lora_a,), (lora_b,), grad_y = _lora_inputs((4, 16, 24), 40, [8], torch.float32)
    x.requires_grad_(), lora_a.requires_grad_(), lora_b.requires_grad_()
    params = {t.untyped_storage().data_ptr() for t in (weight, b, lora_a, lora_b)}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tuple(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = lora_linear(x, weight, b, lora_a, lora_b, 2.0)
    assert sorted(saved.values()) == [(64, 8), (64, 24)]  # x A^T and x (as rows), nothing output-sized
    y.backward(grad_y)
    assert weight.grad is None and b.grad is None
    assert x.grad is not None and lora_a.grad is not None and lora_b.grad is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lora_linear_multi_equals_each_segment_alone(dtype):
    ranks, scales = [2, 5, 3], [0.5, 2.0, 1.0]
    x, weight, b, lora_as, lora_bs, grad_y = _lora_inputs((9, 4, 12), 10, ranks, dtype)
    segments = [(0, 2), (3, 3), (3, 7)]  # batch rows 2, 7 and 8 have no adapter; adapter 1 owns no rows
    x.requires_grad_()
    for t in lora_as + lora_bs:
        t.requires_grad_()
    y = lora_linear_multi(x, weight, b, lora_as, lora_bs, scales, segments)
    grads = _grads(y, [x, *lora_as, *lora_bs], grad_y)

    pieces, losses = [], []
    rows_with_adapter = torch.zeros(9, dtype=torch.bool)
    for (start, end), a, lb, scale in zip(segments, lora_as, lora_bs, scales):
        piece = lora_linear(x[start:end], weight, b, a, lb, scale)
        pieces.append((start, end, piece))
        losses.append((piece * grad_y[start:end]).sum())
        rows_with_adapter[start:end] = True
    base = F.linear(x[~rows_with_adapter], weight, b)
    losses.append((base * grad_y[~rows_with_adapter]).sum())
    for start, end, piece in pieces:
        _close(y[start:end], piece, TOLERANCE[dtype])
    _close(y[~rows_with_adapter], base, TOLERANCE[dtype])
    expected_grads = torch.autograd.grad(sum(losses), [x, *lora_as, *lora_bs], allow_unused=True)
    for actual, reference in zip(grads, expected_grads):
        if reference is None:  # adapter 1 owns no rows: its gradient is zero
            assert torch.equal(actual, torch.zeros_like(actual))
        else:
            _close(actual, reference, TOLERANCE[dtype])


def test_lora_linear_multi_segments_over_tokens_of_2d_input():
    x, weight, b, lora_as, lora_bs, grad_y = _lora_inputs((10, 6), 5, [2, 3], torch.float64)
    inputs = [x.requires_grad_(), *(t.requires_grad_() for t in lora_as + lora_bs)]
    y = lora_linear_multi(x, weight, b, lora_as, lora_bs, [1.0, 0.5], [(1, 4), (4, 10)])
    expected = torch.cat(
        [
            F.linear(x[:1], weight, b),
            _naive_lora(x[1:4], weight, b, lora_as[0], lora_bs[0], 1.0),
            _naive_lora(x[4:], weight, b, lora_as[1], lora_bs[1], 0.5),
        ]
    )
    _close(y, expected, 1e-7)
    for actual, reference in zip(_grads(y, inputs, grad_y), _grads(expected, inputs, grad_y)):
        _close(actual, reference, 1e-7)


def test_lora_linear_bf16_and_fp32_adapter():
    x, weight, b, (lora_a,), (lora_b,), grad_y = _lora_inputs((6, 16, 32), 48, [8], torch.bfloat16)
    inputs = [x.requires_grad_(), lora_a.float().requires_grad_(), lora_b.float().requires_grad_()]
    y = lora_linear(inputs[0], weight, b, inputs[1], inputs[2], 2.0)
    assert y.dtype == torch.bfloat16
    grads = _grads(y, inputs, grad_y)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    exact = [t.detach().double().requires_grad_() for t in inputs]
    expected = _naive_lora(exact[0], weight.double(), b.double(), exact[1], exact[2], 2.0)
    _bf16_close(y, expected)
    for actual, reference in zip(grads, _grads(expected, exact, grad_y.double())):
        _bf16_close(actual, reference)


def test_lora_linear_gradcheck():
    x, weight, b, lora_as, lora_bs, _ = _lora_inputs((5, 2, 4), 3, [2, 1], torch.float64)
    inputs = [t.requires_grad_() for t in (x, weight, b, *lora_as, *lora_bs)]
    assert torch.autograd.gradcheck(lambda *t: lora_linear(t[0], t[1], t[2], t[3], t[5], 1.5), inputs)
    assert torch.autograd.gradcheck(
        lambda *t: lora_linear_multi(t[0], t[1], t[2], [t[3], t[4]], [t[5], t[6]], [1.5, 0.5], [(0, 2), (3, 5)]),
        inputs,
    )


@pytest.mark.parametrize(
    ("segments", "match"),
    [([(0, 3), (2, 4)], "sorted, disjoint"), ([(2, 4), (0, 1)], "sorted, disjoint"), ([(0, 6)], "within")],
)
def test_lora_linear_multi_rejects_bad_segments(segments, match):
    x, weight, b, lora_as, lora_bs, _ = _lora_inputs((5, 4), 3, [2] * len(segments), torch.float32)
    with pytest.raises(ValueError, match=match):
        lora_linear_multi(x, weight, b, lora_as, lora_bs, [1.0] * len(segments), segments)


def test_lora_linear_rejects_mismatched_adapter():
    x, weight, b, (lora_a,), (lora_b,), _ = _lora_inputs((5, 4), 3, [2], torch.float32)
    with pytest.raises(ValueError, match=r"adapter 0 must be lora_a \[r, 4\] and lora_b \[3, r\]"):
        lora_linear(x, weight, b, lora_a, lora_b.T, 1.0)


# ---------------------------------------------------------------------------------------- rms_norm, swiglu


def _naive_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rms_norm_matches_naive(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=gen, dtype=torch.float64) * 3).to(dtype).transpose(0, 1).requires_grad_()
    weight = torch.randn(16, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    grad_y = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
    y = rms_norm(x, weight, 1e-6)
    expected = _naive_rms_norm(x, weight, 1e-6)
    _close(y, expected, TOLERANCE[dtype])
    for actual, reference in zip(_grads(y, [x, weight], grad_y), _grads(expected, [x, weight], grad_y)):
        _close(actual, reference, TOLERANCE[dtype])


def test_rms_norm_bf16_is_hugging_face_llama_rms_norm():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 64, generator=gen).bfloat16().requires_grad_()
    grad_y = torch.randn(4, 7, 64, generator=gen).bfloat16()
    reference = LlamaRMSNorm(64, eps=1e-5).bfloat16()
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=gen))
    weight = reference.weight.detach().clone().requires_grad_()
    y = rms_norm(x, weight, 1e-5)
    expected = reference(x)
    assert torch.equal(y, expected)  # same rounding steps as the layer it replaces
    grads = _grads(y, [x, weight], grad_y)
    for actual, ref in zip(grads, _grads(expected, [x, reference.weight], grad_y)):
        _bf16_close(actual, ref)


def _saved_activation_shapes(fn, *inputs, params=()):
    skip = {t.untyped_storage().data_ptr() for t in params}
    shapes = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in skip:
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*inputs)
    return sorted(shapes)


def test_rms_norm_and_swiglu_save_only_inputs_and_inverse_rms():
    x = torch.randn(6, 32, requires_grad=True)
    weight = torch.ones(32, requires_grad=True)
    assert _saved_activation_shapes(rms_norm, x, weight, 1e-6, params=[weight]) == [(6, 1), (6, 32)]
    gate, up = torch.randn(6, 32, requires_grad=True), torch.randn(6, 32, requires_grad=True)
    assert _saved_activation_shapes(swiglu, gate, up) == [(6, 32), (6, 32)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swiglu_matches_naive(dtype):
    gen = torch.Generator().manual_seed(2)
    gate = (torch.randn(4, 24, generator=gen, dtype=torch.float64) * 4).to(dtype)[:, ::2].requires_grad_()
    up = torch.randn(4, 12, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    grad_y = torch.randn(4, 12, generator=gen, dtype=torch.float64).to(dtype)
    y = swiglu(gate, up)
    expected = F.silu(gate) * up
    _close(y, expected, TOLERANCE[dtype])
    for actual, reference in zip(_grads(y, [gate, up], grad_y), _grads(expected, [gate, up], grad_y)):
        _close(actual, reference, TOLERANCE[dtype])


def test_swiglu_bf16():
    gen = torch.Generator().manual_seed(3)
    gate, up, grad_y = (torch.randn(8, 40, generator=gen).bfloat16() for _ in range(3))
    inputs = [gate.requires_grad_(), up.requires_grad_()]
    y = swiglu(*inputs)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    expected = F.silu(exact[0]) * exact[1]
    _bf16_close(y, expected)
    for actual, reference in zip(_grads(y, inputs, grad_y), _grads(expected, exact, grad_y.double())):
        assert actual.dtype == torch.bfloat16
        _bf16_close(actual, reference)


def test_norms_gradcheck():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, weight))
    up = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x, up))
