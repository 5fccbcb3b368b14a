"""Rows of a training pass packed end to end (bios.worker.packing): a row's log-probs, loss and gradients are
what it gets alone, on every architecture, and packing really happens where the model's attention allows it."""

from __future__ import annotations

import pytest
import torch
from arch_models import CONFIGS, build_model
from transformers import AutoConfig, AutoModelForCausalLM, BioGptConfig, OPTConfig

from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.types import Datum, LoraConfig, ModelInput
from bios.worker.adapter import AdapterState
from bios.worker.attention import ATTENTION, _tests_for_sdpa_by_name, use_bios_attention
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora
from bios.worker.packing import attention_pair_cost, pack_rows

# Rows of 21, 6 and 13 tokens (as inputs) under one adapter and of 4 and 19 under another: five rows that pack
# into four batch rows (13 + 6 share one) or fewer (a batch row up to twice the longest, where attention is cheap).
_TEXTS = [[b"a row of twenty-one by", b"seven t", b"fourteen toke"], [b"four5", b"another row of 19 ch"]]


def _datum(text: bytes) -> Datum:
    tokens = list(text)
    return Datum(ModelInput.from_ints(tokens[:-1]),
                 {"target_tokens": tokens[1:], "weights": [1.0 + i % 3 for i in range(len(tokens) - 1)]})


def _adapters(model) -> list[AdapterState]:
    adapters = [AdapterState.create(f"run{i}", model, LoraConfig(rank=4, seed=i), device="cpu") for i in range(2)]
    for i, adapter in enumerate(adapters):
        with torch.no_grad():
            adapter.params.add_(0.1 * torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(i)))
    return adapters


def _batch_rows(model) -> list[int]:
    """How many batch rows each base-model pass of `model` runs (recorded on the embedding)."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    return seen


def _together_equals_alone(model, loss_fn: str = "cross_entropy") -> list[int]:
    """Run `_TEXTS` in one call, then each datum alone; the batch rows of the call's passes."""
    attach_lora(model)
    adapters = _adapters(model)
    data = [[_datum(text) for text in texts] for texts in _TEXTS]
    passes = _batch_rows(model)
    together = forward_backward(model, [ForwardItem(a, d, loss_fn) for a, d in zip(adapters, data)])
    batch_rows = list(passes)
    grads = [adapter.pending_grad.clone() for adapter in adapters]
    for adapter, datums, outputs, grad in zip(adapters, data, together, grads):
        adapter.pending_grad.zero_()
        for datum, output in zip(datums, outputs.loss_fn_outputs):
            alone = forward_backward(model, [ForwardItem(adapter, [datum], loss_fn)])[0]
            torch.testing.assert_close(output["logprobs"].to_torch(), alone.loss_fn_outputs[0]["logprobs"].to_torch(),
                                       rtol=1e-5, atol=1e-5)
        assert float(grad.abs().max()) > 0
        torch.testing.assert_close(adapter.pending_grad, grad, rtol=0, atol=1e-5 * float(grad.abs().max()))
    return batch_rows


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_packed_row_gets_what_it_gets_alone(arch):
    batch_rows = _together_equals_alone(build_model(arch))
    if arch in ("gpt_oss", "falcon"):  # rows padded: gpt-oss runs eager attention (sinks), Falcon's code
        assert batch_rows == [5]      # leaves its SDPA path when the implementation is not named "sdpa"
    else:
        assert len(batch_rows) == 1 and batch_rows[0] <= 4


def test_bios_packing_0_pads_with_the_same_results(monkeypatch):
    monkeypatch.setenv("BIOS_PACKING", "0")
    assert _together_equals_alone(build_model("llama")) == [5]


