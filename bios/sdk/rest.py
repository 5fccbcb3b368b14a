"""`RestClient`: run history, checkpoints and the key's account (usage, audit log, storage). Methods return
`APIFuture`s, as in the Tinker SDK."""

from __future__ import annotations

from datetime import date, datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bios import account as a
from bios import messages as m
from bios import types as t

from .futures import APIFuture

if TYPE_CHECKING:
    from .connection import Connection


class RestClient:
    def __init__(self, connection: Connection) -> None:
        self._conn = connection

    def _query(self, body: Any) -> APIFuture[Any]:
        return APIFuture(self._conn.spawn(self._conn.ask(body, 60.0)))

    def list_training_runs(self, limit: int = 20, offset: int = 0,
                           project_id: str | None = None) -> APIFuture[t.TrainingRunsResponse]:
        """This key's runs, oldest first; with `project_id`, only those of sessions in that project (set over the
        Tinker API; a session without one is in `default`)."""
        return self._query(m.ListTrainingRuns(limit, offset, project_id))

    async def list_training_runs_async(self, limit: int = 20, offset: int = 0,
                                       project_id: str | None = None) -> t.TrainingRunsResponse:
        return await self.list_training_runs(limit, offset, project_id)

    def list_training_run_ids(self) -> APIFuture[list[str]]:
        """Every run id of this key, oldest first."""
        return APIFuture(self._conn.spawn(self._all_run_ids()))

    async def list_training_run_ids_async(self) -> list[str]:
        return await self.list_training_run_ids()

    async def _all_run_ids(self) -> list[str]:
        ids: list[str] = []
        while True:
            page = await self._conn.ask(m.ListTrainingRuns(limit=100, offset=len(ids)), 60.0)
            ids.extend(run.training_run_id for run in page.training_runs)
            if not page.training_runs or len(ids) >= page.cursor.total_count:
                return ids

    def get_training_run(self, training_run_id: str) -> APIFuture[t.TrainingRun]:
        return self._query(m.GetTrainingRun(training_run_id))

    async def get_training_run_async(self, training_run_id: str) -> t.TrainingRun:
        return await self.get_training_run(training_run_id)

    def get_training_run_metrics(self, training_run_id: str, max_points: int = 0
                                 ) -> APIFuture[m.TrainingRunMetrics]:
        """The run's summary (status, steps, tokens, last loss, last checkpoint) and one point per optimizer step
        (loss, tokens, grad norm, learning rate, cycle, time); `max_points` > 0 thins it evenly."""
        return self._query(m.GetTrainingRunMetrics(training_run_id, max_points))

    async def get_training_run_metrics_async(self, training_run_id: str, max_points: int = 0
                                             ) -> m.TrainingRunMetrics:
        return await self.get_training_run_metrics(training_run_id, max_points)

    def list_run_summaries(self, limit: int = 20, offset: int = 0) -> APIFuture[m.RunSummaries]:
        """Runs of this key, oldest first, each with status, steps, tokens, last loss and last checkpoint."""
        return self._query(m.ListRunSummaries(limit, offset))

    async def list_run_summaries_async(self, limit: int = 20, offset: int = 0) -> m.RunSummaries:
        return await self.list_run_summaries(limit, offset)

    def get_run_trace(self, training_run_id: str) -> APIFuture[m.RunTrace]:
        """Each request of the run: when it was accepted, taken into its cycle, and finished."""
        return self._query(m.GetRunTrace(training_run_id))

    async def get_run_trace_async(self, training_run_id: str) -> m.RunTrace:
        return await self.get_run_trace(training_run_id)

    def list_checkpoints(self, training_run_id: str) -> APIFuture[t.CheckpointsListResponse]:
        return self._query(m.ListCheckpoints(training_run_id))

    async def list_checkpoints_async(self, training_run_id: str) -> t.CheckpointsListResponse:
        return await self.list_checkpoints(training_run_id)

    def delete_checkpoint(self, path: str) -> APIFuture[Any]:
        return self._query(m.DeleteCheckpoint(path))

    async def delete_checkpoint_async(self, path: str) -> None:
        await self.delete_checkpoint(path)

    def download_checkpoint(self, path: str) -> APIFuture[m.CheckpointState]:
        """The checkpoint's tensors (PEFT key names) and metadata."""
        return self._query(m.FetchCheckpoint(path))

    async def download_checkpoint_async(self, path: str) -> m.CheckpointState:
        return await self.download_checkpoint(path)

    def export_checkpoint(self, path: str, out_dir: str | Path, *, merged: bool = False) -> Path:
        """Write a standard PEFT adapter directory (or, `merged=True`, a full model with the adapter merged in)."""
        from bios.export import write_merged_model, write_peft_adapter
        from bios.models import resolve_model_dir

        state = self.download_checkpoint(path).result()
        base_model = str(state.metadata["base_model"])
        if merged:
            return write_merged_model(state, Path(out_dir), base_model=base_model)
        return write_peft_adapter(state, Path(out_dir), base_model_dir=str(resolve_model_dir(base_model)),
                                  base_model=base_model)

    # ------------------------------------------------------------------------------------ checkpoint labels

    def publish_checkpoint(self, path: str, public: bool = True) -> APIFuture[Any]:
        """Publish a checkpoint: every key may then train from it, sample it or copy it by its path."""
        return self._query(a.PublishCheckpoint(path, public))

    def unpublish_checkpoint(self, path: str) -> APIFuture[Any]:
        return self._query(a.PublishCheckpoint(path, False))

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> APIFuture[a.CheckpointTTL]:
        """Delete the checkpoint `ttl_seconds` from now (one hour to ten years; None: keep it)."""
        return self._query(a.SetCheckpointTTL(path, ttl_seconds))

    # ------------------------------------------------------------------------------------ account

    def get_billing_usage(self, starting_on: datetime | float, ending_before: datetime | float
                          ) -> APIFuture[a.UsageReport]:
        """This key's hourly usage in [starting_on, ending_before): tokens trained, prefilled and sampled,
        checkpoints saved and gigabyte-hours stored."""
        return self._query(a.GetUsage(_seconds(starting_on), _seconds(ending_before)))

    def get_audit_log(self, event_type: str = "all", day: date | None = None) -> APIFuture[a.AuditReport]:
        """This key's administrative events on `day` (UTC, default today)."""
        day = day or datetime.now(timezone.utc).date()
        start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()
        return self._query(a.GetAuditLog(start, start + 86400.0, event_type))

    def get_current_checkpoint_storage_usage(self) -> APIFuture[a.StorageReport]:
        """This key's checkpoints now: how many and how many bytes, per project label."""
        return self._query(a.GetCheckpointStorage())


def _seconds(when: datetime | float) -> float:
    return when.timestamp() if isinstance(when, datetime) else float(when)
