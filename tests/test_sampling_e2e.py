"""Sampling through the cluster: memorisation, trainer agreement, seeds, stops, RL, custom losses, bad input."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import BASE, text_datum

from bios import types
from bios.exceptions import BadRequestError, NotFoundError

SENTENCE = "The lighthouse of Varnholm blinks green twice."


def _prompt(text: str) -> types.ModelInput:
    return types.ModelInput.from_ints(list(text.encode()))


@pytest.fixture(scope="module")
def memorized(service):
    tc = service.create_lora_training_client(BASE, rank=16, seed=41)
    datum = text_datum(SENTENCE)
    for _ in range(80):
        tc.forward_backward([datum])
        tc.optim_step(types.AdamParams(learning_rate=3e-3))
    return tc, tc.save_weights_and_get_sampling_client("memorized")


def test_greedy_sample_reproduces_a_memorized_sentence(memorized):
    _, sampler = memorized
    head = SENTENCE[:12]
    rest = SENTENCE[12:].encode()
    out = sampler.sample(_prompt(head), 1, types.SamplingParams(max_tokens=len(rest), temperature=0)).result(60)
    assert bytes(out.sequences[0].tokens) == rest


def test_sample_logprobs_equal_forward_logprobs(memorized):
    tc, sampler = memorized
    prompt = _prompt("The light")
    seq = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=20, temperature=1.0, seed=5)).result(60)
    seq = seq.sequences[0]
    tokens = prompt.to_ints() + seq.tokens
    datum = types.Datum(types.ModelInput.from_ints(tokens[:-1]),
                        {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    forward = tc.forward([datum]).result(60).loss_fn_outputs[0]["logprobs"].to_torch()
    torch.testing.assert_close(torch.tensor(seq.logprobs), forward[-len(seq.tokens):], rtol=1e-4, atol=1e-4)
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result(60)
    assert prompt_lp[0] is None
    torch.testing.assert_close(torch.tensor(prompt_lp[1:]), forward, rtol=1e-4, atol=1e-4)


def test_same_seed_same_tokens_different_seeds_differ(service):
    sampler = service.create_sampling_client(base_model=BASE)
    prompts = [_prompt(p) for p in ("Once upon", "In the year", "Dear reader")]
    params = lambda seed: types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)  # noqa: E731
    a = [sampler.sample(p, 2, params(1)).result(60) for p in prompts]
    b = [sampler.sample(p, 2, params(1)).result(60) for p in prompts]
    c = [sampler.sample(p, 2, params(2)).result(60) for p in prompts]
    tokens = lambda rs: [[s.tokens for s in r.sequences] for r in rs]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)


def test_stop_strings_tokens_and_length(memorized):
    _, sampler = memorized
    prompt = _prompt("The light")
    by_string = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=40, temperature=0, stop=["green"]))
    seq = by_string.result(60).sequences[0]
    assert seq.stop_reason == "stop" and bytes(seq.tokens).endswith(b"green")
    by_token = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=40, temperature=0, stop=[ord("V")]))
    seq = by_token.result(60).sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens[-1] == ord("V")
    capped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, temperature=0, stop=[])).result(60)
    assert capped.sequences[0].stop_reason == "length" and len(capped.sequences[0].tokens) == 3


async def test_many_concurrent_samples_with_gather(memorized):
    _, sampler = memorized
    params = types.SamplingParams(max_tokens=8, temperature=0)
    results = await asyncio.gather(*(sampler.sample_async(_prompt("The light"), 1, params) for _ in range(12)))
    assert len({tuple(r.sequences[0].tokens) for r in results}) == 1


@pytest.mark.parametrize(
    ("params", "num_samples", "field"),
    [
        (types.SamplingParams(max_tokens=0), 1, "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=100000), 1, "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=4, top_p=0.0), 1, "sampling_params.top_p"),
        (types.SamplingParams(max_tokens=4, top_p=1.5), 1, "sampling_params.top_p"),
        (types.SamplingParams(max_tokens=4), 0, "num_samples"),
        (types.SamplingParams(max_tokens=4, temperature=-1), 1, "sampling_params.temperature"),
    ],
)
def test_bad_sampling_requests(memorized, params, num_samples, field):
    _, sampler = memorized
    with pytest.raises(BadRequestError) as err:
        sampler.sample(_prompt("x"), num_samples, params).result(60)
    assert err.value.field == field


def test_sampling_from_unknown_or_deleted_checkpoints(service, memorized):
    tc, _ = memorized
    with pytest.raises(NotFoundError):
        service.create_sampling_client(model_path=f"bios://{tc.model_id}/sampler_weights/never-saved")
    path = tc.save_weights_for_sampler("short-lived").result(60).path
    service.create_rest_client().delete_checkpoint(path).result()
    with pytest.raises(NotFoundError):
        service.create_sampling_client(model_path=path)
    with pytest.raises(BadRequestError):
        service.create_sampling_client(model_path="bios://not-a-path")


def test_forward_backward_custom_matches_a_hand_written_gradient(service):
    data = [text_datum("custom losses run on the client"), text_datum("over returned logprobs")]

    def loss_fn(batch, logprobs):
        loss = sum((lp.exp() * torch.arange(len(lp))).sum() for lp in logprobs)
        return loss, {"mean_logprob:mean": float(torch.cat(logprobs).detach().mean())}

    custom = service.create_lora_training_client(BASE, rank=8, seed=42)
    manual = service.create_lora_training_client(BASE, rank=8, seed=42)
    out = custom.forward_backward_custom(data, loss_fn).result(60)
    assert set(out.metrics) >= {"loss:sum", "surrogate_loss:sum", "mean_logprob:mean"}
    # The same gradient by hand: d/dlogp of sum(exp(lp) * i) is exp(lp) * i, so weights = -exp(lp) * i.
    logprobs = manual.forward(data).result(60).loss_fn_outputs
    weighted = []
    for d, record in zip(data, logprobs):
        lp = record["logprobs"].to_torch()
        w = -(lp.exp() * torch.arange(len(lp)))
        weighted.append(types.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                    "weights": types.TensorData.from_torch(w)}))
    manual.forward_backward(weighted).result(60)
    params = types.AdamParams(learning_rate=1e-2)
    custom.optim_step(params).result(60)
    manual.optim_step(params).result(60)
    assert custom.forward(data).result(60).loss == pytest.approx(manual.forward(data).result(60).loss, rel=1e-6)
    assert out.loss == pytest.approx(float(sum((r["logprobs"].to_torch().exp() * torch.arange(
        len(r["logprobs"].to_torch()))).sum() for r in logprobs)), rel=1e-5)


def test_rl_loop_raises_the_reward(service):
    """Sample → reward (share of lowercase letters) → importance_sampling → optim_step, 20 iterations."""
    tc = service.create_lora_training_client(BASE, rank=16, seed=43)
    prompt = _prompt("Say: ")
    lowercase = set(range(ord("a"), ord("z") + 1))
    rewards = []
    for step in range(20):
        sampler = tc.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1000 + step)  # the same draws every run
        result = sampler.sample(prompt, 16, params).result(60)
        scores = [sum(t in lowercase for t in s.tokens) / len(s.tokens) for s in result.sequences]
        mean = sum(scores) / len(scores)
        rewards.append(mean)
        data = []
        for seq, score in zip(result.sequences, scores):
            tokens = prompt.to_ints() + seq.tokens
            n_prompt = prompt.length - 1
            data.append(types.Datum(
                types.ModelInput.from_ints(tokens[:-1]),
                {
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [score - mean] * len(seq.tokens),
                },
            ))
        tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result(60)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards
