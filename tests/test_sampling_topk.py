"""Top-k logprobs at every sampled position (`topk_sample_logprobs`) and logprobs of chosen prompt ids
(`target_prompt_logprobs`): equal to a plain log-softmax over the model's logits for the same tokens, greedy and
seeded, alone and in a batch with other requests."""

from __future__ import annotations

import numpy as np
import pytest
import test_sampling
import torch
from test_sampling import PROMPTS, perturbed_adapter, run

from bios.exceptions import BadRequestError
from bios.types import SamplingParams, TensorData
from bios.worker import sampling_results
from bios.worker.sampling import SampleItem

# test_sampling.py's tiny Llama with large weights (peaked distributions) and its byte-level tokenizer
model = pytest.fixture(scope="module", name="model")(test_sampling.model.__wrapped__)
tokenizer = pytest.fixture(scope="module", name="tokenizer")(test_sampling.tokenizer.__wrapped__)


def direct_logp(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the base model's logits over `tokens` in one plain forward, [len, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, temperature=0.0),
    SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=11),
    SamplingParams(max_tokens=16, temperature=1.0, seed=3, repetition_penalty=1.3, presence_penalty=0.5),
], ids=["greedy", "seeded-top-k", "seeded-penalties"])
def test_topk_sample_logprobs_equal_a_plain_log_softmax_of_the_models_logits(model, tokenizer, params):
    prompt = PROMPTS[1]
    result = run(model, tokenizer, [SampleItem(None, prompt, 2, params, topk_sample_logprobs=5)])[0]
    for sequence in result.sequences:
        top = sequence.topk_logprobs
        ids, values = top.token_ids.to_numpy(), top.logprobs.to_numpy()
        assert ids.shape == values.shape == (len(sequence.tokens), 5)
        logp = direct_logp(model, prompt + sequence.tokens)[len(prompt) - 1 : -1]
        expected_values = logp.topk(5, dim=-1).values
        # The decode step (one row, cached keys, C kernels at the CPU's vector width) and a full forward sum in
        # other orders: 1e-5 relative, as tests/test_sampling.py allows its peaked fp32 model (AVX2 code differs
        # from the forward by up to ~3e-6 relative here, AVX-512 code by less)
        np.testing.assert_allclose(values, expected_values.numpy(), rtol=1e-5, atol=1e-6)
        # ties aside, the ids are the same; each id's value is its own logprob either way
        np.testing.assert_allclose(logp.gather(1, torch.from_numpy(ids)).numpy(), values, rtol=1e-5, atol=1e-6)
        assert (np.diff(values, axis=1) <= 0).all()
        if params.temperature == 0:
            assert ids[:, 0].tolist() == sequence.tokens  # greedy picks the most likely token
            np.testing.assert_allclose(values[:, 0], sequence.logprobs, rtol=1e-5, atol=1e-6)


def test_topk_in_a_mixed_batch_equals_each_request_alone_and_asks_nothing_of_others(model, tokenizer):
    adapter = perturbed_adapter(model, "topk", seed=2)
    items = [
        SampleItem(adapter, PROMPTS[0], 2, SamplingParams(max_tokens=10, seed=4), topk_sample_logprobs=3),
        SampleItem(None, PROMPTS[1], 1, SamplingParams(max_tokens=6, temperature=0.0)),
        SampleItem(None, PROMPTS[3], 1, SamplingParams(max_tokens=12, seed=9, temperature=0.5),
                   topk_sample_logprobs=7),
    ]
    batched = run(model, tokenizer, items)
    assert batched[1].sequences[0].topk_logprobs is None
    for item, together in zip(items, batched):
        alone = run(model, tokenizer, [item])[0]
        for a, b in zip(alone.sequences, together.sequences, strict=True):
            assert a.tokens == b.tokens
            if item.topk_sample_logprobs:
                assert b.topk_logprobs.token_ids.shape == [len(b.tokens), item.topk_sample_logprobs]
                np.testing.assert_allclose(a.topk_logprobs.logprobs.to_numpy(), b.topk_logprobs.logprobs.to_numpy(),
                                           rtol=0, atol=1e-4)  # other batch shapes: other fp32 rounding
    # an adapter's row: equal to the top-k the prompt scoring gives over prompt + output (a full prefill; this
    # model's large weights make the two paths' fp32 rounding differ by ~2e-5, as in test_sampling.py)
    sequence = batched[0].sequences[0]
    whole = PROMPTS[0] + sequence.tokens
    scored = run(model, tokenizer, [SampleItem(adapter, whole, 1, SamplingParams(max_tokens=1, temperature=0.0),
                                               topk_prompt_logprobs=3)])[0].topk_prompt_logprobs
    np.testing.assert_allclose(sequence.topk_logprobs.logprobs.to_numpy(),
                               scored.logprobs.to_numpy()[len(PROMPTS[0]):], rtol=0, atol=1e-4)


