"""What a decode's output buffers become: streamed progress while it runs, one `SampleResponse` per request at
the end.

The decode loop in `bios.worker.sampling` writes every row's tokens, logprobs and top-k into dense buffers;
`Progress` sends each streaming request the tokens that are new since its last report (every
`_PROGRESS_EVERY_S` or `_PROGRESS_EVERY_TOKENS`), and `responses` cuts the finished rows back into the
caller's requests, in the caller's order, with their prompt scores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bios.types import SampledSequence, SampleResponse, TensorData, TopkLogprobs
from bios.worker.prompt_scoring import PromptScores

if TYPE_CHECKING:
    from bios.worker.sampling_rows import SampleItem

# A streaming request's progress goes out once this long has passed since the last (or this many tokens are new).
_PROGRESS_EVERY_S = 0.05
_PROGRESS_EVERY_TOKENS = 16


class Progress:
    """The streaming requests of a decode (their output rows and callbacks) and what each row has been sent."""

    def __init__(self, streams: list[tuple[int, int, int, Callable]]) -> None:
        self.streams = streams  # (first row, rows, top-k, callback)
        self.sent: dict[int, int] = {row: 0 for first, count, _, _ in streams for row in range(first, first + count)}
        self.last, self.last_step = time.monotonic(), 0

    @staticmethod
    def of(ordered: list[SampleItem]) -> Progress | None:
        streams, row = [], 0
        for item in ordered:
            if item.progress is not None:
                streams.append((row, item.num_samples, item.topk_sample_logprobs, item.progress))
            row += item.num_samples
        return Progress(streams) if streams else None

    def report(self, step: int, out_tokens: Tensor, out_logprobs: Tensor, finished_at: Tensor,
               top: tuple[Tensor, Tensor] | None, *, force: bool = False) -> None:
        """After step `step`: each streaming request's new tokens, if enough time passed or enough are new."""
        now = time.monotonic()
        if not force and now - self.last < _PROGRESS_EVERY_S and step + 1 - self.last_step < _PROGRESS_EVERY_TOKENS:
            return
        self.last, self.last_step = now, step + 1
        rows = sorted(self.sent)
        ends = torch.where(finished_at[rows] > 0, finished_at[rows], step + 1).tolist()
        start = min(self.sent[r] for r in rows)
        tokens = out_tokens[rows, start : step + 1].tolist()
        logprobs = out_logprobs[rows, start : step + 1].tolist()
        ids = values = None
        if top is not None:
            ids, values = top[0][rows, start : step + 1].cpu().numpy(), top[1][rows, start : step + 1].cpu().numpy()
        new = {}
        for i, (row, end) in enumerate(zip(rows, ends)):
            a, b = self.sent[row] - start, end - start
            new[row] = (self.sent[row], tokens[i][a:b], logprobs[i][a:b], i, a, b)
            self.sent[row] = max(self.sent[row], end)
        for first, count, k, callback in self.streams:
            parts = [new[row] for row in range(first, first + count)]
            if not any(part[1] for part in parts):
                continue
            callback([part[0] for part in parts], [
                SampledSequence("length", toks, lps, topk_logprobs=TopkLogprobs(
                    TensorData(ids[i, a:b, :k].copy(), "int64"), TensorData(values[i, a:b, :k].copy(), "float32"))
                    if k and ids is not None else None)
                for _, toks, lps, i, a, b in parts])


def responses(
    items: list[SampleItem],
    order: list[int],
    out_tokens: Tensor,
    out_logprobs: Tensor,
    finished_at: Tensor,
    stopped: Tensor,
    prompt_scores: dict[int, PromptScores],
    top: tuple[Tensor, Tensor] | None = None,
) -> list[SampleResponse]:
    """Rows back into one response per item, in the caller's item order."""
    tokens, logprobs = out_tokens.tolist(), out_logprobs.tolist()
    top_ids, top_logp = (top[0].cpu().numpy(), top[1].cpu().numpy()) if top is not None else (None, None)
    lengths_list, stopped_list = finished_at.tolist(), stopped.tolist()
    sequences: dict[int, list[SampledSequence]] = {}
    row = 0
    for index in order:
        sequences[index] = []
        k = items[index].topk_sample_logprobs
        for _ in range(items[index].num_samples):
            n = lengths_list[row]
            sequences[index].append(
                SampledSequence(
                    stop_reason="stop" if stopped_list[row] else "length",
                    tokens=tokens[row][:n],
                    logprobs=logprobs[row][:n],
                    topk_logprobs=TopkLogprobs(TensorData(top_ids[row, :n, :k].copy(), "int64"),
                                               TensorData(top_logp[row, :n, :k].copy(), "float32"))
                    if k and top_ids is not None else None,
                )
            )
            row += 1
    none = PromptScores()
    return [
        SampleResponse(
            sequences=sequences[i],
            prompt_logprobs=prompt_scores.get(i, none).logprobs,
            topk_prompt_logprobs=prompt_scores.get(i, none).topk,
            prompt_alt_tokens=prompt_scores.get(i, none).alt_tokens,
            target_prompt_logprobs=prompt_scores.get(i, none).targets,
        )
        for i in range(len(items))
    ]
