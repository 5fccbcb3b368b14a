"""Short-lived JWTs for the tinker SDK's key exchange (`POST /auth/token`), HS256 with the standard library.

The SDK trades its API key for a JWT, sends the JWT as X-API-Key and refreshes it at about half its lifetime;
`RestClient.whoami` reads the JWT's claims: `sub` (the key, as a URN), `org_id` (the cluster) and `email`
(empty: Bios keys have none). A token names its key, which must still be active on every request, so revoking
a key ends its tokens too. The secret is drawn when the gateway starts: after a restart the SDK is told its
token is invalid (RFC 6750) and exchanges its key again.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time

from bios.exceptions import AuthenticationError

LIFETIME_S = 3600
JWT_PREFIX = "eyJ"  # base64 of '{"': what the SDK and the gateway take for a JWT
KEY_URN = "bios:key:"
ORG = "bios"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class InvalidToken(AuthenticationError):
    """A JWT this gateway cannot accept (forged, expired, or from before a restart): exchange the key again."""


class Tokens:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or os.urandom(32)
        self._header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())

    def _sign(self, signing_input: str) -> str:
        return _b64(hmac.new(self._secret, signing_input.encode(), hashlib.sha256).digest())

    def issue(self, owner: str, admin: str | None = None) -> str:
        """A token for `owner`; `admin`: the fingerprint of the admin key it stands for (None for an API key's),
        so replacing the admin key (`bios keys admin-key --rotate`) ends its tokens too."""
        now = int(time.time())
        claims = {"sub": f"{KEY_URN}{owner}", "org_id": ORG, "email": "", "admin": admin is not None,
                  "iat": now, "exp": now + LIFETIME_S}
        if admin is not None:
            claims["admin_key"] = admin
        signing_input = f"{self._header}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
        return f"{signing_input}.{self._sign(signing_input)}"

    def verify(self, token: str) -> tuple[str, str | None]:
        """(owner, admin key fingerprint or None) of a token this gateway issued and that has not expired;
        InvalidToken otherwise."""
        header, _, rest = token.partition(".")
        payload, _, signature = rest.partition(".")
        if not signature or not hmac.compare_digest(self._sign(f"{header}.{payload}"), signature):
            raise InvalidToken("this token was not issued by this gateway (or it restarted since): exchange the "
                               "API key for a new one at /api/v1/auth/token")
        claims = json.loads(_unb64(payload))
        if float(claims["exp"]) <= time.time():
            raise InvalidToken("this token expired: exchange the API key for a new one at /api/v1/auth/token")
        admin = claims.get("admin_key") if claims.get("admin") else None
        return str(claims["sub"]).removeprefix(KEY_URN), None if admin is None else str(admin)
