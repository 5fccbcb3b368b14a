"""API keys, the worker token, the admin key and the cluster's CurveZMQ key pair: what `bios keys` writes and the
coordinator checks.

The worker token admits workers only; every worker host holds it. The admin key (`bios keys admin-key`) is the
HTTP gateway's and the web console's admin credential: it reads every key's runs, usage and audit log. It is
created on first use, so a state dir initialised before it existed gets one without `init`.

One SQLite file per state dir (`security.sqlite3`, mode 0600) holds the cluster secrets and, for each API key,
a salted SHA-256 of its secret, never the secret itself. A key string carries everything a client needs: the
key's id, its secret and the server's public key, so the client can encrypt the connection before it sends
the secret, and users paste one string. Key secrets are 192 random bits, so a fast salted hash is enough.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from bios.exceptions import AuthenticationError, NotFoundError
from bios.transport.sockets import Security

KEYS_FILE = "security.sqlite3"
API_KEY_PREFIX = "bios_"
WORKER_TOKEN_PREFIX = "biosworker_"
ADMIN_KEY_PREFIX = "biosadmin_"
TINKER_PREFIX = "tml-"  # the Tinker SDK sends only keys that start with this, so `tml-bios_...` is accepted too

_KEY_ID_BYTES = 8
_SECRET_BYTES = 24
_WORKER_SECRET_BYTES = 32
_ADMIN_SECRET_BYTES = 32
_PUBLIC_BYTES = 32
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")

SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    server_public TEXT NOT NULL,
    server_secret TEXT NOT NULL,
    worker_secret BLOB NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    salt BLOB NOT NULL,
    digest BLOB NOT NULL,
    created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS admin_key (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    secret BLOB NOT NULL,
    created REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS active_key_names ON api_keys (name) WHERE revoked IS NULL;
"""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _key_bytes(text: str, prefix: str) -> bytes:
    """The bytes of a key written `prefix` + base64 (or `tml-` + that, as the Tinker SDK sends keys); b"" when
    `text` is not one, for the caller to refuse with its own hint."""
    body = text.strip().removeprefix(TINKER_PREFIX) if isinstance(text, str) else ""
    if not body.startswith(prefix):
        return b""
    try:
        return _unb64(body[len(prefix):])
    except (binascii.Error, ValueError):
        return b""


def _digest(salt: bytes, secret: bytes) -> bytes:
    return hashlib.sha256(salt + secret).digest()


@dataclass(frozen=True)
class ApiKey:
    """A client's credential. `str(key)` is the one string users paste; `key_id` is the owner of their work."""

    key_id: str
    secret: bytes
    server_public_key: bytes  # Z85, as zmq takes it

    def __str__(self) -> str:
        raw = bytes.fromhex(self.key_id) + self.secret + z85.decode(self.server_public_key)
        return API_KEY_PREFIX + _b64(raw)

    @classmethod
    def parse(cls, text: str) -> ApiKey:
        """The key in `text` (`bios_...`, or `tml-bios_...` as the Tinker SDK sends it); AuthenticationError if
        it is not one."""
        raw = _key_bytes(text, API_KEY_PREFIX)
        if len(raw) != _KEY_ID_BYTES + _SECRET_BYTES + _PUBLIC_BYTES:
            raise AuthenticationError(
                "malformed API key: expected the bios_... string that `bios keys create NAME` printed"
            )
        secret_end = _KEY_ID_BYTES + _SECRET_BYTES
        return cls(raw[:_KEY_ID_BYTES].hex(), raw[_KEY_ID_BYTES:secret_end], z85.encode(raw[secret_end:]))

    def client_security(self) -> Security:
        """CurveZMQ settings for a client: a fresh key pair of its own, and the server's public key to trust."""
        public, secret = zmq.curve_keypair()
        return Security(public, secret, self.server_public_key)


@dataclass(frozen=True)
class WorkerToken:
    """The workers' shared credential. Its secret derives the CurveZMQ key pair the worker socket admits."""

    secret: bytes
    server_public_key: bytes  # Z85

    def __str__(self) -> str:
        return WORKER_TOKEN_PREFIX + _b64(self.secret + z85.decode(self.server_public_key))

    @classmethod
    def parse(cls, text: str) -> WorkerToken:
        body = text.strip() if isinstance(text, str) else ""
        raw = b""
        if body.startswith(WORKER_TOKEN_PREFIX):
            try:
                raw = _unb64(body[len(WORKER_TOKEN_PREFIX):])
            except (binascii.Error, ValueError):
                raw = b""
        if len(raw) != _WORKER_SECRET_BYTES + _PUBLIC_BYTES:
            raise AuthenticationError(
                "malformed worker token: expected the biosworker_... string that `bios keys worker-token` printed"
            )
        return cls(raw[:_WORKER_SECRET_BYTES], z85.encode(raw[_WORKER_SECRET_BYTES:]))

    def curve_secret_key(self) -> bytes:
        """Z85 CurveZMQ secret key derived from the token, so the coordinator knows the matching public key."""
        return z85.encode(hashlib.sha256(b"bios worker curve key\0" + self.secret).digest())

    def curve_public_key(self) -> bytes:
        return zmq.curve_public(self.curve_secret_key())

    def worker_security(self) -> Security:
        return Security(self.curve_public_key(), self.curve_secret_key(), self.server_public_key)


