"""Durable coordinator state in SQLite (WAL): sessions, runs and the request log with stored results.

A request is written here before it is acknowledged, so an accepted request survives anything short of losing
the disk; its result is written before it is pushed, so a resubmitted `(model_id, seq_id)` is answered from
here and never executed twice. Every statement runs under the state directory's full-disk guard (`disk.py`).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from bios.exceptions import RequestFailedError

from .disk import GuardedConnection, StateDisk

log = logging.getLogger(__name__)

SESSION_WRITE_S = 30.0  # a session's last heartbeat is written at most this often

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS runs (
    model_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_config TEXT NOT NULL,
    created REAL NOT NULL,
    last_request_time REAL NOT NULL,
    status TEXT NOT NULL,
    info TEXT,
    user_metadata TEXT
);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    model_id TEXT NOT NULL,
    seq_id INTEGER NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    created REAL NOT NULL,
    finished REAL,
    payload BLOB,
    result BLOB
);
CREATE INDEX IF NOT EXISTS requests_by_model ON requests (model_id, seq_id);
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    step INTEGER NOT NULL,
    automatic INTEGER NOT NULL DEFAULT 0,
    user_metadata TEXT
);
CREATE INDEX IF NOT EXISTS checkpoints_by_run ON checkpoints (run_id, created);
CREATE TABLE IF NOT EXISTS committed (
    model_id TEXT PRIMARY KEY,
    checksum REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sampling_sessions (
    sampling_session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    base_model TEXT NOT NULL,
    model_path TEXT,
    created REAL NOT NULL
);
"""

# Columns added since the first schema: (table, column, type). A state directory written before them gets them
# (NULL for its existing rows) when a coordinator opens it.
ADDED_COLUMNS = (
    ("runs", "user_metadata", "TEXT"),
    ("checkpoints", "user_metadata", "TEXT"),
)


@dataclass(frozen=True)
class StoredRequest:
    request_id: str
    status: str  # accepted | done | failed | rejected
    result: list[bytes] | None


@dataclass(frozen=True)
class PendingRequest:
    """An accepted request with no outcome yet: what a restarted coordinator queues again."""

    request_id: str
    target: str
    seq_id: int
    payload: list[bytes]


@dataclass(frozen=True)
class StoredRun:
    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora_config: dict[str, object]
    created: float
    last_request_time: float
    status: str
    info: dict[str, object] | None
    user_metadata: dict[str, str] | None = None  # what the client attached at creation (Tinker's user_metadata)


