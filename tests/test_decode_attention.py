"""The decode-step attention bf16 sampling uses on CPU (bios.worker.decode_attention): as accurate as SDPA for
one query row, SDPA itself for everything else, and sampled logprobs that agree with the training forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_sampling import forward_logprobs, perturbed_adapter
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.types import SamplingParams
from bios.worker.decode_attention import ATTENTION, decode_step_attention
from bios.worker.lora import attach_lora
from bios.worker.sampling import SampleItem, generate


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _qkv(queries: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(queries)
    shapes = [(4, 9, queries, 32), (4, 3, 40, 32), (4, 3, 40, 32)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def test_one_query_row_is_as_accurate_as_sdpa():
    query, key, value = _qkv(1, torch.bfloat16)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[1, :, :, :7] = False  # a left-padded row
    mask[3, :, :, 30:] = False
    exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                           enable_gqa=True).transpose(1, 2)
    ours, _ = decode_step_attention(_Attention(), query, key, value, mask)
    theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, mask)
    assert ours.shape == theirs.shape == (4, 1, 9, 32) and ours.dtype == torch.bfloat16
    sdpa_error = (theirs.float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= max(sdpa_error, 1e-2)


@pytest.mark.parametrize("queries, dtype", [(5, torch.bfloat16), (1, torch.float32)])
def test_prompts_and_fp32_run_sdpa_itself(queries, dtype):
    query, key, value = _qkv(queries, dtype)
    ours, _ = decode_step_attention(_Attention(), query, key, value, None)
    theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, None)
    assert torch.equal(ours, theirs)


def test_bf16_sampled_logprobs_agree_with_the_training_forward():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    attach_lora(model)
    adapter = perturbed_adapter(model, "a", seed=3)
    prompt = list(b"The decode step")
    params = SamplingParams(max_tokens=16, seed=2, stop=[])
    [result] = generate(model, None, [SampleItem(adapter, prompt, 3, params)], eos_token_id=None)
    assert model.config._attn_implementation == ATTENTION
    for sequence in result.sequences:
        expected = forward_logprobs(model, adapter, prompt + sequence.tokens)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected.float(), rtol=0, atol=0.02)