ADMIN_KEY_HINT = "print it with `bios keys admin-key --state-dir DIR` on the coordinator's host"
WORKER_TOKEN_NOT_ADMIN = ("the worker token admits workers only, not admins: the console's and the HTTP API's admin "
                          f"credential is the admin key; {ADMIN_KEY_HINT}")


@dataclass(frozen=True)
class AdminKey:
    """The cluster's admin credential for the HTTP gateway and the console (every key's records)."""

    secret: bytes

    def __str__(self) -> str:
        return ADMIN_KEY_PREFIX + _b64(self.secret)

    @classmethod
    def parse(cls, text: str) -> AdminKey:
        raw = _key_bytes(text, ADMIN_KEY_PREFIX)
        if len(raw) != _ADMIN_SECRET_BYTES:
            raise AuthenticationError(f"malformed admin key: expected the biosadmin_... string; {ADMIN_KEY_HINT}")
        return cls(raw)


@dataclass(frozen=True)
class ClusterKeys:
    """The coordinator's CurveZMQ key pair and the worker secret, created once by `bios keys init`."""

    server_public_key: bytes  # Z85
    server_secret_key: bytes  # Z85
    worker_secret: bytes

    def server_security(self) -> Security:
        return Security(self.server_public_key, self.server_secret_key)

    def worker_token(self) -> WorkerToken:
        return WorkerToken(self.worker_secret, self.server_public_key)


@dataclass(frozen=True)
class KeyInfo:
    name: str
    key_id: str
    created: float
    revoked: float | None


