"""The scheduler actor: accepts requests, picks each cycle's work, and routes results back to clients.

All request state lives in this actor, so acceptance, selection and completion never race. Cycles themselves
run in `CycleRunner` (its own task), which asks this actor for work at every tick.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bios import messages as m
from bios import types as t
from bios.actors.actor import Actor
from bios.actors.remote import RemoteError
from bios.exceptions import BadRequestError, NotFoundError
from bios.transport.codec import Codec, Envelope
from bios.transport.sockets import next_message_id
from bios.validation import validate_adam_params, validate_forward_backward, validate_lora_rank

from .runs import Queued, Run, model_id_of, request_id_for, seq_of
from .store import Store

log = logging.getLogger(__name__)

Push = Callable[[bytes, list[Any]], Awaitable[None]]


# ------------------------------------------------------------------------------------ mailbox messages


@dataclass(frozen=True)
class Submit:
    peer: bytes
    owner: str
    op: Any
    frames: list[bytes]


@dataclass(frozen=True)
class SelectWork:
    pass


@dataclass(frozen=True)
class Finished:
    done: m.ItemDone


@dataclass(frozen=True)
class CycleEnded:
    cycle_id: int
    finished: frozenset[str]
    aborted: bool


@dataclass(frozen=True)
class Describe:
    model_id: str
    owner: str | None = None


@dataclass(frozen=True)
class QueueDepth:
    pass


@dataclass(frozen=True)
class ListRuns:
    owner: str | None = None


class Scheduler(Actor):
    def __init__(self, store: Store, codec: Codec, push: Push, on_work: Callable[[], None]) -> None:
        self.store = store
        self.codec = codec
        self.push = push
        self.on_work = on_work
        self.runs: dict[str, Run] = {}
        self.waiters: dict[str, set[bytes]] = {}
        self.cycle_ids: dict[str, int] = {}

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Submit):
            return await self._submit(message)
        if isinstance(message, SelectWork):
            return self._select()
        if isinstance(message, Finished):
            return await self._finished(message.done)
        if isinstance(message, CycleEnded):
            return self._cycle_ended(message)
        if isinstance(message, Describe):
            return self._describe(message)
        if isinstance(message, QueueDepth):
            return sum(len(run.queue) for run in self.runs.values())
        if isinstance(message, ListRuns):
            return [r for r in self.runs.values() if message.owner is None or r.owner == message.owner]
        raise TypeError(f"scheduler got unexpected {type(message).__name__}")

    # ------------------------------------------------------------------------------------ accept

    async def _submit(self, sub: Submit) -> m.Accepted:
        op = sub.op
        model_id = model_id_of(op)
        seq_id = seq_of(op)
        request_id = request_id_for(model_id, seq_id)
        stored = self.store.get_request(request_id)
        if stored is not None:
            return await self._resubmitted(sub.peer, stored)
        if isinstance(op, m.CreateModel):
            run = self._create_run(model_id, op, sub.owner)
        else:
            run = self._run_for(model_id, sub.owner)
            if seq_id < run.next_seq or seq_id in run.queue:
                raise BadRequestError(
                    f"seq_id {seq_id} of {model_id} was already used; the next free one is "
                    f"{max([run.next_seq, *run.queue]) + 1}",
                    field="seq_id",
                )
        try:
            self._validate(op, run)
        except BadRequestError as exc:
            exc.request_id = request_id
            frames = self._encode_done(m.RequestDone(request_id, error=RemoteError.from_exception(exc)))
            self.store.add_rejected(request_id, model_id, seq_id, type(op).__name__, frames)
            run.enqueue(seq_id, Queued(request_id, op, rejected=True))
            if isinstance(op, m.CreateModel):
                self.runs.pop(model_id, None)
                self.store.set_run_status(model_id, "failed")
            self.on_work()
            raise
        self.store.add_request(request_id, model_id, seq_id, type(op).__name__, sub.frames)
        run.enqueue(seq_id, Queued(request_id, op))
        self.waiters.setdefault(request_id, set()).add(sub.peer)
        if run.runnable():
            self.on_work()
        return m.Accepted(request_id)

    async def _resubmitted(self, peer: bytes, stored: Any) -> m.Accepted:
        if stored.status == "rejected":
            error = self.codec.decode(stored.result).body.error
            raise BadRequestError(error.message, field=error.field, request_id=stored.request_id)
        if stored.result is not None:
            await self.push(peer, stored.result)
        else:
            self.waiters.setdefault(stored.request_id, set()).add(peer)
        return m.Accepted(stored.request_id)

    def _create_run(self, model_id: str, op: m.CreateModel, owner: str) -> Run:
        if model_id in self.runs:
            raise BadRequestError(f"model {model_id} already exists", field="model_seq_id")
        run = Run(model_id, op.session_id, owner, op.base_model, op.lora)
        self.runs[model_id] = run
        self.store.add_run(model_id, op.session_id, owner, op.base_model, dataclasses.asdict(op.lora))
        return run

    def _run_for(self, model_id: str, owner: str | None) -> Run:
        run = self.runs.get(model_id)
        if run is None or (owner is not None and run.owner != owner):
            raise NotFoundError(f"no training run {model_id!r}; create one with create_lora_training_client")
        if run.status == "failed":
            raise BadRequestError(f"training run {model_id} failed to start; create a new one", field="model_id")
        return run

    def _validate(self, op: Any, run: Run) -> None:
        if isinstance(op, m.CreateModel):
            validate_lora_rank(op.lora.rank)
            if not op.base_model:
                raise BadRequestError("base_model is empty", field="base_model")
        elif isinstance(op, m.ForwardBackward):
            if run.info is not None:
                validate_forward_backward(op.data, op.loss_fn, op.loss_fn_config, run.info)
        elif isinstance(op, m.OptimStep):
            validate_adam_params(op.adam_params)

    # ------------------------------------------------------------------------------------ cycles

    def _select(self) -> list[m.WorkItem]:
        items: list[m.WorkItem] = []
        for run in self.runs.values():
            items.extend(m.WorkItem(q.request_id, q.op) for q in run.take_cycle())
        if any(run.runnable() for run in self.runs.values()):
            self.on_work()
        return items

    async def _finished(self, done: m.ItemDone) -> None:
        request_id = done.request_id
        frames = self._encode_done(m.RequestDone(request_id, done.result, done.error, done.cycle_id))
        model_id = request_id.rpartition("#")[0]
        run = self.runs.get(model_id)
        if isinstance(done.result, m.ModelCreated) and run is not None:
            run.info, run.status = done.result.info, "ready"
            self.store.set_run_status(model_id, "ready", dataclasses.asdict(done.result.info))
        elif done.error is not None and run is not None and run.status == "creating":
            run.status = "failed"
            self.store.set_run_status(model_id, "failed")
        self.store.finish_request(request_id, "failed" if done.error else "done", frames)
        for peer in self.waiters.pop(request_id, ()):
            await self.push(peer, frames)

    def _cycle_ended(self, ended: CycleEnded) -> None:
        for run in self.runs.values():
            if ended.aborted:
                run.cycle_aborted(set(ended.finished))
            else:
                run.cycle_committed()
        if any(run.runnable() for run in self.runs.values()):
            self.on_work()

    def _encode_done(self, done: m.RequestDone) -> list[bytes]:
        return [bytes(f) for f in self.codec.encode(Envelope(next_message_id(), done))]

    # ------------------------------------------------------------------------------------ queries

    def _describe(self, query: Describe) -> t.GetInfoResponse:
        run = self._run_for(query.model_id, query.owner)
        info = run.info
        return t.GetInfoResponse(
            model_id=run.model_id,
            model_data=t.ModelData(
                arch=info.arch if info else None,
                model_name=run.base_model,
                tokenizer_id=info.local_dir if info else None,
            ),
            is_lora=True,
            lora_rank=run.lora.rank,
            model_name=run.base_model,
        )
