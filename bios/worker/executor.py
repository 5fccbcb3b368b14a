"""Runs one cycle's work items on this worker, as one member of its generation's collective group.

Five phases: new adapters; the forward/forward_backward work of every run together (each replica takes its
contiguous, token-balanced shard of every batch; rows of different adapters share forward passes); the gradient
sum across members and the commit; each run's closing op (optim_step, save, load), replicated on every member;
this member's share of the samples.

Every item passes the worker's one wall before it joins a batch: `engine.check_item` for forward work (the
request spec's rules, against the base model), `spec.check_optim_params` and `spec.check_sample` for the
others. A bad item fails alone; nothing past the wall checks the request again.

A failed collective aborts the cycle: uncommitted gradients are dropped and the coordinator re-runs what did
not finish. Every member reports what it finished; the coordinator keeps the first report of each item.

Tensor parallelism is the adapters' business (`adapter_kinds`): a sharded adapter sums its gradients, clips by
the whole adapter's norm, steps, gathers the whole adapter to save it and loads a whole checkpoint as a whole
adapter does, so nothing here asks which kind it holds. Batches are split over replicas, not members: the k
shard holders of a replica run the same rows (`bios/worker/tensor_parallel.py`, docs/tensor-parallel.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from bios import messages as m
from bios import spec
from bios import types as t
from bios.exceptions import BadRequestError, RemoteError
from bios.kernels.prepacked import PrepackedWeights

from . import engine, split_rows
from .adapter_kinds import Adapter, whole_on_rank_zero
from .checkpoint import export_state
from .collectives import CollectiveError, CollectiveGroup
from .context_parallel import SequenceShare
from .custom_loss import CompiledLoss
from .pool import ModelPool
from .sampling import SampleItem, generate
from .split_rows import Share
from .tensor_parallel import TensorParallelError
from .vision import image_reader

log = logging.getLogger(__name__)

Report = Callable[[m.ItemDone | m.SampleProgress], None]
Batch = list[tuple[m.WorkItem, Adapter]]  # one base model's forward items, with their adapters
Shares = dict[tuple[int, int], Share]  # (item index, datum index) -> this replica's share of a split row


@dataclass(frozen=True)
class CycleOutcome:
    aborted: bool
    reason: str
    checksums: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)
    before: dict[str, float] = field(default_factory=dict)  # checksums of the whole adapters it ran on, as it began


def shard_range(token_counts: list[int], world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous slice of a batch, cut where the running token count crosses rank/world of the total."""
    total = sum(token_counts)
    bounds = [0]
    running = 0
    cut = 1
    for i, count in enumerate(token_counts):
        running += count
        while cut < world and running * world >= cut * total and len(bounds) <= cut:
            bounds.append(i + 1)
            cut += 1
    bounds += [len(token_counts)] * (world + 1 - len(bounds))
    return bounds[rank], bounds[rank + 1]


