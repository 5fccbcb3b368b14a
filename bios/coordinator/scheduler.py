"""The scheduler actor: owns request state, acts on admission's verdicts, picks each cycle's work, and closes
requests as their results come in.

All request state lives in this actor, so acceptance, selection and completion never race. The decisions are
made by pieces that change nothing themselves: `Admission` (is this request valid and whose), `PoolPlanner`
(where the base models are placed and how each is split); `ResultRouter` logs and delivers answers. Each group's
cycles run in its `CycleRunner` (its own task), which exchanges one plan and one outcome with this actor per
cycle (`schedule`, `update`: `bios.coordinator.exchange`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from bios import ids
from bios import messages as m
from bios import types as t
from bios.actors.actor import Actor
from bios.exceptions import RemoteError, RequestFailedError
from bios.security.limits import QuotaLedger, Quotas
from bios.transport.codec import Codec

from .admission import Admission, Fresh, Refused, Repeat, Submit, run_for, sample_positions
from .autosave import AutoSave, automatic_save
from .catalog import Catalog
from .cycle_share import CycleShare
from .disk import is_disk_full
from .exchange import CycleOutcome, CyclePlan, GroupLayout
from .metrics import CoordinatorMetrics
from .placement import Group, Placement
from .planning import PoolPlanner, Workers
from .recovery import restore
from .requeue import CycleWork, requeue
from .results import Push, ResultRouter
from .retries import LOST, killed_once
from .runs import Queued, Run, queue_depths, queued_tokens, stored_config
from .samplers import SamplerSessions
from .store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    checkpoint_every: int = 0  # automatic checkpoint every N optimizer steps of a run (0 = off)
    keep_checkpoints: int = 2  # automatic checkpoints kept per run


RECOVERED = -1  # the cycle id results recovered from a worker are recorded under


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
        self.samplers = SamplerSessions(store, catalog)
        self.samples: list[Queued] = []
        # The cycles running now (one per group at most), by cycle id. Answers are given when their cycle is
        # over: by then the state that produced them is committed on every replica, recorded (its checksums) in
        # the state dir, and in the automatic checkpoint if one was due.
        self.cycles: dict[int, CycleWork] = {}
        self.committed: dict[str, float] = {}  # each adapter's checksum after its group's last commit
        self.base_infos: dict[str, t.BaseModelInfo] = {}
        self._cycle_ids = itertools.count(1)  # one numbering for every group's cycles
        self.share = CycleShare()  # what cutting big batches over cycles remembers (`cycle_share`)

    async def started(self) -> None:
        """Carry on where the state dir says the last coordinator stopped."""
        self.committed = dict(self.store.committed())
        restored = restore(self.store, self.codec, self.admission)
        self.runs, self.samplers.by_id, self.samples = restored.runs, restored.samplers, restored.samples
        self.autosave.steps, self.base_infos = restored.steps, restored.infos
        for base_model, info in self.base_infos.items():
            self.planner.loaded(base_model, info)
        for request_id, op, error in restored.failed:
            await self.results.deliver(request_id, op, None, error)
        for base_model, exc in self.planner.plan_runs(list(self.runs.values())).items():
            log.error("%s cannot be planned on this pool any more: %s", base_model, exc.message)
        if self.samples or any(run.ready() for run in self.runs.values()):
            self.on_work()

    # ------------------------------------------------------------------------------------ the front door

    async def submit(self, sub: Submit) -> m.Accepted:
        """Admit a request: accepted (queued, its answer pushed when it has run), repeated, or refused."""
        verdict = self.admission.admit(sub, self.runs, self.samplers.by_id, self.base_infos)
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

    async def watch(self, peer: bytes, owner: str, request_id: str) -> m.Ack:
        """`peer` wants the result of a request it sent before this coordinator started (the HTTP gateway after
        a restart): pushed now if it is logged, else when it comes."""
        return await self.results.watch(peer, owner, request_id)

    async def sample_progress(self, progress: m.SampleProgress) -> None:
        await self.results.progress(progress)

    # ------------------------------------------------------------------------------------ the groups

    async def place(self) -> Placement:
        """Place the base models anew on the live workers (`bios.coordinator.placement`)."""
        self.planner.base_of = {run.model_id: run.base_model for run in self.runs.values()}
        await self._plan_waiting()
        await self._plan_sampled()
        before = self.planner.placement.layout()
        placement = self.planner.replace(queued_tokens(self.runs.values()))
        held = [run for run in self.runs.values() if run.held is not None]
        if held and placement.layout() != before:  # their groups may hold their rows now
            for run in held:
                run.held = None
            self.on_work()
        return placement

    def schedule(self, group_id: str, formed: GroupLayout | None) -> CyclePlan:
        """One tick of a group: its layout and adapters, and, when its generation was `formed` for this layout,
        the next cycle's items."""
        group = self.planner.placement.group(group_id)
        if group is None:
            return CyclePlan(None)
        layout = GroupLayout(group.tp, tuple(self.planner.model_plans(group)), group.workers, group.models)
        adapters = tuple(m.AdapterSpec(r.model_id, r.base_model, r.lora, r.optimizer)
                         for r in self.runs.values() if r.status == "ready" and r.base_model in group.models)
        if not layout.same_shape(formed):
            return CyclePlan(layout, adapters)
        live = [run for run in self.runs.values() if run.status != "lost" and run.base_model in group.models]
        if wait := self.share.wait_s(group_id, live, time.monotonic()):
            return CyclePlan(layout, adapters, wait_s=wait)
        cycle_id = next(self._cycle_ids)
        return CyclePlan(layout, adapters, cycle_id, tuple(self._select(cycle_id, group, live)))

    async def update(self, outcome: CycleOutcome) -> None:
        """A cycle ended: record its results (automatic checkpoints first), its adapters' checksums, then answer
        its requests and requeue what it did not finish."""
        work = self.cycles.pop(outcome.cycle_id, CycleWork({}, set()))
        if not outcome.aborted:
            self.share.ran(outcome.models, outcome.seconds, work.ops, work.whole)
        answers = [answer for done in outcome.results if (answer := await self._finished(work, done)) is not None]
        self._committed(outcome.models, outcome.committed)
        await self._answer(work, answers)
        await self._cycle_ended(work, outcome)

    def formed(self, group_id: str, workers: tuple[str, ...], models: tuple[str, ...],
               checksums: dict[str, float]) -> None:
        """Group `group_id` formed a generation of `workers` (in rank order) holding its adapters as `checksums`."""
        self.planner.placement = self.planner.placement.formed(group_id, workers)
        self._committed(models, checksums)
        for run in self.runs.values():
            if run.base_model in models:  # the members discarded their pending gradients
                run.restart_cut()

    async def recovered(self, results: tuple[m.ItemDone, ...]) -> None:
        """Record what a worker reports of a committed cycle this coordinator's log stops just before."""
        work = CycleWork({}, set())
        for done in results:
            request = ids.RequestId.parse(done.request_id)
            if request.automatic:
                if isinstance(done.result, m.SavedState):
                    self.autosave.write(automatic_save(request.target, request.seq), done.result, done.request_id,
                                        self._owner_of(request.target))
                continue
            run = self.runs.get(request.target)
            queued = run.ran_elsewhere(request.seq) if run is not None else None
            if run is None or queued is None:
                continue
            if isinstance(queued.op, m.OptimStep) and done.error is None:
                self.autosave.steps[run.model_id] = self.autosave.steps.get(run.model_id, 0) + 1
            work.ops[done.request_id] = queued.op
            log.info("recorded %s from a worker that committed it before the coordinator restarted",
                     done.request_id)
            answer = await self._finished(work, dataclasses.replace(done, cycle_id=RECOVERED))
            await self._answer(work, [answer] if answer is not None else [])

    async def runs_lost(self, model_ids: tuple[str, ...]) -> None:
        """These runs' state died with the workers that held it and no checkpoint can bring it back."""
        for model_id in model_ids:
            run = self.runs.get(model_id)
            if run is None:
                continue
            run.status, run.lost_reason = "lost", LOST
            self.store.set_run_status(model_id, "lost")
            await self._fail_queue(run, RemoteError("RequestFailedError", f"training run {model_id} was lost: {LOST}"))

    # ------------------------------------------------------------------------------------ the watchdog and status

    async def notify_waiting(self, message: str, models: tuple[str, ...] | None = None) -> None:
        """Tell the clients of every waiting request on `models` (None: every one) why it waits: a Notice each."""
        waiting = [q.request_id for run in self.runs.values() if models is None or run.base_model in models
                   for q in run.queue.values()]
        placement = self.planner.placement
        samples = [q.request_id for q in self.samples if models is None or placement.samples(q.op.base_model, models)]
        for request_id in waiting + samples:
            await self.results.notify(request_id, message)

    async def expire_gaps(self, gap_s: float) -> None:
        """Withdraw the requests that have waited `gap_s` behind a seq_id that never came."""
        for run in self.runs.values():
            for queued, why in run.expire_gap(gap_s):
                await self.results.withdraw(queued.request_id, queued.op, RemoteError(
                    "BadRequestError", why, field="seq_id", request_id=queued.request_id))

    def stalled(self, older_than_s: float) -> list[str]:
        """Why requests queued longer than `older_than_s` have not run: one line per run."""
        return [why for run in self.runs.values() if (why := run.stalled(older_than_s)) is not None]

    def plan_descriptions(self) -> dict[str, str]:
        """Base model -> its plan and estimate, for `bios status`."""
        return self.planner.descriptions()

    def longest_rows(self, forward_only: bool = False) -> dict[str, int]:
        """Base model -> the longest row its group trains, or with `forward_only` runs in a `forward`
        (`PoolPlanner.longest_row`), for status and the console."""
        return self.planner.longest_rows(forward_only=forward_only)

    def queue_depths(self) -> dict[str, int]:
        """Waiting requests per base model (training queues and samples)."""
        return queue_depths(self.runs.values(), self.samples)

    # ------------------------------------------------------------------------------------ accept

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
            if run.ready():
                self.on_work()
        return m.Accepted(fresh.request_id)

    # ------------------------------------------------------------------------------------ plans

    async def _plan_waiting(self) -> None:
        """Plan the base models whose runs were created before any worker joined; if one fits nowhere, its
        runs end with the planner's error, as `create_lora_training_client` would have."""
        waiting = self.planner.take_waiting()
        runs = [run for run in self.runs.values() if run.base_model in waiting]
        for base_model, exc in self.planner.plan_runs(runs).items():
            for run in [r for r in runs if r.base_model == base_model and r.status == "creating"]:
                await self._drop_run(run, RemoteError.from_exception(exc))

    async def _plan_sampled(self) -> None:
        """Place the base models only samples use (`PoolPlanner.place_sampled`); fail the samples of one that
        fits nowhere."""
        trained = {run.base_model for run in self.runs.values()}
        sampled = {queued.op.base_model for queued in self.samples} | {
            op.base_model for work in self.cycles.values() for op in work.ops.values() if isinstance(op, m.Sample)}
        for base_model, error in self.planner.place_sampled(trained, sampled).items():
            failed = [queued for queued in self.samples if queued.op.base_model == base_model]
            self.samples = [queued for queued in self.samples if queued not in failed]
            for queued in failed:
                await self.results.deliver(queued.request_id, queued.op, None, RemoteError.from_exception(error))

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

    def _committed(self, models: tuple[str, ...], checksums: dict[str, float]) -> None:
        """The adapters of a group's base `models` as last committed (none known under tensor parallelism),
        kept in the state dir, so a restarted coordinator knows which rejoining workers hold the current state;
        other groups' entries stay."""
        self.committed = {model_id: checksum for model_id, checksum in self.committed.items()
                          if (run := self.runs.get(model_id)) is not None and run.base_model not in models}
        self.committed.update(checksums)
        self.store.set_committed(dict(self.committed))

    def _select(self, cycle_id: int, group: Group, live: list[Run]) -> list[m.WorkItem]:
        """The next share of every run of `group` (`live`: its runs not lost; a part of a big request beside
        smaller runs, `cycle_share`), and their samples; but a run whose last cycle stalled runs alone
        (`runs_alone`)."""
        items: list[m.WorkItem] = []
        whole: dict[str, m.Request] = {}
        models = group.models
        alone = next((run for run in live if run.runs_alone()), None)
        now = time.monotonic()
        for run in [alone] if alone is not None else live:
            most = self.share.most_rows(run, live, group.replicas, models, now) if alone is None else None
            taken = run.take_cycle(partial(self._hold, run), most)
            if taken and taken[0].part_rows and not taken[0].done_rows:
                log.info("%s: its %d-row batch runs in parts of %d rows, so the group's smaller runs step meanwhile",
                         run.model_id, len(taken[0].op.data), most)
            items.extend(q.work_item() for q in taken)
            whole.update((q.request_id, q.op) for q in taken if q.part_rows)
            if taken and isinstance(taken[-1].op, m.OptimStep):
                items.extend(self.autosave.after_step(run.model_id))
        if alone is None:
            waiting = [q for q in self.samples if self.planner.placement.samples(q.op.base_model, models)]
            mine = [waiting[i] for i in self.planner.sample_batch([(q.op.base_model, sample_positions(
                q.op, self.admission.limits(q.op.base_model, self.base_infos)), q.op.num_samples) for q in waiting])]
            items.extend(m.WorkItem(q.request_id, q.op) for q in mine)
            self.samples = [q for q in self.samples if q not in mine]
            if len(mine) < len(waiting):  # the rest in the next cycle
                self.on_work()
        work = CycleWork({item.request_id: item.op for item in items}, {run.model_id for run in live}, whole)
        if items:
            self.cycles[cycle_id] = work
        self.results.timeline.taken(work.ops)
        if any(run.ready() for run in self.runs.values()):
            self.on_work()
        return items

    def _hold(self, run: Run, queued: Queued) -> str | None:
        """Why `queued` must wait although it is next: a row longer than its group holds now (accepted when the
        group was bigger; workers left since). Its client hears why; the placement changing lets it try again."""
        op = queued.op
        if not isinstance(op, m.FORWARD_TYPES) or (found := self.planner.too_long(run.base_model, op)) is None:
            return None
        why = f"it waits for workers: {found[1]}"
        log.warning("%s: request %s %s", run.model_id, queued.request_id, why)
        asyncio.ensure_future(self.results.notify(queued.request_id, why))
        return why

    async def _finished(self, work: CycleWork, done: m.ItemDone) -> m.ItemDone | None:
        """Record one item's result (an automatic checkpoint's is written now); returns the answer its client
        gets, None for an automatic item."""
        request_id = done.request_id
        op = work.ops.get(request_id)
        result, error = done.result, done.error
        if isinstance(result, m.SavedState) and isinstance(op, m.SaveWeights):
            result, error = self.autosave.write(op, result, request_id, self._owner_of(op.model_id))
        if ids.is_automatic(request_id) or op is None:
            return None
        run = self.runs.get(ids.target_of(request_id))
        if run is not None and isinstance(op, m.CreateModel):
            if error is not None:
                await self._drop_run(run, error)
            elif isinstance(result, m.ModelCreated):
                run.info, run.status, run.lora_targets = result.info, "ready", result.lora_targets
                self.base_infos[run.base_model] = result.info
                self.planner.loaded(run.base_model, result.info)
                self.store.set_run_status(run.model_id, "ready", dataclasses.asdict(result.info))
        return m.ItemDone(done.cycle_id, request_id, result, error)

    async def _answer(self, work: CycleWork, answers: list[m.ItemDone]) -> None:
        """Log and push the answers of a cycle that ended (in the order they were reported)."""
        for done in answers:
            op = work.whole.get(done.request_id, work.ops.get(done.request_id))
            await self.results.deliver(done.request_id, op, done.result, done.error, done.cycle_id)

    def _owner_of(self, model_id: str) -> str:
        run = self.runs.get(model_id)
        return run.owner if run is not None else ""

    async def _cycle_ended(self, work: CycleWork, outcome: CycleOutcome) -> None:
        """Act on what becomes of the cycle's work (`requeue`)."""
        verdict = requeue(work, outcome, self.runs, self.planner.budgets())
        if not outcome.aborted:
            self.planner.ran(verdict.ran)
        for queued, why in verdict.failed:
            await self.results.deliver(queued.request_id, queued.op, None,
                                       RemoteError("RequestFailedError", why, request_id=queued.request_id))
        for queued, notice in verdict.notices:
            await self.results.notify(queued.request_id, notice)
        if outcome.aborted and outcome.worker_died:
            await self._retry_smaller()
        self.samples[:0] = verdict.samples
        if self.samples or any(run.ready() for run in self.runs.values()):
            self.on_work()

    async def _retry_smaller(self) -> None:
        """A worker died inside the cycle (killed, or out of memory): its requests run once more, in smaller
        passes, and their clients hear why they wait."""
        retried = [(run, q) for run in self.runs.values() for q in run.queue.values()
                   if q.deaths == 1 and not q.rejected]
        shrunk = self.planner.shrink_passes({run.base_model for run, _ in retried})
        for _, queued in retried:
            await self.results.notify(queued.request_id, killed_once(shrunk, bool(self.planner.workers())))

    # ------------------------------------------------------------------------------------ queries

    def get_info(self, owner: str, body: m.GetInfo) -> t.GetInfoResponse:
        run = run_for(self.runs, body.model_id, owner)
        return run.describe(self.planner.describe(run.base_model), self.planner.longest_row(run.base_model),
                            self.planner.longest_row(run.base_model, forward_only=True))

    def get_sampler(self, owner: str, body: m.GetSamplingSession) -> m.SamplingSession:
        return self.samplers.get(owner, body)

    def create_sampler(self, owner: str, body: m.CreateSamplingSession) -> m.SamplingSession:
        return self.samplers.create(owner, body)
