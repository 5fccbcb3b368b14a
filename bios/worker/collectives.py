"""The collective group of one generation: gradients summed across workers with torch.distributed.

gloo on CPU, NCCL on CUDA: the same code with another backend. Each worker hosts a rendezvous `TCPStore`; the
coordinator names one (the generation's rank 0) and every generation uses its own key prefix, so groups of
different generations never mix. A world of one needs no process group at all. Collectives time out after a
few seconds so a dead peer turns into an error, not a hang.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or timed out); the cycle must be aborted and the group rebuilt."""


def advertised_host(coordinator: str) -> str:
    """The local address peers can reach: the one this host uses to reach the coordinator."""
    host = coordinator.split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class CollectiveGroup:
    def __init__(self, device: torch.device, host: str) -> None:
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.host = host
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.store_port = int(self.store.port)
        self.generation = 0
        self.rank = 0
        self.world = 1
        self._client: dist.TCPStore | None = None

    def rebuild(self, generation: int, rank: int, world: int, master_host: str, master_port: int,
                timeout_s: float) -> None:
        """Leave the old group and join this generation's; blocks until every member has joined."""
        self.destroy()
        self.generation, self.rank, self.world = generation, rank, world
        if world == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if master_host == self.host and master_port == self.store_port:
            base = self.store
        else:
            self._client = dist.TCPStore(master_host, master_port, is_master=False, timeout=timeout, use_libuv=True)
            base = self._client
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"gen{generation}/", base), rank=rank,
                                    world_size=world, timeout=timeout)
        except Exception as exc:
            raise CollectiveError(f"could not form generation {generation} ({world} workers): {exc}") from exc
        log.info("joined generation %d as rank %d of %d (%s)", generation, rank, world, self.backend)

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may refuse to close cleanly; it is dropped either way
                log.debug("destroying the old group: %s", exc)
        self.world = 1
        self.rank = 0

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        if self.world > 1:
            self._guard(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if self.world > 1:
            self._guard(lambda: dist.broadcast(tensor, src=src))

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._guard(lambda: dist.all_gather_object(out, obj))
        return out

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            raise CollectiveError(f"collective failed in generation {self.generation}: {exc}") from exc