class CycleExecutor:
    def __init__(self, pool: ModelPool, group: CollectiveGroup) -> None:
        self.pool = pool
        self.group = group
        self.prepacked = PrepackedWeights()  # the sampler's weight copies, kept across cycles that only sample
        # The outputs of the parts run so far of each forward request cut over cycles (`WorkItem.part`): its last
        # part reports them all, with theirs still pending in the adapter's gradient. A new generation drops them.
        self.parts: dict[str, list[t.ForwardBackwardOutput]] = {}

    def run(self, cycle: m.RunCycle, report: Report) -> CycleOutcome:
        self.seconds: dict[str, float] = {}
        started = time.perf_counter()
        creates, forwards, closing, samples = _phases(cycle.items)
        # Only the adapters this cycle may change: any other one's checksum before it is the one after it (and
        # the one the worker registers with), and a worker holding many runs would fingerprint them all each cycle
        before = self.held_checksums({i.op.target for i in (*creates, *forwards, *closing)})
        if len(samples) < len(cycle.items):
            self.prepacked.release()  # training passes, loads and saves get their memory back
        try:
            touched = self._create_phase(cycle.cycle_id, creates, report)
            touched |= self._forward_phase(cycle.cycle_id, forwards, report)
            touched |= self._timed("closing", self._closing_phase, cycle.cycle_id, closing, report)
            self._timed("sample", self._sample_phase, cycle.cycle_id, samples, report)
        except (CollectiveError, TensorParallelError) as exc:
            log.warning("cycle %d aborted: %s", cycle.cycle_id, exc)
            return CycleOutcome(True, str(exc), {})
        checksums = self._checksums(touched)
        self.seconds["cycle"] = time.perf_counter() - started
        return CycleOutcome(False, "", checksums, self.seconds, before)

    def _timed(self, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        mark = time.perf_counter()
        result = fn(*args)
        self.seconds[phase] = time.perf_counter() - mark
        return result

    # ------------------------------------------------------------------------------------ 1. new adapters

    def _create_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> set[str]:
        for item in items:
            _attempt(cycle_id, item, lambda op=item.op: self.pool.create(op), report)
        return {item.op.target for item in items}

    # ------------------------------------------------------------------------------------ 2-3. forward, sum, commit

    def _forward_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> set[str]:
        """Shard, compute, gather outputs, sum gradients, commit; returns the runs whose gradients changed."""
        batches = self._admit(cycle_id, items, report)
        if not batches:
            return set()
        mark = time.perf_counter()
        local = {base_model: self._run_shard(batch) for base_model, batch in batches.items()}
        self.seconds["forward"] = time.perf_counter() - mark
        mark = time.perf_counter()
        gathered = self.group.all_gather_replicas(local)
        touched: set[str] = set()
        for base_model, batch in batches.items():
            parts = [replica[base_model] for replica in gathered]
            failure = next((p for p in parts if isinstance(p, RemoteError)), None)
            if failure is not None:
                _discard(adapter for _, adapter in batch)
                for item, _ in batch:
                    self.parts.pop(item.request_id, None)
                    report(m.ItemDone(cycle_id, item.request_id, error=failure))
                continue
            # A part that more cycles continue leaves its gradient pending: summed and committed with its last part
            training = sorted({a.state.model_id for it, a in batch if not it.op.forward_only and it.last_part})
            norms = self._sum_and_commit([a for _, a in batch], training)
            self.seconds["allreduce"] = time.perf_counter() - mark
            touched.update(training)
            for index, (item, adapter) in enumerate(batch):
                split = {datum: [p[1][index, datum] for p in parts] for i, datum in parts[0][1] if i == index}
                output = split_rows.with_split_rows(_merge([p[0][index] for p in parts]), split,
                                                    {d: item.op.data[d].model_input.length for d in split})
                if item.part is not None:
                    self.parts.setdefault(item.request_id, []).append(output)
                    if not item.last_part:
                        continue
                    output = _merge(self.parts.pop(item.request_id))
                if not item.op.forward_only:
                    output.metrics["grad_norm:max"] = norms[adapter.state.model_id]
                report(m.ItemDone(cycle_id, item.request_id, result=output))
        return touched

    def _admit(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> dict[str, Batch]:
        """The wall: each item checked alone against its base model (`engine.check_item`), so a bad one fails
        without its batch; the rest by base model."""
        batches: dict[str, Batch] = {}
        for item in items:
            op = item.op
            try:
                adapter = self.pool.adapter(op.model_id)
                engine.check_item(op.data, op.loss_fn, op.loss_fn_config, op.custom_loss,
                                  engine.model_limits(adapter.base.model, adapter.base.info))
            except Exception as exc:
                held = self.pool.adapters.get(op.model_id)
                if self.parts.pop(item.request_id, None) is not None and held is not None:
                    held.discard()  # a request cut over cycles: its earlier parts' pending gradient goes too
                report(_failed(cycle_id, item, exc))
                continue
            batches.setdefault(adapter.base_model, []).append((item, adapter))
        return batches

    def _run_shard(self, batch: Batch) -> tuple[list[t.ForwardBackwardOutput], Shares] | RemoteError:
        """This replica's shard of every item in one batched call, then its share of every row split over the
        replicas (`split_rows`): its outputs and shares, or the error every member sees."""
        items, slots, split = [], [], []
        base = batch[0][1]
        per_pass = self.pool.tokens_per_pass(base.base_model)
        for index, (item, adapter) in enumerate(batch):
            op = item.op
            custom = CompiledLoss(op.custom_loss) if op.custom_loss is not None else None
            whole = engine.ForwardItem(adapter.state, op.data, op.loss_fn, op.loss_fn_config, op.forward_only, custom)
            long = [d for d in range(len(op.data))
                    if split_rows.splits(base.base.model, whole, d, per_pass, self.group.replicas)]
            split += [(index, whole, d) for d in long]
            rest = [datum for d, datum in enumerate(op.data) if d not in long]
            start, end = shard_range([d.model_input.length for d in rest], self.group.replicas, self.group.replica)
            slots.append(end > start)
            if end > start:
                items.append(dataclasses.replace(whole, data=rest[start:end]))
        try:
            outputs = iter(engine.forward_backward(base.base.model, items, checked=True, max_tokens_per_pass=per_pass,
                                                   images=image_reader(base.base.info, base.base.image_processor))
                           if items else ())
            shares = {(index, d): split_rows.forward_backward_share(base.base.model, whole, d, SequenceShare(
                whole.data[d].model_input.length, self.group.replicas, self.group.replica, self.group))
                for index, whole, d in split}
        except (TensorParallelError, CollectiveError):  # a split row's gather failed: the cycle aborts
            _discard(adapter for _, adapter in batch)
            raise
        except Exception as exc:
            log.exception("a batched forward of %d items failed", len(items))
            _discard(adapter for _, adapter in batch)
            return RemoteError.from_exception(exc)
        return [next(outputs) if has_rows else _empty_output() for has_rows in slots], shares

    def _sum_and_commit(self, adapters: list[Adapter], training: list[str]) -> dict[str, float]:
        """Sum every member's gradient contributions, then commit them on every member or on none; returns each
        run's whole-adapter gradient norm.

        Sums can run in subgroups (a sharded adapter's), which can fail for some members and succeed for others;
        `settle` decides for everyone, so survivors never disagree about a commit. Every collective runs before
        the first commit, so neither the commit nor the optimizer step after it needs one of its own.
        """
        by_id = {a.state.model_id: a for a in adapters}
        try:
            for model_id in training:  # every member walks the same sorted list: collectives line up
                by_id[model_id].sum_grads(self.group)
            self.group.settle()
        except CollectiveError:
            _discard(by_id.values())
            raise
        return {model_id: by_id[model_id].commit() for model_id in training}

    # ------------------------------------------------------------------------------------ 4. closing ops

    def _closing_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> set[str]:
        for item in items:
            _attempt(cycle_id, item, lambda op=item.op: self._closing_op(op), report)
        return {item.op.model_id for item in items}

    def _closing_op(self, op: m.Request) -> Any:
        if isinstance(op, m.OptimStep):
            adapter = self.pool.adapter(op.model_id)
            spec.check_optim_params(op.adam_params, adapter.state.optimizer)
            return adapter.optim_step(op.adam_params, self.group)
        if isinstance(op, m.SaveWeights):
            adapter = self.pool.adapter(op.model_id)
            saved = export_state(adapter.whole(self.group), base_model=adapter.base_model,
                                 base_info=adapter.base.info, with_optimizer=op.kind == "weights")
            if op.kind == "sampler_weights":
                self.pool.add_sampler(op.path, adapter.base_model, saved)
            return m.SavedState(saved) if self.group.rank == 0 else None
        if isinstance(op, m.LoadWeights):
            if op.state is None:
                raise BadRequestError(f"no checkpoint data came with the load of {op.path}", field="path")
            self.pool.adapter(op.model_id).load(op.state, with_optimizer=op.optimizer)
            return t.LoadWeightsResponse(path=op.path, model_id=op.model_id)
        raise BadRequestError(f"workers do not run {type(op).__name__}", field="kind")

    # ------------------------------------------------------------------------------------ membership

    def reconfigure(self, msg: m.Reconfigure) -> dict[str, float]:
        """Join a new generation and make every adapter identical to its source: replica 0's holder of the same
        shard (rank 0 without tensor parallelism), the replica `msg.sources` names, or its checkpoint; when the last
        generation held it split another way (`msg.source_tp`), put together whole on rank 0 from the shard
        holders ranked first, then cut anew (`whole_on_rank_zero`, `Adapter.cut_from_whole`)."""
        wanted = {held.model_id: held for held in msg.adapters}
        for model_id in [mid for mid in self.pool.adapters if mid not in wanted]:
            del self.pool.adapters[model_id]
        # cut another way now: what this member held, kept past `configure` (which drops it)
        recut = ({mid: adapter.held() for mid, adapter in self.pool.adapters.items()}
                 if msg.source_tp != msg.tp else None)
        self.parts.clear()  # requests cut over cycles start again: their pending gradients are discarded below
        self.pool.configure(msg.tp, msg.rank % msg.tp, msg.plans)
        self.group.rebuild(msg.generation, msg.rank, msg.world, msg.master_host, msg.master_port, msg.timeout_s,
                           msg.tp, msg.epoch, msg.collective_timeout_s)
        self.pool.bind_group(self.group.tp_group)
        self.group.release_retired()
        for held in msg.adapters:
            checkpoint = msg.restore.get(held.model_id)
            if checkpoint is not None or held.model_id not in self.pool.adapters:
                self.pool.create(m.CreateModel("", 0, held.base_model, held.lora, state=checkpoint,
                                               with_optimizer=True, optimizer=held.optimizer),
                                 model_id=held.model_id, seed=held.lora.seed or 0)
        for model_id in sorted(wanted):
            adapter = self.pool.adapters[model_id]
            adapter.discard()
            if model_id in msg.restore:
                continue
            if recut is not None:
                adapter.cut_from_whole(self.group, whole_on_rank_zero(self.group, recut.get(model_id), msg.source_tp))
            else:
                adapter.take_from_replica(self.group, msg.sources.get(model_id, 0))
        return self._checksums(wanted)

    def held_checksums(self, model_ids: Collection[str] | None = None) -> dict[str, float]:
        """Checksums of the whole adapters this worker holds (none of a shard's), those of `model_ids` only if
        given, for registering again: the coordinator may take them as the current state if no other holder
        survived."""
        held = {model_id: adapter.whole_checksum() for model_id, adapter in self.pool.adapters.items()
                if model_ids is None or model_id in model_ids}
        return {model_id: checksum for model_id, checksum in held.items() if checksum is not None}

    def _checksums(self, model_ids: Iterable[str]) -> dict[str, float]:
        """The held adapters' checksums under their keys: replicas of the same state must agree."""
        held = [self.pool.adapters[mid] for mid in sorted(model_ids) if mid in self.pool.adapters]
        return {adapter.checksum_key: adapter.state.checksum() for adapter in held}

    # ------------------------------------------------------------------------------------ 5. samples

    def _sample_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> None:
        """All of this member's samples of one base model in one batch, rows of different adapters together."""
        by_base: dict[str, list[tuple[m.WorkItem, SampleItem]]] = {}
        for item in items:
            op: m.Sample = item.op
            try:
                if op.adapter_state is not None and op.adapter_path is not None:
                    self.pool.add_sampler(op.adapter_path, op.base_model, op.adapter_state)
                adapter = self.pool.sampler(op.adapter_path).state if op.adapter_path is not None else None
                base = self.pool.base(op.base_model)
                spec.check_sample(op.prompt, op.num_samples, op.sampling_params, base.info,
                                  topk_prompt_logprobs=op.topk_prompt_logprobs,
                                  prompt_alt_tokens_k=op.prompt_alt_tokens_k,
                                  topk_sample_logprobs=op.topk_sample_logprobs,
                                  target_prompt_logprobs=op.target_prompt_logprobs)
                reader = image_reader(base.info, base.image_processor)
                expanded = reader.expand(op.prompt, "prompt") if reader is not None else None
            except Exception as exc:
                report(_failed(cycle_id, item, exc))
                continue
            prompt = op.prompt.to_ints() if expanded is None else expanded.tokens.tolist()
            sample_item = SampleItem(adapter, prompt, op.num_samples, op.sampling_params, op.prompt_logprobs,
                                     None if expanded is None else expanded.images, op.topk_prompt_logprobs,
                                     op.prompt_alt_tokens_k, op.topk_sample_logprobs, op.target_prompt_logprobs,
                                     _progress(cycle_id, item.request_id, report) if op.stream else None)
            by_base.setdefault(op.base_model, []).append((item, sample_item))
        for base_model, group in by_base.items():
            base = self.pool.base(base_model)
            try:
                responses = generate(base.model, base.tokenizer, [s for _, s in group],
                                     eos_token_id=base.info.eos_token_id,
                                     images=image_reader(base.info, base.image_processor),
                                     prepacked=self.prepacked, prefill_tokens=self.pool.tokens_per_pass(base_model))
            except TensorParallelError:
                raise
            except Exception as exc:
                for item, _ in group:
                    report(_failed(cycle_id, item, exc))
                continue
            for (item, _), response in zip(group, responses, strict=True):
                report(m.ItemDone(cycle_id, item.request_id, result=response))


def _empty_output() -> t.ForwardBackwardOutput:
    return t.ForwardBackwardOutput("ArrayRecord", [], {"loss:sum": 0.0})


def _merge(parts: list[t.ForwardBackwardOutput]) -> t.ForwardBackwardOutput:
    """Shards in rank order make the whole batch: outputs concatenated, sums summed, per-datum means (a custom
    loss's `:mean` metrics) weighted by each shard's datum count."""
    outputs = [record for part in parts for record in part.loss_fn_outputs]
    metrics: dict[str, float] = {}
    for part in parts:
        for key, value in part.metrics.items():
            if key.endswith(":sum"):
                metrics[key] = metrics.get(key, 0.0) + value
            elif key.endswith(":mean") and outputs:
                metrics[key] = metrics.get(key, 0.0) + value * len(part.loss_fn_outputs) / len(outputs)
            else:
                metrics[key] = value
    return t.ForwardBackwardOutput(parts[0].loss_fn_output_type, outputs, metrics)


def _phases(items: list[m.WorkItem]) -> tuple[list[m.WorkItem], ...]:
    """A cycle's items by phase: creates, forward work, closing ops, samples."""
    creates = [i for i in items if isinstance(i.op, m.CreateModel)]
    forwards = [i for i in items if isinstance(i.op, m.FORWARD_TYPES)]
    samples = [i for i in items if isinstance(i.op, m.Sample)]
    closing = [i for i in items if i not in creates and i not in forwards and i not in samples]
    return creates, forwards, closing, samples


def _discard(adapters: Iterable[Adapter]) -> None:
    for adapter in adapters:
        adapter.discard()


def _attempt(cycle_id: int, item: m.WorkItem, fn: Callable[[], Any], report: Report) -> None:
    """Run one op and report its result or error, if any; a failed collective aborts the cycle."""
    try:
        result = fn()
    except (CollectiveError, TensorParallelError):
        raise
    except Exception as exc:
        report(_failed(cycle_id, item, exc))
        return
    if result is not None:
        report(m.ItemDone(cycle_id, item.request_id, result=result))


def _progress(cycle_id: int, request_id: str, report: Report) -> Callable[[list[int], list[t.SampledSequence]], None]:
    """A streaming sample's progress callback: its tokens so far go out as `SampleProgress`."""
    return lambda offsets, sequences: report(m.SampleProgress(cycle_id, request_id, offsets, sequences))


def _failed(cycle_id: int, item: m.WorkItem, exc: Exception) -> m.ItemDone:
    if getattr(exc, "category", None) is None:
        log.exception("%s failed", item.request_id, exc_info=exc)
    return m.ItemDone(cycle_id, item.request_id, error=RemoteError.from_exception(exc))
