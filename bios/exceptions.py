"""Errors a Bios user can catch. Each one crosses the wire as a `RemoteError` naming its class (`.type`)."""

from __future__ import annotations

from dataclasses import dataclass


class BiosAPIError(Exception):
    """Base of every error the SDK raises on behalf of the cluster."""

    category: str = "server"

    def __init__(self, message: str, *, request_id: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.field = field


class BadRequestError(BiosAPIError):
    """The request was invalid; `field` names the offending input. Nothing was changed."""

    category = "user"


class AuthenticationError(BiosAPIError):
    """Missing, wrong or revoked API key."""

    category = "user"


class NotFoundError(BiosAPIError):
    """No such run, checkpoint or session (or it belongs to another key)."""

    category = "user"


class ConflictError(BiosAPIError):
    """The request clashes with existing state, e.g. a checkpoint name already in use."""

    category = "user"


class RateLimitError(BiosAPIError):
    """A queue or quota is full; retry after `retry_after` seconds."""

    category = "user"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.retry_after = retry_after


class RequestFailedError(BiosAPIError):
    """The request was accepted but failed while running."""


class InternalServerError(BiosAPIError):
    """A bug or fault inside the cluster; the message says where."""


class TimeoutError(BiosAPIError):  # noqa: A001 - the Tinker SDK exports the same name
    """No answer within the deadline."""


class APIConnectionError(BiosAPIError):
    """The coordinator cannot be reached or went away."""


class ReconnectRequired(BiosAPIError):
    """The coordinator does not know this connection (it restarted): the SDK says Hello again and resends."""


ERROR_TYPES: dict[str, type[BiosAPIError]] = {
    cls.__name__: cls
    for cls in (
        BiosAPIError,
        BadRequestError,
        AuthenticationError,
        NotFoundError,
        ConflictError,
        RateLimitError,
        RequestFailedError,
        InternalServerError,
        TimeoutError,
        APIConnectionError,
        ReconnectRequired,
    )
}


@dataclass(frozen=True)
class RemoteError:
    """An error as it crosses the wire (a handler's answer, a request's outcome): the exception's class name, with
    what a user needs to act on it. `ERROR_TYPES[type]` is the class the receiving side raises again."""

    type: str
    message: str
    field: str | None = None
    retry_after: float | None = None
    request_id: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> RemoteError:
        category = getattr(exc, "category", None)
        name = type(exc).__name__ if category is not None else "InternalServerError"
        message = str(exc) if category is not None else f"{type(exc).__name__}: {exc}"
        return cls(
            type=name,
            message=message,
            field=getattr(exc, "field", None),
            retry_after=getattr(exc, "retry_after", None),
            request_id=getattr(exc, "request_id", None),
        )
