"""The audit log: administrative events per key (runs created and deleted, checkpoints deleted, published,
unpublished, given a TTL or copied, keys created and revoked).

Run and checkpoint deletions are written by SQLite triggers on the tables themselves, so no code path that
removes one (a user's delete, automatic pruning, a failed creation) can forget to log it. Key events come from
the key store's own timestamps. Each entry belongs to one key; only the cluster's admin reads every key's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from bios.account import AuditEntry
from bios.exceptions import BadRequestError
from bios.security.keys import KeyInfo

from .disk import GuardedConnection

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_events (
    time REAL NOT NULL,
    owner TEXT NOT NULL,
    event TEXT NOT NULL,
    details TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit_events (time);
CREATE TRIGGER IF NOT EXISTS audit_run_created AFTER INSERT ON runs BEGIN
    INSERT INTO audit_events VALUES (NEW.created, NEW.owner, 'training_run_created',
        json_object('training_run_id', NEW.model_id, 'session_id', NEW.session_id, 'base_model', NEW.base_model));
END;
CREATE TRIGGER IF NOT EXISTS audit_run_deleted AFTER DELETE ON runs BEGIN
    INSERT INTO audit_events VALUES ((julianday('now') - 2440587.5) * 86400.0, OLD.owner, 'training_run_deleted',
        json_object('training_run_id', OLD.model_id, 'session_id', OLD.session_id, 'status', OLD.status));
END;
CREATE TRIGGER IF NOT EXISTS audit_checkpoint_deleted AFTER DELETE ON checkpoints BEGIN
    INSERT INTO audit_events VALUES ((julianday('now') - 2440587.5) * 86400.0, OLD.owner, 'checkpoint_deleted',
        json_object('path', OLD.path, 'training_run_id', OLD.run_id, 'automatic', OLD.automatic));
END;
"""

CATEGORIES = {  # Tinker's `event_type` filter -> the events it selects
    "checkpoints": ("checkpoint_",),
    "projects": ("training_run_", "session_"),
    "organizations": ("api_key_",),
    "teams": (),
}


class AuditLog:
    def __init__(self, db: GuardedConnection) -> None:
        self.db = db
        self.db.executescript(SCHEMA)

    def record(self, owner: str, event: str, **details: Any) -> None:
        self.db.execute("INSERT INTO audit_events VALUES (?, ?, ?, ?)",
                        (time.time(), owner, event, json.dumps(details, sort_keys=True)))

    def entries(self, owner: str | None, start: float, end: float, event_type: str = "all",
                keys: Sequence[KeyInfo] = ()) -> list[AuditEntry]:
        """Events in [start, end) of `owner` (None: every key), oldest first; `keys` adds key creations and
        revocations."""
        rows = self.db.execute("SELECT time, owner, event, details FROM audit_events WHERE time >= ? AND time < ?"
                               + ("" if owner is None else " AND owner = ?"),
                               (start, end) if owner is None else (start, end, owner)).fetchall()
        found = [AuditEntry(float(r[0]), r[1], r[2], json.loads(r[3])) for r in rows]
        for key in keys:
            if owner is not None and key.key_id != owner:
                continue
            for when, event in ((key.created, "api_key_created"), (key.revoked, "api_key_revoked")):
                if when is not None and start <= when < end:
                    found.append(AuditEntry(when, key.key_id, event, {"key_id": key.key_id, "name": key.name}))
        if event_type != "all":
            prefixes = CATEGORIES.get(event_type)
            if prefixes is None:
                raise BadRequestError(f"event_type must be one of all, {', '.join(CATEGORIES)}; got {event_type!r}",
                                      field="event_type")
            found = [e for e in found if e.event.startswith(prefixes)] if prefixes else []
        return sorted(found, key=lambda e: e.time)
