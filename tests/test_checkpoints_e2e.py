"""Checkpoints through the cluster: exact resume, load_state, export to PEFT, listings, bad paths."""

from __future__ import annotations

import peft
import pytest
import torch
from conftest import BASE, text_datum

from bios import types
from bios.exceptions import BadRequestError, ConflictError, NotFoundError
from bios.models import load_base_model

BATCH = [text_datum("Checkpoints carry the adapter and the Adam state."), text_datum("Resume exactly.")]
PARAMS = types.AdamParams(learning_rate=5e-3, weight_decay=0.01)


def _steps(tc, n):
    losses = []
    for _ in range(n):
        losses.append(tc.forward_backward(BATCH).result(60).loss)
        tc.optim_step(PARAMS).result(60)
    return losses


def test_resume_with_optimizer_equals_training_straight_through(service):
    straight = service.create_lora_training_client(BASE, rank=8, seed=31)
    expected = _steps(straight, 10)
    expected_final = straight.forward(BATCH).result(60)

    first = service.create_lora_training_client(BASE, rank=8, seed=31)
    losses = _steps(first, 5)
    path = first.save_state("half").result(60).path
    assert path == f"bios://{first.model_id}/weights/half"
    resumed = service.create_training_client_from_state_with_optimizer(path)
    assert resumed.model_id != first.model_id
    losses += _steps(resumed, 5)
    final = resumed.forward(BATCH).result(60)
    assert losses == expected  # exactly: same ops, same order, same numbers on CPU
    assert final.loss == expected_final.loss


def test_load_state_without_optimizer_restarts_adam(service):
    """The documented difference: weights come back, Adam's moments and step start from zero."""
    source = service.create_lora_training_client(BASE, rank=8, seed=32)
    _steps(source, 3)
    path = source.save_state("three").result(60).path
    with_opt = service.create_training_client_from_state_with_optimizer(path)
    without = service.create_training_client_from_state(path)
    assert with_opt.forward(BATCH).result(60).loss == without.forward(BATCH).result(60).loss
    assert _steps(with_opt, 1) == _steps(without, 1)  # same weights, so the same loss before the update
    assert with_opt.forward(BATCH).result(60).loss != without.forward(BATCH).result(60).loss
    reloaded = service.create_lora_training_client(BASE, rank=8, seed=99)
    reloaded.load_state_with_optimizer(path).result(60)
    assert reloaded.forward(BATCH).result(60).loss == pytest.approx(
        service.create_training_client_from_state(path).forward(BATCH).result(60).loss, rel=1e-7)


def test_listing_conflicts_and_deletion(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=33)
    a = tc.save_state("a").result(60).path
    b = tc.save_weights_for_sampler("b").result(60).path
    with pytest.raises(ConflictError):
        tc.save_state("a").result(60)
    tc.save_state("a", overwrite=True).result(60)
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(tc.model_id).result()
    assert {c.bios_path for c in listed.checkpoints} == {a, b}
    assert {c.checkpoint_type for c in listed.checkpoints} == {"training", "sampler"}
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == BASE and run.lora_rank == 8 and run.last_checkpoint.bios_path == a
    assert tc.model_id in rest.list_training_run_ids().result()
    rest.delete_checkpoint(a).result()
    assert [c.bios_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [b]
    with pytest.raises(NotFoundError):
        service.create_training_client_from_state(a)


@pytest.mark.parametrize(
    "path",
    ["bios:/x/weights/a", "http://run/weights/a", "bios://run/weights", "bios://run/optimizer/a",
     "bios://run/weights/bad name"],
)
def test_malformed_paths_are_bad_requests(service, path):
    with pytest.raises(BadRequestError) as err:
        service.create_training_client_from_state(path)
    assert err.value.field == "path"


def test_peft_export_gives_the_same_logprobs(service, tmp_path):
    tc = service.create_lora_training_client(BASE, rank=8, seed=34)
    _steps(tc, 3)
    path = tc.save_weights_for_sampler("export-me").result(60).path
    out = service.create_rest_client().export_checkpoint(path, tmp_path / "adapter")
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    model = peft.PeftModel.from_pretrained(load_base_model(BASE).model, str(out))
    bios_out = tc.forward(BATCH).result(60)
    for datum, record in zip(BATCH, bios_out.loss_fn_outputs):
        logits = model(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0]
        target = datum.loss_fn_inputs["target_tokens"].to_torch()
        want = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
        torch.testing.assert_close(record["logprobs"].to_torch(), want.detach(), rtol=1e-4, atol=1e-4)
