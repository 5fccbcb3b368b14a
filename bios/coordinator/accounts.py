"""What a front end other than the native endpoint (the HTTP gateway and its console) uses of the coordinator
besides the front door: who an API key is, the labels of sessions and checkpoints, the audit log, run records,
and checkpoint files and copies. One facade, so the gateway sees no store, catalog or wiring of the coordinator."""

from __future__ import annotations

from pathlib import Path

from bios.checkpoint_path import CheckpointPath
from bios.security.keys import KeyStore

from .audit import AuditLog
from .catalog import Catalog
from .copies import copy_checkpoint
from .labels import Labels
from .store import GuardedConnection, Store, StoredRun

LOCAL_OWNER = "local"  # every caller's owner on a cluster without keys


class Accounts:
    def __init__(self, keys: KeyStore | None, labels: Labels, audit: AuditLog, store: Store, catalog: Catalog) -> None:
        self.keys = keys  # None: `bios keys init` never ran, so the coordinator listens on loopback only
        self.labels = labels  # sessions' names, metadata, projects, finish reasons; checkpoints' TTL and publishing
        self.audit = audit
        self._store = store
        self._catalog = catalog

    @property
    def keys_required(self) -> bool:
        """True once `bios keys init` ran for the state dir: every front end must then check keys."""
        return self.keys is not None

    def authenticate(self, api_key: str | None) -> str:
        """The owner an API key stands for (its key id); AuthenticationError if it is missing, wrong or revoked.
        Without keys every caller is `LOCAL_OWNER`."""
        if self.keys is None:
            return LOCAL_OWNER
        return self.keys.authenticate(api_key)

    def is_active(self, owner: str) -> bool:
        """Whether `owner`'s key still stands (always, without keys)."""
        return self.keys is None or self.keys.is_active(owner)

    def run(self, run_id: str) -> StoredRun | None:
        return self._store.get_run(run_id)

    def session_owner(self, session_id: str) -> str | None:
        return self._store.session_owner(session_id)

    def checkpoint_files(self, path: CheckpointPath) -> list[Path]:
        """The files a checkpoint is stored as (for downloads)."""
        return self._catalog.files.files(path)

    def copy_checkpoint(self, source: str, owner: str, session_id: str) -> str:
        """Copy a checkpoint `owner` may read into run `<session_id>:train:0`; returns the copy's path."""
        return copy_checkpoint(self._store, self._catalog, source, owner, session_id)

    @property
    def db(self) -> GuardedConnection:
        """The state dir's SQLite connection, for records a front end keeps there (custom losses)."""
        return self._store.db
