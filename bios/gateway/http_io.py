"""Request plumbing shared by the gateway's route modules: who is calling, JSON bodies, query parameters, error
bodies (every 4xx/5xx has one).

Who: every `/api/v1` request carries `X-API-Key`. A Bios API key (`tml-bios_...`) acts for its own key id; the
cluster's admin key (`bios keys admin-key`) sent as `tml-biosadmin_...` is the admin, as in the web console: it
may read every key's usage, audit log and sessions, and owns no work itself. The worker token admits workers
only and is refused here, with the command that prints the admin key. Without keys every `tml-` key is the one
local owner.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from aiohttp import web

from bios.actors.actor import ActorStopped
from bios.coordinator.accounts import Accounts
from bios.exceptions import (
    AuthenticationError,
    BadRequestError,
    BiosAPIError,
    RateLimitError,
)
from bios.security.keys import TINKER_PREFIX

from .futures import PROTOBUF
from .http_errors import http_status
from .json_body import Body
from .tokens import JWT_PREFIX, InvalidToken, Tokens

log = logging.getLogger(__name__)

API = "/api/v1"
ADMIN_OWNER = "<admin>"  # the owner of an admin request: no key id looks like it, so it owns nothing


@dataclass(frozen=True)
class Caller:
    owner: str
    admin: bool = False

    @property
    def scope(self) -> str | None:
        """The owner whose records a read covers; None (every key's) for the admin."""
        return None if self.admin else self.owner


CALLER = web.RequestKey("caller", Caller)
OWNER = web.RequestKey("owner", str)  # who a request acts for, from its X-API-Key


def identify(api_key: str | None, accounts: Accounts, tokens: Tokens) -> Caller:
    """The caller a request's X-API-Key (a `tml-` key or a JWT from /auth/token) stands for;
    AuthenticationError for a missing, malformed, wrong or revoked one."""
    if api_key and api_key.startswith(JWT_PREFIX):
        owner, admin = tokens.verify(api_key)
        if admin is not None:
            if accounts.keys is None or admin != accounts.keys.admin_fingerprint():
                raise InvalidToken("the admin key this token was issued for was replaced (bios keys admin-key "
                                   "--rotate): exchange the new one at /api/v1/auth/token")
            return Caller(owner, admin=True)
        if not accounts.is_active(owner):
            raise AuthenticationError("the API key this token was issued for was revoked")
        return Caller(owner)
    if not api_key or not api_key.startswith(TINKER_PREFIX):
        raise AuthenticationError("missing or malformed X-API-Key header: pass api_key='tml-...' to the Tinker "
                                  "ServiceClient or set TINKER_API_KEY=tml-...")
    if accounts.keys is not None and accounts.keys.is_admin(api_key):
        return Caller(ADMIN_OWNER, admin=True)
    return Caller(accounts.authenticate(api_key))


def error_response(exc: BiosAPIError) -> web.Response:
    """A JSON error body for every 4xx/5xx (a body-less 400 makes the SDK reconnect and retry)."""
    name = type(exc).__name__
    status = http_status(exc)
    headers = {}
    if isinstance(exc, RateLimitError):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, InvalidToken):  # RFC 6750: the SDK exchanges its key again and replays the request
        headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
    body = {"detail": exc.message, "type": name, "field": exc.field}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_error(exc.status, exc.text or exc.reason)
    except BiosAPIError as exc:
        return error_response(exc)
    except ActorStopped:
        return http_error(503, "the coordinator is shutting down; retry against the restarted cluster")
    except Exception as exc:
        log.exception("gateway error on %s %s", request.method, request.path)
        return http_error(500, f"internal error in the Bios gateway: {type(exc).__name__}: {exc}")


def http_error(status: int, message: str) -> web.Response:
    return web.json_response({"detail": message, "type": "HTTPError", "field": None}, status=status)


async def json_body(request: web.Request) -> Body:
    if request.content_type == PROTOBUF:
        raise web.HTTPUnsupportedMediaType(text=f"{request.path} takes a JSON body (Content-Type: application/json)")
    raw = await request.read()
    try:
        data = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}", field="body") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the body must be a JSON object, got {type(data).__name__}", field="body")
    return Body(data)


def query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"query parameter {name} must be an integer, got {raw!r}", field=name) from None
    if value < 0:
        raise BadRequestError(f"query parameter {name} must be >= 0, got {value}", field=name)
    return value


def query_time(request: web.Request, name: str, default: Callable[[], float] | None = None) -> float:
    """An RFC 3339 query parameter as Unix seconds (a naive time is UTC)."""
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise BadRequestError(f"query parameter {name} (an RFC 3339 time) is required", field=name)
        return default()
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequestError(f"query parameter {name} must be an RFC 3339 time, got {raw!r}", field=name) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")
