"""The official tinker SDK's `topk_sample_logprobs` and `target_prompt_logprobs` through the gateway (once refused
as unsupported): equal to the native SDK's, over the protobuf reply."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from conftest import BASE
from tinker import types as tt

import bios
from bios import types as bt
from bios.gateway import proto

KEY = "tml-test"
PROMPT = list(b"The quick brown fox")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse-csr"])
def test_topk_sample_and_target_prompt_logprobs_through_the_tinker_sdk_equal_the_native_sdk(cluster, sparse):
    params = {"max_tokens": 6, "temperature": 0.9, "seed": 8}
    targets = torch.full((len(PROMPT) - 1, 4), -1, dtype=torch.int64)
    targets[:, 0] = torch.tensor(PROMPT[1:])
    targets[2, 1], targets[5, 3] = 101, 7
    wire = tt.TensorData.from_torch_sparse(targets, pad_value=-1) if sparse else tt.TensorData.from_torch(targets)
    assert (wire.sparse_crow_indices is not None) == sparse
    with tinker.ServiceClient(base_url=cluster.http_url, api_key=KEY) as service:
        sampler = service.create_sampling_client(base_model=BASE).result()
        answer = sampler.sample(tt.ModelInput.from_ints(PROMPT), 2, tt.SamplingParams(**params),
                                include_prompt_logprobs=True, topk_sample_logprobs=4,
                                target_prompt_logprobs=wire).result(120)
    native_client = bios.ServiceClient(address=cluster.address)
    try:
        native = native_client.create_sampling_client(base_model=BASE).sample(
            bt.ModelInput.from_ints(PROMPT), 2, bt.SamplingParams(**params), True, topk_sample_logprobs=4,
            target_prompt_logprobs=bt.TensorData(targets.numpy(), "int64")).result(120)
    finally:
        native_client.close()
    for got, expected in zip(answer.sequences, native.sequences, strict=True):
        assert list(got.tokens) == expected.tokens
        assert got.topk_logprobs_np.token_ids.shape == (len(expected.tokens), 4)
        assert got.topk_logprobs_np.token_ids.tolist() == expected.topk_logprobs.token_ids.to_numpy().tolist()
        np.testing.assert_allclose(got.topk_logprobs_np.logprobs, expected.topk_logprobs.logprobs.to_numpy(),
                                   rtol=0, atol=1e-6)
        assert len(got.topk_logprobs) == len(expected.tokens) and len(got.topk_logprobs[0]) == 4
    scored = answer.target_prompt_logprobs.to_numpy()
    assert scored.shape == tuple(targets.shape)
    np.testing.assert_allclose(scored, native.target_prompt_logprobs.to_numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(scored[:, 0], answer.prompt_logprobs[1:], rtol=0, atol=1e-6)
    assert (scored[targets.numpy() == -1] == 0.0).all() and scored[2, 1] < 0 and scored[5, 3] < 0


def test_bad_targets_and_too_many_alternatives_are_a_400(cluster):
    with tinker.ServiceClient(base_url=cluster.http_url, api_key=KEY) as service:
        sampler = service.create_sampling_client(base_model=BASE).result()
        for kwargs, field in [({"topk_sample_logprobs": 65}, "topk_sample_logprobs"),
                              ({"target_prompt_logprobs": tt.TensorData.from_torch(
                                  torch.zeros(3, 1, dtype=torch.int64))}, "target_prompt_logprobs")]:
            with pytest.raises(tinker.BadRequestError, match=field):
                sampler.sample(tt.ModelInput.from_ints(PROMPT), 1, tt.SamplingParams(max_tokens=2),
                               **kwargs).result(60)


def test_sampled_topk_and_targets_survive_the_protobuf_round_trip():
    from tinker.proto.response_conv import deserialize_sample_response

    ids = np.array([[7, 3], [2, 9], [4, 1]], dtype=np.int64)
    logprobs = np.array([[-0.1, -2.0], [-0.3, -1.5], [-0.2, -0.9]], dtype=np.float32)
    sequence = bt.SampledSequence("length", [7, 2, 4], [-0.1, -0.3, -0.2], topk_logprobs=bt.TopkLogprobs(
        bt.TensorData(ids, "int64"), bt.TensorData(logprobs, "float32")))
    targets = bt.TensorData(np.array([[-0.5, 0.0], [-1.25, -3.0]], np.float32), "float32")
    decoded = deserialize_sample_response(proto.sample_response(
        bt.SampleResponse([sequence], target_prompt_logprobs=targets), None))
    assert decoded.sequences[0].topk_logprobs_np.token_ids.tolist() == ids.tolist()
    np.testing.assert_array_equal(decoded.sequences[0].topk_logprobs_np.logprobs, logprobs)
    assert decoded.target_prompt_logprobs.to_numpy().tolist() == [[-0.5, 0.0], [-1.25, -3.0]]
