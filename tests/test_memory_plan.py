"""Memory planning: the estimate against the measured peak RSS of fresh worker-like processes, the plan order,
the error for a model that fits nowhere, and activation checkpointing changing no numbers.

Run as a script (`python tests/test_memory_plan.py '<spec json>'`) this module is the measured process: it
loads or builds a model, runs one real forward_backward + optim_step through the engine, and prints its peak
RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from bios.exceptions import BadRequestError
from bios.models import resolve_model_dir
from bios.types import AdamParams, Datum, LoraConfig, ModelInput
from bios.worker.adapter import AdapterState
from bios.worker.engine import ForwardItem, commit_gradients, forward_backward, optim_step
from bios.worker.lora import attach_lora
from bios.models.memory_plan import GiB, MiB, ModelShape, choose_plan, estimate, model_shape
from bios.worker.memory_plan import enable_activation_checkpointing, peak_rss, runtime_footprint

RANK = 16
# A 50M-parameter Llama: big enough that weights, activations and logits all show in the RSS.
MID_LLAMA = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
)
# Llama-3.2-1B's shape.
LLAMA_1B = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------------------------------------- measured


def measure_peak(spec: dict[str, Any]) -> dict[str, int]:
    """One forward_backward + optim_step as a worker runs them; the process's peak RSS in bytes, and its
    runtime footprint before any model, measured as a worker measures it when it registers."""
    torch.set_num_threads(1)
    runtime = runtime_footprint(torch.device("cpu"))
    dtype = getattr(torch, spec["dtype"])
    if "builtin" in spec:
        from bios.models import load_base_model

        model = load_base_model(spec["builtin"], dtype=dtype).model
    else:
        model = LlamaForCausalLM(LlamaConfig(**spec["config"])).to(dtype).eval()
    attach_lora(model)
    if spec["checkpointing"]:
        enable_activation_checkpointing(model)
    adapter = AdapterState.create("measured", model, LoraConfig(rank=RANK, seed=0), device="cpu")
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    data = []
    for length in spec["lengths"]:
        tokens = torch.randint(0, vocab, (length + 1,), generator=generator)
        inputs = {"target_tokens": tokens[1:], "weights": torch.ones(length)}
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    forward_backward(model, [ForwardItem(adapter, data, "cross_entropy")])
    commit_gradients(adapter)
    optim_step(adapter, AdamParams(learning_rate=1e-4))
    return {"peak": peak_rss(), "runtime": runtime}


def measured_peak(spec: dict[str, Any]) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


RAGGED = [256, 250, 240, 230]  # padded, so attention runs with a mask
CASES = {
    "tiny-llama": ({"builtin": "bios/tiny-llama", "lengths": [128] * 8}, {}),
    "mid-llama": ({"config": MID_LLAMA, "lengths": RAGGED}, {}),
    "mid-llama checkpointed": ({"config": MID_LLAMA, "lengths": RAGGED}, {"activation_checkpointing": True}),
    "mid-llama bf16": ({"config": MID_LLAMA, "lengths": RAGGED}, {"dtype": "bfloat16"}),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_estimate_is_within_25_percent_of_measured_peak_rss(case):
    spec, options = CASES[case]
    spec = {**spec, "dtype": options.get("dtype", "float32"),
            "checkpointing": options.get("activation_checkpointing", False)}
    if "builtin" in spec:
        config = AutoConfig.from_pretrained(resolve_model_dir(spec["builtin"]), local_files_only=True)
    else:
        config = LlamaConfig(**spec["config"])
    measured = measured_peak(spec)
    predicted = estimate(config, lora_rank=RANK, batch_tokens=len(spec["lengths"]) * max(spec["lengths"]),
                         overhead_bytes=measured["runtime"], **options)
    ratio = predicted.total / measured["peak"]
    assert 0.75 <= ratio <= 1.25, f"{case}: estimated {predicted.describe()}, measured {measured['peak'] / MiB:.0f} MiB"


# ---------------------------------------------------------------------------------------------- plans


def test_each_technique_lowers_the_estimate():
    base = dict(lora_rank=32, batch_tokens=4096)
    plain = estimate(LLAMA_1B, **base)
    checkpointed = estimate(LLAMA_1B, **base, activation_checkpointing=True)
    bf16 = estimate(LLAMA_1B, **base, dtype="bfloat16")
    tp2 = estimate(LLAMA_1B, **base, tp=2)
    tp4 = estimate(LLAMA_1B, **base, tp=4)
    assert checkpointed.activations < plain.activations / 4
    assert bf16.weights == plain.weights // 2
    assert tp4.weights < tp2.weights < plain.weights
    assert tp4.activations < tp2.activations < plain.activations
    # Replicated parts do not shrink: the embeddings/head alone stay, and so do the logits.
    embeddings = LLAMA_1B.vocab_size * LLAMA_1B.hidden_size * 4
    assert tp2.weights > embeddings and tp2.logits == plain.logits
    stock = estimate(LLAMA_1B, **base, fused_kernels=False)
    assert stock.logits > 10 * plain.logits
    # A worker can report the shape instead of the coordinator reading config.json.
    assert estimate(ModelShape.from_config(LLAMA_1B), **base, tp=2) == tp2


def test_choose_plan_prefers_replication_then_checkpointing_then_bf16_then_tensor_parallelism():
    def plan_for(budget: float, workers: int = 4, **options):
        plan = choose_plan(LLAMA_1B, int(budget * GiB), lora_rank=32, batch_tokens=2048, workers=workers, **options)
        return plan.name, plan.tp, plan.replicas

    assert plan_for(24) == ("replicate", 1, 4)
    assert plan_for(9) == ("replicate+checkpointing", 1, 4)
    assert plan_for(6.5) == ("replicate+bf16+checkpointing", 1, 4)
    assert plan_for(4.5) == ("tp2+bf16+checkpointing", 2, 2)
    assert plan_for(3.5) == ("tp4+bf16+checkpointing", 4, 1)
    # Without bf16 the same budget needs more workers per replica, and the plan stays fp32 (exact).
    assert plan_for(6.5, allow_bf16=False) == ("tp2+checkpointing", 2, 2)


def test_choose_plan_widens_passes_while_they_fit():
    def passes(budget_gib: float) -> tuple[str, int]:
        plan = choose_plan(LLAMA_1B, int(budget_gib * GiB), lora_rank=32, batch_tokens=2048, workers=1,
                           max_batch_tokens=16384)
        assert plan.estimate.total <= 0.9 * plan.budget_bytes
        assert plan.estimate == estimate(LLAMA_1B, lora_rank=32, batch_tokens=plan.batch_tokens, dtype=plan.dtype,
                                         activation_checkpointing=plan.activation_checkpointing)
        return plan.name, plan.batch_tokens

    assert passes(80) == ("replicate", 16384)  # a large GPU: one pass for a whole 16k-token batch
    assert passes(24) == ("replicate", 4096)  # one doubling fits, the next does not
    assert passes(9) == ("replicate+checkpointing", 2048)  # only the smallest pass fits
    # without max_batch_tokens the plan keeps the budget it was asked for
    assert choose_plan(LLAMA_1B, 80 * GiB, lora_rank=32, batch_tokens=2048, workers=1).batch_tokens == 2048


def test_choose_plan_fits_the_budget_it_reports():
    plan = choose_plan(LLAMA_1B, 5 * GiB, lora_rank=32, batch_tokens=2048, workers=2)
    assert plan.estimate.total <= 0.9 * 5 * GiB
    assert plan.estimate == estimate(
        LLAMA_1B, lora_rank=32, batch_tokens=2048, dtype=plan.dtype,
        activation_checkpointing=plan.activation_checkpointing, tp=plan.tp,
    )
    assert plan.describe().endswith("per worker of 5.00 GiB")


def test_a_model_that_fits_nowhere_gets_a_clear_error():
    with pytest.raises(BadRequestError) as caught:
        choose_plan(LLAMA_1B, 2 * GiB, lora_rank=32, batch_tokens=2048, workers=4, model_name="llama-1b")
    message = str(caught.value)
    assert caught.value.field == "base_model"
    assert "model llama-1b needs ~2.69 GiB" in message
    assert "even with TP=4, bf16 weights and activation checkpointing" in message
    assert "workers have 2.00 GiB" in message
    with pytest.raises(BadRequestError, match="TP=2 needs 2 workers, the pool has 1"):
        choose_plan(LLAMA_1B, 2 * GiB, lora_rank=32, batch_tokens=2048, workers=1)


def test_tensor_parallel_sizes_must_divide_heads_and_intermediate():
    odd = LlamaConfig(**{**MID_LLAMA, "num_key_value_heads": 2})
    assert ModelShape.from_config(odd).tensor_parallel_problem(2) is None
    assert "2 key/value heads do not split evenly over 4" in ModelShape.from_config(odd).tensor_parallel_problem(4)
    with pytest.raises(BadRequestError, match="no TP=4: its 2 key/value heads"):
        choose_plan(odd, GiB // 4, lora_rank=8, batch_tokens=1024, workers=4)
    with pytest.raises(ValueError, match="do not split evenly"):
        estimate(odd, lora_rank=8, batch_tokens=1024, tp=4)


@pytest.mark.parametrize("name", ["bios/tiny-llama", "bios/tiny-qwen3"])
def test_the_coordinator_reads_the_same_shape_from_config_json_without_transformers(name, tmp_path):
    expected = ModelShape.from_config(AutoConfig.from_pretrained(resolve_model_dir(name), local_files_only=True))
    assert model_shape(name) == expected
    (tmp_path / "config.json").write_text((resolve_model_dir(name) / "config.json").read_text())
    assert model_shape(str(tmp_path)) == expected
    assert model_shape("no/such-model") is None


def test_configs_without_decoder_dimensions_are_refused_by_name():
    with pytest.raises(BadRequestError, match="mystery model: its config has no hidden_size, num_hidden_layers"):
        estimate(ModelShape.from_dict({"model_type": "mystery", "vocab_size": 100}), lora_rank=8, batch_tokens=1024)


# ---------------------------------------------------------------------------------------------- checkpointing


def test_activation_checkpointing_changes_no_numbers():
    """Same losses and gradients with and without checkpointing, also with two adapters in one batch (the
    recomputation must use the LoRA segments of the forward, which the engine has left by then)."""
    config = LlamaConfig(**{**MID_LLAMA, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    generator = torch.Generator().manual_seed(3)
    data = []
    for length in (9, 6, 4):
        tokens = torch.randint(0, 300, (length + 1,), generator=generator)
        inputs = {"target_tokens": tokens[1:], "weights": torch.ones(length)}
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        attach_lora(model)
        if checkpointing:
            enable_activation_checkpointing(model)
        adapters = []
        for seed in (1, 2):
            adapter = AdapterState.create(f"a{seed}", model, LoraConfig(rank=4, seed=seed), device="cpu")
            with torch.no_grad():
                noise = torch.randn(adapter.params.shape, generator=torch.Generator().manual_seed(seed))
                adapter.params.add_(0.01 * noise)
            adapters.append(adapter)
        outputs = forward_backward(model, [ForwardItem(adapters[0], data[:2], "cross_entropy"),
                                           ForwardItem(adapters[1], data[2:], "cross_entropy")])
        results.append(([o.metrics["loss:sum"] for o in outputs], [a.pending_grad.clone() for a in adapters]))
    (plain_losses, plain_grads), (checkpointed_losses, checkpointed_grads) = results
    assert checkpointed_losses == plain_losses
    for plain, checkpointed in zip(plain_grads, checkpointed_grads):
        assert plain.abs().max() > 0
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)


if __name__ == "__main__":
    print(json.dumps(measure_peak(json.loads(sys.argv[1]))))
