"""Batched KV-cache sampling: agreement with HF generate and with the training forward, seeds, stops, batching."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bios.exceptions import BadRequestError
from bios.kernels.c_kernels import c_compiler
from bios.models.builtin import byte_level_tokenizer
from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.types import BaseModelInfo, Datum, LoraConfig, ModelInput, SamplingParams
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora
from bios.spec import check_sample
from bios.worker.sampling import SampleItem, generate
from bios.worker.sampling_rows import DEFAULT_MAX_TOKENS

EOS = 257
CONTEXT = 128
PROMPTS = [list(b"The cat"), list(b"Once upon a time, "), list(b"x"), list(b"def f(a, b):\n    return")]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """A tiny Llama with large weights, so its next-token distributions are peaked and greedy text varies."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=BUILTIN_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        initializer_range=0.3,
        eos_token_id=EOS,
        bos_token_id=256,
        pad_token_id=258,
    )
    llama = LlamaForCausalLM(config).eval()
    attach_lora(llama)
    return llama


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def perturbed_adapter(model, model_id: str, seed: int) -> AdapterState:
    """An adapter with non-zero B, so it changes the model's outputs."""
    adapter = AdapterState.create(model_id, model, LoraConfig(rank=4, seed=seed), device="cpu")
    generator = torch.Generator().manual_seed(seed + 1000)
    state = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in adapter.state_dict().items()}
    adapter.load_state_dict(state)
    return adapter


def run(model, tokenizer, items, eos_token_id=EOS):
    return generate(model, tokenizer, items, eos_token_id=eos_token_id)


def greedy(max_tokens=12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def forward_logprobs(model, adapter, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) from the training engine's forward, shape [len - 1]."""
    inputs = {"target_tokens": tokens[1:], "weights": [0.0] * (len(tokens) - 1)}
    datum = Datum(ModelInput.from_ints(tokens[:-1]), inputs)
    output = forward_backward(model, [ForwardItem(adapter, [datum], "cross_entropy", None, forward_only=True)])[0]
    return output.loss_fn_outputs[0]["logprobs"].to_torch()


# ------------------------------------------------------------------------------------------ agreement


def test_greedy_equals_hf_generate_for_the_base_model(model, tokenizer):
    items = [SampleItem(None, prompt, 1, greedy(max_tokens=16)) for prompt in PROMPTS]
    results = run(model, tokenizer, items)
    for prompt, result in zip(PROMPTS, results):
        with torch.inference_mode():
            reference = model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=EOS, pad_token_id=258
            )[0, len(prompt) :].tolist()
        if EOS in reference:
            reference = reference[: reference.index(EOS) + 1]
        sequence = result.sequences[0]
        assert sequence.tokens == reference
        assert sequence.stop_reason == ("stop" if reference[-1] == EOS else "length")
    assert len({tuple(r.sequences[0].tokens) for r in results}) == len(PROMPTS)


@pytest.mark.parametrize("prefill_tokens", [16, 7, 1])
def test_prompts_prefilled_in_chunks_sample_as_in_one_pass(model, tokenizer, prefill_tokens):
    """A prompt longer than the plan's pass is prefilled a chunk of positions at a time into the cache: the same
    prompt logprobs and the same continuations as one pass, left pads and an adapter included."""
    adapter = perturbed_adapter(model, "chunks", seed=4)
    prompts = [list(b"A long prompt, prefilled in chunks of positions."), list(b"and a short one")]
    items = [SampleItem(adapter, prompt, 2, SamplingParams(max_tokens=10, seed=3, stop=[]), True) for prompt in prompts]
    whole = generate(model, tokenizer, items, eos_token_id=EOS)
    chunked = generate(model, tokenizer, items, eos_token_id=EOS, prefill_tokens=prefill_tokens)
    for one, by_chunks in zip(whole, chunked, strict=True):
        assert one.prompt_logprobs[0] is None and by_chunks.prompt_logprobs[0] is None
        # fp32 in another order (a chunk's queries attend by SDPA, a whole prompt's by the interval kernel)
        torch.testing.assert_close(torch.tensor(by_chunks.prompt_logprobs[1:]), torch.tensor(one.prompt_logprobs[1:]),
                                   rtol=1e-4, atol=1e-4)
        assert [s.tokens for s in by_chunks.sequences] == [s.tokens for s in one.sequences]


