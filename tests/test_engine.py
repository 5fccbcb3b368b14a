"""The worker's training engine on a tiny Llama: exactness against PEFT, accumulation, multi-adapter batches."""

from __future__ import annotations

import peft
import pytest
import torch
from conftest import random_llama
from transformers import LlamaForCausalLM

from bios.exceptions import BadRequestError
from bios.types import AdamParams, BaseModelInfo, Datum, LoraConfig, ModelInput
from bios.worker.adapter import LORA_ALPHA, AdapterState, init_lora_weights, lora_targets, validate_lora_config
from bios.worker.engine import (ForwardItem, check_item, commit_gradients, discard_gradients, forward_backward,
                                model_limits, optim_step)
from bios.worker.lora import active_adapters, attach_lora

VOCAB = 300
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# eps stays at its default: an eps near the gradients' rounding noise (~1e-6 here) makes Adam's update of
# near-zero-gradient elements amplify fp32 reordering noise by lr/eps, for PEFT against itself as much as for us.
ADAM = AdamParams(learning_rate=1e-2, beta1=0.85, beta2=0.98, weight_decay=0.05, grad_clip_norm=5.0)


def tiny_llama() -> LlamaForCausalLM:
    return random_llama(VOCAB)


def make_batch(seed: int, lengths: list[int]) -> list[Datum]:
    """Random token sequences; weights are a mix of zeros and positive reals."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for length in lengths:
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        weights = torch.rand(length, generator=generator) * (torch.rand(length, generator=generator) > 0.2)
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), {"target_tokens": tokens[1:], "weights": weights}))
    return data


def perturbed_adapter(model, model_id: str, rank: int, seed: int) -> AdapterState:
    """An adapter whose B is non-zero too, so it changes the model's outputs from the first pass."""
    adapter = AdapterState.create(model_id, model, LoraConfig(rank=rank, seed=seed), device="cpu")
    generator = torch.Generator().manual_seed(seed + 1000)
    state = {key: value + 0.05 * torch.randn(value.shape, generator=generator) for key, value in adapter.state_dict().items()}
    adapter.load_state_dict(state)
    return adapter


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Equal within `rel` of the tensor's own size: fp32 sums in another order change near-zero elements
    relatively much (and Adam turns a gradient's relative error into its update's), the whole tensor little."""
    error = float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))
    assert error <= rel, f"relative error {error:.3g} > {rel}"


def logprobs_of(output) -> list[torch.Tensor]:
    return [record["logprobs"].to_torch() for record in output.loss_fn_outputs]


def train_step(model, adapter, data, params=ADAM):
    output = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy", None, False)])[0]
    commit_gradients(adapter)
    optim_step(adapter, params)
    return output


# ------------------------------------------------------------------------------------------ exactness


def test_three_steps_equal_peft_with_torch_adamw():
    rank, seed = 8, 1234
    data = make_batch(0, [11, 6, 17, 9])

    reference = tiny_llama()
    targets = lora_targets(reference, LoraConfig(rank=rank))
    peft_model = peft.get_peft_model(
        reference, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=LLAMA_MODULES, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, (lora_a, lora_b) in init_lora_weights(targets, rank, seed).items():
            layer = peft_model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(lora_a)
            layer.lora_B["default"].weight.copy_(lora_b)
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        lora_params,
        lr=ADAM.learning_rate,
        betas=(ADAM.beta1, ADAM.beta2),
        eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
        foreach=True,
    )

    model = tiny_llama()
    adapter = AdapterState.create("run", model, LoraConfig(rank=rank, seed=seed), device="cpu")

    for _ in range(3):
        ref_loss, ref_logprobs = 0.0, []
        for datum in data:
            ids = torch.tensor([datum.model_input.to_ints()])
            logits = peft_model(input_ids=ids).logits[0].float()
            target = datum.loss_fn_inputs["target_tokens"].to_torch()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None]).squeeze(-1)
            loss = -(datum.loss_fn_inputs["weights"].to_torch() * logp).sum()
            loss.backward()
            ref_loss += loss.item()
            ref_logprobs.append(logp.detach())
        torch.nn.utils.clip_grad_norm_(lora_params, ADAM.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad()

        output = train_step(model, adapter, data)
        assert output.loss == pytest.approx(ref_loss, rel=1e-5)
        for got, want in zip(logprobs_of(output), ref_logprobs):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    expected = peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    actual = adapter.state_dict()
    assert actual.keys() == expected.keys()
    for key in expected:
        assert_close_rel(actual[key], expected[key], 1e-5)
    assert adapter.step == 3


# ------------------------------------------------------------------------------------ accumulation


def test_two_half_batches_then_one_step_equal_the_whole_batch():
    data = make_batch(1, [8, 13, 5, 10])
    model = tiny_llama()
    whole = perturbed_adapter(model, "whole", 8, 7)
    halves = perturbed_adapter(model, "halves", 8, 7)

    whole_loss = train_step(model, whole, data).loss

    half_losses = []
    for part in (data[:2], data[2:]):
        half_losses.append(forward_backward(model, [ForwardItem(halves, part, "cross_entropy", None, False)])[0].loss)
        commit_gradients(halves)
    optim_step(halves, ADAM)

    assert sum(half_losses) == pytest.approx(whole_loss, rel=1e-6)
    assert_close_rel(halves.params, whole.params, 1e-5)
    assert_close_rel(halves.exp_avg_sq, whole.exp_avg_sq, 1e-5)


def test_two_items_of_one_adapter_in_one_call_accumulate():
    data = make_batch(2, [8, 13, 5, 10])
    model = tiny_llama()
    one, two = perturbed_adapter(model, "one", 4, 3), perturbed_adapter(model, "two", 4, 3)
    forward_backward(model, [ForwardItem(one, data, "cross_entropy", None, False)])
    outputs = forward_backward(
        model,
        [ForwardItem(two, data[:1], "cross_entropy", None, False), ForwardItem(two, data[1:], "cross_entropy", None, False)],
    )
    assert_close_rel(two.pending_grad, one.pending_grad, 1e-5)
    assert [len(o.loss_fn_outputs) for o in outputs] == [1, 3]


def test_backward_accumulates_into_the_flat_pending_buffer():
    model = tiny_llama()
    adapter = perturbed_adapter(model, "run", 4, 0)
    grads_before = {t.module_name: [view.grad for view in adapter.lora_pair(t.module_name)] for t in adapter.targets}
    forward_backward(model, [ForwardItem(adapter, make_batch(3, [6, 9]), "cross_entropy", None, False)])

    assert adapter.pending_grad.abs().sum() > 0
    assert adapter.grad.abs().sum() == 0  # nothing committed yet
    for target in adapter.targets:
        for view, before in zip(adapter.lora_pair(target.module_name), grads_before[target.module_name]):
            assert view.grad is before
            assert view.grad.abs().sum() > 0
    assert adapter.grad_views_intact()
    norm = commit_gradients(adapter)
    assert norm == pytest.approx(float(adapter.grad.norm()))
    assert adapter.pending_grad.abs().sum() == 0


# ------------------------------------------------------------------------------------ multi-adapter


def test_multi_adapter_batch_equals_each_adapter_alone():
    model = tiny_llama()
    adapters = [perturbed_adapter(model, f"run{i}", rank, seed) for i, (rank, seed) in enumerate([(4, 1), (8, 2), (16, 3)])]
    bystander = perturbed_adapter(model, "bystander", 8, 4)
    bystander_params = bystander.params.clone()
    batches = [make_batch(10, [7, 15]), make_batch(11, [4, 12, 9]), make_batch(12, [20])]

    alone_logprobs, alone_grads, alone_losses = [], [], []
    for adapter, data in zip(adapters, batches):
        output = forward_backward(model, [ForwardItem(adapter, data, "cross_entropy", None, False)])[0]
        alone_logprobs.append(logprobs_of(output))
        alone_losses.append(output.loss)
        alone_grads.append(adapter.pending_grad.clone())
        discard_gradients(adapter)

    single_row_logprobs = [
        [logprobs_of(forward_backward(model, [ForwardItem(a, [d], "cross_entropy", None, True)])[0])[0] for d in data]
        for a, data in zip(adapters, batches)
    ]

    for budget in (16384, 30):  # one pass for everything, then several micro-batches
        items = [ForwardItem(a, data, "cross_entropy", None, False) for a, data in zip(adapters, batches)]
        outputs = forward_backward(model, items, max_tokens_per_pass=budget)
        for i, adapter in enumerate(adapters):
            assert outputs[i].loss == pytest.approx(alone_losses[i], rel=1e-5)
            for got, want, unpadded in zip(logprobs_of(outputs[i]), alone_logprobs[i], single_row_logprobs[i]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(got, unpadded, rtol=1e-5, atol=1e-6)
            assert_close_rel(adapter.pending_grad, alone_grads[i], 1e-5)
            discard_gradients(adapter)

    assert torch.equal(bystander.params, bystander_params)
    assert bystander.pending_grad.abs().sum() == 0 and bystander.grad.abs().sum() == 0


def test_rows_outside_every_segment_use_the_base_model():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits
        attach_lora(model)
        attach_lora(model)  # idempotent
        adapter = perturbed_adapter(model, "run", 8, 9)
        with active_adapters(model, [(1, 2, adapter)]):
            mixed = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(mixed[[0, 2]], base_logits[[0, 2]])
    assert (mixed[1] - base_logits[1]).abs().max() > 1e-3
    torch.testing.assert_close(after, base_logits)  # segments are cleared on exit


def test_attach_lora_keeps_parameter_names_and_freezes_the_base():
    model = tiny_llama()
    names_before = list(model.state_dict())
    attach_lora(model)
    assert list(model.state_dict()) == names_before
    assert not any(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------------- forward_only


def test_forward_only_builds_no_graph_and_matches_forward_backward():
    model = tiny_llama()
    trained, probe = perturbed_adapter(model, "trained", 8, 1), perturbed_adapter(model, "probe", 4, 2)
    data = make_batch(20, [9, 14])
    grad_modes: list[bool] = []
    # the head returns log-probs, or (log-probs, loss) for a pass that trains only on cross-entropy
    hook = model.lm_head.register_forward_hook(
        lambda module, args, out: grad_modes.append(getattr(out, "loss", out).requires_grad))

    forward_only = forward_backward(model, [ForwardItem(probe, data, "cross_entropy", None, True)])[0]
    assert grad_modes == [False]
    assert probe.pending_grad.abs().sum() == 0

    grad_modes.clear()
    mixed = forward_backward(
        model,
        [ForwardItem(probe, data, "cross_entropy", None, True), ForwardItem(trained, data, "cross_entropy", None, False)],
    )
    hook.remove()
    assert sorted(grad_modes) == [False, True]  # one pass with a graph, one without
    assert probe.pending_grad.abs().sum() == 0 and trained.pending_grad.abs().sum() > 0

    with_backward = forward_backward(model, [ForwardItem(probe, data, "cross_entropy", None, False)])[0]
    for a, b, c in zip(logprobs_of(forward_only), logprobs_of(mixed[0]), logprobs_of(with_backward)):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    assert forward_only.loss == pytest.approx(with_backward.loss, rel=1e-6)
    assert forward_only.metrics.keys() == {"loss:sum"}
    assert forward_only.loss_fn_output_type == "ArrayRecord"


def test_rl_loss_runs_through_the_engine():
    model = tiny_llama()
    adapter = perturbed_adapter(model, "rl", 4, 3)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (13,), generator=generator)
    datum = Datum(
        ModelInput.from_ints(tokens[:-1].tolist()),
        {"target_tokens": tokens[1:], "logprobs": -torch.rand(12, generator=generator) * 5, "advantages": torch.randn(12, generator=generator)},
    )
    output = forward_backward(model, [ForwardItem(adapter, [datum], "ppo", {"clip_high_threshold": 1.3}, False)])[0]
    assert torch.isfinite(logprobs_of(output)[0]).all() and adapter.pending_grad.abs().sum() > 0


# -------------------------------------------------------------------------------- abort, state, config


def test_discarded_cycle_leaves_no_trace():
    data, other = make_batch(30, [8, 11]), make_batch(31, [6])
    model = tiny_llama()
    clean, aborted = perturbed_adapter(model, "clean", 8, 5), perturbed_adapter(model, "aborted", 8, 5)

    forward_backward(model, [ForwardItem(clean, data, "cross_entropy", None, False)])
    commit_gradients(clean)
    optim_step(clean, ADAM)

    forward_backward(model, [ForwardItem(aborted, data, "cross_entropy", None, False)])
    commit_gradients(aborted)
    forward_backward(model, [ForwardItem(aborted, other, "cross_entropy", None, False)])
    discard_gradients(aborted)  # the second cycle failed
    optim_step(aborted, ADAM)

    assert torch.equal(aborted.params, clean.params)
    assert torch.equal(aborted.exp_avg, clean.exp_avg) and aborted.step == clean.step


def test_state_dict_and_optimizer_state_round_trip():
    model = tiny_llama()
    data = make_batch(40, [10, 7])
    source = perturbed_adapter(model, "source", 8, 1)
    train_step(model, source, data)
    target = AdapterState.create("target", model, LoraConfig(rank=8, seed=99), device="cpu")
    target.load_state_dict(source.state_dict())
    target.load_optimizer_state(source.optimizer_state())
    assert torch.equal(target.params, source.params) and target.step == 1
    assert target.checksum() == source.checksum()

    outputs = [train_step(model, adapter, data) for adapter in (source, target)]
    assert logprobs_of(outputs[0])[0].tolist() == logprobs_of(outputs[1])[0].tolist()
    assert torch.equal(target.params, source.params)

    wrong_rank = AdapterState.create("r4", model, LoraConfig(rank=4, seed=1), device="cpu")
    params_before = wrong_rank.params.clone()
    with pytest.raises(ValueError, match="different rank"):
        wrong_rank.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="missing keys"):
        target.load_state_dict({k: v for k, v in source.state_dict().items() if "lm_head" not in k})
    with pytest.raises(ValueError, match="different rank"):
        wrong_rank.load_optimizer_state(source.optimizer_state())
    assert torch.equal(wrong_rank.params, params_before)


def test_same_seed_same_start_and_partial_targets():
    model = tiny_llama()
    a = AdapterState.create("a", model, LoraConfig(rank=4, seed=5), device="cpu")
    b = AdapterState.create("b", model, LoraConfig(rank=4, seed=5), device="cpu")
    c = AdapterState.create("c", model, LoraConfig(rank=4, seed=6), device="cpu")
    assert torch.equal(a.params, b.params) and not torch.equal(a.params, c.params)
    assert a.scale == LORA_ALPHA / 4

    attn_only = AdapterState.create("attn", model, LoraConfig(rank=4, seed=5, train_mlp=False, train_unembed=False), device="cpu")
    names = [t.module_name for t in attn_only.targets]
    assert names[:4] == [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert len(names) == 8 and all("self_attn" in n for n in names)
    forward_backward(model, [ForwardItem(attn_only, make_batch(50, [6]), "cross_entropy", None, False)])
    assert attn_only.pending_grad.abs().sum() > 0


@pytest.mark.parametrize("rank", [3, 0, -4, 64, 2.0])
def test_validate_lora_config_rejects_bad_ranks(rank):
    model = tiny_llama()
    with pytest.raises(BadRequestError, match="power of two between 1 and 32") as info:
        validate_lora_config(model, LoraConfig(rank=rank))
    assert info.value.field == "rank"


def test_validate_lora_config_other_fields():
    model = tiny_llama()
    validate_lora_config(model, LoraConfig(rank=32))
    # without attention and the head, the smallest layer is the MLP's 64 wide side
    validate_lora_config(model, LoraConfig(rank=64, train_attn=False, train_unembed=False))
    with pytest.raises(BadRequestError) as info:
        validate_lora_config(model, LoraConfig(rank=8, train_attn=False, train_mlp=False, train_unembed=False))
    assert info.value.field == "train_attn"
    with pytest.raises(BadRequestError) as info:
        validate_lora_config(model, LoraConfig(rank=8, seed=-1))
    assert info.value.field == "seed"


def test_bad_data_raises_before_anything_changes():
    model = tiny_llama()
    adapter = perturbed_adapter(model, "run", 4, 1)
    good = make_batch(60, [5])[0]
    bad_length = Datum(good.model_input, {"target_tokens": good.loss_fn_inputs["target_tokens"], "weights": [1.0, 1.0]})
    bad_token = Datum(ModelInput.from_ints([1, 2, VOCAB]), {"target_tokens": [1, 2, 3], "weights": [1.0, 1.0, 1.0]})
    no_weights = Datum(good.model_input, {"target_tokens": good.loss_fn_inputs["target_tokens"]})
    cases = [
        (bad_length, "cross_entropy", r"item 0 \(run\): data\[1\]\.loss_fn_inputs\['weights'\] has 2 entries"),
        (bad_token, "cross_entropy", "token id 300, outside this model's vocabulary"),
        (no_weights, "cross_entropy", r"data\[1\]\.loss_fn_inputs lacks 'weights'"),
        (good, "nope", "unknown loss_fn"),
    ]
    for bad, loss_fn, message in cases:
        with pytest.raises(ValueError, match=message):
            forward_backward(
                model, [ForwardItem(adapter, [good, bad], loss_fn, None, False)]
            )
    assert adapter.pending_grad.abs().sum() == 0


def test_the_wall_checks_ids_against_the_vocabulary_the_model_holds():
    """The executor's wall (`check_item` against `model_limits`) is the engine's only one: an id it lets through
    indexes the embeddings and the head even where the model's info claims a larger vocabulary."""
    model = tiny_llama()
    info = BaseModelInfo("tiny", "", "llama", VOCAB + 50, 64, 64, 2, 0)
    limits = model_limits(model, info)
    assert (limits.name, limits.vocab_size, limits.max_context_length) == ("tiny", VOCAB, 64)
    good = make_batch(61, [5])[0]
    check_item([good], "cross_entropy", None, None, limits)
    outside = Datum(good.model_input, {"target_tokens": [1, 2, 3, 4, VOCAB], "weights": [1.0] * 5})
    message = rf"data\[1\]\.loss_fn_inputs\['target_tokens'\] has ids outside \[0, {VOCAB}\)"
    with pytest.raises(BadRequestError, match=message):
        check_item([good, outside], "cross_entropy", None, None, limits)
    with pytest.raises(BadRequestError, match="more than tiny's context of 64"):
        check_item([make_batch(62, [70])[0]], "cross_entropy", None, None, limits)


def test_training_cuts_cross_entropy_by_more_than_half():
    model = tiny_llama()
    adapter = AdapterState.create("run", model, LoraConfig(rank=8, seed=0), device="cpu")
    data = make_batch(70, [16, 12, 20, 9])
    params = AdamParams(learning_rate=1e-2)
    losses = [train_step(model, adapter, data, params).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_checksum_is_the_fp64_sum_of_values_and_squares_and_sees_one_changed_parameter(monkeypatch):
    monkeypatch.setattr("bios.worker.adapter._CHECKSUM_CHUNK", 1000)
    model = tiny_llama()
    adapter = perturbed_adapter(model, "sum", 8, 1)
    assert adapter.params.numel() % 1000 and adapter.params.numel() > 2000  # several chunks, a partial last one
    values = adapter.params.double()
    assert adapter.checksum() == pytest.approx(float(values.sum() + values.square().sum()), rel=1e-12)
    before = adapter.checksum()
    assert adapter.checksum() == before  # deterministic
    adapter.params[-1] += 1e-3
    assert adapter.checksum() != before
