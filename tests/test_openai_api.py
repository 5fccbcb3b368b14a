"""The official `openai` client against the gateway's OpenAI-compatible routes, sampling a trained checkpoint:
greedy text equals `SamplingClient.sample` at temperature 0, a stream yields the same text, and the sampling
options (stop, n, seed, logprobs, top_p) mean what OpenAI says they mean."""

from __future__ import annotations

import openai
import pytest
from conftest import BASE, fox_sampler_checkpoint

import bios
from bios import types as t

KEY = "tml-openai-test"
PROMPT = "The quick brown"
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something."}]
GREEDY = t.SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def trained(cluster):
    """A sampler checkpoint of a run trained a few steps, and a native SamplingClient on it."""
    service = bios.ServiceClient(address=cluster.address)
    path = fox_sampler_checkpoint(service, "openai", seed=21, steps=3)
    yield path, service.create_sampling_client(model_path=path), service
    service.close()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def _native_text(sampler, prompt: list[int], params: t.SamplingParams = GREEDY) -> tuple[str, t.SampledSequence]:
    sequence = sampler.sample(t.ModelInput.from_ints(prompt), 1, params).result(120).sequences[0]
    return sampler.get_tokenizer().decode(sequence.tokens, skip_special_tokens=True), sequence


def _chat_prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_completion_equals_native_sampling_and_streams_the_same_text(client, trained):
    path, sampler, service = trained
    tokenizer = sampler.get_tokenizer()
    expected, sequence = _native_text(sampler, tokenizer.encode(PROMPT))
    done = client.completions.create(model=path, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    choice = done.choices[0]
    assert choice.text == expected and expected
    assert choice.finish_reason == ("length" if sequence.stop_reason == "length" else "stop")
    assert choice.logprobs.token_logprobs == pytest.approx(sequence.logprobs, rel=1e-5, abs=1e-6)
    assert done.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert done.usage.completion_tokens == len(sequence.tokens)
    stream = client.completions.create(model=path, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert len([c for c in chunks if c.choices[0].text]) > 1  # it comes in pieces
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_penalties_and_vllm_extensions_sample_like_the_native_params(client, trained):
    path, sampler, service = trained
    tokenizer = sampler.get_tokenizer()
    options = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05, top_k=20)
    expected, _ = _native_text(sampler, tokenizer.encode(PROMPT), t.SamplingParams(max_tokens=12, temperature=0.0,
                                                                                  **options))
    plain, _ = _native_text(sampler, tokenizer.encode(PROMPT))
    assert expected != plain  # the penalties change greedy text here, so the comparison below means something
    done = client.completions.create(model=path, prompt=PROMPT, max_tokens=12, temperature=0,
                                     presence_penalty=1.5, frequency_penalty=0.5,
                                     extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 20})
    assert done.choices[0].text == expected


def test_greedy_chat_uses_the_chat_template_and_streams_the_same_text(client, trained):
    path, sampler, service = trained
    expected, sequence = _native_text(sampler, _chat_prompt(sampler.get_tokenizer()))
    done = client.chat.completions.create(model=path, messages=CHAT, max_tokens=12, temperature=0, logprobs=True)
    assert done.choices[0].message.content == expected and done.choices[0].message.role == "assistant"
    assert [e.logprob for e in done.choices[0].logprobs.content] == pytest.approx(sequence.logprobs, rel=1e-5,
                                                                                  abs=1e-6)
    stream = client.chat.completions.create(model=path, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == len(sequence.tokens)


def test_stop_n_seed_and_the_base_model(client, trained):
    path, sampler, service = trained
    tokenizer = sampler.get_tokenizer()
    full = client.completions.create(model=path, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model=path, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"

    def sampled(seed: int):
        done = client.completions.create(model=path, prompt=[PROMPT, "Hello"], max_tokens=8, temperature=1.0,
                                         top_p=0.9, n=2, seed=seed)
        return [(c.index, c.text) for c in done.choices]

    first = sampled(7)
    assert [i for i, _ in first] == [0, 1, 2, 3]
    assert sampled(7) == first

    base_expected, _ = _native_text(service.create_sampling_client(base_model=BASE), tokenizer.encode(PROMPT))
    base = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=0)
    assert base.model == BASE and base.choices[0].text == base_expected != full
    models = client.models.list()
    assert BASE in [model.id for model in models.data]


def test_errors_come_back_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError, match="no checkpoint"):
        client.completions.create(model="bios://nope:train:0/sampler_weights/x", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.completions.create(model=BASE, prompt="hi", max_tokens=2, n=0)


def test_stream_pieces_never_split_a_character():
    from bios.gateway.openai_choices import pieces
    from bios.models.builtin import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    text = "héllo wörld 😀!"
    tokens = list(text.encode())
    parts = pieces(tokenizer, tokens, text)
    assert "".join(parts) == text and len(parts) == len(text)
    assert "\ufffd" not in "".join(parts)
    assert "".join(pieces(tokenizer, tokens, text[:7])) == text[:7]  # cut before a stop string