def test_temperature_one_logprobs_equal_training_forward(model, tokenizer):
    adapter = perturbed_adapter(model, "a", seed=1)
    prompt = PROMPTS[1]
    result = run(model, tokenizer, [SampleItem(adapter, prompt, 3, SamplingParams(max_tokens=20, seed=5), True)])[0]
    for sequence in result.sequences:
        full = prompt + sequence.tokens
        expected = forward_logprobs(model, adapter, full)
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected[len(prompt) - 1 :], rtol=0, atol=1e-4)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    expected_prompt = forward_logprobs(model, adapter, prompt)
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:]), expected_prompt, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.7, top_k=5, seed=3),
        SamplingParams(max_tokens=24, temperature=1.3, top_p=0.6, seed=4),
    ],
    ids=["top_k", "top_p"],
)
def test_filtered_logprobs_are_those_of_the_distribution_sampled_from(model, tokenizer, params):
    """Each token lies in the top-k / nucleus set of temperature-scaled logits; its logprob is the renormalised one."""
    prompt = PROMPTS[0]
    sequence = run(model, tokenizer, [SampleItem(None, prompt, 1, params)])[0].sequences[0]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + sequence.tokens])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / params.temperature
    for step, (token, logprob) in enumerate(zip(sequence.tokens, sequence.logprobs)):
        probs = torch.softmax(scaled[step], dim=-1)
        ordered, indices = probs.sort(descending=True)
        if params.top_k > 0:
            keep = indices[: params.top_k]
        else:
            keep = indices[: int(((ordered.cumsum(0) - ordered) < params.top_p).sum())]
        assert token in keep.tolist()
        expected = math.log(probs[token] / probs[keep].sum())
        assert logprob == pytest.approx(expected, abs=1e-4)


def test_top_k_one_equals_greedy(model, tokenizer):
    items = [SampleItem(None, p, 1, SamplingParams(max_tokens=12, top_k=1, seed=9, stop=[])) for p in PROMPTS]
    greedy_items = [SampleItem(None, p, 1, greedy(stop=[])) for p in PROMPTS]
    top1 = run(model, tokenizer, items)
    reference = run(model, tokenizer, greedy_items)
    assert [r.sequences[0].tokens for r in top1] == [r.sequences[0].tokens for r in reference]


# ------------------------------------------------------------------------------------------ batching


def test_adapters_change_outputs_and_a_mixed_batch_equals_each_request_alone(model, tokenizer):
    a, b = perturbed_adapter(model, "a", seed=1), perturbed_adapter(model, "b", seed=2)
    items = [
        SampleItem(a, PROMPTS[0], 2, greedy(max_tokens=10)),
        SampleItem(b, PROMPTS[1], 2, SamplingParams(max_tokens=14, seed=3, stop=[])),
        SampleItem(None, PROMPTS[2], 1, SamplingParams(max_tokens=3, top_p=0.9, seed=5)),
        SampleItem(a, PROMPTS[3], 3, SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=7), True),
        SampleItem(None, PROMPTS[0], 1, greedy(max_tokens=10)),
    ]
    batched = run(model, tokenizer, items)
    # Logprobs agree to fp32 rounding, not bitwise: a padded batch runs attention with an explicit mask, a lone
    # request with the causal kernel.
    for item, together in zip(items, batched):
        alone = run(model, tokenizer, [item])[0]
        assert [s.tokens for s in together.sequences] == [s.tokens for s in alone.sequences]
        assert [s.stop_reason for s in together.sequences] == [s.stop_reason for s in alone.sequences]
        for s_together, s_alone in zip(together.sequences, alone.sequences):
            torch.testing.assert_close(
                torch.tensor(s_together.logprobs), torch.tensor(s_alone.logprobs), rtol=1e-4, atol=1e-4
            )
        if item.prompt_logprobs:
            torch.testing.assert_close(
                torch.tensor(together.prompt_logprobs[1:]),
                torch.tensor(alone.prompt_logprobs[1:]),
                rtol=1e-4,
                atol=1e-4,
            )
        assert len(together.sequences) == item.num_samples
    assert batched[0].sequences[0].tokens != batched[4].sequences[0].tokens  # adapter a vs the base model
    assert batched[0].sequences[0].tokens == batched[0].sequences[1].tokens  # greedy samples agree


