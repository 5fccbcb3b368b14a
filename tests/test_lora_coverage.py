"""`get_info()` says what a run's adapter trains: its LoRA targets grouped over layers, routed experts counted.

On the worker side against the models themselves (tiny-llama, a tiny Qwen3-MoE and DeepSeek-V3); then through a
cluster, from the native SDK and as JSON from the Tinker gateway (which the official SDK still parses).
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from arch_models import build_model

import bios
from bios.models import load_base_model
from bios.types import LoraConfig, LoraTargetGroup
from bios.worker.targets import lora_targets, target_groups

KEY = "tml-test"


def _summary(groups: list[LoraTargetGroup]) -> dict[str, tuple[str, str, int, int]]:
    return {g.pattern: (g.role, g.kind, g.modules, g.experts) for g in groups}


def test_tiny_llama_covers_every_projection_of_every_layer_and_the_head():
    model = load_base_model("bios/tiny-llama").model
    groups = target_groups(model, LoraConfig(rank=4))
    layer = "model.layers.*"
    assert _summary(groups) == {
        **{f"{layer}.self_attn.{p}": ("attn", "linear", 4, 0) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"{layer}.mlp.{p}": ("mlp", "linear", 4, 0) for p in ("gate_proj", "up_proj", "down_proj")},
        "lm_head": ("unembed", "linear", 1, 0),
    }
    assert sum(g.modules for g in groups) == len(lora_targets(model, LoraConfig(rank=4)))
    attention_only = target_groups(model, LoraConfig(rank=4, train_mlp=False, train_unembed=False))
    assert {g.role for g in attention_only} == {"attn"} and len(attention_only) == 4


def test_moe_models_count_their_routed_experts():
    qwen = _summary(target_groups(build_model("qwen3_moe"), LoraConfig(rank=4)))
    assert qwen["model.layers.*.mlp.experts.gate_up_proj"] == ("mlp", "experts", 2, 4)
    assert qwen["model.layers.*.mlp.experts.down_proj"] == ("mlp", "experts", 2, 4)
    assert not any(pattern.endswith("mlp.gate") for pattern in qwen)  # routers are never adapted
    deepseek = _summary(target_groups(build_model("deepseek_v3"), LoraConfig(rank=4)))
    # Layer 0 is dense (first_k_dense_replace=1): its MLP and layer 1's shared experts are plain linears.
    assert deepseek["model.layers.*.mlp.gate_proj"] == ("mlp", "linear", 1, 0)
    assert deepseek["model.layers.*.mlp.shared_experts.gate_proj"] == ("mlp", "linear", 1, 0)
    assert deepseek["model.layers.*.mlp.experts.gate_up_proj"] == ("mlp", "experts", 1, 4)
    assert deepseek["model.layers.*.self_attn.kv_a_proj_with_mqa"] == ("attn", "linear", 2, 0)


@pytest.mark.parametrize("base_model", ["bios/tiny-llama", "test/qwen3_moe"])
def test_get_info_reports_the_targets_natively_and_through_the_gateway(cluster, base_model):
    service = bios.ServiceClient(address=cluster.address)
    try:
        tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0, train_unembed=False)
        info = tc.get_info()
    finally:
        service.close()
    assert info.lora_targets and all(g.role != "unembed" for g in info.lora_targets)
    experts = [g for g in info.lora_targets if g.kind == "experts"]
    assert [g.experts for g in experts] == ([4, 4] if base_model == "test/qwen3_moe" else [])

    with tinker.ServiceClient(base_url=cluster.http_url, api_key=KEY) as tinker_service:
        tinker_tc = tinker_service.create_lora_training_client(base_model=base_model, rank=4, seed=0,
                                                               train_unembed=False).result()
        # The official SDK parses the get_info reply (at creation) with its extra field.
        assert tinker_tc.get_info().lora_rank == 4
        reply = httpx.post(f"{cluster.http_url}/api/v1/get_info", headers={"X-API-Key": KEY}, timeout=30,
                           json={"model_id": tinker_tc.model_id, "type": "get_info"})
    reply.raise_for_status()
    assert [LoraTargetGroup(**g) for g in reply.json()["lora_targets"]] == info.lora_targets
