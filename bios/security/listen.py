"""Which addresses a coordinator may listen on without keys: only ones no other machine can reach."""

from __future__ import annotations

import ipaddress


class InsecureListenError(ValueError):
    """A coordinator without keys was asked to listen where other machines could reach it."""


def is_local_address(address: str) -> bool:
    """True for loopback TCP (`127.x`, `::1`, `localhost`) and for `ipc://`/`inproc://` endpoints."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a DNS name: possibly public
        return False


def check_listen(address: str, *, keys: bool) -> None:
    """Refuse a keyless coordinator on a reachable address, before it binds anything."""
    if keys or is_local_address(address):
        return
    raise InsecureListenError(
        f"refusing to listen on {address} without API keys: anyone who can reach it could read and train on "
        "this cluster's data. Create keys first with `bios keys init --state-dir DIR` (the coordinator's "
        "--state-dir), then `bios keys create NAME` for each user; or listen on tcp://127.0.0.1:PORT."
    )