class Store:
    """One SQLite database per coordinator state directory; used only from the coordinator's event loop."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "coordinator.sqlite3"
        self.disk = StateDisk(state_dir)
        self.db = GuardedConnection(sqlite3.connect(self.path, isolation_level=None, check_same_thread=False),
                                    self.disk)
        self._heartbeats_written: dict[str, float] = {}
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._add_columns()

    def _add_columns(self) -> None:
        """Migrate a state directory written by an earlier Bios: add the columns it lacks."""
        for table, column, kind in ADDED_COLUMNS:
            present = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})").fetchall()}
            if column not in present:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------------------------ sessions

    def add_session(self, session_id: str, owner: str) -> None:
        now = time.time()
        self.db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, 0)", (session_id, owner, now, now))

    def touch_session(self, session_id: str) -> bool:
        """True while the session is open. Its time is written at most every SESSION_WRITE_S, and a write the
        full disk refuses is only logged: a heartbeat must not make a full disk look like a lost coordinator."""
        row = self.db.execute("SELECT closed FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        if row is None or row[0]:
            return False
        now = time.time()
        if now - self._heartbeats_written.get(session_id, 0.0) >= SESSION_WRITE_S:
            self._heartbeats_written[session_id] = now
            try:
                self.db.execute("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?", (now, session_id))
            except RequestFailedError as exc:
                log.warning("session %s: heartbeat not recorded: %s", session_id, exc.message)
        return True

    def close_session(self, session_id: str) -> None:
        self._heartbeats_written.pop(session_id, None)
        self.db.execute("UPDATE sessions SET closed = 1 WHERE session_id = ?", (session_id,))

    def session_owner(self, session_id: str) -> str | None:
        row = self.db.execute("SELECT owner FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else row[0]

    # ------------------------------------------------------------------------------------ runs

    def add_run(self, model_id: str, session_id: str, owner: str, base_model: str, lora_config: dict[str, object],
                user_metadata: dict[str, str] | None = None) -> None:
        now = time.time()
        self.db.execute(
            "INSERT OR IGNORE INTO runs (model_id, session_id, owner, base_model, lora_config, created, "
            "last_request_time, status, info, user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?, 'creating', NULL, ?)",
            (model_id, session_id, owner, base_model, json.dumps(lora_config), now, now, _json(user_metadata)),
        )

    def set_run_status(self, model_id: str, status: str, info: dict[str, object] | None = None) -> None:
        if info is None:
            self.db.execute("UPDATE runs SET status = ? WHERE model_id = ?", (status, model_id))
        else:
            self.db.execute(
                "UPDATE runs SET status = ?, info = ? WHERE model_id = ?", (status, json.dumps(info), model_id)
            )

    def delete_run(self, model_id: str) -> None:
        self.db.execute("DELETE FROM runs WHERE model_id = ?", (model_id,))

    def get_run(self, model_id: str) -> StoredRun | None:
        row = self.db.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE model_id = ?", (model_id,)).fetchone()
        return None if row is None else _run(row)

    def live_runs(self) -> list[StoredRun]:
        rows = self.db.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE status IN ('creating', 'ready') "
                               "ORDER BY created").fetchall()
        return [_run(r) for r in rows]

    def sampling_sessions(self) -> list[tuple[str, str, str, str | None]]:
        """(sampling session id, owner, base model, model path) of every sampling session."""
        return [tuple(r) for r in self.db.execute(
            "SELECT sampling_session_id, owner, base_model, model_path FROM sampling_sessions").fetchall()]

    def list_runs(self, owner: str | None = None) -> list[StoredRun]:
        if owner is None:
            rows = self.db.execute(f"SELECT {_RUN_COLUMNS} FROM runs ORDER BY created").fetchall()
        else:
            rows = self.db.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE owner = ? ORDER BY created",
                                   (owner,)).fetchall()
        return [_run(r) for r in rows]

    # ------------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, model_id: str, seq_id: int, kind: str, payload: list[bytes] | None) -> None:
        now = time.time()
        blob = msgpack.packb(payload) if payload is not None else None
        # the insert last: a full disk that refuses either statement leaves no accepted request behind
        self.db.execute("UPDATE runs SET last_request_time = ? WHERE model_id = ?", (now, model_id))
        self.db.execute(
            "INSERT INTO requests VALUES (?, ?, ?, ?, 'accepted', ?, NULL, ?, NULL)",
            (request_id, model_id, seq_id, kind, now, blob),
        )

    def add_rejected(self, request_id: str, model_id: str, seq_id: int, kind: str, result: list[bytes]) -> None:
        now = time.time()
        self.db.execute(
            "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?, 'rejected', ?, ?, NULL, ?)",
            (request_id, model_id, seq_id, kind, now, now, msgpack.packb(result)),
        )

    def forget_request(self, request_id: str) -> None:
        """As if it never came: a request withdrawn before it ran, so that resending it runs it."""
        self.db.execute("DELETE FROM requests WHERE request_id = ?", (request_id,))

    def finish_request(self, request_id: str, status: str, result: list[bytes]) -> None:
        self.db.execute(
            "UPDATE requests SET status = ?, finished = ?, result = ?, payload = NULL WHERE request_id = ?",
            (status, time.time(), msgpack.packb(result), request_id),
        )

    # ------------------------------------------------------------------------------------ checkpoints

    def add_checkpoint(self, ckpt: StoredCheckpoint) -> None:
        self.db.execute(
            f"INSERT OR REPLACE INTO checkpoints ({_CHECKPOINT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (ckpt.path, ckpt.run_id, ckpt.kind, ckpt.name, ckpt.owner, ckpt.created, ckpt.size_bytes, ckpt.step,
             int(ckpt.automatic), _json(ckpt.user_metadata)),
        )

    def get_checkpoint(self, path: str) -> StoredCheckpoint | None:
        row = self.db.execute(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE path = ?", (path,)).fetchone()
        return None if row is None else _checkpoint(row)

    def list_checkpoints(self, run_id: str) -> list[StoredCheckpoint]:
        rows = self.db.execute(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE run_id = ? ORDER BY created",
                               (run_id,)).fetchall()
        return [_checkpoint(r) for r in rows]

    def delete_checkpoint(self, path: str) -> None:
        self.db.execute("DELETE FROM checkpoints WHERE path = ?", (path,))

    # ------------------------------------------------------------------------------------ sampling sessions

    def add_sampling_session(self, session_id: str, owner: str, base_model: str, model_path: str | None) -> None:
        self.db.execute(
            "INSERT OR IGNORE INTO sampling_sessions VALUES (?, ?, ?, ?, ?)",
            (session_id, owner, base_model, model_path, time.time()),
        )

    def get_sampling_session(self, session_id: str) -> tuple[str, str, str | None] | None:
        row = self.db.execute(
            "SELECT owner, base_model, model_path FROM sampling_sessions WHERE sampling_session_id = ?", (session_id,)
        ).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    def pending_requests(self) -> list[PendingRequest]:
        rows = self.db.execute("SELECT request_id, model_id, seq_id, payload FROM requests WHERE status = 'accepted' "
                               "ORDER BY created").fetchall()
        return [PendingRequest(r[0], r[1], r[2], msgpack.unpackb(r[3])) for r in rows]

    def rejected_seqs(self, target: str) -> dict[int, str]:
        """seq_id -> request id of a target's refused requests (their seq_ids are used up)."""
        rows = self.db.execute("SELECT seq_id, request_id FROM requests WHERE model_id = ? AND status = 'rejected'",
                               (target,)).fetchall()
        return {int(seq): str(rid) for seq, rid in rows}

    def last_run_seq(self, target: str) -> int:
        """The highest seq_id of a target that ran (done or failed); -1 if none did."""
        row = self.db.execute("SELECT MAX(seq_id) FROM requests WHERE model_id = ? AND status IN ('done', 'failed')",
                              (target,)).fetchone()
        return -1 if row[0] is None else int(row[0])

    def optimizer_steps(self, target: str) -> int:
        row = self.db.execute("SELECT COUNT(*) FROM requests WHERE model_id = ? AND kind = 'OptimStep' AND "
                              "status = 'done'", (target,)).fetchone()
        return int(row[0])

    def set_committed(self, checksums: dict[str, float]) -> None:
        """Each adapter's checksum after the last cycle that changed it: a worker that kept it is current."""
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM committed")
        self.db.executemany("INSERT INTO committed VALUES (?, ?)", list(checksums.items()))
        self.db.execute("COMMIT")

    def committed(self) -> dict[str, float]:
        return {str(k): float(v) for k, v in self.db.execute("SELECT model_id, checksum FROM committed").fetchall()}

    def get_request(self, request_id: str) -> StoredRequest | None:
        row = self.db.execute("SELECT status, result FROM requests WHERE request_id = ?", (request_id,)).fetchone()
        if row is None:
            return None
        return StoredRequest(request_id, row[0], None if row[1] is None else msgpack.unpackb(row[1]))


