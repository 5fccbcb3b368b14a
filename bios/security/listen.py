"""Which addresses a coordinator may listen on without keys: only ones no other machine can reach.

Both front ends that carry data and control are guarded: the ZeroMQ client socket (`--listen`) and the HTTP
gateway (`--http`: the Tinker API, the console and `/v1`). `--metrics` is not: it serves aggregate counters only
(no data, no control), without a key even on a cluster with keys, as Prometheus scrapes.
"""

from __future__ import annotations

import ipaddress


class InsecureListenError(ValueError):
    """A coordinator without keys was asked to listen where other machines could reach it."""


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback IPs (`127.x`, `::1`, bracketed or not); False for `0.0.0.0`, `*`, names."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', an interface name or a DNS name: possibly public
        return False


def is_local_address(address: str) -> bool:
    """True for loopback TCP (`127.x`, `::1`, `localhost`) and for `ipc://`/`inproc://` endpoints."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    return is_loopback_host(rest.rpartition(":")[0])


def check_listen(address: str, *, keys: bool) -> None:
    """Refuse a keyless coordinator on a reachable address, before it binds anything."""
    if keys or is_local_address(address):
        return
    raise InsecureListenError(
        f"refusing to listen on {address} without API keys: anyone who can reach it could read and train on "
        "this cluster's data. Create keys first with `bios keys init --state-dir DIR` (the coordinator's "
        "--state-dir), then `bios keys create NAME` for each user; or listen on tcp://127.0.0.1:PORT."
    )


def check_http(address: str, *, keys: bool) -> None:
    """Refuse a keyless HTTP gateway (`--http HOST:PORT`) on a reachable host, before anything binds: without
    keys it accepts any `tml-` key, so anyone who reaches it could read and train on the cluster's data."""
    host = address.rpartition(":")[0] or "127.0.0.1"  # an empty host is loopback (the gateway's default)
    if keys or is_loopback_host(host):
        return
    raise InsecureListenError(
        f"refusing to serve the HTTP API on {address} (--http) without API keys: anyone who can reach it could "
        "read and train on this cluster's data. Create keys first with `bios keys init --state-dir DIR` (the "
        "coordinator's --state-dir), then `bios keys create NAME` for each user; or serve on 127.0.0.1:PORT."
    )
