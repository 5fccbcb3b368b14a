"""One row split by sequence over the replicas of a group (context parallelism), for a row longer than a pass.

Each of R replicas takes two of the row's 2R equal chunks, r and 2R-1-r (Megatron's causal load balancing: the
early chunks' queries see few keys, the late ones' many, so every replica gets one of each), and runs every layer
on those positions only, RoPE at their absolute positions. Attention needs every earlier key: each layer gathers
the whole row's keys and values from the replicas (`SequenceShare.gather`), and the gather's backward sums every
replica's gradient for them and keeps its own positions'. Built-in losses are sums over tokens, so a replica's
loss is its positions' share; the cycle's gradient sum over replicas then adds the shares, as it adds shards of
a batch.

On CPU, attention runs Bios's interval kernel: this replica's queries, each over the whole row's keys up to its
position, the same kernel and the same arithmetic per query as one worker running the whole row. Elsewhere
(CUDA) each chunk's queries attend over the keys up to the chunk's end by SDPA with a lower-right causal bias.
Bios's attention (`bios.worker.attention`) asks `current()` at each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from bios.kernels import interval_attention


def share_chunks(length: int, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two chunks ([start, end) positions) replica `rank` of `world` takes of a row of `length`: chunks rank
    and 2*world-1-rank of 2*world as equal as can be."""
    bounds = [length * i // (2 * world) for i in range(2 * world + 1)]
    late = 2 * world - 1 - rank
    return (bounds[rank], bounds[rank + 1]), (bounds[late], bounds[late + 1])


def share_positions(length: int, world: int, rank: int) -> Tensor:
    """The positions of `share_chunks`, ascending."""
    return torch.cat([torch.arange(start, end) for start, end in share_chunks(length, world, rank)])


class Replicas(Protocol):
    """The collectives a split row needs: the worker's `CollectiveGroup` (a failure is the cycle's
    `CollectiveError`)."""

    def all_gather_replicas_(self, parts: list[Tensor], tensor: Tensor) -> None: ...

    def all_reduce_replicas_(self, tensor: Tensor) -> None: ...


@dataclass(frozen=True)
class SequenceShare:
    """Replica `rank` of `world`'s share of one split row of `length` tokens."""

    length: int
    world: int
    rank: int
    replicas: Replicas

    @property
    def positions(self) -> Tensor:
        return share_positions(self.length, self.world, self.rank)

    def gather(self, local: Tensor) -> Tensor:
        """[B, H, n, D] at this replica's positions -> [B, H, length, D]: every replica's, in row order."""
        shares = [share_positions(self.length, self.world, rank) for rank in range(self.world)]
        widest = max(len(share) for share in shares)
        padded = local.new_zeros(*local.shape[:2], widest, local.shape[3])
        padded[:, :, : local.shape[2]] = local
        parts = [torch.empty_like(padded) for _ in shares]
        self.replicas.all_gather_replicas_(parts, padded.contiguous())
        whole = local.new_empty(*local.shape[:2], self.length, local.shape[3])
        for share, part in zip(shares, parts):
            whole[:, :, share] = part[:, :, : len(share)]
        return whole

    def attend(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """Causal attention of this replica's queries [1, Hq, n, D] (rotated) over the whole row's keys and
        values (this replica's [1, Hkv, n, D], gathered): [1, n, Hq, D], Transformers' layout."""
        keys, values = (_GatherSequence.apply(part, self) for part in (key, value))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query.device.type != "cpu":
            return self.attend_by_chunks(query, keys, values, scale)
        queries = query.float()
        if not interval_attention.suits(queries, keys, values, same_length=False):
            return self.attend_by_chunks(query, keys, values, scale)
        lo = torch.zeros(1, queries.shape[2], dtype=torch.int32)
        hi = self.positions.to(torch.int32)[None].contiguous()  # each query sees the keys up to its position
        output = interval_attention.interval_attention(queries, keys.float(), values.float(), lo, hi, scale)
        return output.to(query.dtype)

    def attend_by_chunks(self, query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """`attend` where the interval kernel does not run (CUDA, other head widths): each of the two chunks'
        queries over the keys up to the chunk's end, causal from the bottom right (SDPA with a lower-right causal
        bias, which CUDA's memory-efficient kernel runs without a mask)."""
        from torch.nn.attention.bias import causal_lower_right

        outputs, start = [], 0
        for first, end in share_chunks(self.length, self.world, self.rank):
            count = end - first
            if not count:
                continue
            chunk = query[:, :, start:start + count]
            start += count
            ahead = [part[:, :, :end].to(query.dtype) for part in (keys, values)]
            if ahead[0].shape[1] != query.shape[1]:  # grouped queries: each key head serves several
                ahead = [part.repeat_interleave(query.shape[1] // part.shape[1], dim=1) for part in ahead]
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                chunk, *ahead, attn_mask=causal_lower_right(count, end), scale=scale))
        return torch.cat(outputs, dim=2).transpose(1, 2)


class _GatherSequence(torch.autograd.Function):
    """`SequenceShare.gather`, differentiable: the gradient of the whole row's tensor is summed over the
    replicas (each holds the part its own queries put there), and each keeps its positions'."""

    @staticmethod
    def forward(ctx, local: Tensor, share: SequenceShare) -> Tensor:
        ctx.share = share
        return share.gather(local)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        ctx.share.replicas.all_reduce_replicas_(grad)
        return grad[:, :, ctx.share.positions], None


_SHARE: ContextVar[SequenceShare | None] = ContextVar("bios_sequence_share", default=None)


@contextlib.contextmanager
def splitting(share: SequenceShare) -> Iterator[None]:
    """Attention inside runs `share.attend` (a checkpointed layer's recomputation in backward included)."""
    token = _SHARE.set(share)
    try:
        yield
    finally:
        _SHARE.reset(token)


def current() -> SequenceShare | None:
    return _SHARE.get()
