"""Checkpoints on the worker: AdapterState <-> CheckpointState round trips, exact resume, clear mismatch errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from bios.exceptions import BadRequestError
from bios.messages import CheckpointState
from bios.models import load_base_model
from bios.types import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state, load_into, restore_adapter, sampler_adapter
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
from bios.worker.lora import attach_lora
from bios.worker.sampling import SampleItem, generate

BASE = "bios/tiny-llama"
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Bios trains LoRA adapters.", "Hello, world!"]


@pytest.fixture(scope="module")
def base():
    loaded = load_base_model(BASE)
    attach_lora(loaded.model)
    return loaded


def batch(step: int) -> list[Datum]:
    """A different mini-batch each step, so resuming at the wrong step or data would show."""
    data = []
    for text in TEXTS[step % 2 :]:
        tokens = list(text.encode())
        inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
        data.append(Datum(ModelInput.from_ints(tokens[:-1]), inputs))
    return data


def train(model, adapter: AdapterState, steps: range) -> None:
    for step in steps:
        forward_backward(model, [ForwardItem(adapter, batch(step), "cross_entropy")])
        commit_gradients(adapter)
        optim_step(adapter, ADAM)


def new_adapter(base, model_id="run", rank=8, **config) -> AdapterState:
    return AdapterState.create(model_id, base.model, LoraConfig(rank=rank, seed=7, **config), device="cpu")


def through_disk(state: CheckpointState, tmp_path) -> CheckpointState:
    """What the coordinator's store does: safetensors files plus JSON metadata."""
    save_file(state.adapter, str(tmp_path / "adapter.safetensors"))
    save_file(state.optimizer, str(tmp_path / "optimizer.safetensors"))
    (tmp_path / "metadata.json").write_text(json.dumps(state.metadata))
    return CheckpointState(
        adapter=load_file(str(tmp_path / "adapter.safetensors")),
        optimizer=load_file(str(tmp_path / "optimizer.safetensors")),
        metadata=json.loads((tmp_path / "metadata.json").read_text()),
    )


def test_export_restore_round_trip_keeps_params_moments_and_step(base, tmp_path):
    adapter = new_adapter(base, train_unembed=False)
    train(base.model, adapter, range(3))
    state = export_state(adapter, base_model=BASE, base_info=base.info, with_optimizer=True)
    assert state.metadata["rank"] == 8 and state.metadata["step"] == 3 and state.metadata["train_unembed"] is False
    expected_keys = {
        f"base_model.model.{target.module_name}.lora_{matrix}.weight" for target in adapter.targets for matrix in "AB"
    }
    assert set(state.adapter) == expected_keys
    restored = restore_adapter("copy", base.model, through_disk(state, tmp_path), with_optimizer=True, device="cpu")
    assert restored.config == adapter.config and restored.scale == adapter.scale and restored.seed == adapter.seed
    assert [t.module_name for t in restored.targets] == [t.module_name for t in adapter.targets]
    for name in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(restored, name), getattr(adapter, name)), name
    assert restored.step == 3 and restored.grad_views_intact()


def test_restore_without_optimizer_resets_adam(base):
    adapter = new_adapter(base)
    train(base.model, adapter, range(2))
    state = export_state(adapter, base_model=BASE, base_info=base.info, with_optimizer=True)
    restored = restore_adapter("copy", base.model, state, with_optimizer=False, device="cpu")
    assert torch.equal(restored.params, adapter.params)
    assert not restored.exp_avg.any() and not restored.exp_avg_sq.any() and restored.step == 0
    without = export_state(adapter, base_model=BASE, base_info=base.info, with_optimizer=False)
    assert without.optimizer is None


def test_five_steps_save_restore_five_more_equal_ten_straight_steps_bitwise(base, tmp_path):
    straight = new_adapter(base)
    train(base.model, straight, range(10))

    first = new_adapter(base)
    train(base.model, first, range(5))
    state = through_disk(export_state(first, base_model=BASE, base_info=base.info, with_optimizer=True), tmp_path)
    resumed = restore_adapter("resumed", base.model, state, with_optimizer=True, device="cpu")
    train(base.model, resumed, range(5, 10))

    assert resumed.step == straight.step == 10
    for name in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(resumed, name), getattr(straight, name)), name

    cold = restore_adapter("cold", base.model, state, with_optimizer=False, device="cpu")
    train(base.model, cold, range(5, 10))
    assert not torch.equal(cold.params, straight.params)  # a cold Adam state is a different run


