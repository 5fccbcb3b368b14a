"""The HTTP status of each Bios error, shared by every route family the gateway serves.

A conflict (e.g. a checkpoint name in use) is a 400, not a 409: the Tinker SDK retries 409 for five minutes,
and retrying cannot resolve a conflict.
"""

from __future__ import annotations

from bios.exceptions import BiosAPIError

STATUS: dict[str, int] = {
    "BadRequestError": 400,
    "ConflictError": 400,
    "RequestFailedError": 400,
    "AuthenticationError": 401,
    "NotFoundError": 404,
    "TimeoutError": 408,
    "RateLimitError": 429,
    "APIConnectionError": 503,
}


def http_status(exc: BiosAPIError) -> int:
    """The status of the error's own class, else of the nearest Bios error it specializes."""
    for cls in type(exc).__mro__:
        if cls.__name__ in STATUS:
            return STATUS[cls.__name__]
    return 500


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header; None when there is none."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
