"""The scheduler actor: owns request state, acts on admission's verdicts, picks each cycle's work, and closes
requests as their results come in.

All request state lives in this actor, so acceptance, selection and completion never race. The decisions are
made by pieces that change nothing themselves: `Admission` (is this request valid and whose), `PoolPlanner`
(how the pool holds a base model); `ResultRouter` logs and delivers answers. Cycles run in `CycleRunner` (its
own task), which asks this actor for work at every tick.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bios import ids
from bios import messages as m
from bios import types as t
from bios.actors.actor import Actor
from bios.actors.remote import RemoteError
from bios.exceptions import BadRequestError, NotFoundError, RequestFailedError
from bios.security.limits import QuotaLedger, Quotas
from bios.transport.codec import Codec

from .admission import Admission, Fresh, Refused, Repeat, Sampler, Submit, run_for
from .mailbox import (
    Adapters,
    Committed,
    CycleEnded,
    Finished,
    Formed,
    GroupLayout,
    Layout,
    Place,
    PlanDescriptions,
    Query,
    NotifyWaiting,
    QueueDepth,
    Recovered,
    RunsLost,
    ExpireGaps,
    SelectWork,
    Stalled,
    Watch,
)
from .autosave import AutoSave, automatic_save
from .catalog import Catalog
from .disk import is_disk_full
from .metrics import CoordinatorMetrics, tokens_of
from .planning import PoolPlanner, Workers
from .recovery import restore
from .retries import killed_twice, stalled_once, stalled_twice
from .results import Push, ResultRouter
from .runs import Queued, Run, stored_config
from .store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    checkpoint_every: int = 0  # automatic checkpoint every N optimizer steps of a run (0 = off)
    keep_checkpoints: int = 2  # automatic checkpoints kept per run


RECOVERED = -1  # the cycle id results recovered from a worker are recorded under


@dataclass
class CycleWork:
    """What the scheduler keeps of one running cycle: its items' ops, the runs it took work from, and the
    answers held until the cycle ends."""

    ops: dict[str, Any]  # request id -> op
    runs: set[str]  # model ids
    answers: list[m.ItemDone] = field(default_factory=list)


class Scheduler(Actor):
    def __init__(self, store: Store, catalog: Catalog, codec: Codec, push: Push, on_work: Callable[[], None],
                 config: SchedulerConfig | None = None, ledger: QuotaLedger | None = None,
                 metrics: CoordinatorMetrics | None = None, workers: Workers | None = None) -> None:
        self.store = store
        self.catalog = catalog
        self.on_work = on_work
        self.config = config or SchedulerConfig()
        self.ledger = ledger or QuotaLedger(Quotas())
        self.metrics = metrics or CoordinatorMetrics()
        self.planner = PoolPlanner(workers or (lambda: []))
        self.admission = Admission(store, catalog, self.ledger, self.planner)
        self.results = ResultRouter(store, codec, push, self.ledger, self.metrics)
        self.autosave = AutoSave(catalog, self.config.checkpoint_every, self.config.keep_checkpoints)
        self.codec = codec
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self.samples: list[Queued] = []
        # The cycles running now (one per group at most), by cycle id. Answers are given when their cycle is
        # over: by then the state that produced them is committed on every replica, recorded (its checksums) in
        # the state dir, and in the automatic checkpoint if one was due.
        self.cycles: dict[int, CycleWork] = {}
        self.committed: dict[str, float] = {}  # each adapter's checksum after its group's last commit
        self.base_infos: dict[str, t.BaseModelInfo] = {}

    async def started(self) -> None:
        """Carry on where the state dir says the last coordinator stopped."""
        self.committed = dict(self.store.committed())
        restored = restore(self.store, self.codec, self.admission)
        self.runs, self.samplers, self.samples = restored.runs, restored.samplers, restored.samples
        self.autosave.steps, self.base_infos = restored.steps, restored.infos
        for request_id, op, error in restored.failed:
            await self.results.deliver(request_id, op, None, error)
        for base_model, lora in {run.base_model: run.lora for run in self.runs.values()}.items():
            same_base = sum(1 for run in self.runs.values() if run.base_model == base_model)
            try:
                self.planner.adopt(self.planner.choose(base_model, lora, adapters=same_base - 1))
            except BadRequestError as exc:
                log.error("%s cannot be planned on this pool any more: %s", base_model, exc.message)
        if self.samples or any(run.runnable() for run in self.runs.values()):
            self.on_work()

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Submit):
            return await self._submit(message)
        if isinstance(message, SelectWork):
            return self._select(message.cycle_id, message.models)
        if isinstance(message, m.SampleProgress):
            return await self.results.progress(message)
        if isinstance(message, Finished):
            return await self._finished(message.done)
        if isinstance(message, CycleEnded):
            return await self._cycle_ended(message)
        if isinstance(message, Query):
            return self._query(message.owner, message.body)
        if isinstance(message, Adapters):
            return [m.AdapterSpec(r.model_id, r.base_model, r.lora, r.optimizer)
                    for r in self.runs.values() if r.status == "ready" and r.base_model in message.models]
        if isinstance(message, Place):
            self.planner.base_of = {run.model_id: run.base_model for run in self.runs.values()}
            await self._plan_waiting()
            return self.planner.replace(self._queued_tokens())
        if isinstance(message, Layout):
            group = self.planner.placement.group(message.group_id)
            if group is None:
                return None
            return GroupLayout(group.tp, tuple(self.planner.model_plans(group)), group.workers, group.models)
        if isinstance(message, Formed):
            self.planner.placement = self.planner.placement.formed(message.group_id, message.workers)
            return None
        if isinstance(message, PlanDescriptions):
            return self.planner.descriptions()
        if isinstance(message, RunsLost):
            return await self._runs_lost(message.model_ids)
        if isinstance(message, Committed):
            return self._committed(message)
        if isinstance(message, Recovered):
            return await self._recovered(message.results)
        if isinstance(message, Watch):
            return await self._watch(message)
        if isinstance(message, ExpireGaps):
            return await self._expire_gaps(message.gap_s)
        if isinstance(message, Stalled):
            return [why for run in self.runs.values() if (why := run.stalled(message.older_than_s)) is not None]
        if isinstance(message, NotifyWaiting):
            models = message.models
            waiting = [q.request_id for run in self.runs.values() if models is None or run.base_model in models
                       for q in run.queue.values()]
            samples = [q.request_id for q in self.samples
                       if models is None or self._samples_on(q.op.base_model, models)]
            for request_id in waiting + samples:
                await self.results.notify(request_id, message.message)
            return None
        if isinstance(message, QueueDepth):
            if message.by_pool:
                return self._queue_depths()
            return sum(len(run.queue) for run in self.runs.values()) + len(self.samples)
        raise TypeError(f"scheduler got unexpected {type(message).__name__}")

    def _queued_tokens(self) -> dict[str, int]:
        """Tokens waiting in the training queues, per base model (a refused request holds a place, not work)."""
        tokens: dict[str, int] = {}
        for run in self.runs.values():
            tokens[run.base_model] = tokens.get(run.base_model, 0) + sum(tokens_of(q.op, None)
                                                                         for q in run.queue.values() if not q.rejected)
        return tokens

    def _queue_depths(self) -> dict[str, int]:
        """Waiting requests per base-model pool (training queues and samples)."""
        depths: dict[str, int] = {}
        for run in self.runs.values():
            depths[run.base_model] = depths.get(run.base_model, 0) + len(run.queue)
        for queued in self.samples:
            depths[queued.op.base_model] = depths.get(queued.op.base_model, 0) + 1
        return depths

    # ------------------------------------------------------------------------------------ accept

    async def _submit(self, sub: Submit) -> m.Accepted:
        verdict = self.admission.admit(sub, self.runs, self.samplers, self.base_infos)
        if isinstance(verdict, Repeat):
            return await self.results.repeat(sub.peer, verdict.stored)
        if isinstance(verdict, Fresh):
            try:
                return self._accept(sub, verdict)
            except RequestFailedError as exc:  # the request log is full: refused, so later seq_ids are not stuck
                if not is_disk_full(exc):
                    raise
                verdict = self._unaccept(verdict, exc)
        self.results.refuse(verdict)
        run = self.runs.get(verdict.target)
        if verdict.consumes_seq and run is not None:  # the seq_id is used up: the queue moves past it
            run.enqueue(verdict.seq_id, Queued(verdict.request_id, verdict.op, rejected=True))
            self.on_work()
        raise verdict.error

    def _unaccept(self, fresh: Fresh, exc: RequestFailedError) -> Refused:
        """A request the request log could not take: a new run is undone; any other request uses up its seq_id."""
        create = isinstance(fresh.op, m.CreateModel)
        run = self.runs.pop(fresh.target, None) if create else None
        if run is not None:
            with contextlib.suppress(RequestFailedError):
                self.store.delete_run(run.model_id)
            if not any(r.base_model == run.base_model for r in self.runs.values()):
                self.planner.forget(run.base_model)
        return Refused(fresh.request_id, fresh.target, fresh.seq_id, fresh.op, exc, consumes_seq=not create)

    def _accept(self, sub: Submit, fresh: Fresh) -> m.Accepted:
        op = fresh.op
        sampling = isinstance(op, m.Sample)
        if isinstance(op, m.CreateModel):
            self.planner.adopt(fresh.plan)
            self.runs[fresh.target] = Run(fresh.target, op.session_id, sub.owner, op.base_model, op.lora,
                                          optimizer=op.optimizer)
            self.store.add_run(fresh.target, op.session_id, sub.owner, op.base_model,
                               stored_config(op.lora, op.optimizer), op.user_metadata)
        self.store.add_request(fresh.request_id, fresh.target, fresh.seq_id, type(op).__name__, sub.frames)
        self.ledger.record(fresh.request_id, sub.owner, nbytes=sub.nbytes, sampling=sampling)
        self.metrics.request_accepted(fresh.request_id, op)
        self.results.wait(fresh.request_id, sub.peer)
        if sampling:
            self.samples.append(Queued(fresh.request_id, op))
            self.on_work()
        else:
            run = self.runs[fresh.target]
            run.enqueue(fresh.seq_id, Queued(fresh.request_id, op))
            if run.runnable():
                self.on_work()
        return m.Accepted(fresh.request_id)

    # ------------------------------------------------------------------------------------ plans

    async def _plan_waiting(self) -> None:
        """Plan the base models whose runs were created before any worker joined; if one fits nowhere, its
        runs end with the planner's error, as `create_lora_training_client` would have."""
        for base_model, lora in self.planner.take_waiting().items():
            runs = [r for r in self.runs.values() if r.base_model == base_model]
            try:
                self.planner.adopt(self.planner.choose(base_model, lora, adapters=len(runs) - 1))
            except BadRequestError as exc:
                for run in runs:
                    if run.status == "creating":
                        await self._drop_run(run, RemoteError.from_exception(exc))

    async def _drop_run(self, run: Run, error: RemoteError) -> None:
        """A run whose creation failed: it leaves no run, plan or count behind; its requests end with `error`."""
        self.runs.pop(run.model_id, None)
        self.store.delete_run(run.model_id)
        if not any(r.base_model == run.base_model for r in self.runs.values()):
            self.planner.forget(run.base_model)
        await self._fail_queue(run, error)

    async def _fail_queue(self, run: Run, error: RemoteError) -> None:
        for queued in run.queue.values():
            if not queued.rejected:
                await self.results.deliver(queued.request_id, queued.op, None, error)
        run.queue.clear()

    # ------------------------------------------------------------------------------------ cycles

    def _committed(self, committed: Committed) -> None:
        """A group's adapters as last committed (none known under tensor parallelism): the others' stay."""
        self.committed = {model_id: checksum for model_id, checksum in self.committed.items()
                          if (run := self.runs.get(model_id)) is not None and run.base_model not in committed.models}
        self.committed.update(committed.checksums)
        self.store.set_committed(dict(self.committed))

    def _select(self, cycle_id: int, models: tuple[str, ...]) -> list[m.WorkItem]:
        """The next share of every run of the group's base models, and their samples; but a run whose last
        cycle stalled runs alone (`runs_alone`)."""
        items: list[m.WorkItem] = []
        live = [run for run in self.runs.values() if run.status != "lost" and run.base_model in models]
        alone = next((run for run in live if run.runs_alone()), None)
        for run in [alone] if alone is not None else live:
            taken = run.take_cycle()
            items.extend(m.WorkItem(q.request_id, q.op) for q in taken)
            if taken and isinstance(taken[-1].op, m.OptimStep):
                items.extend(self.autosave.after_step(run.model_id))
        if alone is None:
            mine = [q for q in self.samples if self._samples_on(q.op.base_model, models)]
            items.extend(m.WorkItem(q.request_id, q.op) for q in mine)
            self.samples = [q for q in self.samples if q not in mine]
        work = CycleWork({item.request_id: item.op for item in items}, {run.model_id for run in live})
        if items:
            self.cycles[cycle_id] = work
        self.results.timeline.taken(work.ops)
        if any(run.runnable() for run in self.runs.values()):
            self.on_work()
        return items

    def _samples_on(self, base_model: str, models: tuple[str, ...]) -> bool:
        """Whether a group of `models` samples `base_model`: its own, or any model no group holds (the first
        group's workers load it for the sample)."""
        if base_model in models:
            return True
        placement = self.planner.placement
        return placement.group_of_model(base_model) is None and bool(placement.groups) and \
            placement.groups[0].models == models

    async def _finished(self, done: m.ItemDone) -> None:
        request_id = done.request_id
        work = self.cycles.get(done.cycle_id)
        op = work.ops.get(request_id) if work is not None else None
        result, error = done.result, done.error
        if isinstance(result, m.SavedState) and isinstance(op, m.SaveWeights):
            result, error = self.autosave.write(op, result, request_id, self._owner_of(op.model_id))
        if ids.is_automatic(request_id) or work is None:
            return
        run = self.runs.get(ids.target_of(request_id))
        if run is not None and isinstance(op, m.CreateModel):
            if error is not None:
                await self._drop_run(run, error)
            elif isinstance(result, m.ModelCreated):
                run.info, run.status, run.lora_targets = result.info, "ready", result.lora_targets
                self.base_infos[run.base_model] = result.info
                self.store.set_run_status(run.model_id, "ready", dataclasses.asdict(result.info))
        work.answers.append(m.ItemDone(done.cycle_id, request_id, result, error))

    async def _answer(self, work: CycleWork) -> None:
        """Log and push the answers of a cycle that ended (in the order they were reported)."""
        for done in work.answers:
            await self.results.deliver(done.request_id, work.ops.get(done.request_id), done.result, done.error,
                                       done.cycle_id)
        work.answers.clear()

    async def _watch(self, watch: Watch) -> m.Ack:
        target = ids.target_of(watch.request_id)
        run = self.store.get_run(target)
        sampler = self.store.get_sampling_session(target)
        owner = run.owner if run is not None else sampler[0] if sampler is not None else None
        stored = self.store.get_request(watch.request_id)
        if stored is None or owner != watch.owner:
            raise NotFoundError(f"no request {watch.request_id!r}", field="request_id")
        await self.results.repeat(watch.peer, stored)
        return m.Ack()

    def _owner_of(self, model_id: str) -> str:
        run = self.runs.get(model_id)
        return run.owner if run is not None else ""

    async def _recovered(self, results: tuple[m.ItemDone, ...]) -> None:
        """Record what a worker reports of a committed cycle this coordinator's log stops just before."""
        work = self.cycles[RECOVERED] = CycleWork({}, set())
        for done in results:
            request = ids.RequestId.parse(done.request_id)
            if request.automatic:
                if isinstance(done.result, m.SavedState):
                    self.autosave.write(automatic_save(request.target, request.seq), done.result, done.request_id,
                                        self._owner_of(request.target))
                continue
            run = self.runs.get(request.target)
            queued = run.queue.get(request.seq) if run is not None else None
            if run is None or queued is None or queued.rejected:
                continue
            del run.queue[request.seq]
            run.next_seq = request.seq + 1
            for seq_id in [s for s in run.queue if s < run.next_seq]:  # refused ones it passed
                del run.queue[seq_id]
            if isinstance(queued.op, m.OptimStep) and done.error is None:
                self.autosave.steps[run.model_id] = self.autosave.steps.get(run.model_id, 0) + 1
            work.ops[done.request_id] = queued.op
            log.info("recorded %s from a worker that committed it before the coordinator restarted",
                     done.request_id)
            await self._finished(dataclasses.replace(done, cycle_id=RECOVERED))
        await self._answer(work)
        del self.cycles[RECOVERED]

    async def _cycle_ended(self, ended: CycleEnded) -> None:
        work = self.cycles.pop(ended.cycle_id, CycleWork({}, set()))
        await self._answer(work)
        died = ended.aborted and ended.worker_died
        if not ended.aborted:
            ran: dict[str, int] = {}
            for op in work.ops.values():
                run = self.runs.get(getattr(op, "model_id", ""))
                if run is not None:
                    ran[run.base_model] = ran.get(run.base_model, 0) + tokens_of(op, None)
            self.planner.ran(ran)
        for run in (self.runs[model_id] for model_id in work.runs if model_id in self.runs):
            if not ended.aborted:
                run.cycle_committed()
                continue
            returned = run.cycle_aborted(set(ended.finished), worker_died=died, stalled=ended.stalled)
            for queued in returned.given_up:
                why = (killed_twice(queued, self.planner.budgets()) if queued.deaths >= queued.stalls
                       else stalled_twice(queued, ended.why))
                await self.results.deliver(queued.request_id, queued.op, None,
                                           RemoteError("RequestFailedError", why, request_id=queued.request_id))
            for queued in returned.retried if ended.stalled else ():
                await self.results.notify(queued.request_id, stalled_once(ended.why))
        if died:
            await self._retry_smaller()
        if ended.aborted:
            self.samples = [Queued(rid, op) for rid, op in work.ops.items()
                            if isinstance(op, m.Sample) and rid not in ended.finished] + self.samples
        if self.samples or any(run.runnable() for run in self.runs.values()):
            self.on_work()

    async def _expire_gaps(self, gap_s: float) -> None:
        for run in self.runs.values():
            for queued, why in run.expire_gap(gap_s):
                await self.results.withdraw(queued.request_id, queued.op, RemoteError(
                    "BadRequestError", why, field="seq_id", request_id=queued.request_id))

    async def _retry_smaller(self) -> None:
        """A worker died inside the cycle (killed, or out of memory): its requests run once more, in smaller
        passes, and their clients hear why they wait."""
        retried = [(run, q) for run in self.runs.values() for q in run.queue.values()
                   if q.deaths == 1 and not q.rejected]
        shrunk = self.planner.shrink_passes({run.base_model for run, _ in retried})
        for _, queued in retried:
            await self.results.notify(queued.request_id, (
                "a worker died while running this request (killed, or out of memory); it runs again"
                + (f" in passes of at most {shrunk} tokens" if shrunk else "")
                + (" when a worker is connected" if not self.planner.workers() else "")))

    async def _runs_lost(self, model_ids: tuple[str, ...]) -> None:
        for model_id in model_ids:
            run = self.runs.get(model_id)
            if run is None:
                continue
            run.status = "lost"
            run.lost_reason = ("its state died with every worker that held it and it has no automatic checkpoint "
                               "(start the coordinator with --checkpoint-every N); create a new run or load a "
                               "saved state with create_training_client_from_state")
            self.store.set_run_status(model_id, "lost")
            await self._fail_queue(run, RemoteError("RequestFailedError",
                                                    f"training run {model_id} was lost: {run.lost_reason}"))

    # ------------------------------------------------------------------------------------ queries

    def _query(self, owner: str, body: Any) -> Any:
        if isinstance(body, m.GetInfo):
            run = run_for(self.runs, body.model_id, owner)
            return run.describe(self.planner.describe(run.base_model))
        if isinstance(body, m.CreateSamplingSession):
            return self._create_sampler(owner, body)
        if isinstance(body, m.GetSamplingSession):
            sampler = self.samplers.get(body.sampling_session_id)
            if sampler is None or sampler.owner != owner:
                raise NotFoundError(f"no sampling session {body.sampling_session_id!r}; create one with "
                                    "create_sampling_client", field="sampling_session_id")
            return m.SamplingSession(body.sampling_session_id, sampler.base_model, sampler.model_path)
        raise BadRequestError(f"the scheduler does not answer {type(body).__name__}", field="kind")

    def _create_sampler(self, owner: str, body: m.CreateSamplingSession) -> m.SamplingSession:
        if self.store.session_owner(body.session_id) != owner:
            raise NotFoundError(f"no session {body.session_id!r}: create samplers through a ServiceClient",
                                field="session_id")
        if body.model_path is None and not body.base_model:
            raise BadRequestError("give a model_path (a sampler checkpoint) or a base_model", field="model_path")
        base_model, model_path = body.base_model, None
        if body.model_path is not None:
            record = self.catalog.find_readable(body.model_path, owner, field="model_path")
            model_path = record.path
            run = self.store.get_run(record.run_id)
            base_model = run.base_model if run is not None else base_model
        sampling_session_id = ids.sampler_id(body.session_id, body.sampling_session_seq_id)
        self.samplers[sampling_session_id] = Sampler(owner, str(base_model), model_path)
        self.store.add_sampling_session(sampling_session_id, owner, str(base_model), model_path)
        return m.SamplingSession(sampling_session_id, str(base_model), model_path)