def test_load_into_a_live_run_replaces_weights_and_drops_pending_gradients(base):
    source = new_adapter(base, "source")
    train(base.model, source, range(3))
    state = export_state(source, base_model=BASE, base_info=base.info, with_optimizer=True)
    live = new_adapter(base, "live")
    train(base.model, live, range(1))
    forward_backward(base.model, [ForwardItem(live, batch(0), "cross_entropy")])
    commit_gradients(live)
    assert live.grad.any()

    load_into(live, state, with_optimizer=True)
    assert torch.equal(live.params, source.params) and torch.equal(live.exp_avg, source.exp_avg) and live.step == 3
    assert not live.grad.any() and not live.pending_grad.any()

    load_into(live, state, with_optimizer=False)
    assert torch.equal(live.params, source.params) and not live.exp_avg.any() and live.step == 0


def test_sampler_adapter_holds_params_only_and_samples_like_the_trained_adapter(base):
    adapter = new_adapter(base)
    train(base.model, adapter, range(3))
    state = export_state(adapter, base_model=BASE, base_info=base.info, with_optimizer=False)
    sampler = sampler_adapter("sampler", base.model, state, device="cpu")
    assert torch.equal(sampler.params, adapter.params) and sampler.grad.numel() == 0 and not sampler.trainable
    params = SamplingParams(max_tokens=12, seed=3)
    prompt = list(b"The quick")

    def sample(which):
        return generate(base.model, base.tokenizer, [SampleItem(which, prompt, 2, params)], eos_token_id=None)

    assert sample(sampler) == sample(adapter)
    with pytest.raises(ValueError, match="params-only"):
        export_state(sampler, base_model=BASE, base_info=base.info, with_optimizer=True)


# ------------------------------------------------------------------------------------------ mismatches


def edited(state: CheckpointState, *, adapter=None, optimizer=..., **metadata) -> CheckpointState:
    return CheckpointState(
        adapter=state.adapter if adapter is None else adapter,
        optimizer=state.optimizer if optimizer is ... else optimizer,
        metadata={**state.metadata, **metadata},
    )


@pytest.fixture(scope="module")
def saved(base) -> CheckpointState:
    adapter = new_adapter(base)
    train(base.model, adapter, range(1))
    return export_state(adapter, base_model=BASE, base_info=base.info, with_optimizer=True)


def first_key(state):
    return next(iter(state.adapter))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("other_arch", "trained on a qwen3 model"),
        ("missing_key", "missing keys"),
        ("wrong_shape", "has shape"),
        ("unknown_layer", "targets layers this base model does not have"),
        ("no_optimizer", "holds no optimizer state"),
        ("bad_moments", "optimizer exp_avg has shape"),
        ("future_format", "not one this worker reads"),
    ],
)
def test_checkpoints_that_do_not_fit_raise_bad_request(base, saved, case, message):
    key = first_key(saved)
    state = {
        "other_arch": lambda: edited(saved, arch="qwen3"),
        "missing_key": lambda: edited(saved, adapter={k: v for k, v in saved.adapter.items() if k != key}),
        "wrong_shape": lambda: edited(saved, adapter={**saved.adapter, key: np.zeros((3, 3), np.float32)}),
        "unknown_layer": lambda: edited(
            saved, target_modules=[*saved.metadata["target_modules"], "model.layers.9.mlp.up_proj"]
        ),
        "no_optimizer": lambda: edited(saved, optimizer=None),
        "bad_moments": lambda: edited(saved, optimizer={**saved.optimizer, "exp_avg": np.zeros(5, np.float32)}),
        "future_format": lambda: edited(saved, format_version=99),
    }[case]()
    with pytest.raises(BadRequestError, match=message) as raised:
        restore_adapter("x", base.model, state, with_optimizer=True, device="cpu")
    assert raised.value.field == "path"


def test_failed_load_into_changes_nothing(base, saved):
    live = new_adapter(base, "live")
    train(base.model, live, range(2))
    before = {name: getattr(live, name).clone() for name in ("params", "exp_avg", "exp_avg_sq")}
    key = first_key(saved)
    broken = [
        edited(saved, adapter={**saved.adapter, key: np.zeros((3, 3), np.float32)}),
        edited(saved, optimizer={**saved.optimizer, "exp_avg_sq": np.zeros(5, np.float32)}),
    ]
    for state in broken:
        with pytest.raises(BadRequestError):
            load_into(live, state, with_optimizer=True)
    other_rank = export_state(new_adapter(base, rank=4), base_model=BASE, base_info=base.info, with_optimizer=True)
    with pytest.raises(BadRequestError, match="rank 4"):
        load_into(live, other_rank, with_optimizer=False)
    for name, value in before.items():
        assert torch.equal(getattr(live, name), value), name
    assert live.step == 2


def test_a_checkpoint_does_not_restore_onto_another_architecture(saved):
    qwen = load_base_model("bios/tiny-qwen3")
    attach_lora(qwen.model)
    with pytest.raises(BadRequestError, match="llama") as raised:
        sampler_adapter("x", qwen.model, saved, device="cpu")
    assert raised.value.field == "path"
