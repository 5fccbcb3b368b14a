"""Memory plans for architectures beyond Llama: GPT-2 field names, fused layouts, routed experts (MoE) counted
per expert and per active expert, and exact parameter counts read from the safetensors headers."""

from __future__ import annotations

import dataclasses
import json

import pytest
from arch_models import CONFIGS, MOE, build_model
from transformers import AutoConfig

from bios.models.cache import save_model_files
from bios.models.memory_plan import GiB, ModelShape, _lora_elements, _weight_elements, choose_plan, estimate
from bios.models.model_shape import model_shape, stored_parameters


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_architecture_gets_a_plan(arch):
    shape = ModelShape.from_config(build_model(arch).config)
    plan = choose_plan(shape, 4 * GiB, lora_rank=8, batch_tokens=1024, workers=2)
    assert plan.tp == 1 and plan.estimate.total < 4 * GiB


@pytest.mark.parametrize("arch", ["phi3", "gpt2", "falcon", "gpt_oss", "deepseek_v3"])
def test_layouts_tensor_parallelism_cannot_split_say_why(arch):
    shape = ModelShape.from_config(build_model(arch).config)
    problem = shape.tensor_parallel_problem(2)
    assert problem and ("no tensor-parallel split" in problem)
    assert shape.tensor_parallel_problem(1) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_models_split_their_routed_experts_over_the_group(arch):
    """Expert parallelism: each of two workers holds half of every layer's experts and of their adapters."""
    shape = ModelShape.from_config(build_model(arch).config)
    assert shape.tensor_parallel_problem(2) is None
    odd = dataclasses.replace(shape, num_experts=3)
    assert "3 routed experts per layer do not split evenly over 2" in odd.tensor_parallel_problem(2)
    h, width = shape.hidden_size, shape.expert_intermediate_size
    expert_weights = shape.moe_layers * shape.num_experts * 3 * h * width
    assert _weight_elements(shape, 1) - _weight_elements(shape, 2) >= expert_weights // 2
    assert _lora_elements(shape, 8, 1) - _lora_elements(shape, 8, 2) >= shape.moe_layers * shape.num_experts * 8 * (
        3 * h + 3 * width) // 2


@pytest.mark.parametrize("arch", MOE)
def test_moe_weights_and_adapters_count_every_expert(arch):
    model = build_model(arch)
    shape = ModelShape.from_config(model.config)
    assert shape.num_experts == 4 and shape.experts_per_token == 2 and shape.moe_layers >= 1
    actual = sum(p.numel() for p in model.parameters())
    assert abs(_weight_elements(shape, 1) - actual) < 0.1 * actual  # biases and norms aside, the same count
    experts = [m for m in model.modules() if hasattr(m, "is_transposed")]
    per_expert = sum(p[0].numel() for m in experts for name, p in m.named_parameters() if not name.endswith("bias"))
    assert _lora_elements(shape, 1, 1) > per_expert // shape.hidden_size  # experts' A/B are in the adapter count


def test_moe_activations_grow_with_active_experts_not_all_experts():
    model_type, fields = CONFIGS["qwen3_moe"]
    base = ModelShape.from_config(AutoConfig.for_model(model_type, **fields))
    more_experts = ModelShape.from_config(AutoConfig.for_model(model_type, **{**fields, "num_experts": 64}))
    more_active = ModelShape.from_config(AutoConfig.for_model(model_type, **{**fields, "num_experts_per_tok": 4}))
    act = {name: estimate(shape, lora_rank=8, batch_tokens=4096).activations
           for name, shape in (("base", base), ("experts", more_experts), ("active", more_active))}
    assert act["experts"] == act["base"] < act["active"]


@pytest.mark.parametrize("arch", ["gpt2", "qwen3_moe", "deepseek_v3"])
def test_a_model_directory_is_planned_with_its_stored_parameter_count(arch, tmp_path, monkeypatch):
    model = build_model(arch)
    save_model_files(model, tmp_path)
    stored = stored_parameters(tmp_path)
    tensors = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)): t.numel()
               for t in model.state_dict().values()}
    assert stored == sum(tensors.values())  # tied weights stored once and counted once; persistent buffers too
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps({"test/model": str(tmp_path)}))
    shape = model_shape("test/model")
    assert shape.stored_parameters == stored
    assert estimate(shape, lora_rank=8, batch_tokens=1024).weights == 4 * stored
