"""Where checkpoint tensors live: a small store interface and its directory implementation.

Files are safetensors (adapter, optimizer) plus `metadata.json`, written atomically (a temp directory renamed
into place). The SQLite index in `Store` says which checkpoints exist; this only holds the bytes, so an object
store can replace it later.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from safetensors.numpy import load_file, save_file

from bios.checkpoint_path import CheckpointPath
from bios.messages import CheckpointState


class CheckpointStore(Protocol):
    def put(self, path: CheckpointPath, state: CheckpointState) -> int: ...
    def get(self, path: CheckpointPath) -> CheckpointState: ...
    def delete(self, path: CheckpointPath) -> None: ...


class DirectoryCheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _dir(self, path: CheckpointPath) -> Path:
        return self.root / path.run_id / path.kind / path.name

    def put(self, path: CheckpointPath, state: CheckpointState) -> int:
        """Write all files; returns their total size in bytes."""
        final = self._dir(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        tmp.mkdir()
        save_file({k: _contiguous(v) for k, v in state.adapter.items()}, str(tmp / "adapter.safetensors"))
        if state.optimizer is not None:
            save_file({k: _contiguous(v) for k, v in state.optimizer.items()}, str(tmp / "optimizer.safetensors"))
        (tmp / "metadata.json").write_text(json.dumps(state.metadata, indent=2, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return sum(f.stat().st_size for f in final.iterdir())

    def get(self, path: CheckpointPath) -> CheckpointState:
        folder = self._dir(path)
        optimizer_file = folder / "optimizer.safetensors"
        return CheckpointState(
            adapter=load_file(str(folder / "adapter.safetensors")),
            optimizer=load_file(str(optimizer_file)) if optimizer_file.exists() else None,
            metadata=json.loads((folder / "metadata.json").read_text()),
        )

    def delete(self, path: CheckpointPath) -> None:
        shutil.rmtree(self._dir(path), ignore_errors=True)


def _contiguous(array):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.ascontiguousarray(array)
