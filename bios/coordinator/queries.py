"""Read queries answered from the durable state alone (runs, checkpoints, run history), each scoped to the
caller's key; owner None (the console's admin view) sees every key's runs.

They need nothing the scheduler holds in memory, so they never wait behind a cycle in its mailbox.
"""

from __future__ import annotations

from typing import Any

from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError, NotFoundError

from .catalog import Catalog
from .history import RunHistory
from .store import Store, StoredRun
from .trace import RequestTimeline

QUERY_TYPES = (m.ListTrainingRuns, m.GetTrainingRun, m.ListCheckpoints, m.DeleteCheckpoint, m.FetchCheckpoint,
               m.GetTrainingRunMetrics, m.ListRunSummaries, m.GetRunTrace)


class Queries:
    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store = store
        self.catalog = catalog
        self.history = RunHistory(store.db)
        self.timeline = RequestTimeline(store.db)

    def answer(self, owner: str | None, body: Any) -> Any:
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
        if isinstance(body, m.GetTrainingRunMetrics):
            run = self.run(body.training_run_id, owner)
            return m.TrainingRunMetrics(self.summary(run), self.history.points(run.model_id, body.max_points))
        if isinstance(body, m.GetRunTrace):
            run = self.run(body.training_run_id, owner)
            return m.RunTrace(run.model_id, self.timeline.of_run(run.model_id))
        if isinstance(body, m.ListRunSummaries):
            runs = self.store.list_runs(owner)
            return m.RunSummaries([self.summary(r) for r in runs[body.offset: body.offset + body.limit]], len(runs))
        raise BadRequestError(f"{type(body).__name__} is not a read query", field="kind")

    def summary(self, run: StoredRun) -> m.RunSummary:
        last = self.history.last(run.model_id)
        checkpoints = self.store.list_checkpoints(run.model_id)
        return m.RunSummary(
            training_run_id=run.model_id, base_model=run.base_model, owner=run.owner, status=run.status,
            created=run.created, last_request_time=run.last_request_time,
            steps=last.step if last else 0, tokens=last.total_tokens if last else 0,
            last_loss=last.loss if last else None,
            last_checkpoint=checkpoints[-1].path if checkpoints else None,
            base_dtype=(run.info or {}).get("base_dtype"),  # type: ignore[arg-type]
        )

    def run(self, run_id: str, owner: str | None) -> StoredRun:
        run = self.store.get_run(run_id)
        if run is None or (owner is not None and run.owner != owner):
            raise NotFoundError(f"no training run {run_id!r}", field="training_run_id")
        return run

    def run_ids(self, owner: str) -> list[str]:
        return [run.model_id for run in self.store.list_runs(owner)]

    def sessions(self, owner: str) -> list[str]:
        """The owner's sessions that created runs, oldest first."""
        return list(dict.fromkeys(run.session_id for run in self.store.list_runs(owner)))

    def runs_of_session(self, session_id: str, owner: str) -> list[str]:
        return [run.model_id for run in self.store.list_runs(owner) if run.session_id == session_id]
