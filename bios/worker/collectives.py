"""The collective group of one generation: gradients summed across workers with torch.distributed.

gloo on CPU, NCCL on CUDA: the same code with another backend. Each worker hosts a rendezvous `TCPStore`; the
coordinator names one (the generation's rank 0) and every generation uses its own key prefix, so groups of
different generations never mix. A world of one needs no process group at all. Collectives time out after a
few seconds so a dead peer turns into an error, not a hang.

With tensor parallelism over `tp` workers the generation is also cut into subgroups: rank r is shard r % tp
of replica r // tp; `tp_group` joins the shard holders of one replica (the model's all-reduces, the shared
LoRA gradients), `dp_group` the holders of one shard across replicas (the data-parallel gradient sum and the
hand-over of a shard from replica 0). None stands for the whole world.

Two timeouts, two jobs. Joining a group (the rendezvous) is bounded by `timeout_s`, seconds: a member that never
comes is dead. A collective itself may wait as long as `collective_timeout_s` (default 10 minutes) for a peer
that is alive but busier (one long row on one worker): whether a peer is alive is the heartbeats' call, made by
the coordinator, not a timer's. When the coordinator gives up on a generation (a member died, hangs, or was cut
off) it says so (`abort`, from the event loop), and every gloo collective of that generation ends at once with a
`CollectiveError`, on any thread; NCCL's are ordered on the stream and bounded by the group's timeout.

The sockets open on the interface of the address the worker advertises (bios/worker/interfaces.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from bios.cluster_defaults import COLLECTIVE_TIMEOUT_S

from .interfaces import socket_interfaces, store_listener, unreachable

log = logging.getLogger(__name__)


ABORT_POLL_S = 0.05  # how often a waiting collective looks whether its generation was aborted


class CollectiveError(RuntimeError):
    """A collective failed (a peer died, timed out, or the coordinator aborted the generation); the cycle must be
    aborted and the group rebuilt."""


class _Aborts:
    """The generation the compute thread works in and the last one the coordinator aborted, each named by the
    coordinator's incarnation and number: process-wide, as torch.distributed's groups are, so the tensor-parallel
    layers' collectives honour it too."""

    def __init__(self) -> None:
        self.joined: tuple[str, int] = ("", 0)
        self.aborted: tuple[str, int] | None = None
        self.reason = ""

    def abort(self, epoch: str, generation: int, reason: str) -> None:
        self.aborted, self.reason = (epoch, generation), reason

    def check(self) -> None:
        if self.aborted == self.joined:
            raise CollectiveError(f"generation {self.joined[1]} was aborted by the coordinator: {self.reason}")


_aborts = _Aborts()


