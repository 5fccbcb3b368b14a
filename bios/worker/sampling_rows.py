"""The rows of a sampling batch: one per sample, with what the decode loop needs of each as tensors, built from
the batch's requests (`SampleItem`).

`build_rows` turns a batch's requests into `Rows`: each sample's token-choice state (its parameters and the
uniforms drawn up front from its own generator, `row_seed`), how many tokens it may sample
(`resolved_max_tokens`), its stop token ids, its first position and attention mask, and its adapter. Compaction
(`Rows.select`) indexes every field alike, so the decode loop in `bios.worker.sampling` can drop finished rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from bios import spec
from bios.spec import DEFAULT_MAX_TOKENS, resolved_max_tokens  # noqa: F401  (DEFAULT_MAX_TOKENS: tests)
from bios.types import SampledSequence, SamplingParams, TensorData
from bios.worker.adapter import AdapterState
from bios.worker.logits_processing import RowSpec, TokenChoice, token_choice
from bios.worker.stopping import stop_token_ids
from bios.worker.vision import RowImages

@dataclass
class SampleItem:
    """One sample request: `num_samples` continuations of `prompt` from the base model plus `adapter`."""

    adapter: AdapterState | None  # None: the base model alone
    prompt: list[int]  # with a vision-language model's image tokens in place of its images
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False
    images: RowImages | None = None  # the prompt's images, in order
    topk_prompt_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    topk_sample_logprobs: int = 0  # > 0: the k most likely tokens at every sampled position (model logprobs)
    target_prompt_logprobs: TensorData | None = None  # int64 [len(prompt) - 1, K] prompt ids to score (-1: none)
    # streaming: called now and then during the decode with, per sample, the position its new tokens start at and
    # a `SampledSequence` of them (with logprobs, and top-k when asked); the return value stays the whole result
    progress: Callable[[list[int], list[SampledSequence]], None] | None = None


def row_seed(seed: int, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a request with `seed`: a hash, so nearby seeds and
    indices give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & spec.MAX_SEED


@dataclass
class Rows:
    """Per-row decode state of the live batch, as tensors; `row` maps a batch position to its row in the output
    buffers, and compaction indexes every field alike."""

    row: Tensor  # [B] int64
    choice: TokenChoice
    max_new: Tensor  # [B] int64
    position: Tensor  # [B] int64, position of the first sampled token (the prompt length)
    stop_ids: Tensor  # [B, S] int64, -1 padded
    attention_mask: Tensor  # [B, padded prompt + max steps] int64
    adapters: list[AdapterState | None]

    def select(self, keep: Tensor) -> Rows:
        return Rows(
            row=self.row[keep],
            choice=self.choice.select(keep),
            max_new=self.max_new[keep],
            position=self.position[keep],
            stop_ids=self.stop_ids[keep],
            attention_mask=self.attention_mask[keep],
            adapters=[self.adapters[i] for i in keep.tolist()],
        )


def build_rows(
    ordered: list[SampleItem],
    seeds: list[int],
    prompt_mask: Tensor,
    lengths: list[int],
    eos_token_id: int | None,
    context: int,
    logits: Tensor,
) -> tuple[Rows, dict[int, list[str]]]:
    """Per-row tensors for the decode loop, and the stop strings of rows that have any (by row)."""
    specs: list[RowSpec] = []
    max_new, position, stop_ids, adapters = [], [], [], []
    string_stops: dict[int, list[str]] = {}
    for item, seed, length in zip(ordered, seeds, lengths):
        params = item.params
        new_tokens = resolved_max_tokens(length, params, context)
        strings = spec.stop_strings(params.stop)
        for sample_index in range(item.num_samples):
            if strings:
                string_stops[len(specs)] = strings
            uniforms = torch.zeros(0)
            if params.temperature != 0:
                generator = torch.Generator().manual_seed(row_seed(seed, sample_index))
                uniforms = torch.rand(new_tokens, generator=generator)
            specs.append(RowSpec(params, uniforms, item.prompt))
            max_new.append(new_tokens)
            position.append(length)
            stop_ids.append(stop_token_ids(params.stop, eos_token_id))
            adapters.append(item.adapter)
    device = logits.device
    steps = max(max_new)
    stop_table = torch.full((len(specs), max(len(ids) for ids in stop_ids)), -1, dtype=torch.int64)
    for row, ids in enumerate(stop_ids):
        stop_table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    choice = token_choice(specs, steps, logits.shape[-1], device)
    rows = Rows(
        row=torch.arange(len(specs), device=device),
        choice=choice,
        max_new=torch.tensor(max_new, dtype=torch.int64, device=device),
        position=torch.tensor(position, dtype=torch.int64, device=device),
        stop_ids=stop_table.to(device),
        attention_mask=torch.cat([prompt_mask, torch.ones(len(specs), steps, dtype=torch.int64, device=device)], dim=1),
        adapters=adapters,
    )
    return rows, string_stops
