"""Checkpoints as users see them: saved, listed, loaded and deleted by path, visible only to their owner (a
published one can be loaded by every key).

The SQLite index (`Store`) says what exists and whose it is; the `CheckpointStore` holds the tensors. Anything
that is not the caller's is reported as not found, so existence does not leak across keys.

A full state directory is an error, not an outage: a save that would not fit is refused before it writes, and a
delete removes files before rows, so it frees space even when SQLite itself has none left.
"""

from __future__ import annotations

import time

from bios import types as t
from bios.checkpoint_path import CheckpointPath
from bios.exceptions import ConflictError, NotFoundError
from bios.messages import CheckpointState

from .checkpoints import CheckpointStore
from .disk import is_disk_full
from .labels import Labels
from .runs import from_stored_config
from .store import Store, StoredCheckpoint, StoredRun

_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


class Catalog:
    def __init__(self, store: Store, files: CheckpointStore) -> None:
        self.store = store
        self.files = files
        self.disk = store.disk
        self.labels = Labels(store)  # a published checkpoint is readable by every key

    def check_free(self, path: CheckpointPath, *, overwrite: bool) -> None:
        if not overwrite and self.store.get_checkpoint(str(path)) is not None:
            raise ConflictError(f"checkpoint {path} already exists; pick another name or pass overwrite=True",
                                field="name")

    def save(self, path: CheckpointPath, state: CheckpointState, *, owner: str, automatic: bool,
             user_metadata: dict[str, str] | None = None) -> StoredCheckpoint:
        """Write a checkpoint's files, then its row (with the save's `user_metadata`); RequestFailedError naming
        the full state directory (and nothing left behind) if it does not fit."""
        self.disk.ensure_room(self.files.size_of(state))
        replacing = self.store.get_checkpoint(str(path)) is not None
        try:
            size = self.files.put(path, state)
        except Exception as exc:
            if is_disk_full(exc):
                raise self.disk.full_error(self.files.size_of(state)) from exc
            raise
        record = StoredCheckpoint(
            path=str(path), run_id=path.run_id, kind=path.kind, name=path.name, owner=owner, created=time.time(),
            size_bytes=size, step=int(state.metadata.get("step", 0)), automatic=automatic,
            user_metadata=user_metadata or None,
        )
        try:
            self.store.add_checkpoint(record)
        except Exception:
            if not replacing:  # files no row points at could be neither listed nor deleted
                self.files.delete(path)
            raise
        return record

    def find(self, path: str, owner: str | None, *, field: str = "path") -> StoredCheckpoint:
        parsed = CheckpointPath.parse(path, field=field)
        record = self.store.get_checkpoint(str(parsed))
        if record is None or (owner is not None and record.owner != owner):
            raise NotFoundError(f"no checkpoint at {parsed}; list yours with RestClient.list_checkpoints", field=field)
        return record

    def find_readable(self, path: str, owner: str | None, *, field: str = "path") -> StoredCheckpoint:
        """The owner's checkpoint, or any key's that was published (readable by every key, never deletable)."""
        try:
            return self.find(path, owner, field=field)
        except NotFoundError:
            record = self.store.get_checkpoint(str(CheckpointPath.parse(path, field=field)))
            if record is None or not self.labels.checkpoint(record.path).public:
                raise
            return record

    def load(self, path: str, owner: str | None, *, field: str = "path") -> CheckpointState:
        record = self.find_readable(path, owner, field=field)
        return self.files.get(CheckpointPath.parse(record.path))

    def load_for_workers(self, path: str) -> CheckpointState:
        """A checkpoint's tensors for the workers (sampler weights, restores): any owner's, by its path."""
        return self.load(path, None)

    def delete(self, path: str, owner: str | None) -> None:
        self._remove(self.find(path, owner))

    def prune_automatic(self, run_id: str, keep: int) -> None:
        automatic = [c for c in self.store.list_checkpoints(run_id) if c.automatic]
        for record in automatic[: max(0, len(automatic) - keep)]:
            self._remove(record)

    def _remove(self, record: StoredCheckpoint) -> None:
        """Files first: that frees space, so the row's delete can be written even on a disk that was full. A row
        left by a failure points at nothing and is removed by deleting it again."""
        self.files.delete(CheckpointPath.parse(record.path))
        self.store.delete_checkpoint(record.path)
        self.disk.hold()  # space came back: set the reserve aside again if it was used

    def latest_automatic_path(self, run_id: str) -> str | None:
        automatic = [c for c in self.store.list_checkpoints(run_id) if c.automatic]
        return automatic[-1].path if automatic else None

    # ------------------------------------------------------------------------------------ listings

    def checkpoints(self, run_id: str) -> list[t.Checkpoint]:
        return [as_checkpoint(c) for c in self.store.list_checkpoints(run_id)]

    def training_run(self, run: StoredRun) -> t.TrainingRun:
        checkpoints = self.store.list_checkpoints(run.model_id)
        training = [c for c in checkpoints if c.kind == "weights"]
        sampler = [c for c in checkpoints if c.kind == "sampler_weights"]
        return t.TrainingRun(
            training_run_id=run.model_id,
            base_model=run.base_model,
            model_owner=run.owner,
            is_lora=True,
            lora_rank=int(run.lora_config.get("rank", 0)) or None,  # type: ignore[arg-type]
            last_request_time=run.last_request_time,
            last_checkpoint=as_checkpoint(training[-1]) if training else None,
            last_sampler_checkpoint=as_checkpoint(sampler[-1]) if sampler else None,
            optimizer=from_stored_config(run.lora_config)[1],
            user_metadata=run.user_metadata,
            lora=from_stored_config(run.lora_config)[0] if run.lora_config else None,
        )


def as_checkpoint(record: StoredCheckpoint) -> t.Checkpoint:
    return t.Checkpoint(
        checkpoint_id=f"{record.kind}/{record.name}",
        checkpoint_type=_TYPES[record.kind],  # type: ignore[arg-type]
        time=record.created,
        bios_path=record.path,
        size_bytes=record.size_bytes,
        user_metadata=record.user_metadata,
    )
