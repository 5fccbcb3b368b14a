"""Request timelines for trace export: when each request of a run was accepted, taken into a cycle, finished.

Acceptance and completion are already in the request log (`requests.created`, `.finished`); this adds the
cycle that ran each request and when that cycle took it, in a `request_cycles` table next to the log. The time
a request was taken is held in memory until it finishes, so a request in flight across a coordinator restart
has no start time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from bios import ids
from bios import messages as m
from bios.exceptions import RequestFailedError

from .disk import GuardedConnection, is_disk_full

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS request_cycles (
    request_id TEXT PRIMARY KEY,
    cycle_id INTEGER NOT NULL,
    started REAL
);
"""


class RequestTimeline:
    def __init__(self, db: GuardedConnection) -> None:
        self.db = db
        self.db.executescript(SCHEMA)
        self._taken: dict[str, float] = {}

    def taken(self, request_ids: Iterable[str]) -> None:
        """These requests were just selected for a cycle."""
        now = time.time()
        for request_id in request_ids:
            if not ids.is_automatic(request_id):  # automatic saves are no client's request
                self._taken.setdefault(request_id, now)

    def finished(self, request_id: str, cycle_id: int) -> None:
        started = self._taken.pop(request_id, None)
        if cycle_id <= 0 and started is None:  # never ran (refused, withdrawn, failed before its cycle)
            return
        try:
            self.db.execute("INSERT OR REPLACE INTO request_cycles VALUES (?, ?, ?)", (request_id, cycle_id, started))
        except RequestFailedError as exc:
            if not is_disk_full(exc):
                raise
            log.warning("cycle of %s not recorded for traces: %s", request_id, exc.message)

    def forget(self, request_id: str) -> None:
        self._taken.pop(request_id, None)

    def of_run(self, run_id: str) -> list[m.TracedRequest]:
        rows = self.db.execute(
            "SELECT r.request_id, r.seq_id, r.kind, r.status, r.created, c.started, r.finished, c.cycle_id "
            "FROM requests r LEFT JOIN request_cycles c ON c.request_id = r.request_id "
            "WHERE r.model_id = ? ORDER BY r.seq_id", (run_id,)).fetchall()
        return [m.TracedRequest(str(r[0]), int(r[1]), str(r[2]), str(r[3]), float(r[4]), r[5], r[6],
                                None if r[7] is None else int(r[7])) for r in rows]