def test_same_seed_same_tokens_alone_or_batched_and_different_seeds_differ(model, tokenizer):
    def item(prompt, seed, n=1):
        return SampleItem(None, prompt, n, SamplingParams(max_tokens=16, seed=seed, stop=[]))

    alone = [run(model, tokenizer, [item(p, 11)])[0].sequences[0].tokens for p in PROMPTS]
    again = run(model, tokenizer, [item(PROMPTS[2], 99, n=3)] + [item(p, 11) for p in PROMPTS])
    assert [r.sequences[0].tokens for r in again[1:]] == alone
    other_seed = [r.sequences[0].tokens for r in run(model, tokenizer, [item(p, 12) for p in PROMPTS])]
    assert all(x != y for x, y in zip(alone, other_seed))
    samples = [s.tokens for s in again[0].sequences]
    assert len({tuple(s) for s in samples}) == 3  # the samples of one request are independent draws
    unseeded = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 2, SamplingParams(max_tokens=16, stop=[]))])[0]
    assert unseeded.sequences[0].tokens != unseeded.sequences[1].tokens


def test_requests_with_one_prompt_share_its_prefill_and_sample_as_if_alone(model, tokenizer):
    adapter = perturbed_adapter(model, "shared-prefix", 5)

    def item(prompt, seed, lora=None, logprobs=False):
        return SampleItem(lora, prompt, 2, SamplingParams(max_tokens=10, seed=seed, stop=[]), logprobs)

    items = [item(PROMPTS[1], 1, logprobs=True), item(PROMPTS[1], 2), item(PROMPTS[0], 3),
             item(PROMPTS[1], 4, adapter), item(PROMPTS[1], 5, logprobs=True)]
    prefill_rows = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _, args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        together = run(model, tokenizer, items)
    finally:
        hook.remove()
    # one prefill of three rows: PROMPTS[1] with the base model, PROMPTS[0], PROMPTS[1] with the adapter
    assert prefill_rows == [3]
    for got, request in zip(together, items):
        alone = run(model, tokenizer, [request])[0]
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
        assert got.prompt_logprobs == alone.prompt_logprobs
    assert together[0].sequences[0].tokens != together[1].sequences[0].tokens  # own seeds, own draws


# ------------------------------------------------------------------------------------------ stopping


def test_stop_token_ids_end_with_the_stop_token_included(model, tokenizer):
    reference = run(model, tokenizer, [SampleItem(None, PROMPTS[1], 1, greedy(max_tokens=20, stop=[]))])[0]
    tokens = reference.sequences[0].tokens
    stop_token, never_sampled = tokens[6], next(t for t in range(BUILTIN_VOCAB_SIZE) if t not in tokens)
    params = greedy(max_tokens=20, stop=[never_sampled, stop_token])
    stopped = run(model, tokenizer, [SampleItem(None, PROMPTS[1], 1, params)])
    sequence = stopped[0].sequences[0]
    assert sequence.stop_reason == "stop"
    assert sequence.tokens == tokens[: tokens.index(stop_token) + 1]


def test_stop_strings_end_at_the_token_that_completes_them(model, tokenizer):
    reference = run(model, tokenizer, [SampleItem(None, PROMPTS[3], 1, greedy(max_tokens=40, stop=[]))])[0]
    tokens = reference.sequences[0].tokens
    start = next(i for i in range(3, len(tokens) - 1) if all(32 <= t < 127 for t in tokens[i : i + 2]))
    stop_text = bytes(tokens[start : start + 2]).decode()
    end = next(n for n in range(1, len(tokens) + 1) if stop_text in tokenizer.decode(tokens[:n]))
    for stop in (stop_text, ["never-generated", stop_text]):
        items = [SampleItem(None, PROMPTS[3], 1, greedy(max_tokens=40, stop=stop))]
        result = run(model, tokenizer, items, eos_token_id=None)[0]
        sequence = result.sequences[0]
        assert sequence.stop_reason == "stop"
        assert sequence.tokens == tokens[:end]
        assert stop_text in tokenizer.decode(sequence.tokens)
        assert stop_text not in tokenizer.decode(sequence.tokens[:-1])


def test_eos_stops_by_default_and_an_empty_stop_list_ignores_it(model, tokenizer):
    tokens = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, greedy(stop=[]))])[0].sequences[0].tokens
    eos = tokens[4]  # treat a token the model emits as the end-of-sequence token
    by_default = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, greedy())], eos_token_id=eos)
    assert by_default[0].sequences[0].stop_reason == "stop"
    assert by_default[0].sequences[0].tokens == tokens[: tokens.index(eos) + 1]
    ignoring = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, greedy(stop=[]))], eos_token_id=eos)
    assert ignoring[0].sequences[0].stop_reason == "length" and ignoring[0].sequences[0].tokens == tokens


