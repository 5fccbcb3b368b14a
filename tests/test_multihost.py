"""Several machines as shipped: the coordinator (keys on, a non-loopback address), two workers and the client each
on a host of its own (Linux network namespaces on a bridge, tests/netns_hosts.py), with no *_SOCKET_IFNAME set.

Workers must open their gloo sockets on the interface of the address they advertise: the host name resolves to a
loopback address on many installs, and the peers on other hosts could never connect. Shown here: two hosts train
like one worker (1e-5); a worker SIGKILLed inside a cycle is replaced by a new one on the same host; a host cut
off for longer than the heartbeat timeout comes back and trains again; TP=2 across two hosts trains like one; a
worker whose peers cannot reach it says so in one line naming the variable to set. Skipped only where
`ip netns` is not permitted.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BASE, assert_same_weights
from netns_hosts import Hosts, netns_unavailable
from tp_model import tp2_only_memory_limit, write_tp_model

import bios
from bios.security.keys import KeyStore

pytestmark = pytest.mark.e2e

HEARTBEAT_S = 3.0
SEED = 29
STEPS = 6  # the reference's: 2 plain, 1 across a SIGKILL, 1 with the replacement, 1 across a partition, 1 after
TP_STEPS = 3
LEARNING_RATE = 1e-3  # tests/netns_client.py's
CLIENT = str(Path(__file__).with_name("netns_client.py"))


class Client:
    """The client host: tests/netns_client.py, one JSON command per line."""

    def __init__(self, process: subprocess.Popen[str], log: Path) -> None:
        self.process, self.log = process, log
        assert self._read(120).get("ready"), "the client did not start"

    def __call__(self, cmd: str, timeout: float = 240.0, **args: Any) -> dict[str, Any]:
        self.process.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.process.stdin.flush()
        answer = self._read(timeout)
        assert "error" not in answer, f"{cmd}: {answer['error']}"
        return answer

    def _read(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        assert line, f"no answer from the client in {timeout:.0f}s; its log:\n{self.log.read_text()[-3000:]}"
        return json.loads(line)

    def worker(self, pid: int) -> dict[str, Any]:
        return next(w for w in self("status")["workers"] if w["pid"] == pid)

    def wait_for(self, predicate, what: str, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self("status")
            if predicate(status):
                return status
            time.sleep(0.2)
        raise AssertionError(f"never happened: {what}; last status: {status}")

    def wait_active(self, n: int) -> dict[str, Any]:
        return self.wait_for(lambda s: sum(w["state"] in ("active", "idle") for w in s["workers"]) >= n,
                             f"{n} workers active or idle")


class Cluster:
    """A keyed coordinator on host `head` and workers on the hosts named; every process on the hosts' network."""

    def __init__(self, hosts: Hosts, state_dir: Path) -> None:
        self.hosts, self.state_dir = hosts, state_dir
        keys, _ = KeyStore.init(state_dir)
        self.api_key, self.token = str(keys.create("alice")), str(keys.cluster.worker_token())
        keys.close()
        # What an operator's shell would hold: no *_SOCKET_IFNAME (the workers must find their interface). The
        # references are this cluster's own worker, so all its workers can take MKL's fp32 GEMM: oneDNN's (the CPU
        # default) rounds ~3x more, so a row-parallel shard's partial sums stray ~5x further from the whole
        # product's, and ~1 weight in 10^4 whose gradient sits at that level took an Adam step the other way
        # (bios/kernels/frozen_matmul.py; tests/test_frozen_matmul.py compares the two libraries).
        self.env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")} | {"BIOS_GEMM": "aten"}
        self.processes: list[subprocess.Popen[Any]] = []
        self.workers: list[subprocess.Popen[Any]] = []
        self.address = ""

    def start(self) -> Cluster:
        ready = self.state_dir / "ready.json"
        self._spawn("head", "coordinator", [
            "-m", "bios.cli.coordinator", "--listen", f"tcp://{self.hosts['head'].address}:0",
            "--state-dir", str(self.state_dir), "--cycle-s", "0", "--heartbeat-timeout", str(HEARTBEAT_S),
            "--checkpoint-every", "0", "--ready-file", str(ready)], self.env)
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert self.processes[0].poll() is None, self.hosts.log(self._name("coordinator")).read_text()[-3000:]
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.05)
        self.address = json.loads(ready.read_text())["clients"]
        return self

    def add_worker(self, host: str, memory_limit: int | None = None,
                   env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        args = ["-m", "bios.cli.worker", "--coordinator", self.address, "--threads", "1"]
        if memory_limit is not None:
            args += ["--memory-limit", str(memory_limit)]
        worker = self._spawn(host, f"worker-{len(self.workers)}", args,
                             {**self.env, "BIOS_WORKER_TOKEN": self.token, **(env or {})})
        self.workers.append(worker)
        return worker

    def client(self) -> Client:
        # A script's own directory leads its sys.path, not the working directory: point it at this checkout.
        path = os.pathsep.join(p for p in (str(Path(bios.__file__).parents[1]), self.env.get("PYTHONPATH")) if p)
        env = {**self.env, "BIOS_ADDRESS": self.address, "BIOS_API_KEY": self.api_key, "PYTHONPATH": path}
        name = self._name("client")
        process = self.hosts.spawn("client", name, [CLIENT], env, piped=True)
        self.processes.append(process)
        return Client(process, self.hosts.log(name))

    def worker_log(self, index: int) -> str:
        return self.hosts.log(self._name(f"worker-{index}")).read_text()

    def coordinator_log(self) -> str:
        return self.hosts.log(self._name("coordinator")).read_text()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)

    def _name(self, name: str) -> str:
        return f"{self.state_dir.parent.name}-{name}"

    def _spawn(self, host: str, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[Any]:
        process = self.hosts.spawn(host, self._name(name), argv, env)
        self.processes.append(process)
        return process


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need Linux network namespaces: {reason}")
    with Hosts(["head", "a", "b", "client"], tmp_path_factory.mktemp("hosts")) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    return write_tp_model(tmp_path_factory.mktemp("tp-model"))


@pytest.fixture
def cluster(hosts, tmp_path):
    cluster = Cluster(hosts, tmp_path / "state").start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def first(hosts, tp_model, tmp_path_factory):
    """A cluster whose one worker, on host a, trains the references before the data-parallel test adds more: the
    tiny model's losses and weights after STEPS steps; and, on a cluster of its own (beside the tiny model's run
    it would get a group of its own, and the next worker, once one joins), the TP model's after TP_STEPS and its
    greedy samples."""
    path = tmp_path_factory.mktemp("weights")
    cluster = Cluster(hosts, tmp_path_factory.mktemp("tp-reference") / "state").start()
    try:
        cluster.add_worker("a")
        client = cluster.client()
        client.wait_active(1)
        big = client("create", base_model=str(tp_model), seed=SEED)["run"]
        reference = {"tp_losses": _train(client, big, TP_STEPS)["losses"],
                     "tp_weights": _weights(client, big, path / "big.npz"), "tp_samples": client("sample", run=big)}
    finally:
        cluster.close()
    cluster = Cluster(hosts, tmp_path_factory.mktemp("first") / "state").start()
    try:
        cluster.add_worker("a")
        client = cluster.client()
        client.wait_active(1)
        tiny = client("create", base_model=BASE, seed=SEED)["run"]
        reference.update(losses=_train(client, tiny, STEPS)["losses"], weights=_weights(client, tiny, path / "tiny.npz"))
        yield cluster, client, reference
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def reference(first) -> dict[str, Any]:
    return first[2]


def _weights(client: Client, run: int, path: Path) -> dict[str, np.ndarray]:
    with np.load(client("weights", run=run, path=str(path))["path"]) as saved:
        return dict(saved)


def _train(client: Client, run: int, steps: int) -> dict[str, Any]:
    return client("results", ticket=client("submit", run=run, steps=steps)["ticket"])


def test_two_hosts_train_like_one_through_a_sigkill_and_a_partition(first, tmp_path):
    cluster, client, reference = first
    second = cluster.add_worker("b")
    client.wait_active(2)
    run = client("create", base_model=BASE, seed=SEED)["run"]
    losses = _train(client, run, 2)["losses"]
    assert losses == pytest.approx(reference["losses"][:2], rel=1e-5)
    logs = cluster.worker_log(0) + cluster.worker_log(1)
    for host in ("a", "b"):
        assert f"collectives use interface eth0, which holds {cluster.hosts[host].address}" in logs, logs[-3000:]
    assert "as rank 1 of 2" in logs

    # SIGKILL inside a cycle: the victim is stopped first, so the step's cycle cannot end before it dies.
    second.send_signal(signal.SIGSTOP)
    ticket = client("submit", run=run, steps=1)["ticket"]
    client.wait_for(lambda s: s["queue_depth"] <= 1, "the step taken into a cycle")
    mark = len(cluster.coordinator_log())
    second.kill()
    second.wait()
    replacement = cluster.add_worker("b")
    for trained, step in ((client("results", ticket=ticket), 3), (_train(client, run, 1), 4)):
        assert trained["steps"] == [step]
        losses += trained["losses"]
        assert client.worker(second.pid)["state"] == "dead"
        client.wait_active(2)
    assert " aborted: " in cluster.coordinator_log()[mark:], "the SIGKILL aborted no cycle"

    # A partition longer than the heartbeat timeout, with a step in flight: the cut-off host is declared dead,
    # the other trains alone, and the cut-off one registers again once its link is back.
    mark = len(cluster.coordinator_log())
    cluster.hosts.cut("b")
    try:
        ticket = client("submit", run=run, steps=1)["ticket"]
        client.wait_for(lambda s: any(w["pid"] == replacement.pid and w["state"] == "dead" for w in s["workers"]),
                        "the cut-off worker declared dead")
    finally:
        cluster.hosts.restore("b")
    client.wait_for(lambda s: any(w["pid"] == replacement.pid and w["state"] == "active" for w in s["workers"]),
                    "the cut-off worker active again")
    for trained, step in ((client("results", ticket=ticket), 5), (_train(client, run, 1), 6)):
        assert trained["steps"] == [step]
        losses += trained["losses"]
    assert " aborted: " in cluster.coordinator_log()[mark:], "the partition aborted no cycle"
    assert losses == pytest.approx(reference["losses"], rel=1e-5)
    assert_same_weights(_weights(client, run, tmp_path / "w.npz"), reference["weights"])
    assert replacement.poll() is None
    assert sum(w["state"] == "active" for w in client("status")["workers"]) == 2


def test_tensor_parallel_across_two_hosts_trains_like_one_worker(cluster, reference, tp_model):
    limit = tp2_only_memory_limit(tp_model)
    cluster.add_worker("a", memory_limit=limit)
    cluster.add_worker("b", memory_limit=limit)
    client = cluster.client()
    client.wait_active(2)
    created = client("create", base_model=str(tp_model), seed=SEED)
    assert created["plan"].startswith("tp2+checkpointing: 1 replica(s) x 2 tensor-parallel worker(s)"), created
    trained = _train(client, created["run"], TP_STEPS)
    assert trained["losses"] == pytest.approx(reference["tp_losses"], rel=1e-5)
    # Adam divides each gradient element by its own running size, so an element whose terms nearly cancel (its sum
    # set by rounding, which a row-parallel shard's partial sums change) moves its weight by a different part of
    # lr: one LoRA weight of the TP model in 12288 strayed 3.3e-5 with an Intel Xeon's MKL, however both sides
    # computed it. Such strays stay rare and within 2·lr a step; a wrong shard would move thousands.
    assert_same_weights(_weights(client, created["run"], cluster.state_dir / "w.npz"), reference["tp_weights"],
                        strays=1e-3, stray_tol=2 * LEARNING_RATE * TP_STEPS)
    samples = client("sample", run=created["run"])
    assert samples["tokens"] == reference["tp_samples"]["tokens"]
    assert samples["logprobs"] == pytest.approx(reference["tp_samples"]["logprobs"], abs=1e-4)


def test_a_worker_its_peers_cannot_reach_says_so_in_one_line(cluster):
    """Both workers' GLOO_SOCKET_IFNAME names the loopback interface (what gloo's default, the host name's address,
    gives where /etc/hosts maps it to 127.0.1.1): the group cannot form, and each worker says where its sockets
    are and what to set, in one line, not a traceback."""
    for host in ("a", "b"):
        cluster.add_worker(host, env={"GLOO_SOCKET_IFNAME": "lo"})
    client = cluster.client()
    client.wait_active(2)
    # A run gives the workers a group to form; its creation never finishes, so it is sent without waiting.
    client.process.stdin.write(json.dumps({"cmd": "create", "base_model": BASE, "seed": SEED}) + "\n")
    client.process.stdin.flush()
    deadline = time.monotonic() + 120
    while not any("could not form generation" in cluster.worker_log(i) for i in (0, 1)):
        assert time.monotonic() < deadline, "no worker reported the group that could not form"
        time.sleep(0.2)
    for index, host in ((0, "a"), (1, "b")):
        log = cluster.worker_log(index)
        assert "Traceback" not in log, log
        for line in (line for line in log.splitlines() if "could not form generation" in line):
            assert " ERROR bios.worker.daemon: could not form generation " in line, line
            assert (f"this worker's sockets are on interface lo (127.0.0.1) and it reaches the coordinator from "
                    f"{cluster.hosts[host].address} (interface eth0): if its peers cannot reach it there, set "
                    f"GLOO_SOCKET_IFNAME to the interface the hosts share") in line, line
