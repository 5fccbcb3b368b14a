"""Runs one cycle's work items on this worker, in the cycle's phases.

Phases: new adapters first, then all forward/forward_backward work of every run together (rows of different
adapters share forward passes), then each run's closing op (optim_step, ...). Each item's result is reported the
moment it is ready. Runs on the worker's compute thread; everything it touches belongs to that thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bios import messages as m
from bios import types as t
from bios.actors.remote import RemoteError
from bios.exceptions import BadRequestError
from bios.validation import validate_adam_params, validate_forward_backward, validate_sample

from . import engine
from .checkpoint import export_state, load_into
from .pool import Adapter, ModelPool
from .sampling import SampleItem, generate

log = logging.getLogger(__name__)

Report = Callable[[m.ItemDone], None]


class CycleExecutor:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def run(self, cycle: m.RunCycle, report: Report) -> None:
        creates = [i for i in cycle.items if isinstance(i.op, m.CreateModel)]
        forwards = [i for i in cycle.items if isinstance(i.op, m.FORWARD_TYPES)]
        samples = [i for i in cycle.items if isinstance(i.op, m.Sample)]
        closing = [i for i in cycle.items if i not in creates and i not in forwards and i not in samples]
        for item in creates:
            report(_attempt(cycle.cycle_id, item, lambda op=item.op: self.pool.create(op)))
        self._forward_phase(cycle.cycle_id, forwards, report)
        for item in closing:
            report(_attempt(cycle.cycle_id, item, lambda item=item: self._closing_op(item.op)))
        self._sample_phase(cycle.cycle_id, samples, report)

    def _forward_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> None:
        """Validate each item, then run every valid one of a base model in one batched call."""
        by_base: dict[str, list[tuple[m.WorkItem, Adapter]]] = {}
        for item in items:
            try:
                adapter = self.pool.adapter(item.op.model_id)
                op = item.op
                validate_forward_backward(op.data, op.loss_fn, op.loss_fn_config, adapter.base.info)
            except Exception as exc:
                report(_failed(cycle_id, item, exc))
                continue
            by_base.setdefault(adapter.base_model, []).append((item, adapter))
        for group in by_base.values():
            self._run_group(cycle_id, group, report)

    def _run_group(self, cycle_id: int, group: list[tuple[m.WorkItem, Adapter]], report: Report) -> None:
        model = group[0][1].base.model
        batch = [_forward_item(item, adapter) for item, adapter in group]
        try:
            outputs = engine.forward_backward(model, batch)
        except Exception:
            log.exception("a batched forward of %d items failed; running them one by one", len(group))
            for _, adapter in group:
                engine.discard_gradients(adapter.state)
            if len(group) > 1:
                for one in group:
                    self._run_group(cycle_id, [one], report)
                return
            raise
        norms = {
            id(adapter.state): engine.commit_gradients(adapter.state)
            for (item, adapter) in group
            if not item.op.forward_only
        }
        for (item, adapter), output in zip(group, outputs, strict=True):
            if not item.op.forward_only:
                output.metrics["grad_norm:max"] = norms[id(adapter.state)]
            report(m.ItemDone(cycle_id, item.request_id, result=output))

    def _closing_op(self, op: Any) -> Any:
        if isinstance(op, m.OptimStep):
            validate_adam_params(op.adam_params)
            return engine.optim_step(self.pool.adapter(op.model_id).state, op.adam_params)
        if isinstance(op, m.SaveWeights):
            adapter = self.pool.adapter(op.model_id)
            saved = export_state(adapter.state, base_model=adapter.base_model, base_info=adapter.base.info,
                                 with_optimizer=op.kind == "weights")
            if op.kind == "sampler_weights":
                self.pool.add_sampler(op.path, adapter.base_model, saved)
            return m.SavedState(saved)
        if isinstance(op, m.LoadWeights):
            if op.state is None:
                raise BadRequestError(f"no checkpoint data came with the load of {op.path}", field="path")
            load_into(self.pool.adapter(op.model_id).state, op.state, with_optimizer=op.optimizer)
            return t.LoadWeightsResponse(path=op.path, model_id=op.model_id)
        raise BadRequestError(f"workers do not run {type(op).__name__}", field="kind")

    def _sample_phase(self, cycle_id: int, items: list[m.WorkItem], report: Report) -> None:
        """All samples of one base model in one batch, rows of different adapters together."""
        by_base: dict[str, list[tuple[m.WorkItem, SampleItem]]] = {}
        for item in items:
            op: m.Sample = item.op
            try:
                if op.adapter_state is not None and op.adapter_path is not None:
                    self.pool.add_sampler(op.adapter_path, op.base_model, op.adapter_state)
                adapter = self.pool.sampler(op.adapter_path).state if op.adapter_path is not None else None
                base = self.pool.base(op.base_model)
                validate_sample(op.prompt, op.num_samples, op.sampling_params, base.info)
            except Exception as exc:
                report(_failed(cycle_id, item, exc))
                continue
            sample_item = SampleItem(adapter, op.prompt.to_ints(), op.num_samples, op.sampling_params,
                                     op.prompt_logprobs)
            by_base.setdefault(op.base_model, []).append((item, sample_item))
        for base_model, group in by_base.items():
            base = self.pool.base(base_model)
            try:
                responses = generate(base.model, base.tokenizer, [s for _, s in group],
                                     eos_token_id=base.info.eos_token_id)
            except Exception as exc:
                for item, _ in group:
                    report(_failed(cycle_id, item, exc))
                continue
            for (item, _), response in zip(group, responses, strict=True):
                report(m.ItemDone(cycle_id, item.request_id, result=response))


def _forward_item(item: m.WorkItem, adapter: Adapter) -> engine.ForwardItem:
    op = item.op
    return engine.ForwardItem(
        adapter=adapter.state,
        data=op.data,
        loss_fn=op.loss_fn,
        loss_fn_config=op.loss_fn_config,
        forward_only=op.forward_only,
    )


def _attempt(cycle_id: int, item: m.WorkItem, fn: Callable[[], Any]) -> m.ItemDone:
    try:
        return m.ItemDone(cycle_id, item.request_id, result=fn())
    except Exception as exc:
        return _failed(cycle_id, item, exc)


def _failed(cycle_id: int, item: m.WorkItem, exc: Exception) -> m.ItemDone:
    if getattr(exc, "category", None) is None:
        log.exception("%s failed", item.request_id, exc_info=exc)
    return m.ItemDone(cycle_id, item.request_id, error=RemoteError.from_exception(exc))
