"""Projections that share an input computed as one stacked layer while training (bios.kernels.stacked_lora,
bios.worker.stacked_layers): the same numbers as each LoRA layer on its own, for one adapter or several over
row ranges (one adapting only some of the stacked layers); weights laid out end to end when a Llama is attached;
every case the stacked layer cannot take left to the per-layer path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bios import types
from bios.kernels import lora_linear_multi
from bios.kernels import stacked_lora
from bios.kernels.prepacked import PrepackedWeights
from bios.kernels.stacked_lora import AdapterRows, end_to_end, stacked_lora_linear
from bios.worker import fused_llama
from bios.worker.adapter import AdapterState
from bios.worker.lora import active_adapters, attach_lora
from bios.worker.stacked_layers import lay_out_end_to_end, stacked_output

OUTS = (24, 8, 8)
IN = 16


def _randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_end_to_end_is_a_view_only_over_tensors_laid_out_one_after_another():
    stacked = _randn(40, IN, seed=0)
    parts = list(stacked.split(OUTS))
    view = end_to_end(parts)
    assert view is not None and view.data_ptr() == stacked.data_ptr() and torch.equal(view, stacked)
    assert end_to_end([parts[1], parts[0], parts[2]]) is None  # out of order
    assert end_to_end([parts[0], parts[2]]) is None  # a gap
    assert end_to_end([p.clone() for p in parts]) is None  # separate tensors
    assert end_to_end([stacked[:, :8], stacked[:, 8:]]) is None  # not contiguous rows


def _layers(dtype):
    weights = [_randn(out, IN, seed=i, dtype=dtype) for i, out in enumerate(OUTS)]
    return weights, torch.cat(weights)


def _adapters(dtype):
    """Two adapters: rows 0-1 (every layer, rank 4) and rows 2-3 (layers 0 and 2 only, rank 2); row 4 none."""
    def factors(rank, out, seed):
        return (_randn(rank, IN, seed=seed, dtype=torch.float32).requires_grad_(),
                _randn(out, rank, seed=seed + 50, dtype=torch.float32).requires_grad_())

    first = [factors(4, out, 10 + i) for i, out in enumerate(OUTS)]
    second = {0: factors(2, OUTS[0], 20), 2: factors(2, OUTS[2], 22)}
    return first, second


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_stacked_layer_computes_what_each_layer_computes_on_its_own(dtype):
    weights, stacked = _layers(dtype)
    bias = _randn(sum(OUTS), seed=7, dtype=dtype)
    biases = list(bias.split(OUTS))
    first, second = _adapters(dtype)
    x = _randn(5, 3, IN, seed=8, dtype=dtype)
    grad_y = _randn(5, 3, sum(OUTS), seed=9, dtype=dtype)

    def separate():
        inputs = x.clone().requires_grad_()
        outputs = []
        for i, (weight, layer_bias) in enumerate(zip(weights, biases)):
            pairs, segments = [first[i]], [(0, 2)]
            if i in second:
                pairs.append(second[i])
                segments.append((2, 4))
            outputs.append(lora_linear_multi(inputs, weight, layer_bias, [a for a, _ in pairs], [b for _, b in pairs],
                                             [0.5] * len(pairs), segments))
        return inputs, torch.cat(outputs, dim=-1)

    def stacked_once():
        inputs = x.clone().requires_grad_()
        adapters = [AdapterRows(0, 2, (0, 1, 2), tuple(a for a, _ in first), tuple(b for _, b in first), 0.5),
                    AdapterRows(2, 4, (0, 2), (second[0][0], second[2][0]), (second[0][1], second[2][1]), 0.5)]
        return inputs, stacked_lora_linear(inputs, stacked, bias, OUTS, adapters)

    results = []
    for run in (separate, stacked_once):
        factors = [t for pair in (*first, *second.values()) for t in pair]
        for factor in factors:
            factor.grad = None
        inputs, y = run()
        y.backward(grad_y)
        results.append((y.detach(), inputs.grad, [f.grad.clone() for f in factors]))
    (y_sep, gx_sep, gf_sep), (y_st, gx_st, gf_st) = results
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_st, y_sep, **tolerance)
    torch.testing.assert_close(gx_st, gx_sep, **tolerance)
    for ours, theirs in zip(gf_st, gf_sep):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _tiny_llama(model_type="llama"):
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape))


def _stacked_calls(monkeypatch) -> list[int]:
    calls = []
    apply = stacked_lora._StackedLoraLinear.apply

    def counted(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(stacked_lora._StackedLoraLinear, "apply", counted)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])  # Qwen2's q, k and v have biases
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_attached_llama_trains_its_stacked_layers_as_it_trains_them_apart(model_type, dtype, monkeypatch):
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    monkeypatch.setenv("BIOS_KERNELS", "1")
    model = _tiny_llama(model_type)
    attach_lora(model)
    if dtype == torch.float64:  # the arithmetic itself: the same numbers but for float64 rounding
        for parameter in model.parameters():
            parameter.data = parameter.data.double()
        fused_llama.fuse_llama_modules(model)  # lays the new weights out again
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        assert end_to_end([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]) is not None
        assert end_to_end([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
        if model_type == "qwen2":
            assert end_to_end([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]) is not None
    adapters = [AdapterState.create(name, model, config, device="cpu") for name, config in
                (("all", types.LoraConfig(rank=4, seed=0)), ("mlp", types.LoraConfig(rank=2, seed=1, train_attn=False)))]
    factors = [t for adapter in adapters for target in adapter.targets for t in adapter.lora_pair(target.module_name)]
    with torch.no_grad():
        for factor in factors[1::2]:  # B starts at zero: give the A factors' gradients something to carry
            factor.normal_(std=0.1)
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    calls = _stacked_calls(monkeypatch)
    results = {}
    for stacked in (True, False):
        if not stacked:
            monkeypatch.setattr(fused_llama, "stacked_output", lambda *args: None)
        for factor in factors:
            factor.grad = None
        with active_adapters(model, [(0, 2, adapters[0]), (2, 3, adapters[1])]):
            logits = model(input_ids=ids, use_cache=False).logits  # as the engine calls it: no cache
        (logits * weights).sum().backward()
        results[stacked] = (logits.detach(), [f.grad.clone() for f in factors])
        if stacked:
            assert len(calls) == 2 * 2  # q/k/v and gate/up in each of the 2 layers
    # float64: the stacked layer's arithmetic is the separate layers' (factors' gradients come back in fp32);
    # fp32: their rounding, wider products summing in other orders (the kernels-on-vs-off bound)
    tolerance = 1e-6 if dtype == torch.float64 else 1e-4
    for ours, theirs in zip([results[True][0], *results[True][1]], [results[False][0], *results[False][1]]):
        assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()


def test_the_stacked_layer_stands_aside_where_it_cannot_apply(monkeypatch):
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    model = _tiny_llama()
    attach_lora(model)
    adapter = AdapterState.create("a", model, types.LoraConfig(rank=4, seed=0), device="cpu")
    attention = model.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    x = _randn(2, 5, 32, seed=0, dtype=torch.float32)
    with active_adapters(model, [(0, 2, adapter)]):
        training = stacked_output(x, projections)
        assert training is not None
        with torch.no_grad():
            forward = stacked_output(x, projections)
            with PrepackedWeights().using():  # a decode step keeps its per-layer prepacked products
                assert stacked_output(x, projections) is None
        assert torch.equal(forward, training.detach())  # a forward pass gives the training pass's numbers
        monkeypatch.setenv("BIOS_KERNELS", "0")
        assert stacked_output(x, projections) is None
        monkeypatch.delenv("BIOS_KERNELS")
        attention.k_proj.weight = torch.nn.Parameter(attention.k_proj.weight.detach().clone(), requires_grad=False)
        assert stacked_output(x, projections) is None  # a weight made again (a tensor-parallel shard, say)
        assert lay_out_end_to_end(projections)  # laid out again
        assert stacked_output(x, projections) is not None


def test_laying_out_keeps_parameters_and_values():
    model = _tiny_llama()
    mlp = model.model.layers[0].mlp
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    parameters = (mlp.gate_proj.weight, mlp.up_proj.weight)
    assert lay_out_end_to_end((mlp.gate_proj, mlp.up_proj))
    assert (mlp.gate_proj.weight, mlp.up_proj.weight) == parameters  # the same Parameter objects, now views
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    mixed = torch.nn.Linear(32, 8, dtype=torch.float64)
    assert not lay_out_end_to_end((mlp.gate_proj, mixed))  # dtypes differ: left as they are