def test_eos_still_stops_when_stop_strings_or_ids_are_given(model, tokenizer):
    tokens = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, greedy(stop=[]))])[0].sequences[0].tokens
    eos = tokens[4]
    for stop in (["never-generated"], [261]):
        result = run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, greedy(stop=stop))], eos_token_id=eos)
        assert result[0].sequences[0].stop_reason == "stop"
        assert result[0].sequences[0].tokens == tokens[: tokens.index(eos) + 1]


def test_max_tokens_gives_length_and_none_is_capped(model, tokenizer):
    items = [
        SampleItem(None, PROMPTS[0], 1, SamplingParams(max_tokens=n, seed=1, stop=[])) for n in (1, 5, 13)
    ] + [SampleItem(None, PROMPTS[1], 1, SamplingParams(seed=1, stop=[]))]
    results = run(model, tokenizer, items)
    default = min(DEFAULT_MAX_TOKENS, CONTEXT - len(PROMPTS[1]))
    assert [len(r.sequences[0].tokens) for r in results] == [1, 5, 13, default]
    assert all(r.sequences[0].stop_reason == "length" for r in results)
    assert all(len(r.sequences[0].logprobs) == len(r.sequences[0].tokens) for r in results)


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("prompt", "num_samples", "params", "field"),
    [
        ([1, 2], 0, SamplingParams(max_tokens=4), "num_samples"),
        ([], 1, SamplingParams(max_tokens=4), "prompt"),
        ([1] * CONTEXT, 1, SamplingParams(), "prompt"),
        ([1, 2], 1, SamplingParams(max_tokens=0), "sampling_params.max_tokens"),
        ([1] * 100, 1, SamplingParams(max_tokens=CONTEXT - 99), "sampling_params.max_tokens"),
        ([1, 2], 1, SamplingParams(max_tokens=4, top_p=0.0), "sampling_params.top_p"),
        ([1, 2], 1, SamplingParams(max_tokens=4, top_p=1.5), "sampling_params.top_p"),
        ([1, 2], 1, SamplingParams(max_tokens=4, temperature=-0.1), "sampling_params.temperature"),
        ([1, 2], 1, SamplingParams(max_tokens=4, top_k=0), "sampling_params.top_k"),
        ([1, 2], 1, SamplingParams(max_tokens=4, top_k=-2), "sampling_params.top_k"),
        ([1, 2], 1, SamplingParams(max_tokens=4, stop=["a", 3]), "sampling_params.stop"),
        ([1, 2], 1, SamplingParams(max_tokens=4, stop=[BUILTIN_VOCAB_SIZE]), "sampling_params.stop"),
        ([1, 2], 1, SamplingParams(max_tokens=4, seed=-1), "sampling_params.seed"),
    ],
)
def test_impossible_requests_name_the_field(model, tokenizer, prompt, num_samples, params, field):
    with pytest.raises(BadRequestError) as raised:
        run(model, tokenizer, [SampleItem(None, prompt, num_samples, params)])
    assert raised.value.field == field
    info = BaseModelInfo("tiny", "/nowhere", "llama", BUILTIN_VOCAB_SIZE, CONTEXT, 64, 2, 0, EOS)
    with pytest.raises(BadRequestError) as raised:
        check_sample(prompt, num_samples, params, info)
    assert raised.value.field == field


def test_out_of_vocabulary_prompt_is_rejected(model, tokenizer):
    with pytest.raises(BadRequestError) as raised:
        run(model, tokenizer, [SampleItem(None, [1, BUILTIN_VOCAB_SIZE], 1, greedy())])
    assert raised.value.field == "prompt"


def test_frozen_copy_samples_like_its_source_and_ignores_later_training(model, tokenizer):
    adapter = perturbed_adapter(model, "a", seed=1)
    snapshot = adapter.frozen_copy()
    assert snapshot.grad.numel() == 0 and snapshot.exp_avg.numel() == 0
    items = lambda which: [SampleItem(which, PROMPTS[0], 1, SamplingParams(max_tokens=10, seed=4))]  # noqa: E731
    before = run(model, tokenizer, items(adapter))[0].sequences[0]
    with torch.no_grad():
        adapter.params.mul_(2.0)
    assert run(model, tokenizer, items(snapshot))[0].sequences[0] == before
    assert run(model, tokenizer, items(adapter))[0].sequences[0].tokens != before.tokens


