"""Which network a worker's collectives use, and how to say so when its peers cannot reach it.

gloo and NCCL open their sockets on the interface `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` name, else on the
one the host name resolves to, which on many Linux installs is a loopback address (`/etc/hosts` maps it to
127.0.1.1): peers on other hosts could then never connect. Unless the operator set them, a worker points both
at the interface holding the address it advertises to its peers (the one it reaches the coordinator from).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Mapping

import psutil

log = logging.getLogger(__name__)

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] ": where in gloo's C++ an error arose
_SOURCE_LOCATION = re.compile(r"\[/[^\]\s]+:\d+\] ")


def advertised_host(coordinator: str) -> str:
    """The local address peers can reach: the one this host uses to reach the coordinator."""
    host = coordinator.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def store_listener(host: str) -> tuple[int, int] | None:
    """A listening TCP socket on `host` only (a free port), for the worker's rendezvous `TCPStore`: (its file
    descriptor, which the store takes over and closes, its port). torch's store binds every interface when it
    opens its own socket; a worker on a loopback-only cluster must not be reachable from the network. None when
    `host` is no address of this machine (the store then binds every interface, as torch does, and says so)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        log.warning("the rendezvous store cannot bind %s (%s), so it listens on every interface", host, exc)
        return None
    port = listener.getsockname()[1]
    return listener.detach(), port


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IP `address` on this host, if any does."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            return name
    return None


def socket_interfaces(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The `*_SOCKET_IFNAME` variables to set so collectives use `host`'s interface; the operator's win."""
    unset = [var for var in SOCKET_IFNAME_VARS if not environ.get(var)]
    interface = interface_of(host) if unset else None
    return {var: interface for var in unset} if interface else {}


def socket_endpoint(var: str, environ: Mapping[str, str]) -> str:
    """Where the collectives open this worker's sockets, in words: the interface `var` names and its addresses,
    else the address the host name resolves to."""
    interface = environ.get(var)
    if interface:
        addresses = [a.address for a in psutil.net_if_addrs().get(interface, []) if a.family == socket.AF_INET]
        return f"interface {interface} ({', '.join(addresses) or 'no IPv4 address'})"
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        resolved = "which does not resolve"
    return f"the address of host name {name} ({resolved})"


def unreachable(generation: int, world: int, backend: str, host: str, cause: BaseException,
                environ: Mapping[str, str]) -> str:
    """One line for a group that could not form: gloo's or NCCL's reason, where this worker's sockets were,
    the address it advertises, and the variable that moves them."""
    var = SOCKET_IFNAME_VARS[1] if backend == "nccl" else SOCKET_IFNAME_VARS[0]
    reason = " ".join(_SOURCE_LOCATION.sub("", str(cause)).split())
    advertised = interface_of(host)
    return (f"could not form generation {generation} ({world} workers, {backend}): {reason}; this worker's sockets "
            f"are on {socket_endpoint(var, environ)} and it reaches the coordinator from {host}"
            f"{f' (interface {advertised})' if advertised else ''}: if its peers cannot reach it there, set {var} to "
            f"the interface the hosts share")
