"""Every `bios` error path: one short message that says what to do, no traceback, exit 2 for a wrong command line;
`bios --debug` shows the traceback. And the commands that must not import torch do not."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading

import pytest

import bios
from bios import exceptions
from bios.cli.up_record import write_record
from bios.security.keys import KeyStore


def bios_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bios.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def assert_short_error(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2 or (code == 2 and lines[0].startswith("usage:") and len(lines) <= 3), done.stderr
    for needle in needles:
        assert needle in done.stderr


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def http_port():
    """A plain HTTP server, standing in for the --http gateway or the --metrics port."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_status_with_no_cluster_says_nothing_listens():
    done = bios_cli("status", "--address", f"tcp://127.0.0.1:{free_port()}")
    assert_short_error(done, 1, "nothing listens at", "bios up")


def test_debug_shows_the_traceback():
    done = bios_cli("--debug", "status", "--address", f"tcp://127.0.0.1:{free_port()}")
    assert done.returncode == 1 and "Traceback" in done.stderr and "nothing listens" in done.stderr


def test_an_address_without_tcp_is_accepted(cluster):
    host_port = cluster.address.removeprefix("tcp://")
    done = bios_cli("status", "--address", host_port)
    assert done.returncode == 0, done.stderr
    assert f"coordinator {cluster.address}" in done.stdout


@pytest.mark.parametrize("address, needle", [
    ("localhost", "write tcp://HOST:PORT"),
    ("http://127.0.0.1:8000", "HTTP URL"),
    ("udp://127.0.0.1:7600", "write tcp://HOST:PORT"),
])
def test_a_malformed_address_is_a_usage_error(address, needle):
    assert_short_error(bios_cli("status", "--address", address), 2, needle)


def test_bios_address_from_the_environment_is_checked_too():
    assert_short_error(bios_cli("runs", "list", env={"BIOS_ADDRESS": "localhost"}), 2, "write tcp://HOST:PORT")


def test_status_against_an_http_port_says_so(http_port):
    done = bios_cli("status", "--address", f"127.0.0.1:{http_port}")
    assert_short_error(done, 1, "is an HTTP server", "--listen")


def test_the_sdk_says_it_reached_an_http_port(http_port, tmp_path):
    # An HTTP server never answers the Hello: the SDK tells why once its connect timeout is over, so keep it short.
    with pytest.raises(exceptions.APIConnectionError, match="is an HTTP server"):
        bios.ServiceClient(address=f"tcp://127.0.0.1:{http_port}", connect_timeout_s=1)
    keys, _ = KeyStore.init(tmp_path)
    key = str(keys.create("someone"))
    keys.close()
    with pytest.raises(exceptions.APIConnectionError, match="is an HTTP server"):
        bios.ServiceClient(address=f"tcp://127.0.0.1:{http_port}", api_key=key, connect_timeout_s=1)


def test_the_sdk_accepts_host_port_and_explains_a_url(cluster):
    with bios.ServiceClient(address=cluster.address.removeprefix("tcp://")) as client:
        assert client.cluster_status().workers
    with pytest.raises(ValueError, match="HTTP URL"):
        bios.ServiceClient(address="http://127.0.0.1:8000")


def test_up_on_a_busy_port_names_listen(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = bios_cli("up", "--state-dir", str(tmp_path), "--listen", f"tcp://127.0.0.1:{port}")
    assert_short_error(done, 1, f"cannot listen on tcp://127.0.0.1:{port} (--listen)", "coordinator.log")


def test_a_second_up_on_the_same_state_dir_is_refused(tmp_path):
    write_record(tmp_path, address="tcp://127.0.0.1:7600")  # this test process stands in for a running `bios up`
    assert_short_error(bios_cli("up", "--state-dir", str(tmp_path)), 1, "already runs", "bios down")


def test_down_and_logs_without_a_cluster(tmp_path):
    assert_short_error(bios_cli("down", "--state-dir", str(tmp_path)), 1, "no cluster runs from")
    assert_short_error(bios_cli("logs", "--state-dir", str(tmp_path)), 1, "no coordinator log", "bios up")
    (tmp_path / "coordinator.log").write_text("started\n")
    assert_short_error(bios_cli("logs", "worker", "3", "--state-dir", str(tmp_path)), 1, "there are: coordinator")
    assert_short_error(bios_cli("logs", "coordinator", "2", "--state-dir", str(tmp_path)), 2, "has no number")
    assert_short_error(bios_cli("logs", "scheduler", "--state-dir", str(tmp_path)), 2, "invalid choice")


def test_logs_prints_the_tail(tmp_path):
    (tmp_path / "worker-1.log").write_text("one\ntwo\nthree\n")
    done = bios_cli("logs", "worker", "1", "-n", "2", "--state-dir", str(tmp_path))
    assert done.returncode == 0 and done.stdout == "two\nthree\n"


@pytest.mark.parametrize("command", [
    "from bios.cli.main import main; main(['models', 'list'])",
    "from bios.cli.worker import main; main(['--help'])",
    "from bios.cli.main import main; main(['up', '--help'])",
])
def test_listing_and_help_do_not_import_torch(command):
    check = f"import sys\ntry:\n    {command}\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
