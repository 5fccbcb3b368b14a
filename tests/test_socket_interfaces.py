"""Workers open gloo/NCCL sockets on the interface of the address they advertise, unless the operator chose one.

Without this, gloo takes the interface the host name resolves to (127.0.1.1 on many Linux installs), and
workers on other hosts never form a group.
"""

from __future__ import annotations

import os
import socket

import psutil
import torch

from bios.worker import interfaces
from bios.worker.collectives import CollectiveGroup
from bios.worker.interfaces import interface_of, socket_endpoint, socket_interfaces, unreachable


def _ipv4_addresses() -> dict[str, str]:
    return {a.address: name for name, addrs in psutil.net_if_addrs().items() for a in addrs
            if a.family == socket.AF_INET}


def test_each_local_address_maps_to_the_interface_holding_it():
    addresses = _ipv4_addresses()
    assert "127.0.0.1" in addresses
    for address, name in addresses.items():
        assert interface_of(address) == name
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: no interface here holds it


def test_both_variables_point_at_the_advertised_interface():
    loopback = interface_of("127.0.0.1")
    assert socket_interfaces("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}


def test_the_operators_choice_wins():
    chosen = socket_interfaces("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"})
    assert chosen == {"NCCL_SOCKET_IFNAME": interface_of("127.0.0.1")}
    both = {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib0"}
    assert socket_interfaces("127.0.0.1", both) == {}


def test_an_address_no_interface_holds_sets_nothing():
    assert socket_interfaces("203.0.113.77", {}) == {}


def test_a_worker_group_sets_the_variables_for_its_process(monkeypatch):
    for var in interfaces.SOCKET_IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    group = CollectiveGroup(torch.device("cpu"), "127.0.0.1")
    try:
        assert os.environ["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")
        assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    finally:
        group.destroy()


def test_the_endpoint_names_the_interface_and_its_address_else_the_host_name():
    loopback = interface_of("127.0.0.1")
    assert socket_endpoint("GLOO_SOCKET_IFNAME", {"GLOO_SOCKET_IFNAME": loopback}).startswith(
        f"interface {loopback} (127.0.0.1")
    assert socket_endpoint("GLOO_SOCKET_IFNAME", {}).startswith(f"the address of host name {socket.gethostname()} (")


def test_a_group_that_cannot_form_is_told_in_one_line_naming_the_variable():
    cause = RuntimeError("Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                         "pair.cc:152] timed out connecting: SO_ERROR: Connection refused,\n remote=[127.0.0.1]:29077")
    loopback = interface_of("127.0.0.1")
    line = unreachable(4, 2, "gloo", "127.0.0.1", cause, {"GLOO_SOCKET_IFNAME": loopback})
    assert "\n" not in line and "pair.cc" not in line
    assert line.startswith("could not form generation 4 (2 workers, gloo): Gloo connectFullMesh failed with timed out "
                           "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:29077; ")
    assert f"sockets are on interface {loopback} (127.0.0.1" in line
    assert f"reaches the coordinator from 127.0.0.1 (interface {loopback})" in line
    assert line.endswith("set GLOO_SOCKET_IFNAME to the interface the hosts share")
    assert "set NCCL_SOCKET_IFNAME" in unreachable(4, 2, "nccl", "127.0.0.1", cause, {})
