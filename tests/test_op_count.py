"""How many aten ops the LoRA path dispatches (bench/op_count.py): each is a kernel launch on a GPU, where the host's
dispatching, not the arithmetic, sets the pace of a small model's step. Counts, never times.

The LoRA Functions fold their scales into the GEMMs' alpha and, where autograd would only add a factor's
gradient into its preset `.grad` (the worker's flat gradient buffer), add it there themselves (`grad_sink`):
the gradients must be what autograd's own accumulation gives, and every other case (no `.grad`, hooks,
`torch.autograd.grad`, `create_graph`) must keep returning them.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bios import types
from bios.kernels import lora as lora_module
from bios.kernels import lora_linear_multi
from bios.kernels import stacked_lora as stacked_module
from bios.kernels.stacked_lora import AdapterRows, stacked_lora_linear
from bios.worker.adapter import AdapterState
from bios.worker.engine import (
    ForwardItem,
    commit_gradients,
    forward_backward,
    optim_step,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from op_count import NO_KERNEL, OpCounter, smollm2_shaped, split_counts

IN, OUTS, ROWS = 16, (24, 8, 8), 10


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _factors(out, rank, seed):
    return _randn(rank, IN, seed=seed).requires_grad_(), (_randn(out, rank, seed=seed + 1) / 4).requires_grad_()


def _preset_grads(tensors):
    """Give every tensor a `.grad` that is a view of one flat buffer holding nonzero values, as AdapterState does;
    return the buffer and a copy of its values."""
    buffer = _randn(sum(t.numel() for t in tensors), seed=99)
    offset = 0
    for t in tensors:
        t.grad = buffer[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    return buffer, buffer.clone()


def _lora_case(bias: bool):
    """(run forward and backward, the factors) of lora_linear_multi with two adapters and uncovered rows."""
    x = _randn(ROWS, IN, seed=0).requires_grad_()
    weight, b = _randn(OUTS[0], IN, seed=1), _randn(OUTS[0], seed=2) if bias else None
    (a0, b0), (a1, b1) = _factors(OUTS[0], 4, 10), _factors(OUTS[0], 2, 20)
    upstream = _randn(ROWS, OUTS[0], seed=3)

    def run():
        y = lora_linear_multi(x, weight, b, [a0, a1], [b0, b1], [0.5, 2.0], [(1, 4), (6, 9)])
        y.backward(upstream)

    return run, [a0, b0, a1, b1], x


def _stacked_case(bias: bool):
    """(run, factors) of stacked_lora_linear: one adapter on all three layers, one on layers 0 and 2."""
    x = _randn(ROWS, IN, seed=0).requires_grad_()
    weight, b = _randn(sum(OUTS), IN, seed=1), _randn(sum(OUTS), seed=2) if bias else None
    first = [_factors(out, 4, 10 + 2 * i) for i, out in enumerate(OUTS)]
    second = [_factors(OUTS[0], 2, 30), _factors(OUTS[2], 2, 32)]
    upstream = _randn(ROWS, sum(OUTS), seed=3)
    adapters = [AdapterRows(0, 4, (0, 1, 2), tuple(f[0] for f in first), tuple(f[1] for f in first), 0.5),
                AdapterRows(5, 9, (0, 2), tuple(f[0] for f in second), tuple(f[1] for f in second), 2.0)]

    def run():
        stacked_lora_linear(x, weight, b, OUTS, adapters).backward(upstream)

    return run, [t for f in first + second for t in f], x


CASES = [_lora_case, _stacked_case]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_gradients_added_into_preset_grads_are_what_autograd_would_add(case, bias):
    run, factors, x = case(bias)
    run()  # no .grad yet: autograd stores the returned gradients
    returned = [f.grad.clone() for f in factors]
    x_grad = x.grad.clone()
    for f in factors + [x]:
        f.grad = None
    _, start = _preset_grads(factors)
    pointers = [f.grad.data_ptr() for f in factors]
    run()
    assert [f.grad.data_ptr() for f in factors] == pointers, "a .grad stopped aliasing the flat buffer"
    offset = 0
    for f, expected in zip(factors, returned):
        torch.testing.assert_close(f.grad, start[offset : offset + f.numel()].view(f.shape) + expected,
                                   rtol=1e-5, atol=1e-5)
        offset += f.numel()
    torch.testing.assert_close(x.grad, x_grad, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_autograd_grad_hooks_and_create_graph_still_get_the_gradients_returned(case):
    run, factors, _ = case(True)
    run()
    returned = [f.grad.clone() for f in factors]

    # torch.autograd.grad accumulates into no leaf: the preset .grad stays as it was
    buffer, start = _preset_grads(factors)
    x = _randn(ROWS, IN, seed=0)
    if case is _lora_case:
        y = lora_linear_multi(x, _randn(OUTS[0], IN, seed=1), _randn(OUTS[0], seed=2), factors[0::2], factors[1::2],
                              [0.5, 2.0], [(1, 4), (6, 9)])
        upstream = _randn(ROWS, OUTS[0], seed=3)
    else:
        first, second = factors[:6], factors[6:]
        adapters = [AdapterRows(0, 4, (0, 1, 2), tuple(first[0::2]), tuple(first[1::2]), 0.5),
                    AdapterRows(5, 9, (0, 2), tuple(second[0::2]), tuple(second[1::2]), 2.0)]
        y = stacked_lora_linear(x, _randn(sum(OUTS), IN, seed=1), _randn(sum(OUTS), seed=2), OUTS, adapters)
        upstream = _randn(ROWS, sum(OUTS), seed=3)
    grads = torch.autograd.grad(y, factors, upstream)
    for g, expected in zip(grads, returned):
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(buffer, start)

    # a hook on a factor sees its gradient
    seen = []
    factors[1].register_hook(lambda g: seen.append(g.clone()))
    buffer, start = _preset_grads(factors)
    run()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], returned[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(factors[1].grad, start[factors[0].numel():][: factors[1].numel()].view(
        factors[1].shape) + returned[1], rtol=1e-5, atol=1e-5)


def _compute_ops(run) -> dict[str, int]:
    counter = OpCounter()
    with counter:
        run()
    return split_counts(counter.counts)[0]


def _ops_with_preset_grads(case) -> dict[str, int]:
    """The compute ops of one forward and backward of `case` once its factors' .grad are preset, as the worker
    presets them (a first run makes them exist), the input's gradient cleared."""
    run, factors, x = case
    run()
    _preset_grads(factors)
    x.grad = None
    return _compute_ops(run)


