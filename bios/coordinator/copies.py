"""Copying a checkpoint (the caller's own, or any key's published one) into a run of the caller's (Tinker's
`copy_weights`): the copy outlives its source and keeps its kind; its run holds nothing else and is never
scheduled (status `archived`)."""

from __future__ import annotations

from bios import ids
from bios.checkpoint_path import CheckpointPath

from .catalog import Catalog
from .store import Store

ARCHIVED = "archived"  # a run that only holds copied weights: not live, so nothing creates it on a worker


def copy_checkpoint(store: Store, catalog: Catalog, source: str, owner: str, session_id: str) -> str:
    """Copy the checkpoint at `source` `owner` may read into run `<session_id>:train:0`; returns the copy's path."""
    record = catalog.find_readable(source, owner, field="source_path")
    state = catalog.load(record.path, owner, field="source_path")
    origin = store.get_run(record.run_id)
    run_id = ids.run_id(session_id, 0)
    store.add_run(run_id, session_id, owner, origin.base_model if origin else str(state.metadata.get("base_model")),
                  origin.lora_config if origin else {})
    store.set_run_status(run_id, ARCHIVED)
    target = CheckpointPath(run_id, record.kind, record.name)  # type: ignore[arg-type]
    catalog.save(target, state, owner=owner, automatic=False, user_metadata=record.user_metadata)
    return str(target)
