"""Account records a key can read about itself, and the queries that ask for them: usage (what Tinker bills),
the audit log, checkpoint storage now, and a checkpoint's published flag and expiry.

Typed values shared by the coordinator (which keeps them), the native SDK and the HTTP gateway; the codec
carries every dataclass here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bios.exceptions import BadRequestError

MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400  # Tinker's bounds on a checkpoint's TTL: one hour to ten years
DEFAULT_PROJECT = "default"  # Bios has no projects to grant access to: a session without a project label is here
HOUR = 3600.0
GIGABYTE = 1e9  # storage is billed in decimal gigabytes


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    owner: str
    created: float
    closed: bool
    display_name: str | None
    user_metadata: dict[str, str] | None
    project_id: str | None
    finish_reason: str | None  # success | errored | interrupted, when the client said so
    finish_detail: str | None
    checkpoints_count: int
    checkpoint_storage_bytes: int


def check_ttl(raw: object) -> int | None:
    """None (never expires) or whole seconds from one hour to ten years; BadRequestError otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or not MIN_TTL_S <= raw <= MAX_TTL_S:
        raise BadRequestError(f"ttl_seconds must be an integer from {MIN_TTL_S} (1 hour) to {MAX_TTL_S} "
                              f"(10 years), or null for no expiry; got {raw!r}", field="ttl_seconds")
    return raw


MAX_METADATA_ENTRIES, MAX_METADATA_CHARS = 64, 16384  # bounds on one run's or checkpoint's user_metadata


def check_user_metadata(raw: object, field: str = "user_metadata") -> dict[str, str] | None:
    """Tinker's `user_metadata`: an object of string values (None or empty: none), at most 64 entries and 16 KiB of
    text; BadRequestError otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise BadRequestError(f"{field} must be an object of string keys and string values, got {raw!r:.200}",
                              field=field)
    if len(raw) > MAX_METADATA_ENTRIES or sum(len(k) + len(v) for k, v in raw.items()) > MAX_METADATA_CHARS:
        raise BadRequestError(f"{field} is too large: at most {MAX_METADATA_ENTRIES} entries and "
                              f"{MAX_METADATA_CHARS} characters of keys and values", field=field)
    return dict(raw) or None

# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class UsageBucket:
    """One hour of one kind of usage for one key, session and base model (Tinker's `BillingUsageEvent`)."""

    bucket_start: float
    owner: str
    session_id: str | None
    base_model: str | None
    kind: str  # training | sampling_prefill | sampling_sample | checkpoint | storage
    quantity: float  # tokens, checkpoints saved, or gigabyte-hours


@dataclass(frozen=True)
class StoredNow:
    """A key's checkpoints as they are now, per project label."""

    owner: str
    project_id: str | None  # the session's project label; None when it has none
    checkpoint_count: int
    size_bytes: int


@dataclass(frozen=True)
class AuditEntry:
    time: float
    owner: str
    event: str  # <resource>_<action>, as Tinker names them
    details: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ queries


@dataclass(frozen=True)
class GetUsage:
    """Hourly usage in [start, end) (Unix seconds)."""

    start: float
    end: float


@dataclass(frozen=True)
class UsageReport:
    buckets: list[UsageBucket]


@dataclass(frozen=True)
class GetAuditLog:
    """Audit entries in [start, end); `event_type` is Tinker's filter: all, checkpoints, projects, organizations,
    teams."""

    start: float
    end: float
    event_type: str = "all"


@dataclass(frozen=True)
class AuditReport:
    entries: list[AuditEntry]


@dataclass(frozen=True)
class GetCheckpointStorage:
    pass


@dataclass(frozen=True)
class StorageReport:
    items: list[StoredNow]


@dataclass(frozen=True)
class PublishCheckpoint:
    """Set a checkpoint's `public` flag: every key may load a published checkpoint by its path."""

    path: str
    public: bool = True


@dataclass(frozen=True)
class SetCheckpointTTL:
    """Delete the checkpoint `ttl_seconds` from now (None: never)."""

    path: str
    ttl_seconds: int | None


@dataclass(frozen=True)
class CheckpointTTL:
    path: str
    expires_at: float | None
