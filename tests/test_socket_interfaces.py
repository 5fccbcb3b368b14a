"""Workers open gloo/NCCL sockets on the interface of the address they advertise, unless the operator chose one.

Without this, gloo takes the interface the host name resolves to (127.0.1.1 on many Linux installs), and
workers on other hosts never form a group.
"""

from __future__ import annotations

import os
import socket

import psutil
import torch

from bios.worker import collectives
from bios.worker.collectives import CollectiveGroup, interface_of, socket_interfaces


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
    for var in collectives.SOCKET_IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    group = CollectiveGroup(torch.device("cpu"), "127.0.0.1")
    try:
        assert os.environ["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")
        assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    finally:
        group.destroy()
