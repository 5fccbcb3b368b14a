"""Attention on CPU (bios.worker.cpu_attention): a low-precision model's one query row through a plain fp32
computation as accurate as SDPA; prompts and training passes whose mask gives each query one interval of keys
through the interval kernel (`bios.kernels.interval_attention`, on fp32 copies for bf16), others and everything
without the C kernels through SDPA's fp32 kernel (bit for bit SDPA in fp32 on those copies). That bf16 sampled
log-probs agree with the bf16 training forward through it is tests/test_kernel_integration.py's bf16 sampling
test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_c_kernels
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bios.kernels import c_kernels
from bios.kernels.interval_attention import interval_attention, key_intervals
from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.worker.attention import ATTENTION, use_bios_attention
from bios.worker.cpu_attention import cpu_attention


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _qkv(queries: int, dtype: torch.dtype):
    """Queries against 40 keys and values."""
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
    ours, _ = cpu_attention(_Attention(), query, key, value, mask)
    theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, mask)
    assert ours.shape == theirs.shape == (4, 1, 9, 32) and ours.dtype == torch.bfloat16
    sdpa_error = (theirs.float() - exact).abs().max()
    assert (ours.float() - exact).abs().max() <= max(sdpa_error, 1e-2)


@pytest.mark.parametrize("queries", [1, 5])
def test_fp32_runs_sdpa_itself(queries):
    query, key, value = _qkv(queries, torch.float32)
    ours, _ = cpu_attention(_Attention(), query, key, value, None)
    theirs, _ = sdpa_attention_forward(_Attention(), query, key, value, None)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("c_kernels", ["auto", "off"])
def test_bf16_prompts_and_training_run_in_fp32_on_fp32_copies(c_kernels, monkeypatch, fresh_c_kernels):
    """With the C kernels, the interval kernel (a mask of one interval of keys per query); without, SDPA's fp32
    kernel, bit for bit."""
    monkeypatch.setenv("BIOS_C_KERNELS", c_kernels)
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(shape, generator=generator).to(torch.bfloat16).requires_grad_()
                         for shape in [(2, 9, 40, 32), (2, 3, 40, 32), (2, 3, 40, 32)])
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    mask[1, :, :, :6] = False  # a left-padded row
    mask[1, :, :6, :6] = torch.eye(6, dtype=torch.bool)  # (its pads see themselves, as Transformers' masks do)
    grad = torch.randn(2, 40, 9, 32, generator=generator).to(torch.bfloat16)
    ours, _ = cpu_attention(_Attention(), query, key, value, mask)
    ours.backward(grad)
    assert ours.dtype == torch.bfloat16
    copies = [t.detach().float().requires_grad_() for t in (query, key, value)]
    exact, _ = sdpa_attention_forward(_Attention(), *copies, mask)
    exact.backward(grad.float())
    same = torch.testing.assert_close if c_kernels == "auto" else \
        (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))  # (bf16: to its rounding, then exactly)
    same(ours, exact.to(torch.bfloat16))
    for ours_grad, exact_grad in zip((query.grad, key.grad, value.grad), (t.grad for t in copies)):
        same(ours_grad, exact_grad.to(torch.bfloat16))
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
    with_additive, _ = cpu_attention(_Attention(), query, key, value, additive)  # SDPA either way
    same(with_additive, ours)


@needs_c_kernels
def test_fp32_training_takes_the_interval_kernel_and_sdpa_without_c_kernels(monkeypatch, fresh_c_kernels):
    query, key, value = _qkv(40, torch.float32)
    ours, _ = cpu_attention(_Attention(), query, key, value, None)
    interval = interval_attention(query, key, value, *key_intervals(None, True, 4, 40), 32 ** -0.5)
    assert torch.equal(ours, interval)
    monkeypatch.setenv("BIOS_C_KERNELS", "off")
    c_kernels._loaded.cache_clear()
    ours, _ = cpu_attention(_Attention(), query, key, value, None)
    assert torch.equal(ours, sdpa_attention_forward(_Attention(), query, key, value, None)[0])


@needs_c_kernels
def test_mask_free_rows_over_many_keys_go_to_sdpa(monkeypatch):
    """Past `SDPA_FROM_KEYS` keys PyTorch's flash attention (tiled keys) beats the interval kernel: a mask-free
    call that long runs SDPA; a masked one (packed rows) stays with the kernel."""
    query, key, value = _qkv(40, torch.float32)
    monkeypatch.setattr("bios.worker.cpu_attention.SDPA_FROM_KEYS", 40)
    ours, _ = cpu_attention(_Attention(), query, key, value, None)
    assert torch.equal(ours, sdpa_attention_forward(_Attention(), query, key, value, None)[0])
    mask = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    ours, _ = cpu_attention(_Attention(), query, key, value, mask)
    assert torch.equal(ours, interval_attention(query, key, value, *key_intervals(mask, True, 4, 40), 32 ** -0.5))


def test_values_narrower_than_keys_come_out_at_their_own_width():
    """MLA (DeepSeek-V3: keys 192 wide, values 128) decodes without padding its values."""
    query, key, value = _qkv(1, torch.bfloat16)
    value = value[..., :24]
    ours, _ = cpu_attention(_Attention(), query, key, value, None)
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


def test_a_call_with_extras_reads_an_fp32_cache_in_the_querys_dtype():
    """A position bias and the like go to Transformers' SDPA, which needs one dtype: keys and values from an fp32
    decode cache (`cache_dtype`) are cast back to the query's, as the cache held them before."""
    query, key, value = _qkv(1, torch.bfloat16)
    module, bias = _Attention(), torch.randn(4, 9, 1, 40).to(torch.bfloat16)
    ours, _ = cpu_attention(module, query, key.float(), value.float(), None, position_bias=bias)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, position_bias=bias)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
