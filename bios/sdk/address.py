"""What a coordinator address is, and what actually listens there.

ZeroMQ answers a malformed address with `Invalid argument` and retries a closed or foreign port silently, so a
mistyped address would surface as a bare error or a timeout. `normalize_address` accepts `HOST:PORT` as
`tcp://HOST:PORT` and explains anything else; `what_listens` tells a Bios (ZeroMQ) socket from an HTTP server
or a closed port, so the SDK and the CLI can say which one they reached.
"""

from __future__ import annotations

import socket
from typing import Literal

Listener = Literal["zeromq", "http", "nothing", "unknown-host", "silent"]

_ZMTP_FIRST = 0xFF  # every ZeroMQ (ZMTP 3) peer greets first, with 0xFF, eight padding bytes and 0x7F


class AddressError(ValueError):
    """An address the SDK cannot use; the message says what to write instead."""


def normalize_address(address: str) -> str:
    """`HOST:PORT` or `tcp://HOST:PORT` -> `tcp://HOST:PORT`; anything else raises `AddressError`."""
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    if scheme in ("http", "https"):
        raise AddressError(
            f"{address!r} is an HTTP URL: the Bios SDK connects to the coordinator's --listen address "
            "(tcp://HOST:7600); the HTTP (--http) port serves the Tinker SDK"
        )
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not colon or not host or not port.isdigit():
        raise AddressError(f"{address!r} is not a coordinator address: write tcp://HOST:PORT, "
                           "e.g. tcp://127.0.0.1:7600")
    return f"tcp://{host}:{port}"


def host_port(address: str) -> tuple[str, int]:
    host, _, port = normalize_address(address)[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def what_listens(address: str, timeout_s: float = 1.0) -> Listener:
    """Connect once with plain TCP: a ZeroMQ peer greets first; an HTTP server answers a HEAD request."""
    try:
        conn = socket.create_connection(host_port(address), timeout=timeout_s)
    except ConnectionRefusedError:
        return "nothing"
    except socket.gaierror:
        return "unknown-host"
    except OSError:  # unreachable or filtered: nothing we can name
        return "silent"
    with conn:
        try:
            greeting = conn.recv(10)
            if len(greeting) >= 1 and greeting[0] == _ZMTP_FIRST:
                return "zeromq"
        except TimeoutError:
            pass
        except OSError:
            return "silent"
        try:
            conn.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            reply = conn.recv(5)
        except OSError:
            return "silent"
    return "http" if reply.startswith(b"HTTP/") else "silent"


def explain_unreachable(address: str) -> str | None:
    """Why `address` cannot be a Bios coordinator, when that can be told from outside; None when it might be."""
    found = what_listens(address)
    if found == "nothing":
        return (f"nothing listens at {address}: start a cluster with `bios up` (or bios-coordinator), or point "
                "--address / BIOS_ADDRESS at a running coordinator")
    if found == "unknown-host":
        return f"cannot resolve the host of {address}: check the name, or use an IP address"
    if found == "http":
        return (f"{address} is an HTTP server (a Bios --http gateway or --metrics port?), not a Bios socket: "
                "connect to the coordinator's --listen address (tcp://HOST:7600 by default)")
    return None
