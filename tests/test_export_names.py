"""Exported adapters name their base model by hub id when it has one, as vLLM and PEFT users expect; the local
directory stays in bios-export.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bios.export import EXPORT_INFO, hub_model_id, write_peft_adapter
from bios.messages import CheckpointState
from bios.models import set_model_map

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def name_map(tmp_path):
    set_model_map({"Qwen/Qwen3-8B-Base": str(tmp_path), "my-model": str(tmp_path), "a/b/c": str(tmp_path)})
    yield
    set_model_map(None)


def test_hub_ids_of_pulled_mapped_and_other_names(name_map, tmp_path):
    assert hub_model_id(SMOLLM2) == SMOLLM2
    assert hub_model_id("smollm2") == SMOLLM2  # an alias names the model it stands for
    assert hub_model_id("Qwen/Qwen3-8B-Base") == "Qwen/Qwen3-8B-Base"
    assert hub_model_id("bios/tiny-llama") is None  # a built-in: not on the hub
    assert hub_model_id("my-model") is None and hub_model_id("a/b/c") is None  # mapped, but no org/name
    assert hub_model_id(str(tmp_path)) is None
    assert hub_model_id("Org/Unmapped") is None  # not a name this host resolves


def _state(base_model: str) -> CheckpointState:
    metadata = {"format": "bios-lora", "arch": "llama", "rank": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                "base_model": base_model}
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 8), np.float32)}
    return CheckpointState(adapter=adapter, optimizer=None, metadata=metadata)


@pytest.mark.parametrize("base_model, named", [
    ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B-Base"),
    ("smollm2", SMOLLM2),
    ("bios/tiny-llama", None),
])
def test_an_export_names_the_hub_id_and_keeps_the_directory(name_map, tmp_path, base_model, named):
    local = str(tmp_path / "model-dir")
    out = write_peft_adapter(_state(base_model), tmp_path / "adapter", base_model_dir=local, base_model=base_model)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == (named or local)
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info == {"base_model": base_model, "hub_model_id": named, "base_model_dir": local}
