"""What the Tinker API attaches to sessions and checkpoints that scheduling never reads: a session's display
name, user metadata, project and finish reason; a checkpoint's published flag and expiry; the clients that
joined a sampling session.

Kept beside the store's tables (same SQLite file) so they survive restarts; a checkpoint's labels go with it
(a trigger), and an expired checkpoint is deleted by whoever sweeps `expired()`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from bios.account import SessionSummary

from .store import Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS session_labels (
    session_id TEXT PRIMARY KEY,
    display_name TEXT,
    user_metadata TEXT,
    project_id TEXT,
    finish_reason TEXT,
    finish_detail TEXT
);
CREATE TABLE IF NOT EXISTS checkpoint_labels (
    path TEXT PRIMARY KEY,
    public INTEGER NOT NULL DEFAULT 0,
    expires_at REAL
);
CREATE TRIGGER IF NOT EXISTS labels_checkpoint_deleted AFTER DELETE ON checkpoints BEGIN
    DELETE FROM checkpoint_labels WHERE path = OLD.path;
END;
CREATE TABLE IF NOT EXISTS sampling_clients (
    sampling_session_id TEXT PRIMARY KEY,
    joined INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class CheckpointLabel:
    public: bool = False
    expires_at: float | None = None


class Labels:
    def __init__(self, store: Store) -> None:
        self.db = store.db
        self.db.executescript(SCHEMA)

    # ------------------------------------------------------------------------------------ sessions

    def label_session(self, session_id: str, display_name: str | None, user_metadata: dict[str, str] | None,
                      project_id: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO session_labels VALUES (?, ?, ?, ?, NULL, NULL)",
                        (session_id, display_name, json.dumps(user_metadata) if user_metadata else None, project_id))

    def set_project(self, session_id: str, project_id: str) -> None:
        self.db.execute("INSERT OR IGNORE INTO session_labels (session_id) VALUES (?)", (session_id,))
        self.db.execute("UPDATE session_labels SET project_id = ? WHERE session_id = ?", (project_id, session_id))

    def finish(self, session_id: str, reason: str | None, detail: str | None) -> None:
        self.db.execute("INSERT OR IGNORE INTO session_labels (session_id) VALUES (?)", (session_id,))
        self.db.execute("UPDATE session_labels SET finish_reason = ?, finish_detail = ? WHERE session_id = ?",
                        (reason, detail, session_id))

    def sessions(self, owner: str | None) -> list[SessionSummary]:
        """Sessions of `owner` (None: every key's), newest first, with their checkpoints' count and bytes."""
        rows = self.db.execute(
            "SELECT s.session_id, s.owner, s.created, s.closed, l.display_name, l.user_metadata, l.project_id, "
            "l.finish_reason, l.finish_detail, COUNT(c.path), COALESCE(SUM(c.size_bytes), 0) "
            "FROM sessions s LEFT JOIN session_labels l ON l.session_id = s.session_id "
            "LEFT JOIN runs r ON r.session_id = s.session_id LEFT JOIN checkpoints c ON c.run_id = r.model_id "
            + ("" if owner is None else "WHERE s.owner = ? ")
            + "GROUP BY s.session_id ORDER BY s.created DESC, s.session_id DESC",
            () if owner is None else (owner,)).fetchall()
        return [SessionSummary(r[0], r[1], float(r[2]), bool(r[3]), r[4], json.loads(r[5]) if r[5] else None, r[6],
                               r[7], r[8], int(r[9]), int(r[10])) for r in rows]

    # ------------------------------------------------------------------------------------ checkpoints

    def checkpoint(self, path: str) -> CheckpointLabel:
        row = self.db.execute("SELECT public, expires_at FROM checkpoint_labels WHERE path = ?", (path,)).fetchone()
        return CheckpointLabel() if row is None else CheckpointLabel(bool(row[0]), row[1])

    def publish(self, path: str, public: bool) -> None:
        self.db.execute("INSERT OR IGNORE INTO checkpoint_labels (path) VALUES (?)", (path,))
        self.db.execute("UPDATE checkpoint_labels SET public = ? WHERE path = ?", (int(public), path))

    def set_ttl(self, path: str, ttl_seconds: float | None) -> float | None:
        """Expire the checkpoint `ttl_seconds` from now (None: never); returns when."""
        expires = None if ttl_seconds is None else time.time() + ttl_seconds
        self.db.execute("INSERT OR IGNORE INTO checkpoint_labels (path) VALUES (?)", (path,))
        self.db.execute("UPDATE checkpoint_labels SET expires_at = ? WHERE path = ?", (expires, path))
        return expires

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """(path, owner) of every checkpoint past its expiry."""
        return [(r[0], r[1]) for r in self.db.execute(
            "SELECT l.path, c.owner FROM checkpoint_labels l JOIN checkpoints c ON c.path = l.path "
            "WHERE l.expires_at IS NOT NULL AND l.expires_at <= ?", (time.time() if now is None else now,))]

    # ------------------------------------------------------------------------------------ sampling sessions

    def join_sampling_session(self, sampling_session_id: str) -> int:
        """A new client number for a sampling session: 1, 2, ... (the client that opened it is 0). Durable, so a
        clone never reuses an earlier clone's block of seq_ids, whose results the request log would replay."""
        self.db.execute("INSERT OR IGNORE INTO sampling_clients VALUES (?, 0)", (sampling_session_id,))
        self.db.execute("UPDATE sampling_clients SET joined = joined + 1 WHERE sampling_session_id = ?",
                        (sampling_session_id,))
        return int(self.db.execute("SELECT joined FROM sampling_clients WHERE sampling_session_id = ?",
                                   (sampling_session_id,)).fetchone()[0])
