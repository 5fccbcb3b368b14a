"""Tinker's account routes: the calling key (`auth/apikey/me`), JWT exchange, the audit log and usage.

Usage is what `bios.coordinator.usage` accounts per key (training, prefill and sampled tokens, checkpoints
saved, gigabyte-hours stored), in Tinker's hourly `BillingUsageEvent` shape; Bios prices nothing, so every cost
and rate is null. A key reads its own usage and audit log; the admin (the admin key, `bios keys admin-key`) reads every key's.
`auth/token` exchanges the calling key for a short-lived JWT (`client/config` sets `pjwt_auth_enabled`, so the
SDK sends it instead of the key, and `RestClient.whoami` reads the key, as a URN, from its claims).
"""

from __future__ import annotations

import time
from datetime import date, datetime, timezone
from typing import Any

from aiohttp import web

from bios import account as a
from bios.account import DEFAULT_PROJECT, GIGABYTE, HOUR, AuditEntry, UsageBucket
from bios.coordinator.accounts import Accounts
from bios.coordinator.front_door import FrontDoor
from bios.exceptions import BadRequestError, NotFoundError

from .http_io import API, CALLER, Caller, query_time, rfc3339
from .tokens import Tokens

MAX_WINDOW_S = 14 * 86400  # Tinker's longest usage window
DAY = 86400.0


class AccountRoutes:
    def __init__(self, front_door: FrontDoor, accounts: Accounts, tokens: Tokens) -> None:
        self.accounts = accounts
        self.tokens = tokens
        self.front_door = front_door
        self.labels = accounts.labels

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(f"{API}/auth/apikey/me", self.describe_key),
            web.delete(f"{API}/auth/apikey/me", self.revoke_key),
            web.post(f"{API}/auth/token", self.token),
            web.get(f"{API}/audit", self.audit_log),
            web.get(f"{API}/billing/usage/events", self.usage_events),
            web.get(f"{API}/billing/usage/checkpoints/current", self.storage_now),
        ]

    # ------------------------------------------------------------------------------------ keys

    async def describe_key(self, request: web.Request) -> web.Response:
        """Tinker's `SelfApiKeyResponse`: `key_id` is the (hex) key id as an integer; `bios_key_id` the id itself."""
        caller: Caller = request[CALLER]
        keys = self.accounts.keys
        if keys is None:
            return web.json_response(_key_json(0, caller.owner, "a cluster without keys: every tml- key is the "
                                               "local owner", caller))
        if caller.admin:
            return web.json_response(_key_json(0, "admin key", "the cluster's admin key (bios keys admin-key)", caller))
        info = next(k for k in keys.list() if k.key_id == caller.owner)
        return web.json_response(_key_json(int(info.key_id, 16), info.name, f"created {rfc3339(info.created)}", caller))

    async def revoke_key(self, request: web.Request) -> web.Response:
        """Revoke the calling key itself (what `tinker auth logout` does), never another."""
        caller: Caller = request[CALLER]
        keys = self.accounts.keys
        if keys is None or caller.admin:
            raise BadRequestError("only an API key can revoke itself; this cluster has no keys" if keys is None
                                  else "the admin key cannot revoke itself; replace it with `bios keys admin-key "
                                       "--rotate` instead", field="X-API-Key")
        name = next(k.name for k in keys.list() if k.key_id == caller.owner)
        keys.revoke(name)
        return web.json_response({})

    async def token(self, request: web.Request) -> web.Response:
        """A JWT for the calling key (the tinker SDK's exchange; `bios.gateway.tokens`)."""
        caller: Caller = request[CALLER]
        keys = self.accounts.keys
        admin = keys.admin_fingerprint() if caller.admin and keys is not None else None
        return web.json_response({"jwt": self.tokens.issue(caller.owner, admin)})

    # ------------------------------------------------------------------------------------ audit

    async def audit_log(self, request: web.Request) -> web.Response:
        caller: Caller = request[CALLER]
        raw_day = request.query.get("day")
        try:
            day = date.fromisoformat(raw_day) if raw_day else datetime.now(timezone.utc).date()
        except ValueError:
            raise BadRequestError(f"day must be YYYY-MM-DD, got {raw_day!r}", field="day") from None
        start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()
        query = a.GetAuditLog(start, start + DAY, request.query.get("event_type", "all"))
        report = await self._read(query, caller)
        return web.json_response({"entries": [_audit_json(e) for e in report.entries]})

    async def _read(self, query: Any, caller: Caller) -> Any:
        """The caller's records; every key's for the admin."""
        return self.front_door.read_any_owner(query) if caller.admin else await self.front_door.query(query,
                                                                                                      caller.owner)

    # ------------------------------------------------------------------------------------ usage

    async def usage_events(self, request: web.Request) -> web.Response:
        caller: Caller = request[CALLER]
        start, end = query_time(request, "starting_on"), query_time(request, "ending_before")
        if not start < end <= start + MAX_WINDOW_S:
            raise BadRequestError("ending_before must be after starting_on and at most 14 days later",
                                  field="ending_before")
        if start > time.time():
            raise BadRequestError("starting_on must not be in the future", field="starting_on")
        buckets = (await self._read(a.GetUsage(start, end), caller)).buckets
        sessions = {s.session_id: s for s in self.labels.sessions(caller.scope)}
        data = [_usage_json(b, sessions.get(b.session_id or "")) for b in buckets]
        used = {b.session_id for b in buckets if b.session_id in sessions}
        return web.json_response({"data": data, "cost_data_through": None,
                                  "sessions": {s: {"user_metadata": sessions[s].user_metadata} for s in used}})

    async def storage_now(self, request: web.Request) -> web.Response:
        caller: Caller = request[CALLER]
        project = request.query.get("project_id")
        rows = [r for r in (await self._read(a.GetCheckpointStorage(), caller)).items
                if project is None or (r.project_id or DEFAULT_PROJECT) == project]
        if project is not None and not rows and not any(
                (s.project_id or DEFAULT_PROJECT) == project for s in self.labels.sessions(caller.scope)):
            raise NotFoundError(f"no project {project!r} among your sessions", field="project_id")
        return web.json_response({"effective_rate_usd_per_gigabyte_month": None, "data": [
            {"project_id": r.project_id or DEFAULT_PROJECT, "org_user_urn": r.owner, "checkpoint_count":
             r.checkpoint_count, "size_bytes": r.size_bytes, "size_gigabytes": r.size_bytes / GIGABYTE,
             "estimated_monthly_cost_usd": None} for r in rows]})


