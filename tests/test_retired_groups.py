"""A worker leaving a generation whose collective a peer never joined (an aborted cycle) must not wait for that
peer: the old gloo group's destructor does, until the peer exits. `CollectiveGroup.release_retired` drops the
last generation's groups on a thread of their own (tests/test_tp_cluster.py's SIGKILL test hung ~180 s on it)."""

from __future__ import annotations

import multiprocessing
import time

import torch

COLLECTIVE_TIMEOUT_S = 60.0


def _peer(ports, done) -> None:
    """Rank 0 of generation 1: joins, never takes part in rank 1's collective, and lives until told."""
    from bios.worker.collectives import CollectiveGroup

    group = CollectiveGroup(torch.device("cpu"), "127.0.0.1")
    ports.put(group.store_port)
    group.rebuild(1, 0, 2, "127.0.0.1", group.store_port, 30.0, tp=2, epoch="t/",
                  collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    done.wait(120)


def _leaver(port, results) -> None:
    """Rank 1: starts a tensor-parallel all-reduce its peer never joins, gives it up, then forms a generation
    of its own and lets the old groups go; reports how long that took."""
    import torch.distributed as dist

    from bios.worker.collectives import CollectiveGroup

    group = CollectiveGroup(torch.device("cpu"), "127.0.0.1")
    group.rebuild(1, 1, 2, "127.0.0.1", port, 30.0, tp=2, epoch="t/", collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    work = dist.all_reduce(torch.ones(4), group=group.tp_group, async_op=True)
    time.sleep(0.5)
    del work  # an aborted cycle leaves it pending
    started = time.monotonic()
    group.rebuild(2, 0, 1, "127.0.0.1", group.store_port, 30.0, epoch="t/")
    group.release_retired()
    results.put(time.monotonic() - started)


def test_leaving_a_generation_does_not_wait_for_a_peer_that_never_joined_its_collective():
    context = multiprocessing.get_context("spawn")
    ports, results, done = context.Queue(), context.Queue(), context.Event()
    peer = context.Process(target=_peer, args=(ports, done), daemon=True)
    peer.start()
    leaver = None
    try:
        leaver = context.Process(target=_leaver, args=(ports.get(timeout=60), results), daemon=True)
        leaver.start()
        seconds = results.get(timeout=60)  # before the fix: until the peer exits, here never
        assert seconds < 5.0, f"leaving generation 1 took {seconds:.1f}s"
    finally:
        done.set()
        for process in (leaver, peer):
            if process is not None:
                process.join(30)
                if process.is_alive():
                    process.kill()
