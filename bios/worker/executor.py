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
from bios.actors.remote import RemoteError
from bios.exceptions import BadRequestError
from bios.validation import validate_adam_params, validate_forward_backward

from . import engine
from .pool import Adapter, ModelPool

log = logging.getLogger(__name__)

Report = Callable[[m.ItemDone], None]


class CycleExecutor:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def run(self, cycle: m.RunCycle, report: Report) -> None:
        creates = [i for i in cycle.items if isinstance(i.op, m.CreateModel)]
        forwards = [i for i in cycle.items if isinstance(i.op, m.FORWARD_TYPES)]
        closing = [i for i in cycle.items if i not in creates and i not in forwards]
        for item in creates:
            op = item.op
            model_id = f"{op.session_id}:train:{op.model_seq_id}"
            report(_attempt(cycle.cycle_id, item, lambda op=op, mid=model_id: self.pool.create(mid, op.base_model, op.lora)))
        self._forward_phase(cycle.cycle_id, forwards, report)
        for item in closing:
            report(_attempt(cycle.cycle_id, item, lambda item=item: self._closing_op(item.op)))

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
        raise BadRequestError(f"workers do not run {type(op).__name__}", field="kind")


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
