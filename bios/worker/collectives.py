"""The collective group of one generation: gradients summed across workers with torch.distributed.

gloo on CPU, NCCL on CUDA: the same code with another backend. Each worker hosts a rendezvous `TCPStore`; the
coordinator names one (the generation's rank 0) and every generation uses its own key prefix, so groups of
different generations never mix. A world of one needs no process group at all. Collectives time out after a
few seconds so a dead peer turns into an error, not a hang.

With tensor parallelism over `tp` workers the generation is also cut into subgroups: rank r is shard r % tp
of replica r // tp; `tp_group` joins the shard holders of one replica (the model's all-reduces, the shared
LoRA gradients), `dp_group` the holders of one shard across replicas (the data-parallel gradient sum and the
hand-over of a shard from replica 0). None stands for the whole world.

The sockets open on the interface of the address the worker advertises (bios/worker/interfaces.py).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from .interfaces import socket_interfaces, unreachable

log = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or timed out); the cycle must be aborted and the group rebuilt."""


class CollectiveGroup:
    def __init__(self, device: torch.device, host: str) -> None:
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.host = host
        chosen = socket_interfaces(host, os.environ)
        os.environ.update(chosen)
        if chosen:
            log.info("collectives use interface %s, which holds %s (%s)", next(iter(chosen.values())), host,
                     ", ".join(chosen))
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.store_port = int(self.store.port)
        self.generation = 0
        self.rank = 0
        self.world = 1
        self.tp = 1
        self.tp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self._client: dist.TCPStore | None = None

    @property
    def replicas(self) -> int:
        return self.world // self.tp

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def rebuild(self, generation: int, rank: int, world: int, master_host: str, master_port: int,
                timeout_s: float, tp: int = 1, epoch: str = "") -> None:
        """Leave the old group and join this generation's; blocks until every member has joined. `epoch` names
        the coordinator's incarnation: a restarted one numbers generations afresh, under keys of its own."""
        self.destroy()
        if world % tp:
            raise CollectiveError(f"generation {generation}: {world} workers do not form replicas of {tp}")
        self.generation, self.rank, self.world, self.tp = generation, rank, world, tp
        if world == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        if master_host == self.host and master_port == self.store_port:
            base = self.store
        else:
            self._client = dist.TCPStore(master_host, master_port, is_master=False, timeout=timeout, use_libuv=True)
            base = self._client
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"{epoch}gen{generation}/", base), rank=rank,
                                    world_size=world, timeout=timeout)
            if tp > 1:
                self._subgroups(tp)
        except Exception as exc:
            raise CollectiveError(unreachable(generation, world, self.backend, self.host, exc, os.environ)) from exc
        log.info("joined generation %d as rank %d of %d (%s, tensor-parallel size %d)", generation, rank, world,
                 self.backend, tp)

    def _subgroups(self, tp: int) -> None:
        """Every member creates every subgroup, in the same order (`new_group` is collective)."""
        replicas = self.world // tp
        for replica in range(replicas):
            group = dist.new_group(list(range(replica * tp, (replica + 1) * tp)))
            if replica == self.replica:
                self.tp_group = group
        for shard in range(tp):
            ranks = list(range(shard, self.world, tp))
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if shard == self.tp_rank and group is not None:
                self.dp_group = group

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may refuse to close cleanly; it is dropped either way
                log.debug("destroying the old group: %s", exc)
        self.world = 1
        self.rank = 0
        self.tp = 1
        self.tp_group = self.dp_group = None

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        if self.world > 1:
            self.guard(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))

    def all_reduce_replicas_(self, tensor: torch.Tensor) -> None:
        """Sum over the replicas holding the same shard (everyone, without tensor parallelism)."""
        if self.replicas > 1:
            self.guard(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group))

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if self.world > 1:
            self.guard(lambda: dist.broadcast(tensor, src=src))

    def broadcast_from_first_replica_(self, tensor: torch.Tensor) -> None:
        """Every replica takes the tensor of replica 0's member holding the same shard."""
        if self.replicas > 1:
            self.guard(lambda: dist.broadcast(tensor, src=self.tp_rank, group=self.dp_group))

    def guard(self, fn: Any) -> Any:
        """Run `fn` (which runs collectives), turning a failure into a `CollectiveError`."""
        try:
            return fn()
        except Exception as exc:
            raise CollectiveError(f"collective failed in generation {self.generation}: {exc}") from exc

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.guard(lambda: dist.all_gather_object(out, obj))
        return out
