"""Dimuon: the damped matrix sign, loss falling on a tiny model, exact resume from a checkpoint, a run's optimizer
fixed at creation, and data parallelism (2 workers equal 1, the reference trained through the tinker SDK)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
import torch
from conftest import BASE, random_llama, text_datum, wait_for_workers
from tinker import types as tt

import bios
from bios import types
from bios.exceptions import BadRequestError
from bios.kernels.dimuon import REFERENCE_RANK, damped_sign
from bios.models.catalog import BUILTIN_VOCAB_SIZE
from bios.spec import check_optim_params
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state, load_into, restore_adapter
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
from bios.worker.lora import attach_lora

TEXTS = ["Dimuon orthogonalises the momentum of each LoRA factor.", "The quick brown fox jumps over the lazy dog."]
PARAMS = types.DimuonParams(learning_rate=2e-3)


# ------------------------------------------------------------------------------------------ the matrix sign


@pytest.mark.parametrize(("shape", "rank_rows"), [((4, 48), True), ((48, 4), False), ((3, 8, 40), True)],
                         ids=["A", "B", "experts_A"])
def test_damped_sign_is_the_polar_factor_with_singular_values_shrunk_by_damping(shape, rank_rows):
    generator = torch.Generator().manual_seed(0)
    momentum = torch.randn(shape, generator=generator) * 1e-3
    normalised = (momentum.double() / torch.linalg.matrix_norm(momentum.double(), keepdim=True))
    u, s, vh = torch.linalg.svd(normalised, full_matrices=False)
    for damping in (1e-9, 0.05):
        direction = damped_sign(momentum, damping, rank_rows).double()
        expected = u @ torch.diag_embed(s / torch.sqrt(s**2 + damping)) @ vh
        torch.testing.assert_close(direction, expected, rtol=0, atol=1e-6)
    rank = min(shape[-2:])
    norms = torch.linalg.matrix_norm(damped_sign(momentum, 1e-9, rank_rows).double())
    torch.testing.assert_close(norms, torch.full_like(norms, math.sqrt(rank)), rtol=1e-5, atol=0)
    assert damped_sign(torch.zeros(shape), 1e-4, rank_rows).abs().max() == 0  # no gradient yet (A at step 1): no move


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def model():
    llama = random_llama(BUILTIN_VOCAB_SIZE)
    attach_lora(llama)
    return llama


def dimuon_adapter(model, rank=8, seed=3) -> AdapterState:
    adapter = AdapterState.create("d", model, types.LoraConfig(rank=rank, seed=seed), device="cpu")
    adapter.optimizer = "dimuon"
    return adapter


def step(model, adapter, params=PARAMS) -> float:
    data = [text_datum(text) for text in TEXTS]
    loss = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy", None)])[0].loss
    commit_gradients(adapter)
    optim_step(adapter, params)
    return loss


def test_loss_falls_and_the_first_step_moves_each_b_by_lr_times_sqrt_rank(model):
    adapter = dimuon_adapter(model)
    losses = [step(model, adapter, types.DimuonParams(learning_rate=2e-2)) for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0]
    # the first step only: B starts at 0, so A has no gradient yet and each B moves lr * c * D, where ||D|| is
    # sqrt(rank) when damping is negligible
    fresh = dimuon_adapter(model)
    before = {name: (a.detach().clone(), b.detach().clone()) for name, (a, b) in fresh.pairs_in(fresh.params).items()}
    step(model, fresh, types.DimuonParams(learning_rate=1e-3, rank_lr_correction_exponent=0.5, damping=1e-12))
    correction = (REFERENCE_RANK / 8) ** 0.5
    for name, (a, b) in fresh.pairs_in(fresh.params).items():
        assert torch.equal(a, before[name][0]), name
        moved = float(torch.linalg.matrix_norm(b - before[name][1]))
        assert moved == pytest.approx(1e-3 * correction * math.sqrt(8), rel=1e-4), name
    assert fresh.step == 1 and float(fresh.exp_avg.abs().sum()) > 0 and float(fresh.exp_avg_sq.abs().sum()) == 0


def test_save_and_load_with_optimizer_resumes_exactly(model):
    original = dimuon_adapter(model, seed=5)
    for _ in range(3):
        step(model, original)
    info = types.BaseModelInfo(name="random-llama", local_dir="", arch="llama", vocab_size=BUILTIN_VOCAB_SIZE,
                               max_context_length=256, hidden_size=64, num_layers=2, num_parameters=0)
    saved = export_state(original, base_model="random-llama", base_info=info, with_optimizer=True)
    assert saved.metadata["optimizer"] == "dimuon"
    resumed = restore_adapter("r", model, saved, with_optimizer=True, device="cpu", optimizer="dimuon")
    weights_only = restore_adapter("w", model, saved, with_optimizer=False, device="cpu", optimizer="dimuon")
    for _ in range(2):
        expected, got = step(model, original), step(model, resumed)
        step(model, weights_only)
        assert got == expected
    assert torch.equal(resumed.params, original.params) and torch.equal(resumed.exp_avg, original.exp_avg)
    assert not torch.equal(weights_only.params, original.params)  # the momentum mattered
    adamw = AdapterState.create("a", model, types.LoraConfig(rank=8, seed=5), device="cpu")
    with pytest.raises(BadRequestError, match="dimuon optimizer state"):
        load_into(adamw, saved, with_optimizer=True)


def test_a_run_takes_only_its_own_optimizers_params():
    check_optim_params(PARAMS, "dimuon")
    check_optim_params(types.AdamParams(), "adamw")
    with pytest.raises(BadRequestError, match="created with the dimuon optimizer"):
        check_optim_params(types.AdamParams(), "dimuon")
    with pytest.raises(BadRequestError, match="created with the adamw optimizer"):
        check_optim_params(PARAMS, "adamw")
    for bad in (types.DimuonParams(-1.0), types.DimuonParams(1e-3, beta1=1.0), types.DimuonParams(1e-3, damping=0.0),
                types.DimuonParams(1e-3, grad_clip_norm=float("inf"))):
        with pytest.raises(BadRequestError) as info:
            check_optim_params(bad, "dimuon")
        assert info.value.field.startswith("optimizer_params.")


# ------------------------------------------------------------------------------------------ clusters


def _batch_tinker() -> list[tt.Datum]:
    data = []
    for text in TEXTS * 3:
        tokens = list(text.encode())
        data.append(tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]),
                             loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}))
    return data


@pytest.mark.e2e
def test_two_workers_equal_one_and_the_tinker_sdk_equals_the_native_sdk(cluster):
    steps = 4
    with tinker.ServiceClient(base_url=cluster.http_url, api_key="tml-test") as service:  # the session's one worker
        tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=21,
                                                 optimizer=tt.DimuonOptimizerConfig()).result()
        assert tc.get_info().optimizer_config.type == "dimuon"
        with pytest.raises(tinker.BadRequestError, match="dimuon"):
            tc.optim_step(tt.AdamParams(learning_rate=1e-3)).result(60)
        reference = []
        for _ in range(steps):
            reference.append(tc.forward_backward(_batch_tinker(), "cross_entropy").result(120).metrics["loss:sum"])
            tc.optim_step(tt.DimuonParams(learning_rate=2e-3)).result(120)
        assert reference[-1] < reference[0]
    with bios.LocalCluster(workers=2, worker_threads=1) as pair, bios.ServiceClient(address=pair.address) as service:
        wait_for_workers(service, 2)
        tc = service.create_lora_training_client(BASE, rank=8, seed=21, optimizer=types.DimuonOptimizerConfig())
        batch = [text_datum(text) for text in TEXTS * 3]
        losses = []
        for _ in range(steps):
            losses.append(tc.forward_backward(batch).result(120).loss)
            tc.optim_step(PARAMS).result(120)
        # a checkpoint with its optimizer state continues as a Dimuon run
        resumed = service.create_training_client_from_state_with_optimizer(tc.save_state("d").result(120).path)
        resumed.optim_step(PARAMS).result(120)
        with pytest.raises(BadRequestError, match="adamw"):
            service.create_training_client_from_state(tc.save_state("d2").result(120).path).optim_step(
                PARAMS).result(120)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


# ------------------------------------------------------------------------------------------ tensor parallelism

DIMUON_TP = types.DimuonParams(learning_rate=1e-2, beta1=0.85, grad_clip_norm=0.5)


def dimuon_tp2_work(rank: int, world: int) -> dict:
    """Three Dimuon steps on a TP=2 shard (run in a spawned process by `run_workers`)."""
    from test_tensor_parallel import LORA, batch, start_state, tiny_llama

    from bios.worker.sharded_adapter import (commit_sharded_gradients, create_sharded_adapter, gather_full_adapter,
                                             reduce_shared_grads, shard_adapter_state, sharded_optim_step)
    from bios.worker.tensor_parallel import shard_model

    model = tiny_llama()
    start = start_state(model)
    info = shard_model(model, rank, world)
    adapter = create_sharded_adapter("a", model, LORA, seed=LORA.seed, device="cpu")
    adapter.optimizer = "dimuon"
    adapter.load_state_dict(shard_adapter_state(start, info))
    losses = []
    for _ in range(3):
        [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
        reduce_shared_grads(adapter, info)
        commit_sharded_gradients(adapter, info)
        sharded_optim_step(adapter, DIMUON_TP, info)
        losses.append(output.metrics["loss:sum"])
    full = gather_full_adapter(adapter, info)
    return {"losses": losses, "final": full.state_dict(), "momentum": full.exp_avg.clone()}


def test_tp2_dimuon_equals_one_worker(tmp_path, monkeypatch):
    from test_tensor_parallel import LORA, assert_close, assert_states_close, batch, run_workers, start_state, \
        tiny_llama

    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")
    model = tiny_llama()
    adapter = AdapterState.create("a", model, LORA, device="cpu")
    adapter.optimizer = "dimuon"
    adapter.load_state_dict(start_state(model))
    losses = []
    for _ in range(3):
        [output] = forward_backward(model, [ForwardItem(adapter, batch(), "cross_entropy")])
        commit_gradients(adapter)
        optim_step(adapter, DIMUON_TP)
        losses.append(output.metrics["loss:sum"])
    for shard in run_workers(2, dimuon_tp2_work, tmp_path):
        assert shard["losses"] == pytest.approx(losses, rel=1e-5)
        assert_states_close(shard["final"], adapter.state_dict(), "weights after 3 Dimuon steps")
        assert_close(shard["momentum"], adapter.exp_avg, "momentum")
