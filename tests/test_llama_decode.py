"""The sampler's lean decode step (bios.worker.llama_decode): for each Llama-family architecture it samples the
same tokens with the same log-probs as the module path, bit for bit on PyTorch's ops, in fp32 and bf16, with and
without adapters, through padded prompts and compaction; to fp32 rounding where its fp32 norms and SwiGLU run in
Bios's C kernels (`bios.kernels.decode_ops`); and it stands aside wherever it would compute something else."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from bios.kernels import c_kernels
from bios.kernels.decode_ops import DecodeOps
from bios.types import LoraConfig, SamplingParams
from bios.worker import decode_cache
from bios.worker.adapter import AdapterState
from bios.worker.llama_decode import LlamaDecodeStep
from bios.worker.lora import attach_lora
from bios.worker.sampling import SampleItem, generate

_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_SHAPE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_SHAPE)),  # q/k/v biases
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_SHAPE, head_dim=16)),  # per-head query and key norms
}


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("BIOS_KERNELS", "1")  # the lean step runs with the fused kernels only


def _model(architecture: str, dtype: str, monkeypatch) -> torch.nn.Module:
    monkeypatch.setenv("BIOS_BASE_DTYPE", dtype)
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]().eval()
    if architecture == "qwen2":
        for layer in model.model.layers:  # Transformers initialises biases to zero: make them count
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.data.normal_(0, 0.3)
    attach_lora(model)
    return model


def _adapter(model, model_id: str, seed: int) -> AdapterState:
    adapter = AdapterState.create(model_id, model, LoraConfig(rank=4, seed=seed), device="cpu")
    generator = torch.Generator().manual_seed(seed)
    adapter.load_state_dict({k: v + 0.2 * torch.randn(v.shape, generator=generator)
                             for k, v in adapter.state_dict().items()})
    return adapter


def _with_c_kernels(setting: str, dtype: str, monkeypatch) -> float:
    """Set `BIOS_C_KERNELS`; the log-probs' tolerance against the module path: 0 (bit for bit) unless the lean
    step's fp32 norms and SwiGLU run in C (another order of sums, another exp: up to 7e-5 apart over 12 steps on
    these models' large weights, as in the cascade's test below)."""
    monkeypatch.setenv("BIOS_C_KERNELS", setting)
    return 5e-4 if dtype == "float32" and c_kernels.c_kernels() is not None else 0.0


def _both_paths(model, items, monkeypatch, layout=decode_cache.RowCache):
    """(responses through the lean step, responses through the modules), asserting the lean step ran with its
    cache in `layout`, on C ops exactly where they apply (fp32 with Bios's C kernels)."""
    made = []
    real = LlamaDecodeStep.for_model

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(LlamaDecodeStep, "for_model", spy)
    lean = generate(model, None, items(), eos_token_id=None)
    assert made and made[-1] is not None, "the lean step did not run"
    assert all(type(cache) is layout for cache in made[-1]._caches)
    c_ops = model.dtype == torch.float32 and c_kernels.c_kernels() is not None
    assert isinstance(made[-1]._ops, DecodeOps) == c_ops
    monkeypatch.setattr(LlamaDecodeStep, "for_model", lambda *args, **kwargs: None)
    modules = generate(model, None, items(), eos_token_id=None)
    return lean, modules


def _assert_same(lean, modules, tolerance: float = 0.0):
    """Same tokens and stop reasons; log-probs equal (bit for bit by default) or within `tolerance`."""
    for ours, theirs in zip(lean, modules, strict=True):
        for a, b in zip(ours.sequences, theirs.sequences, strict=True):
            assert a.tokens == b.tokens
            assert a.stop_reason == b.stop_reason
            if tolerance:
                assert a.logprobs == pytest.approx(b.logprobs, abs=tolerance)
            else:
                assert a.logprobs == b.logprobs


@pytest.mark.parametrize("c_kernels_setting", ["off", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_lean_step_samples_what_the_modules_sample(architecture, dtype, c_kernels_setting, monkeypatch):
    tolerance = _with_c_kernels(c_kernels_setting, dtype, monkeypatch)
    model = _model(architecture, dtype, monkeypatch)
    first, second = _adapter(model, "first", 1), _adapter(model, "second", 2)

    def items():  # prompts of different lengths (left pads), three adapters' rows, rows that finish early
        return [SampleItem(first, [5, 17, 33, 60, 2, 9, 90], 3, SamplingParams(max_tokens=12, seed=1)),
                SampleItem(None, [7, 8], 2, SamplingParams(max_tokens=4, temperature=0.7, seed=2)),
                SampleItem(second, [40, 41, 42], 2, SamplingParams(max_tokens=3, temperature=0.0))]

    _assert_same(*_both_paths(model, items, monkeypatch), tolerance)


@pytest.mark.parametrize("c_kernels_setting", ["off", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_adapter_on_every_row_through_its_copies_samples_the_same(dtype, c_kernels_setting, monkeypatch):
    """A long decode whose rows all use one adapter multiplies by copies with the adapter in them, resolved
    once per projection by the lean step (two prompts: each row keeps its own copy of its prompt's cache)."""
    tolerance = _with_c_kernels(c_kernels_setting, dtype, monkeypatch)
    model = _model("llama", dtype, monkeypatch)
    adapter = _adapter(model, "only", 3)

    def items():
        return [SampleItem(adapter, [3, 1, 4, 1, 5], 3, SamplingParams(max_tokens=40, seed=7)),
                SampleItem(adapter, [2, 7, 1, 8], 2, SamplingParams(max_tokens=40, seed=8))]

    _assert_same(*_both_paths(model, items, monkeypatch), tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 5e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_rows_of_one_prompt_attend_to_it_once_with_the_same_results(architecture, dtype, tolerance, monkeypatch):
    """Every row continues one prompt (RL's many samples): the prompt's keys and values are kept once and
    attention is cascaded over them (`decode_cache.SharedPromptCache`); the same tokens, log-probs to rounding
    (bf16: the attention's output is rounded to bf16 after another order of sums; fp32: up to 1.1e-4 apart on this
    model's peaked distributions with AVX2 kernels), through compaction."""
    model = _model(architecture, dtype, monkeypatch)
    adapter = _adapter(model, "rl", 4)

    def items():
        prompt = [9, 80, 7, 33, 120, 5, 61, 2, 44, 17]
        return [SampleItem(adapter, prompt, 6, SamplingParams(max_tokens=24, seed=11)),
                SampleItem(adapter, prompt, 3, SamplingParams(max_tokens=6, temperature=0.5, seed=12))]

    lean, modules = _both_paths(model, items, monkeypatch, layout=decode_cache.SharedPromptCache)
    _assert_same(lean, modules, tolerance)


def _prefilled_cache(model, prompt_rows: int = 1):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([[1, 2, 3]] * prompt_rows), past_key_values=cache, use_cache=True)
    return cache


def _lean(model, cache, rows: int = 2):
    return LlamaDecodeStep.for_model(model, cache, torch.zeros(rows, dtype=torch.int64), 4, torch.float32)


def test_models_it_does_not_compute_keep_the_module_path(monkeypatch):
    model = _model("llama", "float32", monkeypatch)
    assert _lean(model, _prefilled_cache(model)) is not None
    monkeypatch.setenv("BIOS_KERNELS", "0")  # stock ops everywhere
    assert _lean(model, _prefilled_cache(model)) is None
    monkeypatch.delenv("BIOS_KERNELS")
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)  # as tensor parallelism hooks
    assert _lean(model, _prefilled_cache(model)) is None
    handle.remove()
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = _prefilled_cache(model)
    cache.layers[1] = DynamicSlidingWindowLayer(sliding_window=16)
    assert _lean(model, cache) is None


def test_a_sliding_window_shorter_than_the_decode_keeps_the_module_path(monkeypatch):
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**_SHAPE, head_dim=16, use_sliding_window=True, sliding_window=8,
                                         max_window_layers=0)).eval()
    attach_lora(model)
    from transformers import DynamicCache

    cache = DynamicCache()  # plain layers, so only the window decides
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    expand = torch.zeros(2, dtype=torch.int64)
    assert LlamaDecodeStep.for_model(model, cache, expand, 5, torch.float32) is not None  # 3 + 5 positions fit
    assert LlamaDecodeStep.for_model(model, cache, expand, 6, torch.float32) is None
    mistral = MistralForCausalLM(MistralConfig(**_SHAPE, sliding_window=6)).eval()
    attach_lora(mistral)
    assert _lean(mistral, _prefilled_cache(mistral)) is None
    short = generate(mistral, None, [SampleItem(None, [1, 2, 3, 4], 2, SamplingParams(max_tokens=6, seed=0))],
                     eos_token_id=None)
    assert [len(s.tokens) for s in short[0].sequences] == [6, 6]
