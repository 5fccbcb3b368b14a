"""Training through the embedded cluster: learning, exactness against PEFT, accumulation, futures, cycles."""

from __future__ import annotations

import asyncio

import peft
import pytest
import torch
from conftest import BASE, held, text_datum

from bios import types
from bios.models import load_base_model
from bios.worker.adapter import LORA_ALPHA, init_lora_weights, lora_targets

BATCH = [
    text_datum("The quick brown fox jumps over the lazy dog."),
    text_datum("Bios trains LoRA adapters on a cycle clock."),
    text_datum("Many adapters share one base model."),
]


def test_loss_falls_by_more_than_half_within_50_steps(service):
    tc = service.create_lora_training_client(BASE, rank=16, seed=0)
    first = None
    for _ in range(50):
        fwd = tc.forward_backward(BATCH, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3))
        loss = fwd.result(120).loss
        first = loss if first is None else first
    final = tc.forward(BATCH, "cross_entropy").result(60).loss
    assert final < first / 2, (first, final)


def test_results_carry_conveniences(service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=1)
    fwd = tc.forward_backward(BATCH, "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
    out = fwd.result(60)
    assert out.loss == out.metrics["loss:sum"] > 0
    assert out.grad_norm is not None and out.grad_norm > 0
    assert len(out.loss_fn_outputs) == len(BATCH)
    for datum, record in zip(BATCH, out.loss_fn_outputs):
        logprobs = record["logprobs"].to_numpy()
        assert logprobs.shape == (datum.model_input.length,) and (logprobs <= 0).all()
    assert -sum(r["logprobs"].to_numpy().sum() for r in out.loss_fn_outputs) == pytest.approx(out.loss, rel=1e-5)
    assert opt.result(60).learning_rate == 1e-4
    assert opt.result().grad_norm == pytest.approx(out.grad_norm, rel=1e-6)
    info = tc.get_info()
    assert info.model_id == tc.model_id and info.lora_rank == 8 and info.model_data.model_name == BASE
    assert info.base_dtype == "float32"  # the suite pins BIOS_BASE_DTYPE=float32 (tests/conftest.py)
    assert tc.get_tokenizer().decode(list(b"hi")) == "hi"


def _peft_reference(rank: int, seed: int):
    base = load_base_model(BASE)
    targets = lora_targets(base.model, types.LoraConfig(rank=rank))
    modules = sorted({t.module_name.rsplit(".", 1)[-1] for t in targets})
    model = peft.get_peft_model(
        base.model, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=modules, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, (a, b) in init_lora_weights(targets, rank, seed).items():
            layer = model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
    return model


def _reference_pass(model, data, *, backward: bool):
    total, logprobs = 0.0, []
    for datum in data:
        ids = torch.tensor([datum.model_input.to_ints()])
        logits = model(input_ids=ids).logits[0].float()
        target = datum.loss_fn_inputs["target_tokens"].to_torch()
        logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1)
        loss = -(datum.loss_fn_inputs["weights"].to_torch() * logp).sum()
        if backward:
            loss.backward()
        total += loss.item()
        logprobs.append(logp.detach())
    return total, logprobs


def test_three_steps_equal_in_process_peft_and_torch_adamw(service):
    rank, seed = 8, 77
    params = types.AdamParams(learning_rate=3e-3, beta1=0.85, beta2=0.97, eps=1e-8, weight_decay=0.01,
                              grad_clip_norm=5.0)
    reference = _peft_reference(rank, seed)
    lora = [p for p in reference.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(lora, lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                              weight_decay=params.weight_decay, foreach=True)
    tc = service.create_lora_training_client(BASE, rank=rank, seed=seed)
    for _ in range(3):
        want_loss, want_logprobs = _reference_pass(reference, BATCH, backward=True)
        torch.nn.utils.clip_grad_norm_(lora, params.grad_clip_norm)
        adamw.step()
        adamw.zero_grad()
        out = tc.forward_backward(BATCH, "cross_entropy").result(60)
        tc.optim_step(params).result(60)
        assert out.loss == pytest.approx(want_loss, rel=1e-5)
        for record, want in zip(out.loss_fn_outputs, want_logprobs):
            torch.testing.assert_close(record["logprobs"].to_torch(), want, rtol=1e-5, atol=1e-6)
    # After the third update, logprobs are a function of the trained weights.
    want_loss, want_logprobs = _reference_pass(reference, BATCH, backward=False)
    out = tc.forward(BATCH, "cross_entropy").result(60)
    assert out.loss == pytest.approx(want_loss, rel=1e-5)
    for record, want in zip(out.loss_fn_outputs, want_logprobs):
        torch.testing.assert_close(record["logprobs"].to_torch(), want, rtol=1e-5, atol=1e-6)


def test_two_halves_accumulate_to_the_whole_batch(service):
    whole = service.create_lora_training_client(BASE, rank=8, seed=5)
    halves = service.create_lora_training_client(BASE, rank=8, seed=5)
    whole.forward_backward(BATCH, "cross_entropy")
    whole.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    halves.forward_backward(BATCH[:1], "cross_entropy")
    halves.forward_backward(BATCH[1:], "cross_entropy")
    halves.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    a = whole.forward(BATCH, "cross_entropy").result(60)
    b = halves.forward(BATCH, "cross_entropy").result(60)
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    for ra, rb in zip(a.loss_fn_outputs, b.loss_fn_outputs):
        torch.testing.assert_close(ra["logprobs"].to_torch(), rb["logprobs"].to_torch(), rtol=1e-5, atol=1e-6)


async def test_double_await_accepts_before_the_result_exists(ticking_cluster, ticking_service):
    tc = await ticking_service.create_lora_training_client_async(BASE, rank=8, seed=3)
    with held(ticking_cluster.workers[0]):  # no cycle can end, so no result can exist before the worker resumes
        future = await asyncio.wait_for(tc.forward_backward_async(BATCH, "cross_entropy"), 60)  # accepted
        assert not future.done()
    out = await future
    assert out.loss > 0


async def test_futures_awaited_in_reverse_still_follow_submission_order(service):
    params = types.AdamParams(learning_rate=1e-2)
    pipelined = await service.create_lora_training_client_async(BASE, rank=8, seed=4)
    futures = []
    for _ in range(4):
        futures.append(await pipelined.forward_backward_async(BATCH, "cross_entropy"))
        futures.append(await pipelined.optim_step_async(params))
    results = [await f for f in reversed(futures)][::-1]

    sequential = await service.create_lora_training_client_async(BASE, rank=8, seed=4)
    expected = []
    for _ in range(4):
        expected.append(await (await sequential.forward_backward_async(BATCH, "cross_entropy")))
        await (await sequential.optim_step_async(params))
    assert [r.loss for r in results[0::2]] == pytest.approx([r.loss for r in expected], rel=1e-6)
    assert [r.metrics["step:max"] for r in results[1::2]] == [1, 2, 3, 4]


async def _cycles_since(service, before: int, expected: int, timeout: float = 60.0) -> int:
    """Cycles run since `before`, read once `expected` have been counted (a cycle is counted just after its
    results are sent, so the count can lag them; it never runs ahead)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        ran = (await service.cluster_status_async()).cycles_run - before
        if ran >= expected or asyncio.get_running_loop().time() > deadline:
            return ran
        await asyncio.sleep(0.02)


async def _until_taken(service) -> None:
    while (await service.cluster_status_async()).queue_depth:
        await asyncio.sleep(0.02)


async def test_pipelined_requests_share_a_cycle_and_awaited_ones_do_not(ticking_cluster, ticking_service):
    """Requests accepted while a cycle runs wait for the next one and run in it together; a request sent only
    after the previous result came back gets a cycle of its own. Cycles are ordered by holding the worker."""
    service = ticking_service
    tc = await service.create_lora_training_client_async(BASE, rank=8, seed=6)
    blocker = await service.create_lora_training_client_async(BASE, rank=8, seed=7)
    before = (await service.cluster_status_async()).cycles_run
    with held(ticking_cluster.workers[0]):
        blocking = await blocker.forward_async(BATCH, "cross_entropy")
        await asyncio.wait_for(_until_taken(service), 60)  # its cycle has started, and cannot end
        fwd = await tc.forward_backward_async(BATCH, "cross_entropy")
        opt = await tc.optim_step_async()
        assert not (blocking.done() or fwd.done() or opt.done())
    await asyncio.wait_for(asyncio.gather(blocking, fwd, opt), 120)
    assert await _cycles_since(service, before, 2) == 2  # the blocker's cycle, then one for both requests

    before = (await service.cluster_status_async()).cycles_run
    await (await tc.forward_backward_async(BATCH, "cross_entropy"))
    await (await tc.optim_step_async())
    assert await _cycles_since(service, before, 2) == 2
