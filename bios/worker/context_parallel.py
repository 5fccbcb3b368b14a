"""One row split by sequence over the replicas of a group (context parallelism), for a row longer than a pass.

Each of R replicas takes two of the row's 2R equal chunks, r and 2R-1-r (Megatron's causal load balancing: the
early chunks' queries see few keys, the late ones' many, so every replica gets one of each), and runs every layer
on those positions only, RoPE at their absolute positions. Built-in losses are sums over tokens, so a replica's
loss is its positions' share; the cycle's gradient sum over replicas then adds the shares, as it adds shards of
a batch.

Attention needs every earlier key. On CPU each layer streams them (`_StreamedAttention`, ring attention's
arithmetic): replica after replica broadcasts its keys and values, and every replica attends its queries to
that source's chunks (a chunk's pair is whole, causal, or skipped) with PyTorch's CPU flash attention, merging
the partial outputs by their log-sum-exp; in backward the same broadcasts come again, and each source's key and
value gradients are summed onto it. A replica holds one source's keys at a time, so what a split row adds to a
worker shrinks with R (`bios.models.long_rows.split_attention_bytes`). Elsewhere (CUDA) each layer gathers the
whole row's keys and values (`SequenceShare.gather`) and each chunk's queries attend over the keys up to the
chunk's end by SDPA with a lower-right causal bias. Bios's attention (`bios.worker.attention`) asks `current()`
at each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


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

    def broadcast_from_replica_(self, tensor: Tensor, replica: int = 0) -> None: ...

    def reduce_to_replica_(self, tensor: Tensor, replica: int) -> None: ...


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
        values (this replica's [1, Hkv, n, D]; the others' come from their replicas): [1, n, Hq, D],
        Transformers' layout."""
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query.device.type == "cpu":
            output = _StreamedAttention.apply(query.float(), key.float(), value.float(), self, scale)
            return output.to(query.dtype).transpose(1, 2)
        keys, values = (_GatherSequence.apply(part, self) for part in (key, value))
        return self.attend_by_chunks(query, keys, values, scale)

    def keys_values_of(self, source: int, key: Tensor, value: Tensor) -> Tensor:
        """Replica `source`'s keys and values, [2, 1, Hkv, n_source, D] (this replica's own if it is the
        source): every replica calls this for every source, in the same order."""
        if source == self.rank:
            pair = torch.stack([key, value])
        else:
            count = len(share_positions(self.length, self.world, source))
            pair = key.new_empty(2, *key.shape[:2], count, key.shape[3])
        self.replicas.broadcast_from_replica_(pair, source)
        return pair

    def blocks(self, source: int) -> list[tuple[slice, slice, bool]]:
        """Which of this replica's queries attend to which of `source`'s keys, and whether causally: (query
        positions, key positions, causal) in the two replicas' share tensors. Chunk pairs are whole (an earlier
        chunk's keys), causal (the same chunk) or skipped (a later chunk); a query chunk's whole pairs with
        adjacent key chunks go in one call."""
        mine = _chunk_slices(self.length, self.world, self.rank)
        theirs = _chunk_slices(self.length, self.world, source)
        found = []
        for query_chunk, queries in mine:
            if queries.start == queries.stop:
                continue
            whole = [keys for key_chunk, keys in theirs if key_chunk < query_chunk and keys.start < keys.stop]
            if whole:
                found.append((queries, slice(whole[0].start, whole[-1].stop), False))
            found += [(queries, keys, True) for key_chunk, keys in theirs if key_chunk == query_chunk]
        return found

    def attend_by_chunks(self, query: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """`attend` off CPU (CUDA), over the whole row's gathered keys and values: each of the two chunks'
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


def _chunk_slices(length: int, world: int, rank: int) -> list[tuple[int, slice]]:
    """Replica `rank`'s two chunks as (chunk index, positions in its share tensor)."""
    (first, first_end), (late, late_end) = share_chunks(length, world, rank)
    return [(rank, slice(0, first_end - first)),
            (2 * world - 1 - rank, slice(first_end - first, first_end - first + late_end - late))]


class _StreamedAttention(torch.autograd.Function):
    """`SequenceShare.attend` on CPU, fp32: this replica's queries [1, Hq, n, D] over every source's keys and
    values [1, Hkv, n_source, D] (grouped queries as they are: the kernel takes them), one source at a time;
    -> [1, Hq, n, D]. Backward takes the keys and values again from each source and sums their gradients onto
    it (`reduce_to_replica_`), as ring attention does (with the merged output and log-sum-exp, each pair's
    backward is that of the whole row's attention)."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, share: SequenceShare, scale: float) -> Tensor:
        output = torch.zeros_like(query)
        lse = query.new_full(query.shape[:3], float("-inf"))
        for source in range(share.world):
            keys, values = share.keys_values_of(source, key, value)
            for queries, keys_at, causal in share.blocks(source):
                part, part_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query[:, :, queries], keys[:, :, keys_at], values[:, :, keys_at], 0.0, causal, scale=scale)
                merged = torch.logaddexp(lse[:, :, queries], part_lse)
                output[:, :, queries] = (output[:, :, queries] * (lse[:, :, queries] - merged).exp()[..., None]
                                         + part * (part_lse - merged).exp()[..., None])
                lse[:, :, queries] = merged
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.share, ctx.scale = share, scale
        return output

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        query, key, value, output, lse = ctx.saved_tensors
        share, grad = ctx.share, grad.contiguous()
        grad_query = torch.zeros_like(query)
        grad_key = grad_value = None
        for source in range(share.world):
            pair = share.keys_values_of(source, key, value)
            grad_pair = torch.zeros_like(pair)
            for queries, keys_at, causal in share.blocks(source):
                part_query, part_key, part_value = \
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        grad[:, :, queries], query[:, :, queries], pair[0][:, :, keys_at], pair[1][:, :, keys_at],
                        output[:, :, queries], lse[:, :, queries], 0.0, causal, scale=ctx.scale)
                grad_query[:, :, queries] += part_query
                grad_pair[0][:, :, keys_at] += part_key
                grad_pair[1][:, :, keys_at] += part_value
            share.replicas.reduce_to_replica_(grad_pair, source)
            if source == share.rank:
                grad_key, grad_value = grad_pair
        return grad_query, grad_key, grad_value, None, None


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
