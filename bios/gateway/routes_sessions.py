"""Tinker's session routes: create, heartbeat, finish, list, get, search, project and trace export.

A session's display name, user metadata, project and finish reason are kept (`bios.coordinator.labels`) for
`get_session` and `search_sessions`. Bios has no projects to grant access to: a project id is a label, and a
session without one is in project `default`. A key searches its own sessions; only the admin (the admin key)
searches every key's. `trace_export` is ready at once: a link, served by this gateway, to the Chrome trace JSON
(which Perfetto opens) of the session's training runs and sampling sessions, one process each.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from aiohttp import web

from bios import messages as m
from bios.account import DEFAULT_PROJECT, SessionSummary
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import BadRequestError, NotFoundError
from bios.run_trace import chrome_trace

from .http_io import API, CALLER, OWNER, http_error, json_body, query_int, rfc3339
from .signed_urls import PREFIX, SignedUrls

MAX_SEARCH = 200


class SessionRoutes:
    def __init__(self, front_door: FrontDoor, accounts: Accounts, urls: SignedUrls) -> None:
        self.accounts = accounts
        self.front_door = front_door
        self.labels = accounts.labels
        self.urls = urls

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(f"{API}/create_session", self.create_session),
            web.post(f"{API}/session_heartbeat", self.session_heartbeat),
            web.post(f"{API}/telemetry", self.telemetry),
            web.post(f"{API}/sessions/{{session_id}}/finish", self.finish_session),
            web.get(f"{API}/sessions", self.list_sessions),
            web.post(f"{API}/sessions/search", self.search_sessions),
            web.get(f"{API}/sessions/{{session_id}}", self.get_session),
            web.put(f"{API}/sessions/{{session_id}}/project", self.assign_project),
            web.get(f"{API}/sessions/{{session_id}}/trace_export", self.trace_export),
            web.get(f"{PREFIX}traces/{{session_id}}.json", self.download_trace),
        ]

    # ------------------------------------------------------------------------------------ lifecycle

    async def create_session(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        session_id = self.front_door.open_session(request[OWNER])
        metadata = body.data.get("user_metadata")
        self.labels.label_session(session_id, _text(body.data.get("display_name")),
                                  _str_dict(metadata, "user_metadata") if metadata else None,
                                  _text(body.data.get("project_id")))
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def session_heartbeat(self, request: web.Request) -> web.Response:
        session_id = (await json_body(request)).text("session_id")
        if not self.front_door.heartbeat(session_id, request[OWNER]):
            return http_error(410, f"session {session_id} is finished")
        return web.json_response({"type": "session_heartbeat"})

    async def telemetry(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "accepted"})

    async def finish_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        body = await json_body(request)
        self.front_door.close_session(session_id, request[OWNER])
        reason = body.data.get("reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        self.labels.finish(session_id, kind if kind in ("success", "errored", "interrupted") else None,
                           _text(body.data.get("detail")))
        return web.json_response({})

    # ------------------------------------------------------------------------------------ reading

    async def list_sessions(self, request: web.Request) -> web.Response:
        """The key's sessions, newest first."""
        listed = [s.session_id for s in self.labels.sessions(request[OWNER])]
        offset, limit = query_int(request, "offset", 0), query_int(request, "limit", 20)
        return web.json_response({"sessions": listed[offset: offset + limit]})

    async def get_session(self, request: web.Request) -> web.Response:
        session_id, owner = request.match_info["session_id"], request[OWNER]
        out: dict[str, Any] = {"training_run_ids": self.front_door.runs_of_session(session_id, owner),
                               "sampler_ids": self.front_door.samplers_of_session(session_id, owner)}
        summary = self._summary(session_id, owner)
        if summary is not None:
            out["user_metadata"], out["display_name"] = summary.user_metadata, summary.display_name
        return web.json_response(out)

    def _summary(self, session_id: str, owner: str) -> SessionSummary | None:
        return next((s for s in self.labels.sessions(owner) if s.session_id == session_id), None)

    async def assign_project(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        project = _text((await json_body(request)).data.get("project_id"))
        if not project:
            raise BadRequestError("project_id is required (sessions cannot be moved out of a project)",
                                  field="project_id")
        self.front_door.check_session(session_id, request[OWNER])
        self.labels.set_project(session_id, project)
        return web.json_response({})

    async def search_sessions(self, request: web.Request) -> web.Response:
        body, caller = (await json_body(request)).data, request[CALLER]
        limit = body.get("limit", 50)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_SEARCH:
            raise BadRequestError(f"limit must be 1 to {MAX_SEARCH}, got {limit!r}", field="limit")
        found = [s for s in self.labels.sessions(caller.scope if _whose(body) != "own" else caller.owner)
                 if _matches(s, body)]
        cursor = body.get("cursor")
        if isinstance(cursor, dict):
            after = (_seconds(cursor.get("last_created_at")), str(cursor.get("last_session_id")))
            found = [s for s in found if (round(s.created, 6), s.session_id) < (round(after[0], 6), after[1])]
        page = found[:limit]
        next_cursor = None
        if len(found) > limit:
            last = page[-1]
            next_cursor = {"last_created_at": rfc3339(last.created), "last_session_id": last.session_id}
        return web.json_response({"sessions": [_summary_json(s) for s in page], "next_cursor": next_cursor})

    # ------------------------------------------------------------------------------------ traces

    async def trace_export(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        self.front_door.check_session(session_id, request[OWNER])
        url, _ = self.urls.sign(f"{request.scheme}://{request.host}", f"traces/{session_id}.json")
        return web.json_response({"status": "ready", "url": url})

    async def download_trace(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        self.urls.check(f"traces/{session_id}.json", request.query.get("expires"), request.query.get("sig"))
        owner = self.accounts.session_owner(session_id)
        if owner is None:
            raise NotFoundError(f"no session {session_id!r}", field="session_id")
        events: list[dict[str, Any]] = []
        targets = self.front_door.runs_of_session(session_id, owner) + self.front_door.samplers_of_session(
            session_id, owner)
        for pid, target in enumerate(targets, start=1):
            trace = chrome_trace(await self.front_door.query(m.GetRunTrace(target), owner))
            events.extend({**event, "pid": pid} for event in trace["traceEvents"])
        return web.json_response({"traceEvents": events, "displayTimeUnit": "ms"})


def _whose(body: dict[str, Any]) -> str:
    owner = body.get("owner")
    return str(owner.get("type", "own")) if isinstance(owner, dict) else "own"


def _status(s: SessionSummary) -> dict[str, Any] | None:
    if not s.closed:
        return {"type": "active"}
    if s.finish_reason is not None:
        return {"type": "client_finished", "reason": {"type": s.finish_reason}, "detail": s.finish_detail}
    return None  # closed when its heartbeats stopped: neither finished nor running


def _matches(s: SessionSummary, query: dict[str, Any]) -> bool:
    session_id, name = query.get("session_id"), query.get("display_name")
    if session_id is not None or name is not None:
        by_id = session_id is not None and s.session_id == session_id
        words = str(name or "").lower().split()
        by_name = bool(words) and s.display_name is not None and all(w in s.display_name.lower() for w in words)
        if not (by_id or by_name):
            return False
    projects = query.get("project_ids")
    if projects is not None and (s.project_id or DEFAULT_PROJECT) not in projects:
        return False
    metadata = query.get("user_metadata") or {}
    if any((s.user_metadata or {}).get(k) != v for k, v in metadata.items()):
        return False
    owner = query.get("owner")
    if isinstance(owner, dict) and owner.get("type") == "user" and s.owner not in (owner.get("owner_urns") or []):
        return False
    statuses = query.get("statuses")
    if statuses is not None:
        status = _status(s)
        return status is not None and any(_status_matches(status, q) for q in statuses if isinstance(q, dict))
    return True


def _status_matches(status: dict[str, Any], query: dict[str, Any]) -> bool:
    if status["type"] != query.get("type"):
        return False
    reasons = query.get("reasons")
    return reasons is None or status["reason"]["type"] in reasons


def _summary_json(s: SessionSummary) -> dict[str, Any]:
    return {"session_id": s.session_id, "created_at": rfc3339(s.created), "owner": s.owner,
            "project_id": s.project_id or DEFAULT_PROJECT, "status": _status(s),
            "checkpoints_count": s.checkpoints_count, "display_name": s.display_name,
            "user_metadata": s.user_metadata, "checkpoint_storage_bytes": s.checkpoint_storage_bytes}


def _seconds(text: object) -> float:
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise BadRequestError(f"cursor.last_created_at must be an RFC 3339 time, got {text!r}",
                              field="cursor") from None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _str_dict(value: object, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadRequestError(f"{field} must be an object of string values", field=field)
    return dict(value)
