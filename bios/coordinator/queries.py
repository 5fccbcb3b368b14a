"""Read queries answered from the durable state alone (runs, checkpoints, run history), each scoped to the
caller's key; owner None (the console's admin view) sees every key's runs.

They need nothing the scheduler holds in memory, so they never wait behind a cycle in its mailbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bios import account as a
from bios import messages as m
from bios import types as t
from bios.account import DEFAULT_PROJECT
from bios.exceptions import BadRequestError, BiosAPIError, NotFoundError
from bios.security.keys import KeyInfo

from .audit import AuditLog
from .catalog import Catalog
from .history import RunHistory
from .labels import Labels
from .store import Store, StoredRun
from .trace import RequestTimeline
from .usage import Usage

log = logging.getLogger(__name__)

ACCOUNT_TYPES = (a.GetUsage, a.GetAuditLog, a.GetCheckpointStorage)  # reads the admin may make over every key
QUERY_TYPES = (m.ListTrainingRuns, m.GetTrainingRun, m.ListCheckpoints, m.DeleteCheckpoint, m.FetchCheckpoint,
               m.GetTrainingRunMetrics, m.ListRunSummaries, m.GetRunTrace, a.PublishCheckpoint, a.SetCheckpointTTL,
               *ACCOUNT_TYPES)


class Queries:
    def __init__(self, store: Store, catalog: Catalog, keys: Callable[[], list[KeyInfo]] = list) -> None:
        self.store = store
        self.catalog = catalog
        self.keys = keys  # the cluster's API keys, for their creation and revocation in the audit log
        self.history = RunHistory(store.db)
        self.timeline = RequestTimeline(store.db)
        self.labels = Labels(store)
        self.usage = Usage(store)
        self.audit = AuditLog(store.db)

    def answer(self, owner: str | None, body: Any) -> Any:
        if isinstance(body, m.ListTrainingRuns):
            runs = self.store.list_runs(owner)
            if body.project_id is not None:
                runs = self.in_project(runs, body.project_id, owner)
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
        if isinstance(body, m.GetRunTrace):  # a training run's requests, or a sampling session's
            sampler = self.store.get_sampling_session(body.training_run_id)
            if sampler is None or (owner is not None and sampler[0] != owner):
                self.run(body.training_run_id, owner)
            return m.RunTrace(body.training_run_id, self.timeline.of_run(body.training_run_id))
        if isinstance(body, a.PublishCheckpoint):
            record = self.catalog.find(body.path, owner)
            self.labels.publish(record.path, body.public)
            self.audit.record(record.owner, "checkpoint_published" if body.public else "checkpoint_unpublished",
                              path=record.path)
            return m.Ack()
        if isinstance(body, a.SetCheckpointTTL):
            ttl = a.check_ttl(body.ttl_seconds)
            record = self.catalog.find(body.path, owner)
            expires = self.labels.set_ttl(record.path, ttl)
            self.audit.record(record.owner, "checkpoint_ttl_set", path=record.path, expires_at=expires)
            return a.CheckpointTTL(record.path, expires)
        if isinstance(body, a.GetUsage):
            return a.UsageReport(self.usage.buckets(owner, body.start, body.end))
        if isinstance(body, a.GetAuditLog):
            return a.AuditReport(self.audit.entries(owner, body.start, body.end, body.event_type, self.keys()))
        if isinstance(body, a.GetCheckpointStorage):
            return a.StorageReport(self.usage.stored_now(owner))
        if isinstance(body, m.ListRunSummaries):
            runs = self.store.list_runs(owner)
            return m.RunSummaries([self.summary(r) for r in runs[body.offset: body.offset + body.limit]], len(runs))
        raise BadRequestError(f"{type(body).__name__} is not a read query", field="kind")

    def expire_checkpoints(self) -> list[str]:
        """Delete every checkpoint past its TTL; returns their paths."""
        gone = []
        for path, owner in self.labels.expired():
            try:
                self.catalog.delete(path, owner)
                gone.append(path)
            except BiosAPIError as exc:  # e.g. a full disk: the next sweep tries again
                log.warning("expired checkpoint %s not deleted: %s", path, exc.message)
        return gone

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

    def in_project(self, runs: list[StoredRun], project_id: str, owner: str | None) -> list[StoredRun]:
        """The runs whose session is in `project_id` now (its label from create_session or assign_session_project;
        a session without one is in `default`); none for a project no session is in."""
        projects = {s.session_id: s.project_id or DEFAULT_PROJECT for s in self.labels.sessions(owner)}
        return [run for run in runs if projects.get(run.session_id, DEFAULT_PROJECT) == project_id]

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

    def samplers_of_session(self, session_id: str, owner: str) -> list[str]:
        """The sampling sessions a client session opened."""
        return [sampler for sampler, sampler_owner, _, _ in self.store.sampling_sessions()
                if sampler_owner == owner and sampler.startswith(f"{session_id}:")]

    def runs_of_session(self, session_id: str, owner: str) -> list[str]:
        return [run.model_id for run in self.store.list_runs(owner) if run.session_id == session_id]