@pytest.mark.parametrize("intel", [False, True])
def test_long_decodes_of_one_adapters_rows_run_through_merged_copies_with_the_same_results(model, tokenizer, intel,
                                                                                         monkeypatch):
    """fp32 decode steps whose rows all use one adapter, for enough steps to repay the copies, multiply by
    prepacked copies of W + scale·B·A (oneDNN's, or MKL's packs on Intel CPUs): the same tokens and logprobs (to
    fp32 rounding) as the plain path."""
    from bios.kernels import gemm_choice
    from bios.kernels.prepacked import LoraUpdate, MklPack, PrepackedWeights, prepacked_stack

    monkeypatch.setattr(gemm_choice, "intel_cpu", lambda: intel)
    monkeypatch.delenv("BIOS_PREPACK", raising=False)
    monkeypatch.delenv("BIOS_GEMM", raising=False)
    monkeypatch.setenv("BIOS_KERNELS", "1")  # the stock ops (`BIOS_KERNELS=0`) multiply by the plain weights
    model = model.float()
    adapter = perturbed_adapter(model, "a", seed=6)
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]  # the lean step stacks q, k and v
    weights = [model.get_submodule(name).weight for name in names]
    updates = [LoraUpdate(*adapter.lora_pair(name), adapter.scale) for name in names]

    def holds_merged_copy(keeper) -> bool:
        held = keeper.held_bytes()
        with torch.inference_mode(), keeper.using(adapter=True, rows=3):
            copy = prepacked_stack(torch.zeros(1, weights[0].shape[1]), weights, updates)
            assert isinstance(copy, MklPack) == intel
            return keeper.held_bytes() == held  # (on leaving, the block drops the merged copies it did not use)

    long = SampleItem(adapter, PROMPTS[1], 3, SamplingParams(max_tokens=40, seed=2, stop=[]))
    keeper = PrepackedWeights()
    merged = generate(model, tokenizer, [long], eos_token_id=EOS, prepacked=keeper)[0]
    assert holds_merged_copy(keeper)
    monkeypatch.setenv("BIOS_PREPACK", "off")
    plain = generate(model, tokenizer, [long], eos_token_id=EOS)[0]
    assert [s.tokens for s in merged.sequences] == [s.tokens for s in plain.sequences]
    for s_merged, s_plain in zip(merged.sequences, plain.sequences):  # (this model's large weights make its
        # log-probs sensitive to the merged sum's one more rounding: up to 3e-4 apart over 40 steps)
        torch.testing.assert_close(torch.tensor(s_merged.logprobs), torch.tensor(s_plain.logprobs), rtol=1e-3,
                                   atol=1e-3)
    monkeypatch.delenv("BIOS_PREPACK")
    short = SampleItem(adapter, PROMPTS[1], 3, SamplingParams(max_tokens=8, seed=2, stop=[]))
    keeper = PrepackedWeights()
    generate(model, tokenizer, [short], eos_token_id=EOS, prepacked=keeper)
    assert not holds_merged_copy(keeper)  # too few steps to repay them


@pytest.mark.skipif(c_compiler() is None, reason="no C compiler: no row kernel here")
@pytest.mark.parametrize("with_adapter", [True, False])
def test_decodes_of_5_to_32_rows_multiply_by_row_kernel_packs_with_the_same_results(model, tokenizer, with_adapter,
                                                                                    monkeypatch):
    """fp32 decode steps of 5 to 32 rows multiply by the row kernel's packs (`bios.kernels.row_gemm`): of the
    weights, or of W + scale·B·A when one adapter has every row for long enough; the same tokens and logprobs (to
    fp32 rounding) as the plain weights'."""
    from bios.kernels.prepacked import LoraUpdate, PrepackedWeights, prepacked_stack
    from bios.kernels.row_gemm import RowGemmPack

    for name in ("BIOS_PREPACK", "BIOS_GEMM", "BIOS_C_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BIOS_KERNELS", "1")
    model = model.float()
    adapter = perturbed_adapter(model, "a", seed=6) if with_adapter else None
    params = SamplingParams(max_tokens=40, seed=2, stop=[])
    items = ([SampleItem(adapter, PROMPTS[1], 6, params)] if with_adapter
             else [SampleItem(None, PROMPTS[0], 4, params), SampleItem(None, PROMPTS[3], 3, params)])
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    weights = [model.get_submodule(name).weight for name in names]
    updates = [LoraUpdate(*adapter.lora_pair(name), adapter.scale) if with_adapter else None for name in names]
    keeper = PrepackedWeights()
    packed = generate(model, tokenizer, items, eos_token_id=EOS, prepacked=keeper)
    held = keeper.held_bytes()
    with torch.inference_mode(), keeper.using(adapter=with_adapter, rows=7):  # the copy the decode made is kept
        assert isinstance(prepacked_stack(torch.zeros(1, weights[0].shape[1]), weights, updates), RowGemmPack)
        assert keeper.held_bytes() == held
    monkeypatch.setenv("BIOS_PREPACK", "off")
    plain = generate(model, tokenizer, items, eos_token_id=EOS)
    for result_packed, result_plain in zip(packed, plain):
        assert [s.tokens for s in result_packed.sequences] == [s.tokens for s in result_plain.sequences]
        for s_packed, s_plain in zip(result_packed.sequences, result_plain.sequences):
            torch.testing.assert_close(torch.tensor(s_packed.logprobs), torch.tensor(s_plain.logprobs), rtol=1e-3,
                                       atol=1e-3)


