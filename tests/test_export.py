"""Export to Hugging Face formats: a PEFT adapter directory and a merged model, both matching Bios's logprobs."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from bios.export import write_merged_model, write_peft_adapter
from bios.models import load_base_model
from bios.types import Datum, LoraConfig, ModelInput
from bios.worker.adapter import AdapterState
from bios.worker.checkpoint import export_state
from bios.worker.engine import ForwardItem, forward_backward
from bios.worker.lora import attach_lora

TOKENS = list(b"Bios exports standard PEFT adapters.")


@pytest.fixture(autouse=True)
def fp32_base(monkeypatch):
    """The exports are compared with fp32 Hugging Face models to 1e-4: Bios's side must hold its base in fp32
    too, whatever the caller's BIOS_BASE_DTYPE (bf16 would be the default on an avx512_bf16 CPU)."""
    monkeypatch.setenv("BIOS_BASE_DTYPE", "float32")


def trained_like_state(base_model: str, **config):
    """A checkpoint whose A and B are both non-zero (as after training), from a Bios-loaded base model."""
    loaded = load_base_model(base_model)
    attach_lora(loaded.model)
    adapter = AdapterState.create("run", loaded.model, LoraConfig(rank=4, seed=3, **config), device="cpu")
    generator = torch.Generator().manual_seed(0)
    adapter.load_state_dict(
        {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in adapter.state_dict().items()}
    )
    inputs = {"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)}
    datum = Datum(ModelInput.from_ints(TOKENS[:-1]), inputs)
    output = forward_backward(loaded.model, [ForwardItem(adapter, [datum], "cross_entropy", forward_only=True)])[0]
    bios_logprobs = output.loss_fn_outputs[0]["logprobs"].to_torch()
    state = export_state(adapter, base_model=base_model, base_info=loaded.info, with_optimizer=False)
    return state, loaded.info, bios_logprobs


def hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(TOKENS[1:])[:, None]).squeeze(-1)


@pytest.mark.parametrize("base_model", ["bios/tiny-llama", "bios/tiny-qwen3"])
def test_peft_adapter_loads_with_peft_and_matches_bios(tmp_path, base_model):
    state, info, bios_logprobs = trained_like_state(base_model)
    out = write_peft_adapter(state, tmp_path / "adapter", base_model_dir=info.local_dir)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == state.metadata["lora_alpha"] and config["lora_dropout"] == 0
    assert config["base_model_name_or_path"] == info.local_dir and config["task_type"] == "CAUSAL_LM"
    base = AutoModelForCausalLM.from_pretrained(info.local_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    lora_layers = {name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert {name.removeprefix("base_model.model.") for name in lora_layers} == set(state.metadata["target_modules"])
    peft_logprobs = hf_logprobs(model)
    torch.testing.assert_close(peft_logprobs, bios_logprobs, rtol=0, atol=1e-4)
    plain = hf_logprobs(AutoModelForCausalLM.from_pretrained(info.local_dir, dtype=torch.float32))
    assert (plain - bios_logprobs).abs().max() > 1e-3  # the adapter matters, so the comparison above means something


@pytest.mark.parametrize("base_model", ["bios/tiny-llama", "bios/tiny-qwen3"])
def test_merged_model_loads_with_transformers_and_matches_bios(tmp_path, base_model):
    state, _, bios_logprobs = trained_like_state(base_model)
    out = write_merged_model(state, tmp_path / "merged", base_model=base_model)
    assert (out / "tokenizer.json").is_file() and any(out.glob("*.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(hf_logprobs(merged), bios_logprobs, rtol=0, atol=1e-4)


def test_merging_keeps_tied_input_embeddings_when_only_the_body_is_trained(tmp_path):
    state, info, bios_logprobs = trained_like_state("bios/tiny-qwen3", train_unembed=False)
    out = write_merged_model(state, tmp_path / "merged", base_model="bios/tiny-qwen3")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    torch.testing.assert_close(hf_logprobs(merged), bios_logprobs, rtol=0, atol=1e-4)


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    state, _, _ = trained_like_state("bios/tiny-llama")
    with pytest.raises(ValueError, match="llama"):
        write_merged_model(state, tmp_path / "merged", base_model="bios/tiny-qwen3")
