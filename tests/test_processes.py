"""Process-level robustness: garbage on the sockets, killed clients, SIGTERM, crashed user scripts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import psutil
import pytest
import zmq
from conftest import BASE, text_datum

import bios
from bios import types

GARBAGE = [
    [b"\x00\x01\x02random bytes \xff\xfe"],
    [os.urandom(4096)],
    [msgpack.packb({"v": 1, "id": 7, "kind": "ForwardBackward", "body": {"model_id": "x"}})[:-3]],
    [msgpack.packb({"v": 1, "id": 8, "kind": "NoSuchKind", "body": {}})],
    [msgpack.packb({"v": 1, "id": 9, "kind": "Hello", "body": {"api_key": 5}})],
    [msgpack.packb({"v": 1, "id": 10, "kind": "OptimStep", "body": {}}), b"extra frame"],
    # A tensor that claims 2**39 floats but carries four bytes.
    [msgpack.packb({"v": 1, "id": 11, "kind": "Ping", "body": {"payload": msgpack.ExtType(1, msgpack.packb(
        ["float32", [2**39], 1]))}}), b"1234"],
    [b"\x92" * 100],
    [b"\xdd\xff\xff\xff\xff"],  # an array header declaring 4 billion elements
    [b""],
]


def _send_garbage(address: str) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    replies = 0
    for frames in GARBAGE:
        sock.send_multipart(frames)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and replies < len(GARBAGE) - 1:
        if sock.poll(200):
            sock.recv_multipart()
            replies += 1
    sock.close()
    ctx.term()
    return replies


def test_garbage_on_both_sockets_neither_crashes_nor_blocks(cluster, service):
    tc = service.create_lora_training_client(BASE, rank=8, seed=21)
    replies = _send_garbage(cluster.address)
    worker_address = json.loads((cluster.state_dir / "coordinator.json").read_text())["workers"]
    _send_garbage(worker_address)
    assert replies >= len(GARBAGE) - 2  # everything addressable got an error reply
    assert cluster.coordinator is not None and cluster.coordinator.poll() is None
    out = tc.forward_backward([text_datum("still training after the garbage")]).result(60)
    assert out.loss > 0
    assert service.cluster_status().workers[0].state == "active"


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, bios
    from bios import types
    svc = bios.ServiceClient(address=sys.argv[1])
    tc = svc.create_lora_training_client("bios/tiny-llama", rank=8, seed=1)
    d = types.Datum(types.ModelInput.from_ints(list(range(1, 200))),
                    {"target_tokens": list(range(2, 201)), "weights": [1.0] * 199})
    print("ready", flush=True)
    while True:
        for _ in range(8):
            tc.forward_backward([d] * 4)
        tc.optim_step().result()
    """
)


def test_a_killed_client_does_not_disturb_another(cluster, service):
    victim = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, cluster.address], stdout=subprocess.PIPE)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == b"ready"
        tc = service.create_lora_training_client(BASE, rank=8, seed=22)
        reference = service.create_lora_training_client(BASE, rank=8, seed=22)
        losses = []
        for step in range(6):
            if step == 2:
                victim.kill()
            losses.append(tc.forward_backward([text_datum("survivor")]).result(60).loss)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    finally:
        victim.kill()
        victim.wait()
    expected = []
    for _ in range(6):
        expected.append(reference.forward_backward([text_datum("survivor")]).result(60).loss)
        reference.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    assert losses == pytest.approx(expected, rel=1e-6)


def _descendants_gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_sigterm_to_the_coordinator_stops_its_workers():
    cluster = bios.LocalCluster(workers=2).start()
    try:
        with bios.ServiceClient(address=cluster.address) as svc:
            svc.create_lora_training_client(BASE, rank=8)  # both workers are up once a run exists
            while len(svc.cluster_status().workers) < 2:
                time.sleep(0.1)
        assert cluster.coordinator is not None
        pids = [cluster.coordinator.pid, *(w.pid for w in cluster.workers)]
        cluster.coordinator.send_signal(signal.SIGTERM)
        for proc in [cluster.coordinator, *cluster.workers]:
            proc.wait(20)
        assert _descendants_gone(pids)
    finally:
        cluster.stop()


EMBEDDED_SCRIPT = textwrap.dedent(
    """
    import os, sys, bios, psutil
    svc = bios.ServiceClient()
    tc = svc.create_lora_training_client("bios/tiny-llama", rank=8)
    kids = [p.pid for p in psutil.Process().children(recursive=True)]
    print(" ".join(map(str, kids)), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the user's script crashed")
    sys.stdin.read()  # wait to be killed
    """
)


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_embedded_cluster_leaves_no_orphans(how):
    proc = subprocess.Popen(
        [sys.executable, "-c", EMBEDDED_SCRIPT, how],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    kids = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(kids) >= 2, proc.stderr.read().decode() if proc.stderr else ""
    if how == "sigkill":
        proc.kill()
    proc.wait(60)
    assert _descendants_gone(kids), f"orphans left: {kids}"
