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
