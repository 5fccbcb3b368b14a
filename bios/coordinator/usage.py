"""Usage accounting per key: tokens trained, prefilled and sampled, checkpoints saved, bytes stored over time.

Token counts are added to hourly totals when a request finishes (`record`, from the result router), so a failed
request costs nothing and the table grows by hours, not by requests. Checkpoint storage is kept as intervals
(saved .. deleted or replaced) by SQLite triggers on the `checkpoints` table, so every way a checkpoint comes
or goes (saves, automatic saves, pruning, deletes) is counted without its code knowing. Bios prices nothing: Tinker's cost fields stay None.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from bios import ids
from bios import messages as m
from bios import types as t
from bios.account import GIGABYTE, HOUR, StoredNow, UsageBucket
from bios.exceptions import RequestFailedError

from .disk import is_disk_full
from .store import Store

log = logging.getLogger(__name__)


SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_hours (
    hour INTEGER NOT NULL,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    kind TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (hour, owner, session_id, base_model, kind)
);
CREATE TABLE IF NOT EXISTS checkpoint_storage (
    path TEXT NOT NULL,
    run_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    deleted REAL
);
CREATE INDEX IF NOT EXISTS storage_by_path ON checkpoint_storage (path);
CREATE TRIGGER IF NOT EXISTS storage_on_save AFTER INSERT ON checkpoints BEGIN
    UPDATE checkpoint_storage SET deleted = NEW.created WHERE path = NEW.path AND deleted IS NULL;
    INSERT INTO checkpoint_storage VALUES (NEW.path, NEW.run_id, NEW.owner, NEW.size_bytes, NEW.created, NULL);
END;
CREATE TRIGGER IF NOT EXISTS storage_on_delete AFTER DELETE ON checkpoints BEGIN
    UPDATE checkpoint_storage SET deleted = (julianday('now') - 2440587.5) * 86400.0
    WHERE path = OLD.path AND deleted IS NULL;
END;
INSERT INTO checkpoint_storage
    SELECT path, run_id, owner, size_bytes, created, NULL FROM checkpoints
    WHERE path NOT IN (SELECT path FROM checkpoint_storage WHERE deleted IS NULL);
"""

TRAINING, PREFILL, SAMPLE = "training", "sampling_prefill", "sampling_sample"


class Usage:
    """Reads join `session_labels` (`labels.py`) for projects: create `Labels` on the same store first."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db
        self.db.executescript(SCHEMA)

    # ------------------------------------------------------------------------------------ recording

    def record(self, op: m.Request | None, result: Any) -> None:
        """Count a finished request's tokens against the key that owns its run or sampling session."""
        if isinstance(op, m.ForwardBackward) and isinstance(result, t.ForwardBackwardOutput):
            run = self.store.get_run(op.model_id)
            if run is not None:
                tokens = sum(datum.model_input.length for datum in op.data)
                self._add(run.owner, run.session_id, run.base_model, TRAINING, tokens)
        elif isinstance(op, m.Sample) and isinstance(result, t.SampleResponse):
            session = self.store.get_sampling_session(op.sampling_session_id)
            if session is not None:
                owner, base_model, _ = session
                client_session = ids.session_of(op.sampling_session_id)
                self._add(owner, client_session, base_model, PREFILL, op.prompt.length)
                self._add(owner, client_session, base_model, SAMPLE, sum(len(s.tokens) for s in result.sequences))

    def _add(self, owner: str, session_id: str, base_model: str, kind: str, tokens: int) -> None:
        """Add to the hour's total (one row per hour, key, session, model and kind, however many requests)."""
        if tokens <= 0:
            return
        try:
            self.db.execute("INSERT INTO usage_hours VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                            "tokens = tokens + excluded.tokens",
                            (int(time.time() // HOUR), owner, session_id, base_model, kind, tokens))
        except RequestFailedError as exc:  # the request ran; a full disk loses only its accounting
            if not is_disk_full(exc):
                raise
            log.warning("usage of %s not recorded: %s", owner, exc.message)

    # ------------------------------------------------------------------------------------ reading

    def buckets(self, owner: str | None, start: float, end: float) -> list[UsageBucket]:
        """Hourly usage in the hours starting in [start, end) for `owner` (None: every key), by bucket then kind."""
        where, args = _scope(owner)
        rows = self.db.execute(
            f"SELECT hour, owner, session_id, base_model, kind, tokens FROM usage_hours "
            f"WHERE hour * 3600 >= ? AND hour * 3600 < ? {where}", (start, end, *args)).fetchall()
        out = [UsageBucket(row[0] * HOUR, row[1], row[2], row[3], row[4], float(row[5])) for row in rows]
        out += self._checkpoint_buckets(owner, start, end)
        return sorted(out, key=lambda b: (b.bucket_start, b.kind, -b.quantity))

    def _checkpoint_buckets(self, owner: str | None, start: float, end: float) -> list[UsageBucket]:
        where, args = _scope(owner, "s.owner")
        rows = self.db.execute(
            "SELECT s.owner, r.session_id, r.base_model, s.size_bytes, s.created, s.deleted FROM checkpoint_storage s "
            f"LEFT JOIN runs r ON r.model_id = s.run_id WHERE s.created < ? AND (s.deleted IS NULL OR s.deleted > ?) "
            f"{where}", (end, start, *args)).fetchall()
        saved: dict[tuple[Any, ...], float] = {}
        stored: dict[tuple[Any, ...], float] = {}
        now = time.time()
        for key_owner, session_id, base_model, size, created, deleted in rows:
            if start <= created < end:
                key = (math.floor(created / HOUR) * HOUR, key_owner, session_id, base_model)
                saved[key] = saved.get(key, 0.0) + 1
            first, last = max(created, start), min(deleted if deleted is not None else now, end)
            hour = math.floor(first / HOUR) * HOUR
            while hour < last:
                overlap = min(last, hour + HOUR) - max(first, hour)
                if overlap > 0:
                    key = (hour, key_owner, None, base_model)
                    stored[key] = stored.get(key, 0.0) + size / GIGABYTE * overlap / HOUR
                hour += HOUR
        return ([UsageBucket(*key, "checkpoint", n) for key, n in saved.items()]
                + [UsageBucket(*key, "storage", gb_h) for key, gb_h in stored.items()])

    def stored_now(self, owner: str | None) -> list[StoredNow]:
        """Checkpoints as they are now, by key and by the project label of the session that made their run."""
        where, args = _scope(owner, "c.owner")
        rows = self.db.execute(
            "SELECT c.owner, l.project_id, COUNT(*), SUM(c.size_bytes) FROM checkpoints c "
            "LEFT JOIN runs r ON r.model_id = c.run_id LEFT JOIN session_labels l ON l.session_id = r.session_id "
            f"WHERE 1 {where} GROUP BY 1, 2 ORDER BY 1, 2", args).fetchall()
        return [StoredNow(row[0], row[1], int(row[2]), int(row[3] or 0)) for row in rows]


def _scope(owner: str | None, column: str = "owner") -> tuple[str, tuple[str, ...]]:
    return ("", ()) if owner is None else (f"AND {column} = ?", (owner,))
