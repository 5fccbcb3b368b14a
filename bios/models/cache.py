"""Where model directories live on disk, and how one appears there atomically.

Several workers may start at once on a fresh machine and all ask for the same model. Each builds it in a
private staging directory next to the target and renames it into place: a rename within one filesystem is
atomic, so a reader sees either no directory or a complete one, and the losers of the race throw their copy away.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bios.cache_dir import cache_dir


def models_dir() -> Path:
    return cache_dir() / "models"


def model_dir_for(name: str) -> Path:
    """The cache directory of a named model: `bios/tiny-llama` -> `<cache>/models/bios--tiny-llama`."""
    return models_dir() / name.replace("/", "--")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextmanager
def staged_model_dir(final: Path) -> Iterator[Path]:
    """Yield an empty staging directory; on a clean exit, publish it as `final` unless another process won.

    The staging directory sits beside `final` (same filesystem, so the rename is atomic) and is removed
    whatever happens, so a failed build leaves nothing behind.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-", dir=final.parent))
    try:
        yield stage
        _publish(stage, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, final: Path) -> None:
    # mkdtemp makes the directory 0700 and safetensors writes 0600; the cache is meant to be shared.
    stage.chmod(0o755)
    for path in stage.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        os.rename(stage, final)
    except OSError:
        if is_model_dir(final):
            return  # another process published the same model first; its copy is as good as ours
        raise OSError(
            f"cannot publish model directory {final}: it exists but holds no config.json; "
            f"delete it and retry"
        ) from None


def save_model_files(model: Any, out: Path, config: Any = None) -> None:
    """Write a causal LM as config, generation config and safetensors weights (`config` defaults to the model's).

    Not `save_pretrained`: in a process that belongs to a torch.distributed group with a rank other than 0 (a
    worker in a generation of several) it silently writes no config and no weights. Tied tensors are stored
    once, under their first name in state-dict order (the input embedding, as `save_pretrained` does), so the
    file is the same in every process; `from_pretrained` re-ties them.
    """
    import safetensors.torch

    config = model.config if config is None else config
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tensors, stored = {}, set()
    for name, tensor in model.state_dict().items():
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if storage not in stored:
            stored.add(storage)
            tensors[name] = tensor.detach().contiguous()
    safetensors.torch.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
