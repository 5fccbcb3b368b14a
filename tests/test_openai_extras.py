"""What a vLLM user switching to Bios's OpenAI endpoint needs, with the official `openai` client: an unknown model
is a 404 naming the known ones; `logprobs=k` / `top_logprobs=k` give k alternatives per position equal to the
native sampler's top-k and to a plain log-softmax of the model's logits; `echo` and `best_of` work; parameters
Bios does not implement are a 400 naming them; `/v1/models` lists the caller's sampler checkpoints (and no one
else's); `/tokenize` and `/detokenize` answer as vLLM's do."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import BASE, fox_sampler_checkpoint

import bios
from bios import types as t

KEY = "tml-openai-test"
PROMPT = "The quick brown"
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def trained(cluster):
    service = bios.ServiceClient(address=cluster.address)
    path = fox_sampler_checkpoint(service, "openai-extras", seed=22, steps=2)
    sampler = service.create_sampling_client(model_path=path)
    yield path, sampler, sampler.get_tokenizer()
    service.close()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def base_model():
    """The tiny base model loaded here, in fp32, for the direct log-softmax."""
    from transformers import AutoModelForCausalLM

    from bios.models import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(BASE)), dtype=torch.float32).eval()


def _direct_topk(model, tokens: list[int], start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log_softmax values (and ids) of the model's logits at the positions predicting tokens[start:]."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    return logp[start - 1 : -1].topk(k, dim=-1)


# ------------------------------------------------------------------------------------------ 1. unknown models


def test_an_unknown_model_is_a_404_naming_the_known_ones(client, cluster):
    for call in (lambda: client.completions.create(model="no/such-model", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="no/such-model", messages=CHAT, max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        message = str(error.value)
        assert "unknown base model 'no/such-model'; known: " in message and BASE in message
    refused = httpx.post(f"{cluster.http_url}/tokenize", json={"model": "no/such-model", "prompt": "hi"},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert refused.status_code == 404 and BASE in refused.json()["error"]["message"]


# ------------------------------------------------------------------------------------------ 2. top-k logprobs


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_top_logprobs_are_k_alternatives_equal_to_a_plain_log_softmax(client, cluster, base_model, trained, params):
    tokenizer = trained[2]
    done = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=5,
                                          **params)
    content = done.choices[0].logprobs.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    service = bios.ServiceClient(address=cluster.address)
    try:
        native = service.create_sampling_client(base_model=BASE).sample(
            t.ModelInput.from_ints(prompt), 1, t.SamplingParams(max_tokens=10, **params),
            topk_sample_logprobs=5).result(120).sequences[0]
    finally:
        service.close()
    values, ids = _direct_topk(base_model, prompt + native.tokens, len(prompt), 5)
    assert [e.token for e in content] == [tokenizer.decode([tok]) for tok in native.tokens]
    assert [e.logprob for e in content] == pytest.approx(native.logprobs, abs=1e-6)
    for position, entry in enumerate(content):
        assert len(entry.top_logprobs) == 5
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values[position].tolist(), abs=1e-5)
        assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in ids[position]]
    np.testing.assert_allclose(native.topk_logprobs.logprobs.to_numpy(), values.numpy(), rtol=0, atol=1e-5)


def test_completion_logprobs_k_of_a_checkpoint_equal_the_native_top_k(client, trained):
    path, sampler, tokenizer = trained
    prompt = tokenizer.encode(PROMPT)
    native = sampler.sample(t.ModelInput.from_ints(prompt), 1, t.SamplingParams(max_tokens=8, temperature=0.7, seed=2),
                            topk_sample_logprobs=3).result(120).sequences[0]
    done = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0.7, seed=2, logprobs=3)
    logprobs = done.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx(native.logprobs, abs=1e-6)
    ids, values = native.topk_logprobs.token_ids.to_numpy(), native.topk_logprobs.logprobs.to_numpy()
    for position, top in enumerate(logprobs.top_logprobs):
        expected = {}
        for i, v in zip(ids[position], values[position]):
            expected.setdefault(tokenizer.decode([int(i)]), float(v))
        expected.setdefault(logprobs.tokens[position], logprobs.token_logprobs[position])  # "up to logprobs + 1"
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-5)
    # the same top-k as the prompt scoring of prompt + output (a full prefill rather than cached decode steps)
    scored = sampler.sample(t.ModelInput.from_ints(prompt + native.tokens), 1, t.SamplingParams(max_tokens=1),
                            topk_prompt_logprobs=3).result(120).topk_prompt_logprobs
    np.testing.assert_allclose(values, scored.logprobs.to_numpy()[len(prompt):], rtol=0, atol=1e-5)


def test_streamed_logprobs_equal_the_whole_response(client, trained):
    path = trained[0]
    whole = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    tops = [top for c in chunks if c.choices[0].logprobs for top in c.choices[0].logprobs.top_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    assert tops == whole.choices[0].logprobs.top_logprobs
    chat = list(client.chat.completions.create(model=path, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                               top_logprobs=2, stream=True))
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    whole_chat = client.chat.completions.create(model=path, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                                top_logprobs=2)
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole_chat.choices[0].logprobs.content]
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)


# ------------------------------------------------------------------------------------------ 3. echo, best_of, refusals


def test_echo_returns_the_prompt_and_its_logprobs(client, trained):
    path, sampler, tokenizer = trained
    prompt = tokenizer.encode(PROMPT)
    expected = sampler.compute_logprobs(t.ModelInput.from_ints(prompt)).result(120)
    done = client.completions.create(model=path, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    choice = done.choices[0]
    plain = client.completions.create(model=path, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    assert choice.text == tokenizer.decode(prompt, skip_special_tokens=True) + plain
    assert choice.logprobs.tokens[: len(prompt)] == [tokenizer.decode([tok]) for tok in prompt]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1: len(prompt)] == pytest.approx(expected[1:], abs=1e-5)
    assert len(choice.logprobs.tokens) == len(prompt) + 3
    assert choice.logprobs.text_offset[len(prompt)] == len(tokenizer.decode(prompt, skip_special_tokens=True))
    scored = client.completions.create(model=path, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == PROMPT and len(scored.choices[0].logprobs.tokens) == len(prompt)
    assert scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)


def test_best_of_returns_the_n_most_likely_of_the_samples(client, trained):
    path, sampler, tokenizer = trained
    params = t.SamplingParams(max_tokens=6, temperature=1.0, seed=13)
    samples = sampler.sample(t.ModelInput.from_ints(tokenizer.encode(PROMPT)), 4, params).result(120).sequences
    ranked = sorted(samples, key=lambda s: -sum(s.logprobs))
    done = client.completions.create(model=path, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=13, n=2, best_of=4)
    assert [c.text for c in done.choices] == [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in ranked[:2]]
    with pytest.raises(openai.BadRequestError, match="best_of must be at least n"):
        client.completions.create(model=path, prompt=PROMPT, max_tokens=2, n=3, best_of=2)


@pytest.mark.parametrize("chat, extra, param", [
    (True, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    (True, {"response_format": {"type": "json_object"}}, "response_format"),
    (True, {"logit_bias": {"65": 5}}, "logit_bias"),
    (False, {"suffix": "!"}, "suffix"),
    (False, {"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    (True, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (False, {"logprobs": 21}, "logprobs"),
])
def test_parameters_bios_does_not_implement_are_a_400_naming_them(client, chat, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        if chat:
            client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=2, **extra)
        else:
            client.completions.create(model=BASE, prompt="hi", max_tokens=2, **extra)
    assert param in str(error.value) and error.value.body["param"] == param


def test_values_that_ask_for_nothing_and_bookkeeping_fields_are_accepted(client):
    done = client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=2, user="u1", tool_choice="none",
                                          response_format={"type": "text"}, logit_bias={}, metadata={"a": "b"})
    assert done.choices[0].message.role == "assistant"


# ------------------------------------------------------------------------------------------ 4. models, 5. tokenize


def test_models_list_the_callers_sampler_checkpoints_usable_as_model(client, trained):
    path = trained[0]
    listed = {m.id: m for m in client.models.list().data}
    assert BASE in listed and path in listed
    assert listed[path].model_extra["parent"] == BASE and listed[BASE].model_extra["max_model_len"] == 1024
    assert client.completions.create(model=path, prompt=PROMPT, max_tokens=2, temperature=0).model == path


def test_tokenize_and_detokenize_answer_as_vllms(cluster, trained):
    path, _, tokenizer = trained
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cluster.http_url, headers=headers, timeout=60) as http:
        for route in ("/tokenize", "/v1/tokenize"):
            answer = http.post(route, json={"model": BASE, "prompt": PROMPT}).json()
            assert answer["tokens"] == tokenizer.encode(PROMPT) and answer["count"] == len(answer["tokens"])
            assert answer["max_model_len"] > 0
        bare = http.post("/tokenize", json={"model": path, "prompt": PROMPT, "add_special_tokens": False}).json()
        assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
        chat = http.post("/tokenize", json={"model": BASE, "messages": CHAT}).json()
        text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        for route in ("/detokenize", "/v1/detokenize"):
            assert http.post(route, json={"model": BASE, "tokens": bare["tokens"]}).json() == {"prompt": PROMPT}
        refused = http.post("/detokenize", json={"model": BASE, "tokens": [10**9]})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={"model": BASE, "prompt": "x", "oops": 1}).status_code == 400


def test_another_keys_checkpoints_are_neither_listed_nor_usable(tmp_path_factory):
    from bios.security.keys import KeyStore

    state_dir = tmp_path_factory.mktemp("openai-keyed")
    keys, _ = KeyStore.init(state_dir)
    alice, bob = str(keys.create("alice")), str(keys.create("bob"))
    try:
        with bios.LocalCluster(state_dir=state_dir, worker_threads=1, http="127.0.0.1:0") as cluster:
            service = bios.ServiceClient(address=cluster.address, api_key=alice, connect_timeout_s=20)
            try:
                tc = service.create_lora_training_client(BASE, rank=2, seed=1)
                path = tc.save_weights_for_sampler("alices").result(120).path
            finally:
                service.close()

            def models(key: str) -> list[str]:
                with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=key, max_retries=0) as c:
                    return [m.id for m in c.models.list().data]

            assert path in models(alice)
            assert path not in models(bob) and BASE in models(bob)
            with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=bob, max_retries=0) as c, \
                    pytest.raises(openai.NotFoundError):
                c.completions.create(model=path, prompt="hi", max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                models("tml-wrong")
    finally:
        keys.close()


def test_json_of_unknown_fields_in_raw_requests_names_the_field(cluster):
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    answer = httpx.post(f"{cluster.http_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == 400 and json.loads(answer.text)["error"]["param"] == "ignore_eos"
