"""A MoE model and a GPT-2 through the whole service: the session's cluster maps a name to a tiny model directory
(`BIOS_MODEL_MAP`, conftest's `mapped`), the SDK trains, checkpoints, samples and exports, as a user of such a
model would."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from bios import types


@pytest.mark.parametrize("base_model", ["test/qwen3_moe", "test/gpt2"])
def test_train_checkpoint_sample_and_export(service, mapped, base_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps(mapped))  # the exporting client resolves the name too
    tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)
    tokens = list(b"the experts learn this sentence")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    losses = []
    for _ in range(6):
        fwd = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fwd.result().metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses
    path = tc.save_weights_for_sampler("final").result().path
    sampler = tc.create_sampling_client(path)
    prompt = types.ModelInput.from_ints(tokens[:5])
    sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])).result()
    assert len(sample.sequences[0].tokens) == 5
    merged_dir = service.create_rest_client().export_checkpoint(path, tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    forward = tc.forward([datum], "cross_entropy").result()
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(forward.loss_fn_outputs[0]["logprobs"].to_torch(), expected, rtol=0, atol=2e-4)


def test_the_tinker_sdk_trains_and_samples_a_moe_model_through_the_gateway(cluster, service):
    """The official tinker SDK over the gateway trains the tiny Qwen3-MoE's experts as the Bios SDK does: the
    same losses step by step (same seed), and its sampler answers from the trained weights."""
    import tinker
    from tinker import types as tt

    tokens = list(b"experts answer through the gateway")
    targets = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=targets)
    native = service.create_lora_training_client(base_model="test/qwen3_moe", rank=4, seed=5)
    expected = []
    for _ in range(4):
        fwd = native.forward_backward([types.Datum(types.ModelInput.from_ints(tokens[:-1]), targets)],
                                      "cross_entropy")
        native.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        expected.append(fwd.result().metrics["loss:sum"])
    with tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-test") as client:
        tc = client.create_lora_training_client(base_model="test/qwen3_moe", rank=4, seed=5).result()
        losses = []
        for _ in range(4):
            fwd = tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(tt.AdamParams(learning_rate=1e-2)).result()
            losses.append(fwd.result().metrics["loss:sum"])
        sampler = tc.save_weights_and_get_sampling_client("moe")
        sample = sampler.sample(tt.ModelInput.from_ints(tokens[:6]), 1,
                                tt.SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert losses == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]
    assert len(sample.sequences[0].tokens) == 6
