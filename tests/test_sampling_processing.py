"""Sampling parameters beyond temperature/top-k/top-p: min_p and the penalties (each token's logprob is that of
the distribution it was drawn from), top-k prompt logprobs and alternative prompt tokens; batched equals single."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_sampling import PROMPTS, forward_logprobs, greedy, model, perturbed_adapter, run, tokenizer  # noqa: F401

from bios.exceptions import BadRequestError
from bios.spec import check_sample
from bios.types import TOPK_MASK_LOGPROB, SamplingParams
from bios.worker.sampling import SampleItem


def next_token_logits(model, tokens: list[int]) -> torch.Tensor:
    """The base model's logits for every next token of `tokens`, [len, V] fp32."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """The specification of the penalties, written out per token (vLLM's meaning)."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return logits


# ------------------------------------------------------------------------------------------ min_p and penalties


def test_min_p_keeps_only_tokens_at_least_min_p_times_the_most_likely(model, tokenizer):
    params = SamplingParams(max_tokens=24, temperature=1.5, min_p=0.2, seed=3, stop=[])
    prompt = PROMPTS[1]
    sequence = run(model, tokenizer, [SampleItem(None, prompt, 1, params)])[0].sequences[0]
    logits = next_token_logits(model, prompt + sequence.tokens)[len(prompt) - 1 : -1]
    unfiltered = run(model, tokenizer, [SampleItem(None, prompt, 1, SamplingParams(max_tokens=24, temperature=1.5,
                                                                                    seed=3, stop=[]))])[0]
    assert unfiltered.sequences[0].tokens != sequence.tokens  # min_p changed what was drawn
    masked_any = False
    for step, (token, logprob) in enumerate(zip(sequence.tokens, sequence.logprobs)):
        probs = torch.softmax(logits[step] / params.temperature, dim=-1)
        keep = probs >= params.min_p * probs.max()
        masked_any |= bool((~keep).any())
        assert keep[token]
        assert logprob == pytest.approx(math.log(probs[token] / probs[keep].sum()), abs=1e-4)
    assert masked_any


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.8, stop=[]),
        SamplingParams(max_tokens=20, temperature=0.9, presence_penalty=1.5, frequency_penalty=0.7, seed=8, stop=[]),
        SamplingParams(max_tokens=20, temperature=1.0, repetition_penalty=1.3, frequency_penalty=-1.0, top_k=8,
                       seed=9, stop=[]),
    ],
    ids=["greedy_repetition", "presence_frequency", "all_with_top_k"],
)
def test_penalties_shape_each_step_as_specified_and_change_the_samples(model, tokenizer, params):
    prompt = PROMPTS[3]
    sequence = run(model, tokenizer, [SampleItem(None, prompt, 1, params)])[0].sequences[0]
    plain = SamplingParams(max_tokens=20, temperature=params.temperature, top_k=params.top_k, seed=params.seed,
                           stop=[])
    assert run(model, tokenizer, [SampleItem(None, prompt, 1, plain)])[0].sequences[0].tokens != sequence.tokens
    logits = next_token_logits(model, prompt + sequence.tokens)[len(prompt) - 1 : -1]
    for step, (token, logprob) in enumerate(zip(sequence.tokens, sequence.logprobs)):
        shaped = penalised(logits[step], prompt, sequence.tokens[:step], params)
        if params.temperature == 0:
            assert token == int(shaped.argmax())
            expected = torch.log_softmax(shaped, dim=-1)[token]
        else:
            scaled = shaped / params.temperature
            if params.top_k > 0:
                scaled[scaled < scaled.topk(params.top_k).values[-1]] = -math.inf
            expected = torch.log_softmax(scaled, dim=-1)[token]
        assert logprob == pytest.approx(float(expected), abs=1e-4)


def test_no_penalty_rows_are_unchanged_next_to_penalised_rows(model, tokenizer):
    """A batch with one penalising row allocates penalty state for all; the others must sample as before."""
    plain = SampleItem(None, PROMPTS[0], 2, SamplingParams(max_tokens=12, seed=4, stop=[]))
    alone = run(model, tokenizer, [plain])[0]
    together = run(model, tokenizer, [plain, SampleItem(None, PROMPTS[1], 1, greedy(presence_penalty=2.0))])[0]
    assert [s.tokens for s in together.sequences] == [s.tokens for s in alone.sequences]


# ------------------------------------------------------------------------------------------ prompt scoring


def test_topk_prompt_logprobs_equal_a_forwards_log_softmax_top_k(model, tokenizer):
    prompt, k = PROMPTS[1], 5
    result = run(model, tokenizer, [SampleItem(None, prompt, 1, greedy(max_tokens=2), True, None, k)])[0]
    ids, logprobs = result.topk_prompt_logprobs.token_ids.to_numpy(), result.topk_prompt_logprobs.logprobs.to_numpy()
    assert ids.shape == logprobs.shape == (len(prompt), k)
    assert ids.dtype == np.int64 and logprobs.dtype == np.float32
    assert (ids[0] == 0).all() and (logprobs[0] == TOPK_MASK_LOGPROB).all()  # Tinker's sentinels
    expected = torch.log_softmax(next_token_logits(model, prompt)[:-1], dim=-1).topk(k, dim=-1)
    torch.testing.assert_close(torch.from_numpy(logprobs[1:]), expected.values, rtol=0, atol=1e-4)
    assert (ids[1:] == expected.indices.numpy()).all()
    assert (np.diff(logprobs[1:], axis=1) <= 0).all()


