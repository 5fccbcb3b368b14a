#!/usr/bin/env python3
"""bios-fetch-models: download the Hugging Face models that BIOS_MODEL_MAP maps to directories into them.

Each entry `"org/name": "/models/DIR"` whose DIR holds no config.json yet is downloaded from the Hub repository
`org/name` (HF_TOKEN for gated ones). Entries mapped to another name, and directories that already hold a model,
are left alone: weights copied in by hand, or published under another name than the one clients use, need only
their directory filled before this runs. The map is read by Bios's own reader, so what this accepts the workers do.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from bios.models.registry import model_map

# The same weights again in formats transformers does not load here (Meta's originals, GGUF, ONNX, TF, Flax).
OTHER_FORMATS = ["original/*", "*.pth", "*.gguf", "*.onnx", "onnx/*", "*.h5", "*.msgpack", "*.ot", "*.tflite"]
# Pickled PyTorch weights: a second copy where the repository has safetensors, the only copy where it has not.
PICKLED = ["*.bin", "*.pt"]


def fetch(name: str, directory: Path) -> None:
    from huggingface_hub import list_repo_files, snapshot_download

    has_safetensors = any(f.endswith(".safetensors") for f in list_repo_files(name))
    ignore = OTHER_FORMATS + (PICKLED if has_safetensors else [])
    # A hidden sibling renamed into place when complete: a worker starting meanwhile finds no model rather than
    # half of one, and a download that was cut off resumes there on the next run.
    stage = directory.with_name(f".{directory.name}.partial")
    stage.parent.mkdir(parents=True, exist_ok=True)
    snapshot_download(name, local_dir=stage, ignore_patterns=ignore)
    shutil.rmtree(stage / ".cache", ignore_errors=True)  # huggingface_hub's resume bookkeeping
    stage.rename(directory)


def main() -> int:
    try:
        mapping = model_map()
    except ValueError as exc:
        print(f"bios-fetch-models: {exc}", file=sys.stderr)
        return 2
    if not mapping:
        print("bios-fetch-models: BIOS_MODEL_MAP is unset or maps nothing", file=sys.stderr)
        return 2
    failed = []
    for name, target in mapping.items():
        directory = Path(target)
        if not directory.is_absolute():
            print(f"{name}: mapped to {target!r}, not a directory: nothing to download", flush=True)
        elif (directory / "config.json").is_file():
            print(f"{name}: {directory} holds a model already", flush=True)
        else:
            print(f"{name}: downloading into {directory}", flush=True)
            try:
                fetch(name, directory)
            except Exception as exc:  # one missing or gated repository should not stop the others
                print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                failed.append(name)
    if failed:
        print(f"bios-fetch-models: not downloaded: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