@dataclass(frozen=True)
class StoredCheckpoint:
    path: str
    run_id: str
    kind: str
    name: str
    owner: str
    created: float
    size_bytes: int
    step: int
    automatic: bool
    user_metadata: dict[str, str] | None = None  # what the client attached to the save (Tinker's user_metadata)


_RUN_COLUMNS = ("model_id, session_id, owner, base_model, lora_config, created, last_request_time, status, info, "
                "user_metadata")
_CHECKPOINT_COLUMNS = "path, run_id, kind, name, owner, created, size_bytes, step, automatic, user_metadata"


def _json(value: dict[str, str] | None) -> str | None:
    return json.dumps(value) if value else None


def _checkpoint(row: tuple[object, ...]) -> StoredCheckpoint:
    metadata = row[9]
    return StoredCheckpoint(*row[:8], bool(row[8]),  # type: ignore[arg-type]
                            user_metadata=json.loads(str(metadata)) if metadata else None)


def _run(row: tuple[object, ...]) -> StoredRun:
    model_id, session_id, owner, base_model, lora, created, last, status, info, metadata = row
    return StoredRun(
        model_id=str(model_id),
        session_id=str(session_id),
        owner=str(owner),
        base_model=str(base_model),
        lora_config=json.loads(str(lora)),
        created=float(created),  # type: ignore[arg-type]
        last_request_time=float(last),  # type: ignore[arg-type]
        status=str(status),
        info=None if info is None else json.loads(str(info)),
        user_metadata=json.loads(str(metadata)) if metadata else None,
    )
