"""Runs one cycle's work items on this worker, as one member of its generation's collective group.

Phases: new adapters first; then all forward/forward_backward work of every run together (each member takes
its contiguous, token-balanced shard of every batch; rows of different adapters share forward passes); then
the gradient sum across members (one all-reduce per adapter) and the commit; then each run's closing op
(optim_step, save, load), replicated on every member; then this member's share of the samples.

A failed collective aborts the cycle: uncommitted gradients are dropped and the coordinator re-runs what did
not finish. Every member reports what it finished; the coordinator keeps the first report of each item.

Tensor parallelism (see bios/worker/tensor_parallel.py and collectives.py): batches are split over replicas,
not members; the k shard holders of a replica run the same rows, sum the LoRA gradients only they each saw a
share of (`reduce_shared_grads`) and then sum across replicas; the optimizer clips by the whole adapter's
norm; saves gather the whole adapter, so a checkpoint is the one a single worker would write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from bios import spec
from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError, RemoteError
from bios.kernels.prepacked import PrepackedWeights

from . import engine
from .adapter import AdapterState
from .checkpoint import export_state, load_into
from .collectives import CollectiveError, CollectiveGroup
from .custom_loss import CompiledLoss
from .pool import Adapter, ModelPool
from .sampling import SampleItem, generate
from .vision import image_reader
from .sharded_adapter import (
    copy_full_into_shard,
    gather_full_adapter,
    reduce_shared_grads,
    sharded_grad_norm,
    sharded_optim_step,
)
from .tensor_parallel import shard_info, TensorParallelError

log = logging.getLogger(__name__)

Report = Callable[[m.ItemDone | m.SampleProgress], None]


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
        self.grad_norms: dict[str, float] = {}  # whole-adapter norm of each committed gradient (sharded adapters)
        self.prepacked = PrepackedWeights()  # the sampler's weight copies, kept across cycles that only sample

    def run(self, cycle: m.RunCycle, report: Report) -> CycleOutcome:
        self.seconds: dict[str, float] = {}
        started = time.perf_counter()
        creates = [i for i in cycle.items if isinstance(i.op, m.CreateModel)]
        forwards = [i for i in cycle.items if isinstance(i.op, m.FORWARD_TYPES)]
        samples = [i for i in cycle.items if isinstance(i.op, m.Sample)]
        closing = [i for i in cycle.items if i not in creates and i not in forwards and i not in samples]
        # Only the adapters this cycle may change: any other one's checksum before it is the one after it (and
        # the one the worker registers with), and a worker holding many runs would fingerprint them all each cycle
        before = self.held_checksums({i.op.target for i in (*creates, *forwards, *closing)})
        if len(samples) < len(cycle.items):
            self.prepacked.release()  # training passes, loads and saves get their memory back
        touched: set[str] = set()
        try:
            for item in creates:
                done = _attempt(cycle.cycle_id, item, lambda op=item.op: self.pool.create(op))
                if done is not None:
                    report(done)
                touched.add(item.op.target)
            touched |= self._forward_phase(cycle.cycle_id, forwards, report)
            mark = time.perf_counter()
            for item in closing:
                done = _attempt(cycle.cycle_id, item, lambda item=item: self._closing_op(item.op))
                if done is not None:
                    report(done)
                touched.add(item.op.model_id)
            self.seconds["closing"] = time.perf_counter() - mark
            mark = time.perf_counter()
            self._sample_phase(cycle.cycle_id, samples, report)
            self.seconds["sample"] = time.perf_counter() - mark
        except (CollectiveError, TensorParallelError) as exc:
            log.warning("cycle %d aborted: %s", cycle.cycle_id, exc)
            return CycleOutcome(True, str(exc), {})
        checksums = {self._checksum_key(mid): self.pool.adapters[mid].state.checksum() for mid in sorted(touched)
                     if mid in self.pool.adapters}
        self.seconds["cycle"] = time.perf_counter() - started
        return CycleOutcome(False, "", checksums, self.seconds, before)

    # ------------------------------------------------------------------------------------ forward

    def _forward_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> set[str]:
        """Shard, compute, gather outputs, sum gradients, commit; returns the runs whose gradients changed."""
        groups: dict[str, list[tuple[m.WorkItem, Adapter]]] = {}
        for item in items:
            try:
                adapter = self.pool.adapter(item.op.model_id)
                op = item.op
                spec.check_forward(op.data, op.loss_fn, op.loss_fn_config, adapter.base.info, op.custom_loss)
            except Exception as exc:
                report(_failed(cycle_id, item, exc))
                continue
            groups.setdefault(adapter.base_model, []).append((item, adapter))
        if not groups:
            return set()
        mark = time.perf_counter()
        local: dict[str, Any] = {}
        for base_model, group in groups.items():
            local[base_model] = self._run_shard(group)
        self.seconds["forward"] = time.perf_counter() - mark
        mark = time.perf_counter()
        gathered = self.group.all_gather_object(local)
        touched: set[str] = set()
        for base_model, group in groups.items():
            parts = [g[base_model] for g in gathered[:: self.group.tp]]  # one member per replica
            failure = next((p for p in parts if isinstance(p, RemoteError)), None)
            training = sorted({a.state.model_id for it, a in group if not it.op.forward_only})
            if failure is not None:
                for _, adapter in group:
                    engine.discard_gradients(adapter.state)
                for item, _ in group:
                    report(m.ItemDone(cycle_id, item.request_id, error=failure))
                continue
            norms = self._sum_and_commit([a for _, a in group], training)
            self.seconds["allreduce"] = time.perf_counter() - mark
            touched.update(training)
            for index, (item, adapter) in enumerate(group):
                output = _merge([p[index] for p in parts])
                if not item.op.forward_only:
                    output.metrics["grad_norm:max"] = norms[adapter.state.model_id]
                report(m.ItemDone(cycle_id, item.request_id, result=output))
        return touched

    def _run_shard(self, group: list[tuple[m.WorkItem, Adapter]]) -> list[t.ForwardBackwardOutput] | RemoteError:
        """This member's shard of every item in one batched call: its outputs, or the error every member sees."""
        batch, slots = [], []
        for item, adapter in group:
            op = item.op
            start, end = shard_range([d.model_input.length for d in op.data], self.group.replicas,
                                     self.group.replica)
            slots.append(end > start)
            if end > start:
                custom = CompiledLoss(op.custom_loss) if op.custom_loss is not None else None
                batch.append(engine.ForwardItem(adapter.state, op.data[start:end], op.loss_fn, op.loss_fn_config,
                                                op.forward_only, custom))
        base = group[0][1]
        try:
            outputs = iter(engine.forward_backward(base.base.model, batch,
                                                   max_tokens_per_pass=self.pool.tokens_per_pass(base.base_model),
                                                   images=image_reader(base.base.info, base.base.image_processor))
                           if batch else ())
        except TensorParallelError:
            for _, adapter in group:
                engine.discard_gradients(adapter.state)
            raise
        except Exception as exc:
            log.exception("a batched forward of %d items failed", len(batch))
            for _, adapter in group:
                engine.discard_gradients(adapter.state)
            return RemoteError.from_exception(exc)
        return [next(outputs) if has_rows else _empty_output() for has_rows in slots]

    def _sum_and_commit(self, adapters: list[Adapter], training: list[str]) -> dict[str, float]:
        """Sum every member's gradient contributions, then commit them on every member or on none.

        Under tensor parallelism the sums run in subgroups, which can fail for some members and succeed for
        others; one last collective over everyone decides, so survivors never disagree about a commit. The
        whole adapter's gradient norm is taken then too, so the optimizer step needs no collective of its own
        (one that could half-succeed after its request was reported done).
        """
        by_id = {a.state.model_id: a for a in adapters}
        norms: dict[str, float] = {}
        try:
            for model_id in training:  # every member walks the same sorted list: collectives line up
                adapter = by_id[model_id]
                info = shard_info(adapter.base.model)
                if info is not None:
                    self.group.guard(lambda: reduce_shared_grads(adapter.state, info, self.group.tp_group))
                self.group.all_reduce_replicas_(adapter.state.pending_grad)
                if info is not None:
                    total = adapter.state.grad + adapter.state.pending_grad
                    norms[model_id] = self.group.guard(
                        lambda: sharded_grad_norm(adapter.state, info, self.group.tp_group, grad=total))
            if self.group.tp > 1:
                self.group.all_reduce_sum_(torch.zeros(1))
        except CollectiveError:
            for adapter in by_id.values():
                engine.discard_gradients(adapter.state)
            raise
        self.grad_norms.update(norms)
        for model_id in training:
            local_norm = engine.commit_gradients(by_id[model_id].state)
            norms.setdefault(model_id, local_norm)  # a shard's local norm is not the whole adapter's
        return norms

    # ------------------------------------------------------------------------------------ membership

    def reconfigure(self, msg: m.Reconfigure) -> dict[str, float]:
        """Join a new generation and make every adapter identical to its source: replica 0's holder of the same
        shard (rank 0 without tensor parallelism), or its checkpoint."""
        wanted = {spec.model_id: spec for spec in msg.adapters}
        if msg.source_tp != msg.tp and any(spec.model_id not in msg.restore for spec in msg.adapters):
            raise NotImplementedError(f"receiving adapters held over {msg.source_tp} worker(s) as shards of {msg.tp}")
        for model_id in [mid for mid in self.pool.adapters if mid not in wanted]:
            del self.pool.adapters[model_id]
        self.pool.configure(msg.tp, msg.rank % msg.tp, msg.plans)
        self.grad_norms.clear()
        self.group.rebuild(msg.generation, msg.rank, msg.world, msg.master_host, msg.master_port, msg.timeout_s,
                           msg.tp, msg.epoch, msg.collective_timeout_s)
        self.pool.bind_group(self.group.tp_group)
        for wanted_spec in msg.adapters:
            checkpoint = msg.restore.get(wanted_spec.model_id)
            if checkpoint is not None or wanted_spec.model_id not in self.pool.adapters:
                self.pool.create(m.CreateModel("", 0, wanted_spec.base_model, wanted_spec.lora, state=checkpoint,
                                               with_optimizer=True, optimizer=wanted_spec.optimizer),
                                 model_id=wanted_spec.model_id,
                                 seed=wanted_spec.lora.seed or 0)
        for model_id in sorted(wanted):
            state = self.pool.adapters[model_id].state
            engine.discard_gradients(state)
            if model_id in msg.restore:
                continue
            step = torch.tensor([state.step], dtype=torch.int64)
            for buffer in (state.params, state.grad, state.exp_avg, state.exp_avg_sq, step):
                self.group.broadcast_from_first_replica_(buffer)
            state.step = int(step.item())
        return {self._checksum_key(mid): self.pool.adapters[mid].state.checksum() for mid in sorted(wanted)}

    def held_checksums(self, model_ids: Collection[str] | None = None) -> dict[str, float]:
        """Checksums of the whole adapters this worker holds (none while it holds shards), those of `model_ids`
        only if given, for registering again: the coordinator may take them as the current state if no other
        holder survived."""
        if self.group.tp != 1:
            return {}
        return {model_id: adapter.state.checksum() for model_id, adapter in self.pool.adapters.items()
                if model_ids is None or model_id in model_ids}

    def _checksum_key(self, model_id: str) -> str:
        """Replicas of the same shard must agree; different shards of one adapter differ by nature."""
        return model_id if self.group.tp == 1 else f"{model_id}/shard{self.group.tp_rank}"

    # ------------------------------------------------------------------------------------ closing ops

    def _closing_op(self, op: m.Request) -> Any:
        if isinstance(op, m.OptimStep):
            adapter = self.pool.adapter(op.model_id)
            spec.check_optim_params(op.adam_params, adapter.state.optimizer)
            info = shard_info(adapter.base.model)
            if info is None:
                return engine.optim_step(adapter.state, op.adam_params)
            norm = self.grad_norms.pop(op.model_id, None)
            return self.group.guard(lambda: sharded_optim_step(adapter.state, op.adam_params, info,
                                                               self.group.tp_group, grad_norm=norm))
        if isinstance(op, m.SaveWeights):
            adapter = self.pool.adapter(op.model_id)
            saved = export_state(self._whole(adapter), base_model=adapter.base_model, base_info=adapter.base.info,
                                 with_optimizer=op.kind == "weights")
            if op.kind == "sampler_weights":
                self.pool.add_sampler(op.path, adapter.base_model, saved)
            return m.SavedState(saved) if self.group.rank == 0 else None
        if isinstance(op, m.LoadWeights):
            if op.state is None:
                raise BadRequestError(f"no checkpoint data came with the load of {op.path}", field="path")
            adapter = self.pool.adapter(op.model_id)
            info = shard_info(adapter.base.model)
            self.grad_norms.pop(op.model_id, None)  # the load drops the committed gradient
            if info is None:
                load_into(adapter.state, op.state, with_optimizer=op.optimizer)
            else:
                shard = adapter.state
                full = AdapterState(shard.model_id, shard.config,
                                    [info.full_target(target.module_name) for target in shard.targets], shard.seed,
                                    shard.params.device)
                full.optimizer = shard.optimizer
                load_into(full, op.state, with_optimizer=op.optimizer)
                copy_full_into_shard(full, shard, info)
            return t.LoadWeightsResponse(path=op.path, model_id=op.model_id)
        raise BadRequestError(f"workers do not run {type(op).__name__}", field="kind")

    def _whole(self, adapter: Adapter) -> AdapterState:
        """The whole adapter: itself, or gathered from the shard holders of this member's replica."""
        info = shard_info(adapter.base.model)
        if info is None:
            return adapter.state
        return self.group.guard(lambda: gather_full_adapter(adapter.state, info, self.group.tp_group))

    # ------------------------------------------------------------------------------------ sampling

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
                                     prepacked=self.prepacked)
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


def _attempt(cycle_id: int, item: m.WorkItem, fn: Callable[[], Any]) -> m.ItemDone | None:
    """Run one op: its result or error for the client, or nothing; a failed collective aborts the cycle."""
    try:
        result = fn()
    except (CollectiveError, TensorParallelError):
        raise
    except Exception as exc:
        return _failed(cycle_id, item, exc)
    return None if result is None else m.ItemDone(cycle_id, item.request_id, result=result)


def _progress(cycle_id: int, request_id: str, report: Report) -> Callable[[list[int], list[t.SampledSequence]], None]:
    """A streaming sample's progress callback: its tokens so far go out as `SampleProgress`."""
    return lambda offsets, sequences: report(m.SampleProgress(cycle_id, request_id, offsets, sequences))


def _failed(cycle_id: int, item: m.WorkItem, exc: Exception) -> m.ItemDone:
    if getattr(exc, "category", None) is None:
        log.exception("%s failed", item.request_id, exc_info=exc)
    return m.ItemDone(cycle_id, item.request_id, error=RemoteError.from_exception(exc))
