"""How full the coordinator's state directory is, and what happens when it fills up.

A full disk must be an error a user can act on, never an outage: a save that would not fit is refused before a
byte is written, with an error that says how much is free and how to free more. A reserve file set aside at start
is given up the moment SQLite finds the disk full, so deleting checkpoints and writing the request log keep
working; it is set aside again once space comes back.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from bios import messages as m
from bios.exceptions import RequestFailedError

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
RESERVE_NAME = "space-reserve"
RESERVE_BYTES = 8 * MiB  # at most; a small filesystem reserves 1/16 of itself
LOW_BYTES = 1 * GiB  # below this much free (or LOW_FRACTION of the filesystem), status warns
LOW_FRACTION = 0.05
HOW_TO_FREE = ("free space by deleting checkpoints you no longer need (`bios checkpoints list RUN_ID` or "
               "RestClient.list_checkpoints lists them, RestClient.delete_checkpoint(path) deletes one), or give "
               "the coordinator a larger --state-dir")

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    free_bytes: int
    total_bytes: int

    @property
    def low(self) -> bool:
        """Time to free space: well before saves start failing."""
        return self.free_bytes < LOW_BYTES or self.free_bytes < LOW_FRACTION * self.total_bytes

    def describe(self) -> str:
        return f"{size(self.free_bytes)} free of {size(self.total_bytes)}"


class StateDisk:
    """Free space and the reserve of one state directory (used only from the coordinator's event loop)."""

    def __init__(self, state_dir: Path, reserve_bytes: int | None = None) -> None:
        self.state_dir = state_dir
        self.reserve_path = state_dir / RESERVE_NAME
        self.reserve_bytes = (min(RESERVE_BYTES, self.usage().total_bytes // 16) if reserve_bytes is None
                              else reserve_bytes)
        self.hold()

    def usage(self) -> Usage:
        st = os.statvfs(self.state_dir)
        return Usage(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)

    def space(self) -> m.StateDirSpace:
        """For `bios status`: free space, with a warning well before saves start failing."""
        usage = self.usage()
        warning = ""
        if usage.low or not self.reserve_path.exists():
            state = "is full" if usage.free_bytes < 2 * self.reserve_bytes else "is running out of space"
            warning = f"the state directory {self.state_dir} {state} ({usage.describe()}); {HOW_TO_FREE}"
        return m.StateDirSpace(str(self.state_dir), usage.free_bytes, usage.total_bytes, warning)

    # ------------------------------------------------------------------------------------ the reserve

    def hold(self) -> bool:
        """Set the reserve aside if it is not, and there is room for it twice over; True if it is held."""
        if self.reserve_path.exists():
            return True
        if self.reserve_bytes <= 0 or self.usage().free_bytes < 2 * self.reserve_bytes:
            return False
        partial = self.reserve_path.with_name(RESERVE_NAME + ".tmp")
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
            os.replace(partial, self.reserve_path)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            log.warning("could not set aside %s in %s for a full disk: %s", size(self.reserve_bytes),
                        self.state_dir, exc)
            return False
        return True

    def release(self) -> bool:
        """Give the reserve up so deletes and the request log can proceed; False if it was already gone."""
        try:
            self.reserve_path.unlink()
        except FileNotFoundError:
            return False
        log.error("the state directory %s is full: released its %s reserve so deletes and the request log can "
                  "proceed; %s", self.state_dir, size(self.reserve_bytes), HOW_TO_FREE)
        return True

    # ------------------------------------------------------------------------------------ writes

    def ensure_room(self, nbytes: int) -> None:
        """Refuse a write of `nbytes` that would leave less than a reserve's worth free for the request log."""
        self.hold()
        if nbytes + self.reserve_bytes > self.usage().free_bytes:
            raise self.full_error(nbytes) from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.state_dir))

    def full_error(self, nbytes: int | None = None) -> RequestFailedError:
        need = ("; the request log cannot be written" if nbytes is None else
                f"; it needs {size(nbytes)}, and {size(self.reserve_bytes)} stays free for the request log")
        return RequestFailedError(f"the coordinator's state directory {self.state_dir} is full "
                                  f"({self.usage().describe()}{need}); {HOW_TO_FREE}")

    def retrying(self, write: Callable[[], T]) -> T:
        """Run `write`; if the disk is full, give up the reserve and run it once more (a failed SQLite statement
        leaves nothing behind), then fail with the full-disk error rather than the bare OS or SQLite one."""
        try:
            return write()
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            if not self.release():
                raise self.full_error() from exc
        try:
            return write()
        except Exception as exc:
            if is_disk_full(exc):
                raise self.full_error() from exc
            raise


class GuardedConnection:
    """A SQLite connection whose statements run under `StateDisk.retrying`: a full disk costs the reserve first,
    then fails the statement with an error that names the state directory, how much is free and how to free it."""

    def __init__(self, db: sqlite3.Connection, disk: StateDisk) -> None:
        self.db = db
        self.disk = disk

    def execute(self, sql: str, parameters: Any = ()) -> sqlite3.Cursor:
        return self.disk.retrying(lambda: self.db.execute(sql, parameters))

    def executemany(self, sql: str, parameters: Any) -> sqlite3.Cursor:
        rows = list(parameters)
        return self.disk.retrying(lambda: self.db.executemany(sql, rows))

    def executescript(self, script: str) -> sqlite3.Cursor:
        return self.disk.retrying(lambda: self.db.executescript(script))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def is_disk_full(exc: BaseException | None) -> bool:
    """True if `exc` (or what caused it) says the filesystem has no room: an OSError, SQLite's SQLITE_FULL, or
    safetensors' own error wrapping ENOSPC."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                                               or "database or disk is full" in str(exc)):
            return True
        if type(exc).__name__ == "SafetensorError" and ("No space left" in str(exc) or "StorageFull" in str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def size(nbytes: float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
