"""Hosts for multi-host tests: Linux network namespaces on one bridge, each with its own non-loopback address.

Every host is a namespace holding one end of a veth pair (`eth0`, 10.77.0.N/24); the other ends hang on a bridge
in a namespace of its own, so nothing is added to the machine's own network and concurrent test runs cannot
collide (namespace names carry the test process's pid). `cut` / `restore` set a host's link down and up: a
network partition. `close` kills what was started and deletes the namespaces, whatever happened before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

SUBNET = "10.77.0"
_PR_SET_PDEATHSIG = 1


def netns_unavailable() -> str | None:
    """Why this machine cannot run namespace hosts (no `ip`, or `ip netns add` refused), else None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"biosprobe{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"`ip netns add` is not permitted here: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _remove_stale_namespaces() -> None:
    """Delete the namespaces of test runs that were killed before they could (their pid is gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        match = re.fullmatch(r"bios(\d+)\w*", name)
        if match and not psutil.pid_exists(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the child when the test process dies, so no daemon outlives a crashed test run."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    interface: str = "eth0"


class Hosts:
    def __init__(self, names: list[str], log_dir: Path) -> None:
        self.prefix = f"bios{os.getpid()}"
        self.bridge_ns = f"{self.prefix}br"
        self.hosts = {name: Host(name, f"{self.prefix}{name}", f"{SUBNET}.{i + 1}")
                      for i, name in enumerate(names)}
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []

    def __enter__(self) -> Hosts:
        _remove_stale_namespaces()
        try:
            self._add_namespace(self.bridge_ns)
            self._ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
            self._ip(self.bridge_ns, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts.values()):
                self._add_namespace(host.namespace)
                port = f"port{i}"
                self._ip(host.namespace, "link", "add", host.interface, "type", "veth", "peer", "name", port,
                         "netns", self.bridge_ns)
                self._ip(self.bridge_ns, "link", "set", port, "master", "br0")
                self._ip(self.bridge_ns, "link", "set", port, "up")
                self._ip(host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
                self._ip(host.namespace, "link", "set", host.interface, "up")
                self._ip(host.namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def spawn(self, host: str, name: str, argv: list[str], env: dict[str, str], *,
              piped: bool = False) -> subprocess.Popen[Any]:
        """Run `python argv...` on `host`, its output in `<log_dir>/<name>.log`; `piped`: stdin and stdout are text
        pipes for a line protocol instead. `ip netns exec` execs the command, so the Popen's pid is the Python
        process's own (a SIGKILL reaches it)."""
        with open(self.log(name), "ab") as log:
            pipes = (dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) if piped else
                     dict(stdin=subprocess.DEVNULL, stdout=log))
            process = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].namespace, sys.executable, *argv],
                                       stderr=log, env=env, preexec_fn=_die_with_parent, **pipes)
        self.processes.append(process)
        return process

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def cut(self, host: str) -> None:
        """Partition `host` from the others: its link goes down (its processes keep running)."""
        self._ip(self.hosts[host].namespace, "link", "set", self.hosts[host].interface, "down")

    def restore(self, host: str) -> None:
        self._ip(self.hosts[host].namespace, "link", "set", self.hosts[host].interface, "up")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self._namespaces.clear()

    def _add_namespace(self, namespace: str) -> None:
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
        self._namespaces.append(namespace)

    @staticmethod
    def _ip(namespace: str, *args: str) -> None:
        done = subprocess.run(["ip", "-n", namespace, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip -n {namespace} {' '.join(args)}: {done.stderr.strip()}")
