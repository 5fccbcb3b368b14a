"""A bf16 model's training pass multiplies by one cast copy of each adapter's factors (bios.worker.factor_copies)
instead of casting each factor at each layer: the same losses and gradients bit for bit, several adapters in one
pass, and fp32 models take the factors themselves."""

from __future__ import annotations

import torch
from test_kernel_integration import random_batch

from bios import types
from bios.models import load_base_model
from bios.worker import engine
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.factor_copies import FactorCopy, factor_copies
from bios.worker.lora import attach_lora


def _adapters(model, count):
    adapters = []
    for i in range(count):
        adapter = AdapterState.create(f"a{i}", model, types.LoraConfig(rank=4, seed=i), device="cpu")
        with torch.no_grad():  # B starts at zero: move off it so every factor's gradient is non-trivial
            adapter.params.add_(0.05 * torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(i)))
        adapters.append(adapter)
    return adapters


def test_one_cast_copy_per_adapter_trains_bit_for_bit_as_per_layer_casts(monkeypatch):
    monkeypatch.setenv("BIOS_BASE_DTYPE", "bfloat16")
    model = load_base_model("bios/tiny-llama").model
    attach_lora(model)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    adapters = _adapters(model, 2)
    data = [random_batch(model.config.vocab_size, [12, 7], seed=1), random_batch(model.config.vocab_size, [9], seed=2)]
    made = []

    def spy(*args):
        copies = factor_copies(*args)
        made.extend(copies.values())
        return copies

    results = []
    for copies in (spy, lambda *args: {}):
        monkeypatch.setattr(engine, "factor_copies", copies)
        for adapter in adapters:
            adapter.pending_grad.zero_()
        outputs = forward_backward(model, [ForwardItem(a, d, "cross_entropy") for a, d in zip(adapters, data)])
        results.append(([o.loss_fn_outputs[0]["logprobs"].to_torch() for o in outputs],
                        [a.pending_grad.clone() for a in adapters]))
        if copies is spy:
            assert len(made) == 2 and all(isinstance(copy, FactorCopy) for copy in made)
    (logprobs, grads), (logprobs_cast, grads_cast) = results
    assert all(torch.equal(a, b) for a, b in zip(logprobs, logprobs_cast))
    assert all(g.abs().sum() > 0 and torch.equal(g, h) for g, h in zip(grads, grads_cast))


def test_fp32_factors_need_no_copy():
    model = load_base_model("bios/tiny-llama").model
    adapter = _adapters(model, 1)[0]
    assert factor_copies([adapter, adapter], torch.float32) == {}
    copies = factor_copies([adapter, adapter], torch.bfloat16)
    assert list(copies) == [id(adapter)]  # one copy however many rows share the adapter
    name = adapter.targets[0].module_name
    copy_a, copy_b = copies[id(adapter)].lora_pair(name)
    assert copy_a.dtype == torch.bfloat16 and copy_a.is_leaf and copy_a.requires_grad
    assert torch.equal(copy_b, adapter.lora_pair(name)[1].to(torch.bfloat16))
