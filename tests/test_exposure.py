"""No listener an operator would not expect, and an admin credential of its own (issue 40).

A keyless coordinator refuses `--http` beyond loopback as it refuses `--listen`, before it binds anything; a
worker's rendezvous store listens on its advertised address only; every socket of a loopback cluster is on
loopback; the admin key, not the worker token, is the console's and the HTTP API's admin; an HTTP client at the
ZeroMQ port is hung up on instead of left waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch

import bios
from bios import messages as m
from bios.cli.main import main as bios_cli
from bios.coordinator.scheduler import Scheduler
from bios.coordinator.membership import Membership
from bios.coordinator.config import CoordinatorConfig
from bios.coordinator.server import Coordinator
from bios.coordinator.watchdog import NO_WORKER, NO_WORKER_YET, Watchdog
from bios.exceptions import AuthenticationError
from bios.gateway.http_io import identify
from bios.gateway.tokens import Tokens
from bios.security.keys import KeyStore
from bios.security.listen import InsecureListenError, check_http
from bios.worker.collectives import CollectiveGroup
from bios.worker.interfaces import SOCKET_IFNAME_VARS, store_listener

DEADLINE_S = 120.0  # a guard against hanging, never a measured time


def _coordinator_cli(*args: str, state_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "bios.cli.coordinator", "--state-dir", str(state_dir), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------- --http guard


def test_keyless_public_http_is_refused_before_anything_binds(tmp_path):
    ready = tmp_path / "ready.json"
    proc = _coordinator_cli("--listen", "tcp://127.0.0.1:0", "--http", "0.0.0.0:0", "--ready-file", str(ready),
                            state_dir=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve the HTTP API on 0.0.0.0:0 (--http) without API keys" in proc.stderr
    assert "bios keys init --state-dir DIR" in proc.stderr and "127.0.0.1:PORT" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Refused before the coordinator was built: no store, no ready file, no client socket served meanwhile.
    assert not ready.exists() and not (tmp_path / "coordinator.sqlite3").exists()


def test_the_http_guard_allows_loopback_and_keyed_clusters_only():
    for address in ("127.0.0.1:8000", "localhost:0", "[::1]:8000", "::1:8000", ":8000", "127.0.0.5:1"):
        check_http(address, keys=False)
    for address in ("0.0.0.0:8000", "[::]:8000", "*:8000", "10.1.2.3:8000", "myhost.example:8000"):
        with pytest.raises(InsecureListenError, match="bios keys init"):
            check_http(address, keys=False)
        check_http(address, keys=True)


# ---------------------------------------------------------------------------------------------- rendezvous store


def _listening(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_the_rendezvous_store_listens_on_the_advertised_address_only(monkeypatch):
    for var in SOCKET_IFNAME_VARS:  # CollectiveGroup sets them for its process: undo that after the test
        monkeypatch.delenv(var, raising=False)
    group = CollectiveGroup(torch.device("cpu"), "127.0.0.1")
    port = group.store_port
    assert [ip for ip, p in _listening(os.getpid()) if p == port] == ["127.0.0.1"]
    with socket.create_connection(("127.0.0.1", port), timeout=30):
        pass
    # 127.0.0.2 is another address of this machine (all of 127/8 is local on Linux): not served there.
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.2", port), timeout=30):
        pass
    group.store.set("probe", "ok")
    assert group.store.get("probe") == b"ok"
    del group


def test_an_address_not_of_this_machine_falls_back_to_torchs_own_socket():
    assert store_listener("192.0.2.1") is None  # TEST-NET-1: held by no interface here
    fd, port = store_listener("127.0.0.1")
    try:
        assert port > 0
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- a keyed cluster


@dataclass
class Keyed:
    cluster: bios.LocalCluster
    state_dir: Path
    alice: str
    admin: str
    worker_token: str


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("exposure")
    keys, _ = KeyStore.init(state_dir)
    alice, admin, token = str(keys.create("alice")), str(keys.admin_key()), str(keys.cluster.worker_token())
    keys.close()
    with bios.LocalCluster(state_dir=state_dir, worker_threads=1, http="127.0.0.1:0", metrics="127.0.0.1:0") as cluster:
        yield Keyed(cluster, state_dir, alice, admin, token)


def test_every_socket_of_a_loopback_cluster_is_on_loopback(keyed):
    worker = keyed.cluster.workers[0].pid
    deadline = time.monotonic() + DEADLINE_S
    while not _listening(worker):  # its rendezvous store opens while it starts
        assert time.monotonic() < deadline, f"the worker never listened: {keyed.cluster.log_tail('worker-0')}"
        time.sleep(0.2)
    for pid in (keyed.cluster.coordinator.pid, worker):
        listeners = _listening(pid)
        assert listeners and all(ip in ("127.0.0.1", "::1") for ip, _ in listeners), (pid, listeners)


def test_the_admin_key_is_the_admin_and_the_worker_token_is_refused(keyed):
    url = keyed.cluster.http_url
    whoami = f"{url}/console/api/whoami"
    seen = httpx.get(whoami, headers={"Authorization": f"Bearer {keyed.admin}"}, timeout=60)
    assert seen.status_code == 200 and seen.json()["admin"] is True
    assert httpx.get(whoami, headers={"Authorization": f"Bearer {keyed.alice}"}, timeout=60).json()["admin"] is False
    refused = httpx.get(whoami, headers={"Authorization": f"Bearer {keyed.worker_token}"}, timeout=60)
    assert refused.status_code == 401 and "bios keys admin-key" in refused.json()["detail"]

    me = f"{url}/api/v1/auth/apikey/me"
    admin = httpx.get(me, headers={"X-API-Key": f"tml-{keyed.admin}"}, timeout=60)
    assert admin.status_code == 200 and admin.json()["admin"] is True and admin.json()["name"] == "admin key"
    refused = httpx.get(me, headers={"X-API-Key": f"tml-{keyed.worker_token}"}, timeout=60)
    assert refused.status_code == 401 and "bios keys admin-key" in refused.json()["detail"]
    usage = httpx.get(f"{url}/api/v1/billing/usage/events", headers={"X-API-Key": f"tml-{keyed.worker_token}"},
                      timeout=60)
    assert usage.status_code == 401


def test_a_rotated_admin_key_is_refused(keyed, capsys):
    state = ["--state-dir", str(keyed.state_dir)]
    assert bios_cli(["keys", "admin-key", *state]) == 0
    assert capsys.readouterr().out.strip() == keyed.admin  # printed again, unchanged
    assert bios_cli(["keys", "admin-key", "--rotate", *state]) == 0
    new = capsys.readouterr().out.strip()
    assert new.startswith("biosadmin_") and new != keyed.admin
    whoami = f"{keyed.cluster.http_url}/console/api/whoami"
    old = httpx.get(whoami, headers={"Authorization": f"Bearer {keyed.admin}"}, timeout=60)
    assert old.status_code == 401 and "wrong admin key" in old.json()["detail"]
    assert httpx.get(whoami, headers={"Authorization": f"Bearer {new}"}, timeout=60).json()["admin"] is True
    keyed.admin = new


async def test_identify_tells_the_admin_a_key_and_the_worker_token_apart(tmp_path):
    keys, _ = KeyStore.init(tmp_path)
    alice = keys.create("alice")
    token = str(keys.cluster.worker_token())
    coordinator = Coordinator(CoordinatorConfig(listen="tcp://127.0.0.1:0", state_dir=tmp_path))
    tokens = Tokens()
    try:
        with pytest.raises(AuthenticationError, match="no admin key yet"):
            identify("tml-biosadmin_" + "A" * 43, coordinator.accounts, tokens)
        admin = str(keys.admin_key())
        assert identify(f"tml-{admin}", coordinator.accounts, tokens).admin
        jwt = tokens.issue("<admin>", keys.admin_fingerprint())
        assert identify(jwt, coordinator.accounts, tokens).admin  # its JWT too, until the admin key is replaced
        keys.admin_key(rotate=True)
        with pytest.raises(AuthenticationError, match="was replaced"):
            identify(jwt, coordinator.accounts, tokens)
        admin = str(keys.admin_key())
        caller = identify(f"tml-{alice}", coordinator.accounts, tokens)
        assert caller.owner == alice.key_id and not caller.admin
        assert identify(tokens.issue(alice.key_id), coordinator.accounts, tokens) == caller
        with pytest.raises(AuthenticationError, match="admits workers only.*bios keys admin-key"):
            identify(f"tml-{token}", coordinator.accounts, tokens)
        with pytest.raises(AuthenticationError, match="malformed admin key"):
            identify("tml-biosadmin_short", coordinator.accounts, tokens)
        assert keys.is_admin(admin) and not keys.is_admin(str(alice)) and not keys.is_admin(None)
        with pytest.raises(AuthenticationError, match="admits workers only"):
            keys.is_admin(token)
    finally:
        coordinator.close_sockets()
        coordinator.store.close()
        coordinator.keys.close()
        coordinator.ctx.term()
        keys.close()


def test_admin_key_needs_keys_first(tmp_path, capsys):
    with pytest.raises(SystemExit, match="bios keys init"):
        bios_cli(["keys", "admin-key", "--state-dir", str(tmp_path)])


# ---------------------------------------------------------------------------------------------- wrong port


def test_an_http_client_at_the_zeromq_port_is_hung_up_on(tmp_path):
    """The Tinker SDK pointed at the ZeroMQ port: the connection closes at once (with keys or without), instead
    of waiting for an answer that never comes."""
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "bios.cli.coordinator", "--state-dir", str(tmp_path),
                             "--listen", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the coordinator never became ready"
            time.sleep(0.1)
        port = json.loads(ready.read_text())["clients"].rsplit(":", 1)[1]
        # Hung up on (closed or reset, by timing); a read timeout instead is what the old behaviour looked like.
        with pytest.raises((httpx.RemoteProtocolError, httpx.NetworkError)):
            httpx.post(f"http://127.0.0.1:{port}/api/v1/create_session", json={}, timeout=DEADLINE_S)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


# ---------------------------------------------------------------------------------------------- plain errors


def test_a_missing_key_names_the_cli_option(keyed, monkeypatch, capsys):
    monkeypatch.delenv("BIOS_API_KEY", raising=False)
    assert bios_cli(["status", "--address", keyed.cluster.address]) == 1
    err = capsys.readouterr().err
    assert "requires an API key" in err and "--api-key" in err and "BIOS_API_KEY" in err


class _Scheduler:
    def __init__(self) -> None:
        self.told: list[str] = []

    async def ask(self, method, *args):
        if method is Scheduler.notify_waiting:
            self.told.append(args[0])
        return [] if method is Scheduler.stalled else {"bios/tiny-llama": 1}  # one request waits (queue_depths)


class _FrontDoor:
    def expire_sessions(self, timeout_s):
        return []

    def expire_checkpoints(self):
        return []


async def _first_notice(membership: Membership) -> str:
    scheduler = _Scheduler()
    watchdog = Watchdog(membership, None, scheduler, _FrontDoor(), heartbeat_timeout_s=1.0, session_timeout_s=60.0,
                        stalled_after_s=0.02, seq_gap_s=60.0)
    task = asyncio.get_running_loop().create_task(watchdog.watch_progress())
    try:
        while not scheduler.told:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return scheduler.told[0]


async def test_no_worker_yet_is_told_apart_from_every_worker_gone():
    membership = Membership(1.0)
    assert await _first_notice(membership) == NO_WORKER_YET
    assert "bios up" in NO_WORKER_YET and "start one with bios-worker)" not in NO_WORKER_YET
    membership.register(b"peer", m.RegisterWorker("w0", "host", 1, "cpu", 1 << 30, token=None))
    membership.mark_dead("w0", "test")
    assert await _first_notice(membership) == NO_WORKER


def test_worker_threads_help_says_how_bios_up_splits_the_cores(capsys):
    with pytest.raises(SystemExit):
        bios_cli(["up", "--help"])
    assert "torch's choice" not in capsys.readouterr().out
