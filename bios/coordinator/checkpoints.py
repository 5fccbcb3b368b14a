"""Where checkpoint tensors live: a small store interface and its directory implementation.

Files are safetensors (adapter, optimizer) plus `metadata.json`, written atomically (a temp directory renamed
into place, removed if anything fails, so a full disk leaves nothing partial). The SQLite index in `Store` says
which checkpoints exist; this only holds the bytes, so an object store can replace it later.
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

# safetensors' header per tensor (name, dtype, shape, offsets) is well under this; metadata.json is small
_OVERHEAD_PER_TENSOR = 256
_OVERHEAD = 64 * 1024


class CheckpointStore(Protocol):
    def put(self, path: CheckpointPath, state: CheckpointState) -> int: ...
    def size_of(self, state: CheckpointState) -> int: ...
    def get(self, path: CheckpointPath) -> CheckpointState: ...
    def delete(self, path: CheckpointPath) -> None: ...
    def files(self, path: CheckpointPath) -> list[Path]: ...


class DirectoryCheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _dir(self, path: CheckpointPath) -> Path:
        return self.root / path.run_id / path.kind / path.name

    def size_of(self, state: CheckpointState) -> int:
        """At least the bytes `put` will write (tensor data plus a generous allowance for headers)."""
        tensors = [*state.adapter.values(), *(state.optimizer or {}).values()]
        return sum(int(a.nbytes) + _OVERHEAD_PER_TENSOR for a in tensors) + _OVERHEAD

    def put(self, path: CheckpointPath, state: CheckpointState) -> int:
        """Write all files; returns their total size in bytes. Any failure (safetensors raises its own errors,
        not only OSError) removes the temp directory before it propagates."""
        final = self._dir(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
        try:
            tmp.mkdir()
            save_file({k: _contiguous(v) for k, v in state.adapter.items()}, str(tmp / "adapter.safetensors"))
            if state.optimizer is not None:
                save_file({k: _contiguous(v) for k, v in state.optimizer.items()},
                          str(tmp / "optimizer.safetensors"))
            (tmp / "metadata.json").write_text(json.dumps(state.metadata, indent=2, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_empty(final.parent, self.root)
            raise
        return sum(f.stat().st_size for f in final.iterdir())

    def get(self, path: CheckpointPath) -> CheckpointState:
        folder = self._dir(path)
        optimizer_file = folder / "optimizer.safetensors"
        return CheckpointState(
            adapter=load_file(str(folder / "adapter.safetensors")),
            optimizer=load_file(str(optimizer_file)) if optimizer_file.exists() else None,
            metadata=json.loads((folder / "metadata.json").read_text()),
        )

    def files(self, path: CheckpointPath) -> list[Path]:
        """The checkpoint's files (what an archive download serves)."""
        folder = self._dir(path)
        return sorted(f for f in folder.iterdir() if f.is_file()) if folder.is_dir() else []

    def delete(self, path: CheckpointPath) -> None:
        folder = self._dir(path)
        shutil.rmtree(folder, ignore_errors=True)
        _remove_empty(folder.parent, self.root)


def _remove_empty(folder: Path, root: Path) -> None:
    """Remove `folder` and its parents up to (not including) `root` while they are empty."""
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:  # not empty (or already gone): stop
            return
        folder = folder.parent


def _contiguous(array):  # type: ignore[no-untyped-def]
    import numpy as np

    return np.ascontiguousarray(array)