def test_a_lora_layer_with_preset_grads_dispatches_one_op_per_product():
    """Forward: the frozen product, then per adapter x Aᵀ and one addmm_ (scale as alpha). Backward: the input's
    gradient through W, per adapter g B, one addmm_ into the input's gradient, one addmm_ into A's .grad, and for
    B the fast-orientation product (scale as alpha) and one add_ into its .grad: no mul_, no separate scaling."""
    ops = _ops_with_preset_grads(_lora_case(bias=False))
    assert "mul_" not in ops and "mul" not in ops, ops
    # 2 adapters: forward 1 + 2 x 2, backward 1 + 2 x (g B, addmm_ x, addmm_ A, B's product + add_), x's grad store
    assert sum(ops.values()) <= 1 + 4 + 1 + 2 * 5 + 1, ops


def test_a_stacked_layer_with_preset_grads_dispatches_no_scaling_ops():
    ops = _ops_with_preset_grads(_stacked_case(bias=False))
    assert "mul_" not in ops and "mul" not in ops, ops
    assert ops.get("add_", 0) <= 5, ops  # B's gradients (3 + 2 layers); A's go in by addmm_


class LoraPathOps(TorchDispatchMode):
    """Compute ops of the LoRA path: those dispatched inside the LoRA layers' Functions (forward and backward)
    and those writing into the adapter's gradient buffer (autograd's accumulation of the factors' gradients)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.inside = 0
        self.storage = buffer.untyped_storage().data_ptr()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            first = args[0] if args else None
            into_buffer = isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() == self.storage
            if self.inside or into_buffer:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _counted(mode: LoraPathOps, method):
    def wrapped(*args, **kwargs):
        mode.inside += 1
        try:
            return method(*args, **kwargs)
        finally:
            mode.inside -= 1
    return staticmethod(wrapped)


# One SmolLM2-shaped step of 2 layers, 4 x 32 tokens, BIOS_C_KERNELS=off (the op path CUDA takes), fp32. Measured
# for issue 39 (scales folded into the GEMMs' alpha, factor gradients added into .grad by the GEMMs, no cat of
# g·B): the LoRA path 110 compute ops (before: 144; mul_ 24 -> 2, add_ 30 -> 16, mm 44 -> 22, cat 8 -> 4), the
# whole step 393 (before: 427). The bounds sit between the two, a little above the measurement.
LORA_PATH_BOUND = 118  # 110 measured
# mul_: SwiGLU's recompute for down_proj's input (silu(gate) * up), once per layer. add_: on a CPU each B's
# gradient is its fast-orientation GEMM plus one add_ into .grad (7 a layer), the head's A and B 2 (its own Function)
LORA_PATH_OP_BOUNDS = {"mul_": 2, "add_": 16}
STEP_BOUND = 405  # 393 measured, before 427: other changes to the step have a little room

def test_a_training_step_dispatches_no_more_lora_ops_than_measured(monkeypatch):
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    model = smollm2_shaped(2)
    generator = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        tokens = torch.randint(0, model.config.vocab_size, (33,), generator=generator).tolist()
        data.append(types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                                {"target_tokens": tokens[1:], "weights": [1.0] * 32}))
    adapter = AdapterState.create("ops", model, types.LoraConfig(rank=16, seed=0), device="cpu")

    def step():
        forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])

    def optimizer():
        commit_gradients(adapter)
        optim_step(adapter, types.AdamParams(learning_rate=1e-4))

    step()
    optimizer()
    lora_ops = LoraPathOps(adapter.pending_grad)
    functions = (lora_module._LoraLinear, stacked_module._StackedLoraLinear)
    originals = [(f, f.__dict__["forward"], f.__dict__["backward"]) for f in functions]
    try:
        for function, forward, backward in originals:
            function.forward = _counted(lora_ops, forward.__func__)
            function.backward = _counted(lora_ops, backward.__func__)
        with lora_ops:
            step()
    finally:
        for function, forward, backward in originals:
            function.forward, function.backward = forward, backward
    optimizer()
    counts = dict(lora_ops.counts)
    total = sum(counts.values())
    print(f"LoRA path: {total} compute ops per step", counts)
    for name, bound in LORA_PATH_OP_BOUNDS.items():
        assert counts.get(name, 0) <= bound, f"{counts.get(name, 0)} {name} in the LoRA path, at most {bound}: {counts}"
    assert total <= LORA_PATH_BOUND, f"the LoRA path dispatched {total} compute ops, at most {LORA_PATH_BOUND}: {counts}"

    step_ops = _compute_ops(lambda: (step(), optimizer()))
    step_total = sum(step_ops.values())
    print(f"whole step: {step_total} compute ops", step_ops)
    assert step_total <= STEP_BOUND, f"{step_total} compute ops per step, at most {STEP_BOUND}: {step_ops}"