def test_target_prompt_logprobs_score_the_chosen_ids_and_zero_where_minus_one(model, tokenizer):
    prompt = PROMPTS[1]
    targets = np.full((len(prompt) - 1, 3), -1, dtype=np.int64)
    targets[:, 0] = prompt[1:]  # the prompt's own next tokens: prompt_logprobs
    targets[::2, 1] = 7
    targets[3, 2] = 257  # EOS, a special token
    result = run(model, tokenizer, [SampleItem(None, prompt, 1, SamplingParams(max_tokens=2, seed=1), True,
                                               target_prompt_logprobs=TensorData(targets, "int64"))])[0]
    got = result.target_prompt_logprobs.to_numpy()
    assert got.shape == targets.shape and result.target_prompt_logprobs.dtype == "float32"
    logp = direct_logp(model, prompt)[:-1]
    expected = logp.gather(1, torch.from_numpy(targets).clamp(min=0)).masked_fill(torch.from_numpy(targets) < 0, 0.0)
    np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[:, 0], result.prompt_logprobs[1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    ({"topk_sample_logprobs": 65}, "topk_sample_logprobs"),
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"target_prompt_logprobs": TensorData(np.zeros((3, 1), np.int64), "int64")}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": TensorData(np.full((6, 1), 10**6, np.int64), "int64")}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": TensorData(np.zeros((6, 1), np.float32), "float32")}, "target_prompt_logprobs"),
])
def test_impossible_topk_and_targets_name_the_field(model, tokenizer, kwargs, field):
    with pytest.raises(BadRequestError) as error:
        run(model, tokenizer, [SampleItem(None, PROMPTS[0], 1, SamplingParams(max_tokens=2), **kwargs)])
    assert error.value.field == field



def test_a_streaming_request_reports_its_tokens_while_the_decode_runs(model, tokenizer, monkeypatch):
    """Progress comes in order, before the decode ends (the last report at the latest at the last step), and the
    pieces add up to the whole result; other requests of the batch are unaffected."""
    monkeypatch.setattr(sampling_results, "_PROGRESS_EVERY_S", 1e9)  # by token count only: deterministic
    monkeypatch.setattr(sampling_results, "_PROGRESS_EVERY_TOKENS", 4)
    reports = []
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=6, stop=[])
    stream = SampleItem(None, PROMPTS[1], 2, params, topk_sample_logprobs=2,
                        progress=lambda offsets, sequences: reports.append((offsets, sequences)))
    other = SampleItem(None, PROMPTS[0], 1, SamplingParams(max_tokens=5, temperature=0.0))
    results = run(model, tokenizer, [other, stream])
    assert results[0].sequences[0].tokens == run(model, tokenizer, [other])[0].sequences[0].tokens
    assert len(reports) >= 30 // 4  # in pieces, while it ran
    for sample, whole in enumerate(results[1].sequences):
        tokens, logprobs, top = [], [], []
        for offsets, sequences in reports:
            assert offsets[sample] == len(tokens)  # in order, nothing repeated or skipped
            tokens += sequences[sample].tokens
            logprobs += sequences[sample].logprobs
            if sequences[sample].tokens:
                top += sequences[sample].topk_logprobs.logprobs.to_numpy().tolist()
        assert tokens == whole.tokens and logprobs == whole.logprobs
        assert top == whole.topk_logprobs.logprobs.to_numpy().tolist()
    assert len(reports[0][1][0].tokens) == 4  # the first report came after 4 of 30 tokens