def test_topk_prompt_logprobs_with_an_adapter_agree_with_the_training_forward(model, tokenizer):
    """With k = the whole vocabulary every prompt token is listed, at the training forward's logprob."""
    adapter = perturbed_adapter(model, "a", seed=1)
    prompt, k = PROMPTS[3], model.config.vocab_size
    result = run(model, tokenizer, [SampleItem(adapter, prompt, 1, greedy(max_tokens=1), True, None, k)])[0]
    ids, logprobs = result.topk_prompt_logprobs.token_ids.to_numpy(), result.topk_prompt_logprobs.logprobs.to_numpy()
    reference = forward_logprobs(model, adapter, prompt)
    for position in range(1, len(prompt)):
        (hit,) = np.flatnonzero(ids[position] == prompt[position])
        # fp32 in other orders (the sampler's merged weights): ~1e-5 relative on this peaked model's logprobs down
        # to -20 (AVX2 code: -19.64150 against -19.64138)
        assert logprobs[position, hit] == pytest.approx(float(reference[position - 1]), rel=1e-5, abs=1e-4)
        assert logprobs[position, hit] == pytest.approx(result.prompt_logprobs[position], abs=1e-6)


def test_prompt_alt_tokens_are_seeded_draws_with_the_logprobs_of_the_tempered_distribution(model, tokenizer):
    prompt, k = PROMPTS[1], 4

    def alt(temperature, seed):
        params = SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
        return run(model, tokenizer, [SampleItem(None, prompt, 1, params, False, None, 0, k)])[0].prompt_alt_tokens

    logits = next_token_logits(model, prompt)[:-1]
    drawn = alt(0.8, 5)
    tokens, logprobs = drawn.tokens.to_numpy(), drawn.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(prompt) - 1, k)
    tempered = torch.log_softmax(logits / 0.8, dim=-1)
    torch.testing.assert_close(torch.from_numpy(logprobs), tempered.gather(1, torch.from_numpy(tokens)),
                               rtol=0, atol=1e-4)
    assert len({tuple(row) for row in tokens.tolist()}) > 1 and len(set(tokens.ravel().tolist())) > k
    assert (alt(0.8, 5).tokens.to_numpy() == tokens).all()
    assert (alt(0.8, 6).tokens.to_numpy() != tokens).any()
    argmax = alt(0.0, None)
    assert (argmax.tokens.to_numpy() == logits.argmax(dim=-1, keepdim=True).numpy()).all()


# ------------------------------------------------------------------------------------------ batching and checks


def test_batched_equals_single_with_every_new_parameter(model, tokenizer):
    adapter = perturbed_adapter(model, "b", seed=2)
    items = [
        SampleItem(adapter, PROMPTS[0], 2, SamplingParams(max_tokens=10, min_p=0.1, repetition_penalty=1.5,
                                                          seed=3, stop=[]), True, None, 3, 2),
        SampleItem(None, PROMPTS[1], 1, greedy(max_tokens=14, frequency_penalty=1.0), False, None, 0, 3),
        SampleItem(adapter, PROMPTS[3], 3, SamplingParams(max_tokens=7, temperature=0.7, presence_penalty=-0.5,
                                                          top_p=0.9, seed=7)),
        SampleItem(None, PROMPTS[2], 1, SamplingParams(max_tokens=5, seed=1), False, None, 4),
    ]
    batched = run(model, tokenizer, items)
    for item, together in zip(items, batched):
        alone = run(model, tokenizer, [item])[0]
        assert [s.tokens for s in together.sequences] == [s.tokens for s in alone.sequences]
        for s_together, s_alone in zip(together.sequences, alone.sequences):
            torch.testing.assert_close(torch.tensor(s_together.logprobs), torch.tensor(s_alone.logprobs),
                                       rtol=1e-4, atol=1e-4)
        for name in ("topk_prompt_logprobs", "prompt_alt_tokens"):
            a, b = getattr(together, name), getattr(alone, name)
            assert (a is None) == (b is None)
            if a is not None:
                first, second = (a.token_ids, a.logprobs) if name.startswith("topk") else (a.tokens, a.logprobs)
                other = (b.token_ids, b.logprobs) if name.startswith("topk") else (b.tokens, b.logprobs)
                assert (first.to_numpy() == other[0].to_numpy()).all()
                np.testing.assert_allclose(second.to_numpy(), other[1].to_numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("params", "kwargs", "field"),
    [
        (SamplingParams(min_p=1.5), {}, "sampling_params.min_p"),
        (SamplingParams(min_p=float("nan")), {}, "sampling_params.min_p"),
        (SamplingParams(repetition_penalty=0.0), {}, "sampling_params.repetition_penalty"),
        (SamplingParams(presence_penalty=2.5), {}, "sampling_params.presence_penalty"),
        (SamplingParams(frequency_penalty=-3), {}, "sampling_params.frequency_penalty"),
        (SamplingParams(), {"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        (SamplingParams(), {"prompt_alt_tokens_k": 5000}, "prompt_alt_tokens_k"),
    ],
)
def test_out_of_range_parameters_name_their_field(params, kwargs, field):
    with pytest.raises(BadRequestError) as info:
        check_sample([1, 2, 3], 1, params, None, **kwargs)
    assert info.value.field == field