class KeyStore:
    """The keys of one state dir. Open it with `KeyStore.open` (None until `KeyStore.init` has run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
        self.db.executescript(SCHEMA)
        row = self.db.execute("SELECT server_public, server_secret, worker_secret FROM cluster").fetchone()
        if row is None:
            self.db.close()
            raise FileNotFoundError(f"{path} holds no cluster keys; run `bios keys init`")
        self.cluster = ClusterKeys(row[0].encode(), row[1].encode(), bytes(row[2]))

    @staticmethod
    def path_in(state_dir: Path) -> Path:
        return Path(state_dir) / KEYS_FILE

    @classmethod
    def open(cls, state_dir: Path) -> KeyStore | None:
        """The state dir's keys, or None when `bios keys init` never ran for it (a keyless, loopback cluster)."""
        path = cls.path_in(state_dir)
        return cls(path) if path.exists() else None

    @classmethod
    def init(cls, state_dir: Path) -> tuple[KeyStore, bool]:
        """Create the cluster secrets unless they exist; returns (store, whether they were created now)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        path = cls.path_in(state_dir)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))  # private before any secret is written
        db = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            db.executescript(SCHEMA)
            public, secret = zmq.curve_keypair()
            cursor = db.execute(
                "INSERT OR IGNORE INTO cluster VALUES (1, ?, ?, ?, ?)",
                (public.decode(), secret.decode(), secrets.token_bytes(_WORKER_SECRET_BYTES), time.time()),
            )
            created = cursor.rowcount == 1
        finally:
            db.close()
        return cls(path), created

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------------------------ managing keys

    def create(self, name: str) -> ApiKey:
        """A new key named `name` (unique among keys not revoked); only its hash is stored."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"key name {name!r} must be 1-64 letters, digits, '.', '_', '@' or '-'")
        key = ApiKey(secrets.token_bytes(_KEY_ID_BYTES).hex(), secrets.token_bytes(_SECRET_BYTES),
                     self.cluster.server_public_key)
        salt = secrets.token_bytes(16)
        try:
            self.db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, NULL)",
                            (key.key_id, name, salt, _digest(salt, key.secret), time.time()))
        except sqlite3.IntegrityError:
            raise ValueError(f"a key named {name!r} exists already; revoke it first or pick another name") from None
        return key

    def list(self) -> list[KeyInfo]:
        rows = self.db.execute("SELECT name, key_id, created, revoked FROM api_keys ORDER BY created").fetchall()
        return [KeyInfo(*row) for row in rows]

    def revoke(self, name: str) -> KeyInfo:
        """Revoke the active key called `name`: new connections with it are refused, open ones at their next
        heartbeat."""
        row = self.db.execute("SELECT name, key_id, created FROM api_keys WHERE name = ? AND revoked IS NULL",
                              (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no active key named {name!r}; `bios keys list` shows the keys")
        now = time.time()
        self.db.execute("UPDATE api_keys SET revoked = ? WHERE key_id = ?", (now, row[1]))
        return KeyInfo(row[0], row[1], row[2], now)

    # ------------------------------------------------------------------------------------ checking keys

    def authenticate(self, api_key: str | None) -> str:
        """The owner (key id) of a valid key; AuthenticationError for a missing, malformed, wrong or revoked one."""
        if not api_key:
            raise AuthenticationError(
                "this Bios cluster requires an API key: set BIOS_API_KEY, or pass --api-key KEY to the bios "
                "command (api_key=... to ServiceClient; the key field in the web console); the cluster's admin "
                "creates one with `bios keys create NAME`"
            )
        key = ApiKey.parse(api_key)
        if not hmac.compare_digest(key.server_public_key, self.cluster.server_public_key):
            raise AuthenticationError("this API key belongs to another Bios cluster (its server key differs)")
        row = self.db.execute("SELECT name, salt, digest, revoked FROM api_keys WHERE key_id = ?",
                              (key.key_id,)).fetchone()
        if row is None or not hmac.compare_digest(_digest(bytes(row[1]), key.secret), bytes(row[2])):
            raise AuthenticationError("invalid API key: it is not one of this cluster's keys")
        if row[3] is not None:
            raise AuthenticationError(f"API key {row[0]!r} was revoked; ask the cluster's admin for a new one")
        return key.key_id

    def is_active(self, key_id: str) -> bool:
        row = self.db.execute("SELECT revoked FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        return row is not None and row[0] is None

    # ------------------------------------------------------------------------------------ the admin key

    def admin_key(self, *, rotate: bool = False) -> AdminKey:
        """The admin key, created on first use; `rotate` replaces it (the old one is refused from then on)."""
        secret = secrets.token_bytes(_ADMIN_SECRET_BYTES)
        verb = "INSERT OR REPLACE" if rotate else "INSERT OR IGNORE"
        self.db.execute(f"{verb} INTO admin_key VALUES (1, ?, ?)", (secret, time.time()))
        return AdminKey(bytes(self.db.execute("SELECT secret FROM admin_key").fetchone()[0]))

    def admin_fingerprint(self) -> str | None:
        """A digest naming the current admin key (what the gateway's admin JWTs carry); None before it exists."""
        row = self.db.execute("SELECT secret FROM admin_key").fetchone()
        return None if row is None else hashlib.sha256(b"bios admin key\0" + bytes(row[0])).hexdigest()[:32]

    def is_admin(self, credential: str | None) -> bool:
        """True for this cluster's admin key (`biosadmin_...`, or `tml-biosadmin_...`); False for anything else
        that is no admin credential (an API key: authenticate it). AuthenticationError for a wrong admin key, and
        for the worker token, which admits workers only."""
        body = credential.strip().removeprefix(TINKER_PREFIX) if isinstance(credential, str) else ""
        if body.startswith(WORKER_TOKEN_PREFIX):
            raise AuthenticationError(WORKER_TOKEN_NOT_ADMIN)
        if not body.startswith(ADMIN_KEY_PREFIX):
            return False
        presented = AdminKey.parse(body)
        row = self.db.execute("SELECT secret FROM admin_key").fetchone()
        if row is None:
            raise AuthenticationError("this cluster has no admin key yet: create it with `bios keys admin-key "
                                      "--state-dir DIR` on the coordinator's host")
        if not hmac.compare_digest(presented.secret, bytes(row[0])):
            raise AuthenticationError(f"wrong admin key (it may have been rotated): {ADMIN_KEY_HINT}")
        return True

    def check_worker_token(self, token: str | None) -> None:
        """AuthenticationError unless `token` is this cluster's worker token."""
        if not token:
            raise AuthenticationError("this cluster requires a worker token: start bios-worker with --token or "
                                      "BIOS_WORKER_TOKEN (print it with `bios keys worker-token`)")
        if not hmac.compare_digest(WorkerToken.parse(token).secret, self.cluster.worker_secret):
            raise AuthenticationError("wrong worker token: print this cluster's with `bios keys worker-token`")
