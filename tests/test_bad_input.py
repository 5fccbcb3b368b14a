"""Bad requests get a BadRequestError naming the field, and leave the run exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BASE, text_datum

from bios import types
from bios.exceptions import BadRequestError

GOOD = [text_datum("valid training text for the tiny model")]
LR = types.AdamParams(learning_rate=1e-2)


def _datum(tokens, targets, weights):
    return types.Datum(types.ModelInput.from_ints(tokens), {"target_tokens": targets, "weights": weights})


BAD_BATCHES = {
    "token id >= vocab": ([_datum([1, 2, 99999], [2, 3, 4], [1.0] * 3)], "cross_entropy", "data[0].model_input"),
    "negative token id": ([_datum([1, -2, 3], [2, 3, 4], [1.0] * 3)], "cross_entropy", "data[0].model_input"),
    "short targets": ([_datum([1, 2, 3], [2, 3], [1.0] * 3)], "cross_entropy", "data[0].loss_fn_inputs.target_tokens"),
    "long weights": ([_datum([1, 2, 3], [2, 3, 4], [1.0] * 4)], "cross_entropy", "data[0].loss_fn_inputs.weights"),
    "target out of vocab": ([_datum([1, 2, 3], [2, 3, 4000], [1.0] * 3)], "cross_entropy",
                            "data[0].loss_fn_inputs.target_tokens"),
    "NaN weight": ([_datum([1, 2, 3], [2, 3, 4], [1.0, math.nan, 1.0])], "cross_entropy",
                   "data[0].loss_fn_inputs.weights"),
    "unknown loss": (GOOD, "mean_squared_error", "loss_fn"),
    "empty batch": ([], "cross_entropy", "data"),
    "missing sampler logprobs": (GOOD, "importance_sampling", "data[0].loss_fn_inputs.logprobs"),
}

BAD_PARAMS = {
    "NaN learning rate": (types.AdamParams(learning_rate=math.nan), "adam_params.learning_rate"),
    "negative learning rate": (types.AdamParams(learning_rate=-1e-3), "adam_params.learning_rate"),
    "beta1 of 1": (types.AdamParams(beta1=1.0), "adam_params.beta1"),
    "zero eps": (types.AdamParams(eps=0.0), "adam_params.eps"),
    "negative clip": (types.AdamParams(grad_clip_norm=-1.0), "adam_params.grad_clip_norm"),
}


@pytest.fixture(scope="module")
def clean_run_losses(service):
    """Three steps of a run that never saw a bad request."""
    tc = service.create_lora_training_client(BASE, rank=8, seed=11)
    losses = []
    for _ in range(3):
        losses.append(tc.forward_backward(GOOD).result(60).loss)
        tc.optim_step(LR).result(60)
    return losses


def test_every_bad_request_is_rejected_by_field_and_changes_nothing(service, clean_run_losses):
    tc = service.create_lora_training_client(BASE, rank=8, seed=11)
    losses = []
    for _ in range(3):
        for name, (data, loss_fn, field) in BAD_BATCHES.items():
            with pytest.raises(BadRequestError) as err:
                tc.forward_backward(data, loss_fn).result(60)
            assert err.value.field == field, name
        losses.append(tc.forward_backward(GOOD).result(60).loss)
        for name, (params, field) in BAD_PARAMS.items():
            with pytest.raises(BadRequestError) as err:
                tc.optim_step(params).result(60)
            assert err.value.field == field, name
        tc.optim_step(LR).result(60)
    assert losses == pytest.approx(clean_run_losses, rel=1e-6)


async def test_async_form_raises_at_the_first_await(service):
    tc = await service.create_lora_training_client_async(BASE, rank=8, seed=12)
    with pytest.raises(BadRequestError, match="has 2 entries but model_input has 3 tokens"):
        await tc.forward_backward_async([_datum([1, 2, 3], [2, 3], [1.0] * 3)])
    ok = await tc.forward_backward_async(GOOD)
    assert (await ok).loss > 0


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"base_model": "no-such/model"}, "base_model", "unknown base model"),
        ({"rank": 3}, "rank", "power of two"),
        ({"rank": 0}, "rank", "power of two"),
        ({"rank": 1024}, "rank", "rank"),
    ],
)
def test_bad_training_runs_are_refused(service, kwargs, field, message):
    with pytest.raises(BadRequestError, match=message) as err:
        service.create_lora_training_client(**{"base_model": BASE, **kwargs})
    assert err.value.field == field


def test_error_messages_say_what_to_do(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=13)
    with pytest.raises(BadRequestError) as err:
        tc.forward_backward([_datum([1, 2, 300], [2, 3, 4], [1.0] * 3)]).result(60)
    assert "token id 300" in str(err.value) and "[0, 262)" in str(err.value)
    with pytest.raises(BadRequestError, match="choose one of cross_entropy"):
        tc.forward_backward(GOOD, "hinge").result(60)
    assert torch.isfinite(torch.tensor(tc.forward(GOOD).result(60).loss))