@pytest.mark.parametrize("lean", [True, False])
def test_a_bf16_models_decode_cache_is_kept_in_fp32_with_the_same_results(model, tokenizer, lean, monkeypatch):
    """On CPU the attention reads a bf16 cache in fp32 (`cpu_attention`), so the decode keeps it in fp32 and casts
    one new position a step: the same tokens and logprobs, bit for bit, as a bf16 cache cast at every step. Both
    for the lean decode step's caches (`bios.worker.decode_cache`) and Transformers' (the module path)."""
    import copy

    from bios.worker import decode_step, llama_decode

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    adapter = perturbed_adapter(bf16, "a", seed=7)
    items = [SampleItem(adapter, PROMPTS[0], 3, SamplingParams(max_tokens=10, seed=4, stop=[])),
             SampleItem(None, PROMPTS[3], 2, SamplingParams(max_tokens=6, seed=5, stop=[]))]
    dtypes = []
    if lean:
        monkeypatch.setenv("BIOS_KERNELS", "1")  # the lean step runs with the fused kernels only
        caches = llama_decode.decode_caches
        monkeypatch.setattr(llama_decode, "decode_caches",
                            lambda prefill, expand, room, dtype: dtypes.append(dtype) or caches(prefill, expand, room,
                                                                                                 dtype))
    else:
        reserve = decode_step.reserve_decode_room
        monkeypatch.setattr(llama_decode.LlamaDecodeStep, "for_model", lambda *args, **kwargs: None)
        monkeypatch.setattr(decode_step, "reserve_decode_room",
                            lambda cache, steps, dtype=None: dtypes.append(dtype) or reserve(cache, steps, dtype))
    fp32_cache = generate(bf16, tokenizer, items, eos_token_id=EOS)
    monkeypatch.setattr(decode_step, "cache_dtype", lambda dtype, device: dtype)
    bf16_cache = generate(bf16, tokenizer, items, eos_token_id=EOS)
    assert dtypes == [torch.float32, torch.bfloat16]
    for ours, theirs in zip(fp32_cache, bf16_cache):
        assert [s.tokens for s in ours.sequences] == [s.tokens for s in theirs.sequences]
        assert [s.logprobs for s in ours.sequences] == [s.logprobs for s in theirs.sequences]


def test_an_adapters_factors_are_cast_once_per_version_for_sampling(model):
    """The sampler reads each layer's factors in the model's dtype at every step; casting them once per version of
    the adapter (not per call or per compaction) keeps a bf16 decode's prepacked copies of `[W; A]` alive."""
    adapter = perturbed_adapter(model, "a", seed=7)
    name = "model.layers.0.mlp.up_proj"
    assert adapter.lora_pair_in(name, torch.float32) == adapter.lora_pair(name)  # its own dtype: the pair itself
    with torch.inference_mode():
        first = adapter.lora_pair_in(name, torch.bfloat16)
    again = adapter.lora_pair_in(name, torch.bfloat16)
    assert all(a is b for a, b in zip(first, again))
    assert all(torch.equal(cast, factor.to(torch.bfloat16)) for cast, factor in zip(first, adapter.lora_pair(name)))
    with torch.no_grad():
        adapter.params.mul_(2.0)  # a training step
    changed = adapter.lora_pair_in(name, torch.bfloat16)
    assert all(torch.equal(cast, 2 * old) for cast, old in zip(changed, first))