def completed(work: dist.Work | None) -> None:
    """Wait for a collective started with `async_op=True`. On gloo the wait ends early, with a `CollectiveError`,
    once the coordinator aborts this generation; NCCL's `wait` only orders the stream (its watchdog and the
    group's timeout bound it)."""
    if work is None:
        return
    if dist.get_backend() == "gloo":
        finished = threading.Event()
        work.get_future().add_done_callback(lambda _: finished.set())
        while not finished.is_set():
            _aborts.check()
            finished.wait(ABORT_POLL_S)
    work.wait()


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
        listener = store_listener(host)  # the advertised address only: torch's own socket would bind every one
        self.store = dist.TCPStore(host, listener[1] if listener else 0, is_master=True, wait_for_workers=False,
                                   use_libuv=True, master_listen_fd=listener[0] if listener else None)
        self.store_port = int(self.store.port)
        self.generation = 0
        self.rank = 0
        self.world = 1
        self.tp = 1
        self.tp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self._client: dist.TCPStore | None = None
        self._retired: list[Any] = []  # the last generation's groups, until `release_retired`

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
                timeout_s: float, tp: int = 1, epoch: str = "",
                collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Leave the old group and join this generation's; blocks until every member has joined (at most
        `timeout_s`). `epoch` names the coordinator's incarnation: a restarted one numbers generations afresh,
        under keys of its own."""
        self.destroy()
        if world % tp:
            raise CollectiveError(f"generation {generation}: {world} workers do not form replicas of {tp}")
        self.generation, self.rank, self.world, self.tp = generation, rank, world, tp
        _aborts.joined = (epoch, generation)
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
            groups = [None, *self._subgroups(tp, timeout)] if tp > 1 else [None]
        except Exception as exc:
            raise CollectiveError(unreachable(generation, world, self.backend, self.host, exc, os.environ)) from exc
        for group in groups:  # joined: from now on a peer may be slower by up to the collective timeout
            _set_pg_timeout(datetime.timedelta(seconds=collective_timeout_s), group)
        log.info("joined generation %d as rank %d of %d (%s, tensor-parallel size %d)", generation, rank, world,
                 self.backend, tp)

    def _subgroups(self, tp: int, timeout: datetime.timedelta) -> list[dist.ProcessGroup]:
        """Every member creates every subgroup, in the same order (`new_group` is collective); returns those it
        is in."""
        replicas = self.world // tp
        for replica in range(replicas):
            group = dist.new_group(list(range(replica * tp, (replica + 1) * tp)), timeout=timeout)
            if replica == self.replica:
                self.tp_group = group
        for shard in range(tp):
            ranks = list(range(shard, self.world, tp))
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if shard == self.tp_rank and group is not None:
                self.dp_group = group
        return [g for g in (self.tp_group, self.dp_group) if g is not None]

    @staticmethod
    def abort(epoch: str, generation: int, reason: str) -> None:
        """The coordinator gave up on `generation` (called from the event loop): its collectives, running or to
        come, fail at once instead of waiting for a peer that will not come."""
        _aborts.abort(epoch, generation, reason)

    def destroy(self) -> None:
        if dist.is_initialized():
            self._retired += [g for g in (dist.group.WORLD, self.tp_group, self.dp_group) if g is not None]
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may refuse to close cleanly; it is dropped either way
                log.debug("destroying the old group: %s", exc)
        self.world = 1
        self.rank = 0
        self.tp = 1
        self.tp_group = self.dp_group = None

    def release_retired(self) -> None:
        """Let go of the last generation's groups (once nothing else points at them: `ModelPool.bind_group`) on a
        thread of their own. A gloo group whose collective was left pending by an aborted cycle waits in its
        destructor for that peer, until it exits or the collective times out: on the compute thread, a survivor's
        reconfigure hung that long after it had joined the new generation (the coordinator gave the formation up
        after 180 s)."""
        retired, self._retired = self._retired, []
        if retired:
            threading.Thread(target=retired.clear, name="retired-groups", daemon=True).start()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        if self.world > 1:
            self.guard(lambda: completed(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)))

    def all_reduce_replicas_(self, tensor: torch.Tensor) -> None:
        """Sum over the replicas holding the same shard (everyone, without tensor parallelism)."""
        if self.replicas > 1:
            self.guard(lambda: completed(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.dp_group,
                                                         async_op=True)))

    def all_gather_replicas_(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every replica's `tensor` into `parts`, in replica order: from the members holding this member's shard
        (everyone, without tensor parallelism)."""
        if self.replicas == 1:
            parts[0].copy_(tensor)
            return
        self.guard(lambda: completed(dist.all_gather(parts, tensor, group=self.dp_group, async_op=True)))

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        if self.world > 1:
            self.guard(lambda: completed(dist.broadcast(tensor, src=src, async_op=True)))

    def broadcast_from_replica_(self, tensor: torch.Tensor, replica: int = 0) -> None:
        """Every replica takes the tensor of `replica`'s member holding the same shard."""
        if self.replicas > 1:
            src = replica * self.tp + self.tp_rank
            self.guard(lambda: completed(dist.broadcast(tensor, src=src, group=self.dp_group, async_op=True)))

    def reduce_to_replica_(self, tensor: torch.Tensor, replica: int) -> None:
        """Sum every replica's `tensor` onto `replica`'s member holding the same shard (the others' are left
        undefined)."""
        if self.replicas > 1:
            dst = replica * self.tp + self.tp_rank
            self.guard(lambda: completed(dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=self.dp_group,
                                                     async_op=True)))

    def guard(self, fn: Any) -> Any:
        """Run `fn` (which runs collectives), turning a failure into a `CollectiveError`."""
        try:
            return fn()
        except Exception as exc:
            raise CollectiveError(f"collective failed in generation {self.generation}: {exc}") from exc

    def settle(self) -> None:
        """After sums in subgroups (tensor parallelism), which can fail for some members and succeed for others:
        one last collective over everyone decides, so survivors never disagree about what the sums were for."""
        if self.tp > 1:
            self.all_reduce_sum_(torch.zeros(1))

    def all_gather_replicas(self, obj: Any) -> list[Any]:
        """Every replica's `obj` (its first member's: the shard holders of one replica compute the same), in
        replica order."""
        return self.all_gather_object(obj)[:: self.tp]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in rank order: `dist.all_gather_object`, but made of abortable collectives (the
        first collective after a forward phase, where a busier member's peers wait longest)."""
        if self.world == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self.guard(lambda: completed(dist.all_gather(sizes, size, async_op=True)))
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self.guard(lambda: completed(dist.all_gather(parts, padded, async_op=True)))
        return [pickle.loads(part[:length].cpu().numpy().tobytes()) for part, length in zip(parts, lengths)]
