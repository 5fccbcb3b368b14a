"""Workers that die of memory: the request that did it waits (its client is told why) and runs again in smaller
passes on a worker with room; one that kills workers twice fails alone with the memory error; the run lives on.

The worker is put in a memory cgroup smaller than what its `--memory-limit` promises, as a container limit or a
crowded host would do, and sent a batch whose passes do not fit there.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import BASE, text_datum

import bios
from bios import types as t
from bios.coordinator.planning import MAX_TOKENS_PER_PASS
from bios.exceptions import RequestFailedError

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1, as on these machines
HEADROOM = 48 * 2**20  # what the worker may grow by before the cgroup kills it: far less than one pass needs
# 12 rows of 1000 tokens: passes of MAX_TOKENS_PER_PASS (what 4 GiB allows the tiny model; after a death, half as
# many) need well over HEADROOM.
BIG = [text_datum(("memory " * 200)[:1001]) for _ in range(12)]


def anonymous_memory(pid: int) -> int:
    """Bytes of `pid`'s own (anonymous) memory: what a memory cgroup it starts in is charged for."""
    line = next(li for li in Path(f"/proc/{pid}/status").read_text().splitlines() if li.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@contextmanager
def memory_cgroup(pid: int, limit: int):
    """Confine process `pid` to `limit` bytes of memory it allocates from now on (cgroup v1 does not move what
    it already holds); the kernel kills it beyond."""
    if not os.access(MEMORY_CGROUPS, os.W_OK):
        pytest.skip(f"{MEMORY_CGROUPS} is not writable here: a memory cgroup cannot be made")
    group = MEMORY_CGROUPS / f"bios-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        swap_limit = group / "memory.memsw.limit_in_bytes"
        if swap_limit.exists():
            swap_limit.write_text(str(limit))
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for _ in range(100):  # the killed process leaves the group as it is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _cluster(tmp_path) -> bios.LocalCluster:
    return bios.LocalCluster(workers=1, cycle_s=0.0, worker_threads=1, state_dir=tmp_path, checkpoint_every=1,
                             heartbeat_timeout_s=2.0, worker_memory_limit="4GiB")


def test_the_only_worker_killed_by_memory_leaves_its_request_waiting_for_a_worker_with_room(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="bios.sdk.connection")
    with _cluster(tmp_path) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(BASE, rank=4, seed=21)
        tc.forward_backward([text_datum("a small step first")]).result(120)
        tc.optim_step(t.AdamParams(learning_rate=1e-3)).result(120)  # its automatic checkpoint is on disk
        victim = cluster.workers[0]
        with memory_cgroup(victim.pid, HEADROOM):
            big = tc.forward_backward(BIG)
            victim.wait(120)  # killed by the cgroup while running it
        assert victim.returncode < 0
        deadline = time.monotonic() + 30
        while "a worker died while running this request" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "a worker died while running this request" in caplog.text  # the client hears why it waits
        assert not big.done()
        cluster.add_worker()  # with room
        assert big.result(300).metrics["loss:sum"] > 0
        status = svc.create_rest_client().get_training_run(tc.model_id).result()
        assert tc.forward_backward([text_datum("and the run goes on")]).result(120).metrics["loss:sum"] > 0
        log = cluster.log_path("coordinator").read_text()
    assert status.training_run_id == tc.model_id
    assert f"passes of at most {MAX_TOKENS_PER_PASS // 2} tokens" in log  # the retry ran in smaller passes
    assert "failed to start" not in log and f"training run {status.training_run_id} was lost" not in log


def test_a_batch_that_kills_workers_twice_fails_alone(tmp_path):
    with _cluster(tmp_path) as cluster, bios.ServiceClient(address=cluster.address) as svc:
        tc = svc.create_lora_training_client(BASE, rank=4, seed=22)
        tc.forward_backward([text_datum("a small step first")]).result(120)
        tc.optim_step(t.AdamParams(learning_rate=1e-3)).result(120)
        # The first worker may allocate HEADROOM more; the next one, confined from its start, what a worker that
        # loaded the model holds plus HEADROOM: both die running the batch.
        limits = [HEADROOM, anonymous_memory(cluster.workers[0].pid) + HEADROOM]
        big = tc.forward_backward(BIG)
        for limit in limits:
            victim = cluster.workers[-1]
            with memory_cgroup(victim.pid, limit):
                victim.wait(120)
            cluster.add_worker()
        with pytest.raises(RequestFailedError, match="died twice.*out of memory.*smaller batches"):
            big.result(300)
        assert tc.forward_backward([text_datum("the run goes on")]).result(120).metrics["loss:sum"] > 0
