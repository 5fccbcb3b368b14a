"""Download links that need no API key, as Tinker's signed URLs: `/downloads/<path>?expires=T&sig=HMAC`.

The secret is drawn when the gateway starts, so a restarted gateway's links stop working (ask again for fresh
ones, as for expired links). The HMAC covers the path and the expiry, so a link opens one file until it expires.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from urllib.parse import quote

from bios.exceptions import AuthenticationError

PREFIX = "/downloads/"
LIFETIME_S = 3600.0


class SignedUrls:
    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or os.urandom(32)

    def _sig(self, path: str, expires: int) -> str:
        return hmac.new(self._secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def sign(self, base_url: str, path: str, lifetime_s: float = LIFETIME_S) -> tuple[str, float]:
        """A link to `path` (below /downloads/) and when it expires (Unix seconds)."""
        expires = int(time.time() + lifetime_s)
        return f"{base_url}{PREFIX}{quote(path)}?expires={expires}&sig={self._sig(path, expires)}", float(expires)

    def check(self, path: str, expires: str | None, sig: str | None) -> None:
        """AuthenticationError unless the link to `path` is ours and unexpired."""
        if not expires or not expires.isdigit() or not sig:
            raise AuthenticationError("a download link needs its expires and sig parameters; ask for a new link")
        if not hmac.compare_digest(self._sig(path, int(expires)), sig):
            raise AuthenticationError("this download link is not valid here (wrong signature, or the gateway "
                                      "restarted since): ask for a new link")
        if int(expires) < time.time():
            raise AuthenticationError("this download link expired: ask for a new link")