def _key_json(number: int, name: str, note: str, caller: Caller) -> dict[str, Any]:
    return {"key_id": number, "name": name, "note": note, "bios_key_id": caller.owner, "admin": caller.admin,
            "details": {"org_details": {"name": "bios"}, "user_details": {"email": ""}}}


def _audit_json(entry: AuditEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"timestamp": rfc3339(entry.time), "event": entry.event,
                           "event_details": {**entry.details, "owner": entry.owner}}
    if "path" in entry.details and entry.event.startswith("checkpoint_"):
        path = str(entry.details["path"])
        out["tinker_path"] = f"tinker://{path.partition('://')[2]}"
        out["model_id"] = path.partition("://")[2].split("/")[0]
    return out


def _usage_json(bucket: UsageBucket, session: Any) -> dict[str, Any]:
    kind, quantity = bucket.kind, bucket.quantity
    info: dict[str, Any] = {"type": kind}
    if kind == "storage":
        info.update(free=False, gigabyte_hours=quantity)
    elif kind == "checkpoint":
        info["count"] = int(quantity)
    else:
        info["token_count"] = int(quantity)
        if kind == "sampling_prefill":
            info["cached"] = False  # Bios has no prefill cache to serve from
    return {"bucket_start": rfc3339(bucket.bucket_start), "bucket_end": rfc3339(bucket.bucket_start + HOUR),
            "base_model": bucket.base_model, "user_id": bucket.owner, "session_id": bucket.session_id,
            "project_id": (session.project_id or DEFAULT_PROJECT) if session is not None else None,
            "estimated_cost_usd": None, "effective_rate_usd_per_million_tokens": None,
            "effective_rate_usd_per_gigabyte_month": None, "event_info": info}
