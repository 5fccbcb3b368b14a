"""Read queries answered from the durable state alone (runs, checkpoints), each scoped to the caller's key.

They need nothing the scheduler holds in memory, so they never wait behind a cycle in its mailbox.
"""

from __future__ import annotations

from typing import Any

from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError, NotFoundError

from .catalog import Catalog
from .store import Store, StoredRun

QUERY_TYPES = (m.ListTrainingRuns, m.GetTrainingRun, m.ListCheckpoints, m.DeleteCheckpoint, m.FetchCheckpoint)


class Queries:
    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store = store
        self.catalog = catalog

    def answer(self, owner: str, body: Any) -> Any:
        if isinstance(body, m.ListTrainingRuns):
            runs = self.store.list_runs(owner)
            page = runs[body.offset: body.offset + body.limit]
            return t.TrainingRunsResponse([self.catalog.training_run(r) for r in page],
                                          t.Cursor(body.offset, body.limit, len(runs)))
        if isinstance(body, m.GetTrainingRun):
            return self.catalog.training_run(self.run(body.training_run_id, owner))
        if isinstance(body, m.ListCheckpoints):
            self.run(body.training_run_id, owner)
            return t.CheckpointsListResponse(self.catalog.checkpoints(body.training_run_id))
        if isinstance(body, m.DeleteCheckpoint):
            self.catalog.delete(body.path, owner)
            return m.Ack()
        if isinstance(body, m.FetchCheckpoint):
            return self.catalog.load(body.path, owner)
        raise BadRequestError(f"{type(body).__name__} is not a read query", field="kind")

    def run(self, run_id: str, owner: str) -> StoredRun:
        run = self.store.get_run(run_id)
        if run is None or run.owner != owner:
            raise NotFoundError(f"no training run {run_id!r}", field="training_run_id")
        return run

    def run_ids(self, owner: str) -> list[str]:
        return [run.model_id for run in self.store.list_runs(owner)]

    def sessions(self, owner: str) -> list[str]:
        """The owner's sessions that created runs, oldest first."""
        return list(dict.fromkeys(run.session_id for run in self.store.list_runs(owner)))

    def runs_of_session(self, session_id: str, owner: str) -> list[str]:
        return [run.model_id for run in self.store.list_runs(owner) if run.session_id == session_id]