_SMALL = dict(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize("model_type, fields", [
    ("mistral", dict(sliding_window=5)),  # every layer windowed
    ("gemma3_text", dict(head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    ("starcoder2", dict(sliding_window=4)),
    ("gpt_neox", {}), ("phi", {}), ("stablelm", dict(num_key_value_heads=4)), ("cohere", {}),
    # its shared expert sees the tokens flattened, [batch x tokens, in], like OPT's MLP
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32)),
])
def test_more_architectures_pack_with_their_windows(model_type, fields):
    """More layouts (windows of a few tokens in every layer or some, partial rotary, parallel blocks):
    windows and row boundaries both hold."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_SMALL, **fields}, initializer_range=0.1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert _together_equals_alone(model)[0] <= 4


def test_a_model_that_builds_its_mask_without_position_ids_still_keeps_packed_rows_apart():
    """BioGPT does not hand position ids to Transformers' mask builder: Bios's mask keeps the rows apart."""
    torch.manual_seed(0)
    config = BioGptConfig(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert _together_equals_alone(model)[0] <= 4


def test_opt_flattens_tokens_before_its_mlp_and_each_row_still_gets_its_adapter():
    """OPT's fc1/fc2 see `[batch x tokens, in]`: LoRA segments over batch rows are scaled to its tokens."""
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=128, dropout=0.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert _together_equals_alone(model)[0] <= 4


def test_a_pass_budget_counts_the_positions_packed_rows_take(monkeypatch):
    """Micro-batches are sized by the positions their pass really runs: packed rows fit more in one pass than
    padded ones, no pass goes over the budget, and the results are the padded passes'."""
    model = build_model("llama")
    attach_lora(model)
    adapter = _adapters(model)[0]
    data = [_datum(bytes(range(97, 97 + n))) for n in (20, 5, 12, 9, 16, 3, 7)]  # rows of 19, 4, 11, ... tokens
    positions: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: positions.append(out.shape[0] * out.shape[1]))
    runs = {}
    for packing in ("1", "0"):
        monkeypatch.setenv("BIOS_PACKING", packing)
        positions.clear()
        adapter.pending_grad.zero_()
        output = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")], max_tokens_per_pass=40)[0]
        runs[packing] = (list(positions), output, adapter.pending_grad.clone())
    (packed_passes, packed, packed_grad), (padded_passes, padded, padded_grad) = runs["1"], runs["0"]
    assert max(packed_passes + padded_passes) <= 40
    assert len(packed_passes) < len(padded_passes) == 3  # padded: [19, 15], [11, 8, 6], [4, 2]
    for got, want in zip(packed.loss_fn_outputs, padded.loss_fn_outputs):
        torch.testing.assert_close(got["logprobs"].to_torch(), want["logprobs"].to_torch(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_grad, padded_grad, rtol=0, atol=1e-5 * float(padded_grad.abs().max()))


def test_a_model_whose_code_tests_for_sdpa_by_name_keeps_sdpa():
    """Falcon's attention runs SDPA only while the implementation is named "sdpa" (and it cannot be switched):
    it keeps plain SDPA, and its rows are padded (checked above); Llama switches."""
    falcon, llama = build_model("falcon"), build_model("llama")
    assert _tests_for_sdpa_by_name(falcon) and not _tests_for_sdpa_by_name(llama)
    assert not use_bios_attention(falcon) and falcon.config._attn_implementation == "sdpa"
    assert use_bios_attention(llama) and llama.config._attn_implementation == ATTENTION


def test_pack_rows_fills_short_batch_rows_one_adapter_each():
    tokens = [torch.arange(n) + 100 * n for n in (5, 9, 3, 4, 2)]
    packed = pack_rows(tokens, ["a", "a", "a", "b", "a"], pair_cost=1.0)  # attention dear: rows of 10 at most
    assert packed.input_ids.shape == (3, 10)  # best fit decreasing: a [9] [5 + 3 + 2], then b [4]
    flat = packed.input_ids.reshape(-1)
    for row, start in zip(tokens, torch.cumsum(torch.tensor([0] + [t.numel() for t in tokens]), 0)):
        assert torch.equal(flat[packed.token_index[start:start + row.numel()]], row)
    assert packed.owners == [1, 0, 3]
    assert packed.position_ids[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert packed.sequence_ids.tolist() == [[0] * 9 + [1], [0] * 5 + [1] * 3 + [2] * 2, [0] * 4 + [1] * 6]
    assert pack_rows([torch.arange(4), torch.arange(4)], [0, 1]).sequence_ids is None  # nothing to mask
    cheap = pack_rows(tokens, ["a"] * 5)  # attention free: fewest positions, all 23 tokens in one batch row
    assert cheap.input_ids.shape == (1, 23) and cheap.sequence_ids[0, -1] == 4
    # between: 3 x 9 positions ([9] [5 + 4] [3 + 2]) cost less than 1 x 23 or 2 x 12
    assert pack_rows(tokens, ["a"] * 5, pair_cost=0.1).input_ids.shape == (3, 9)


def test_attention_pair_cost_weighs_attention_against_the_linear_layers():
    llama_7b = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                    num_key_value_heads=8)
    # one pair: 4 x 4096 FLOPs; one token through a layer: 2 x (4096 x (2 x 4096 + 2 x 1024) + 3 x 4096 x 11008)
    assert attention_pair_cost(llama_7b) == pytest.approx(4 * 4096 / (2 * 4096 * (10240 + 33024)))

    class Opaque:  # a config without the fields: attention counted dear
        def get_text_config(self):
            return self

    assert attention_pair_cost(Opaque()) == 1.0
