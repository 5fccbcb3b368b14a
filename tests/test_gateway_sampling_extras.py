"""The official tinker SDK's top-k prompt logprobs and alternative prompt tokens through the gateway, equal to the
native SDK's; penalties and min_p sent as raw JSON reach the workers."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from conftest import BASE
from test_gateway import _retrieve
from tinker import types as tt
from tinker.types.topk_logprobs import MASK_LOGPROB

import bios
from bios import types as bt
from bios.gateway import proto

KEY = "tml-test"
PROMPT = list(b"The quick brown fox")


def test_topk_prompt_logprobs_and_alt_tokens_through_the_tinker_sdk_equal_the_native_sdk(cluster):
    params = dict(max_tokens=4, temperature=0.7, seed=3)
    with tinker.ServiceClient(base_url=cluster.http_url, api_key=KEY) as service:
        sampler = service.create_sampling_client(base_model=BASE)
        answer = sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(**params),
                                include_prompt_logprobs=True, topk_prompt_logprobs=3, prompt_alt_tokens_k=2,
                                prompt_logprobs_last_n=5).result(120)
    native_client = bios.ServiceClient(address=cluster.address)
    try:
        native = native_client.create_sampling_client(base_model=BASE).sample(
            bt.ModelInput.from_ints(PROMPT), 1, bt.SamplingParams(**params), True,
            topk_prompt_logprobs=3, prompt_alt_tokens_k=2).result(120)
    finally:
        native_client.close()
    topk = answer.topk_prompt_logprobs_np
    assert topk.token_ids.shape == (len(PROMPT), 3)
    cut = len(PROMPT) - 5  # prompt_logprobs_last_n: rows before the last 5 are Tinker's sentinels
    assert (topk.token_ids[:cut] == 0).all() and (topk.logprobs[:cut] == MASK_LOGPROB).all()
    assert answer.topk_prompt_logprobs[:cut] == [None] * cut
    assert (topk.token_ids[cut:] == native.topk_prompt_logprobs.token_ids.to_numpy()[cut:]).all()
    np.testing.assert_allclose(topk.logprobs[cut:], native.topk_prompt_logprobs.logprobs.to_numpy()[cut:], atol=1e-6)
    alt = answer.prompt_alt_tokens
    assert alt.tokens.shape == [len(PROMPT) - 1, 2]
    assert alt.tokens.tolist() == native.prompt_alt_tokens.tokens.to_numpy().tolist()
    np.testing.assert_allclose(alt.logprobs.to_numpy(), native.prompt_alt_tokens.logprobs.to_numpy(), atol=1e-6)
    assert list(answer.sequences[0].tokens) == native.sequences[0].tokens


def test_raw_json_penalties_reach_the_sampler_and_bad_values_are_a_400(cluster):
    from tinker.proto.response_conv import deserialize_sample_response

    penalties = {"min_p": 0.05, "repetition_penalty": 3.0, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    with httpx.Client(base_url=f"{cluster.http_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        session = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "raw"}).json()
        sampler = http.post("/create_sampling_session", json={"session_id": session["session_id"],
                                                             "sampling_session_seq_id": 0, "base_model": BASE}).json()
        body = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": PROMPT, "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 16, "temperature": 0.0, "stop": [], **penalties}}
        promise = http.post("/asample", json=body).json()
        tokens = list(deserialize_sample_response(_retrieve(http, promise["request_id"]).content).sequences[0].tokens)
        refused = http.post("/asample", json={**body, "seq_id": 1,
                                              "sampling_params": {**body["sampling_params"], "presence_penalty": 9.0}})
        assert refused.status_code == 400 and "presence_penalty" in refused.text
    native_client = bios.ServiceClient(address=cluster.address)
    try:
        native = native_client.create_sampling_client(base_model=BASE)
        penalised = native.sample(bt.ModelInput.from_ints(PROMPT), 1, bt.SamplingParams(
            max_tokens=16, temperature=0.0, stop=[], **penalties)).result(120).sequences[0].tokens
        plain = native.sample(bt.ModelInput.from_ints(PROMPT), 1, bt.SamplingParams(
            max_tokens=16, temperature=0.0, stop=[])).result(120).sequences[0].tokens
    finally:
        native_client.close()
    assert tokens == penalised != plain


def test_topk_and_alt_tokens_survive_the_protobuf_round_trip():
    from tinker.proto.response_conv import deserialize_sample_response

    ids = np.array([[0, 0], [7, 3], [2, 9]], dtype=np.int64)
    logprobs = np.array([[MASK_LOGPROB] * 2, [-0.1, -2.0], [-0.3, -1.5]], dtype=np.float32)
    alt = bt.PromptAltTokens(bt.TensorData(np.array([[4], [5]], np.int64), "int64"),
                             bt.TensorData(np.array([[-1.0], [-2.0]], np.float32), "float32"))
    response = bt.SampleResponse([bt.SampledSequence("length", [1], [-0.5])], None,
                                 bt.TopkLogprobs(bt.TensorData(ids, "int64"), bt.TensorData(logprobs, "float32")), alt)
    decoded = deserialize_sample_response(proto.sample_response(response, None))
    assert decoded.topk_prompt_logprobs == [None, [(7, pytest.approx(-0.1)), (3, -2.0)],
                                            [(2, pytest.approx(-0.3)), (9, -1.5)]]
    assert decoded.prompt_alt_tokens.tokens.tolist() == [[4], [5]]
    assert decoded.prompt_alt_tokens.logprobs.tolist() == [[-1.0], [-2.0]]
