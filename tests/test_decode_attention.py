"""The decode-step attention bf16 sampling uses on CPU (bios.worker.decode_attention): as accurate as SDPA for
one query row, and SDPA itself for everything else. That bf16 sampled log-probs agree with the bf16 training
forward through it is tests/test_kernel_integration.py's bf16 sampling test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.worker.attention import ATTENTION, use_bios_attention
from bios.worker.decode_attention import decode_step_attention


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


def test_values_narrower_than_keys_come_out_at_their_own_width():
    """MLA (DeepSeek-V3: keys 192 wide, values 128) decodes without padding its values."""
    query, key, value = _qkv(1, torch.bfloat16)
    value = value[..., :24]
    ours, _ = decode_step_attention(_Attention(), query, key, value, None)
    exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), enable_gqa=True).transpose(1, 2)
    assert ours.shape == (4, 1, 9, 24)
    torch.testing.assert_close(ours.float(), exact, rtol=0, atol=2e-2)


def _decoded_logprobs(model, tokens: list[int], attention: str) -> torch.Tensor:
    """log p(tokens[i + 1] | tokens[: i + 1]) for i >= 3, decoding one token per step after a 4-token prompt."""
    model.set_attn_implementation(attention)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = [model(input_ids=torch.tensor([tokens[:4]]), past_key_values=cache, use_cache=True).logits[0, -1]]
        for token in tokens[4:-1]:
            logits.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1])
    logprobs = torch.log_softmax(torch.stack(logits).float(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens[4:])[:, None]).squeeze(1)


def test_a_bf16_model_decodes_at_least_as_close_to_fp32_as_with_sdpa():
    """Teacher-forced decode steps of a bf16 Llama whose attention is far from uniform: against the same weights
    in fp32, the decode-step attention is as accurate as SDPA (it computes in fp32)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1)
    exact = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    model.load_state_dict({key: value.to(torch.bfloat16) for key, value in exact.state_dict().items()})
    exact.load_state_dict({key: value.float() for key, value in model.state_dict().items()})  # the same weights
    use_bios_attention(model)
    tokens = list(b"attention that is not uniform at all, over forty tokens")
    truth = _decoded_logprobs(exact, tokens, "sdpa")
    ours = (_decoded_logprobs(model, tokens, ATTENTION) - truth).abs()
    sdpa = (_decoded_logprobs(model, tokens, "sdpa") - truth).abs()
    assert ours.mean() <= 1.25 * sdpa.mean() + 1e-3, (ours.mean(), sdpa.mean())
    assert ours.max() <= 1.25 * sdpa.max() + 1e-3, (ours.max(), sdpa.max())
