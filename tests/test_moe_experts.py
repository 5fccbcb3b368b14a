"""LoRA on routed experts with kernels on and off (`BIOS_KERNELS`): the same losses and gradients, the stock
path really stock, and the kernel path keeping only the layer's tokens, the gate_up output and the experts'
outputs for backward (bios.worker.lora_experts, bios.kernels.expert_lora)."""

from __future__ import annotations

import pytest
import torch
from arch_models import build_model

from bios.types import Datum, LoraConfig, ModelInput
from bios.worker import lora_experts
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import LoraSegment, attach_lora

TEXTS = (b"routed experts with adapters", b"a second adapter's batch", b"and more of it")


def _datum(text: bytes) -> Datum:
    tokens = list(text)
    return Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _adapters(model, count: int) -> list[AdapterState]:
    """Adapters with A and B both non-zero, as after training (B starts at zero)."""
    adapters = [AdapterState.create(f"run{i}", model, LoraConfig(rank=4, seed=i), device="cpu") for i in range(count)]
    for i, adapter in enumerate(adapters):
        with torch.no_grad():
            adapter.params.add_(0.1 * torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(i)))
    return adapters


@pytest.fixture
def expert_calls(monkeypatch) -> list[str]:
    """The names of the expert kernels called, in order."""
    calls: list[str] = []
    for name in ("expert_linear", "combine_experts"):
        kernel = getattr(lora_experts, name)

        def spy(*args, _kernel=kernel, _name=name, **kwargs):
            calls.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(lora_experts, name, spy)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_kernels_on_and_off_give_the_same_losses_and_gradients(arch, monkeypatch, expert_calls):
    model = build_model(arch)
    attach_lora(model)
    adapters = _adapters(model, 2)
    items = [ForwardItem(adapters[0], [_datum(TEXTS[0])], "cross_entropy"),
             ForwardItem(adapters[1], [_datum(TEXTS[1]), _datum(TEXTS[2])], "cross_entropy")]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("BIOS_KERNELS", setting)
        expert_calls.clear()
        outputs = forward_backward(model, items)
        results[setting] = ([out.metrics["loss:sum"] for out in outputs], [a.pending_grad.clone() for a in adapters])
        for adapter in adapters:
            adapter.pending_grad.zero_()
        layers = model.config.num_hidden_layers
        assert expert_calls == ([] if setting == "0" else ["expert_linear", "expert_linear", "combine_experts"] * layers)
    (losses_on, grads_on), (losses_off, grads_off) = results["1"], results["0"]
    assert losses_on == pytest.approx(losses_off, rel=1e-5)
    for on, off in zip(grads_on, grads_off):
        assert float(on.abs().max()) > 0
        torch.testing.assert_close(on, off, rtol=0, atol=1e-5 * float(off.abs().max()))


def _saved_bytes(experts, hidden, top_k_index, top_k_weights) -> int:
    """Bytes of the activations one experts forward keeps for backward (parameters and factors not counted)."""
    held = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    held |= {t.untyped_storage().data_ptr() for slot in experts.lora_slots.values() for s in slot.lora_segments
             for t in (s.lora_a, s.lora_b)}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        experts(hidden, top_k_index, top_k_weights)
    return sum(saved.values())


def test_a_layer_keeps_its_tokens_the_gate_up_output_and_the_expert_outputs(monkeypatch):
    model = build_model("qwen3_moe")
    attach_lora(model)
    experts = model.model.layers[0].mlp.experts
    num_experts, width, hidden_size = experts.gate_up_proj.shape[0], experts.down_proj.shape[2], model.config.hidden_size
    rank, tokens, top_k = 4, 64, model.config.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in {"gate_up_proj": (2 * width, hidden_size),
                                             "down_proj": (hidden_size, width)}.items():
        lora_a = torch.randn(num_experts, rank, in_features, generator=generator, requires_grad=True)
        lora_b = torch.randn(num_experts, out_features, rank, generator=generator, requires_grad=True)
        experts.lora_slots[name].lora_segments = [LoraSegment(0, 1, lora_a, lora_b, 2.0)]
    experts.bios_rows_per_item = tokens
    hidden = torch.randn(tokens, hidden_size, generator=generator, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, top_k, generator=generator, requires_grad=True)
    saved = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("BIOS_KERNELS", setting)
        saved[setting] = _saved_bytes(experts, hidden, top_k_index, top_k_weights)
    pairs = tokens * top_k
    activations = 4 * (tokens * hidden_size + pairs * 2 * width + pairs * hidden_size)  # fp32
    small = 8 * 2 * pairs + 4 * (pairs + 2 * pairs * rank)  # order and rows (int64), weights, x A_eᵀ of both
    assert saved["1"] <= activations + small
    assert saved["0"] > activations + small  # the stock path also keeps the gathered tokens and the gate's outputs
