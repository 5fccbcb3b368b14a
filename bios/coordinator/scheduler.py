"""The scheduler actor: accepts requests, picks each cycle's work, and routes results back to clients.

All request state lives in this actor, so acceptance, selection and completion never race. Cycles themselves
run in `CycleRunner` (its own task), which asks this actor for work at every tick.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bios import messages as m
from bios import types as t
from bios.actors.actor import Actor
from bios.actors.remote import RemoteError
from bios.checkpoint_path import CheckpointPath, check_name
from bios.exceptions import ERROR_TYPES, BadRequestError, BiosAPIError, NotFoundError
from bios.models.memory_plan import Plan, choose_plan, model_shape
from bios.security.limits import QuotaLedger, Quotas
from bios.transport.codec import Codec, Envelope
from bios.transport.sockets import next_message_id
from bios.validation import validate_adam_params, validate_forward_backward, validate_lora_rank, validate_sample

from .catalog import Catalog
from .metrics import CoordinatorMetrics
from .runs import Queued, Run, model_id_of, request_id_for, seq_of
from .store import Store

log = logging.getLogger(__name__)

Push = Callable[[bytes, list[Any]], Awaitable[None]]
Workers = Callable[[], list[Any]]  # the live workers (membership Members: memory_bytes, runtime_bytes)

# Plans are sized for forward/backward passes of at most this many (padded) tokens; workers split bigger
# batches into passes of this size, so a plan holds whatever the batch.
PLAN_TOKENS_PER_PASS = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    checkpoint_every: int = 0  # automatic checkpoint every N optimizer steps of a run (0 = off)
    keep_checkpoints: int = 2  # automatic checkpoints kept per run


# ------------------------------------------------------------------------------------ mailbox messages


@dataclass(frozen=True)
class Submit:
    peer: bytes
    owner: str
    op: Any
    frames: list[bytes]


@dataclass(frozen=True)
class Query:
    owner: str
    body: Any


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
class QueueDepth:
    by_pool: bool = False  # a dict base model -> depth instead of the total


@dataclass(frozen=True)
class Adapters:
    """The adapters every worker of a generation must hold: one per ready run."""


@dataclass(frozen=True)
class Layout:
    """How the pool holds its base models: the tensor-parallel size and each base model's plan."""


@dataclass(frozen=True)
class PoolLayout:
    tp: int
    plans: tuple[m.ModelPlan, ...]


@dataclass(frozen=True)
class PlanDescriptions:
    """Base model -> its plan and estimate, for `bios status`."""


@dataclass(frozen=True)
class RunsLost:
    """These runs' state died with the worker pool and no checkpoint can bring it back."""

    model_ids: tuple[str, ...]


@dataclass
class Sampler:
    owner: str
    base_model: str
    model_path: str | None


class Scheduler(Actor):
    def __init__(self, store: Store, catalog: Catalog, codec: Codec, push: Push, on_work: Callable[[], None],
                 config: SchedulerConfig | None = None, ledger: QuotaLedger | None = None,
                 metrics: CoordinatorMetrics | None = None, workers: Workers | None = None) -> None:
        self.store = store
        self.catalog = catalog
        self.codec = codec
        self.push = push
        self.on_work = on_work
        self.config = config or SchedulerConfig()
        self.ledger = ledger or QuotaLedger(Quotas())
        self.metrics = metrics or CoordinatorMetrics()
        self.runs: dict[str, Run] = {}
        self.samplers: dict[str, Sampler] = {}
        self.samples: list[Queued] = []
        self.waiters: dict[str, set[bytes]] = {}
        self.running: dict[str, Any] = {}  # request id -> op, for the current cycle
        self.steps: dict[str, int] = {}
        self.base_infos: dict[str, t.BaseModelInfo] = {}
        self.workers = workers or (lambda: [])
        self.plans: dict[str, Plan | None] = {}  # base model -> its memory plan (None: could not plan it)
        self.plan_notes: dict[str, str] = {}  # base model -> the plan and estimate, or why there is none
        self.tp = 1  # tensor-parallel size of the pool: grows when a model needs it, never shrinks under runs
        self.waiting_plans: dict[str, t.LoraConfig] = {}  # base models created before any worker joined

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Submit):
            return await self._submit(message)
        if isinstance(message, SelectWork):
            return self._select()
        if isinstance(message, Finished):
            return await self._finished(message.done)
        if isinstance(message, CycleEnded):
            return self._cycle_ended(message)
        if isinstance(message, Query):
            return self._query(message.owner, message.body)
        if isinstance(message, Adapters):
            return [m.AdapterSpec(r.model_id, r.base_model, r.lora) for r in self.runs.values() if r.status == "ready"]
        if isinstance(message, Layout):
            await self._plan_waiting()
            return PoolLayout(self.tp, tuple(self._model_plans()))
        if isinstance(message, PlanDescriptions):
            return dict(self.plan_notes)
        if isinstance(message, RunsLost):
            return await self._runs_lost(message.model_ids)
        if isinstance(message, QueueDepth):
            if message.by_pool:
                return self._queue_depths()
            return sum(len(run.queue) for run in self.runs.values()) + len(self.samples)
        raise TypeError(f"scheduler got unexpected {type(message).__name__}")

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
        op = sub.op
        if isinstance(op, m.Sample):
            return await self._submit_sample(sub)
        model_id = model_id_of(op)
        seq_id = seq_of(op)
        request_id = request_id_for(model_id, seq_id)
        self._check_owner(model_id, sub.owner)
        stored = self.store.get_request(request_id)
        if stored is not None:
            return await self._resubmitted(sub.peer, stored)
        nbytes = sum(len(f) for f in sub.frames)
        if isinstance(op, m.CreateModel):
            self.ledger.check(sub.owner, nbytes=nbytes, sampling=False)
            op, run = self._create_run(model_id, op, sub.owner)
        else:
            run = self._run_for(model_id, sub.owner)
            if seq_id < run.next_seq or seq_id in run.queue:
                raise BadRequestError(
                    f"seq_id {seq_id} of {model_id} was already used; the next free one is "
                    f"{max([run.next_seq, *run.queue]) + 1}",
                    field="seq_id",
                )
            if seq_id != run.next_seq:  # a run's next request always gets in: later ones, accepted while it was
                self.ledger.check(sub.owner, nbytes=nbytes, sampling=False)  # refused, must not keep it out
        try:
            op = self._prepare(op, run, sub.owner)
        except BiosAPIError as exc:  # rejected: the seq_id is used up, so the run's queue moves past it
            self._reject(request_id, model_id, seq_id, op, exc)
            run.enqueue(seq_id, Queued(request_id, op, rejected=True))
            if isinstance(op, m.CreateModel):
                self.runs.pop(model_id, None)
                self.store.set_run_status(model_id, "failed")
            self.on_work()
            raise
        self.store.add_request(request_id, model_id, seq_id, type(op).__name__, sub.frames)
        self.ledger.record(request_id, sub.owner, nbytes=nbytes, sampling=False)
        self.metrics.request_accepted(request_id, op)
        run.enqueue(seq_id, Queued(request_id, op))
        self.waiters.setdefault(request_id, set()).add(sub.peer)
        if run.runnable():
            self.on_work()
        return m.Accepted(request_id)

    async def _submit_sample(self, sub: Submit) -> m.Accepted:
        op: m.Sample = sub.op
        request_id = request_id_for(op.sampling_session_id, op.seq_id)
        sampler = self.samplers.get(op.sampling_session_id)
        known = (sampler.owner,) if sampler is not None else self.store.get_sampling_session(op.sampling_session_id)
        if known is not None and known[0] != sub.owner:
            raise NotFoundError(f"no sampling session {op.sampling_session_id!r}; create one with "
                                "create_sampling_client", field="sampling_session_id")
        stored = self.store.get_request(request_id)
        if stored is not None:
            return await self._resubmitted(sub.peer, stored)
        sampler = self._sampler_for(op.sampling_session_id, sub.owner)
        nbytes = sum(len(f) for f in sub.frames)
        self.ledger.check(sub.owner, nbytes=nbytes, sampling=True)
        try:
            validate_sample(op.prompt, op.num_samples, op.sampling_params, self.base_infos.get(sampler.base_model))
            max_tokens = op.sampling_params.max_tokens or 1
            self.ledger.check_tokens(op.num_samples * (op.prompt.length + max_tokens), "sampling_params.max_tokens")
        except BiosAPIError as exc:
            self._reject(request_id, op.sampling_session_id, op.seq_id, op, exc)
            raise
        # only the coordinator names the weights a sample uses: a client's adapter_state never reaches a worker
        op = dataclasses.replace(op, base_model=sampler.base_model, adapter_path=sampler.model_path,
                                 adapter_state=None)
        self.store.add_request(request_id, op.sampling_session_id, op.seq_id, "Sample", sub.frames)
        self.ledger.record(request_id, sub.owner, nbytes=nbytes, sampling=True)
        self.metrics.request_accepted(request_id, op)
        self.samples.append(Queued(request_id, op))
        self.waiters.setdefault(request_id, set()).add(sub.peer)
        self.on_work()
        return m.Accepted(request_id)

    def _reject(self, request_id: str, model_id: str, seq_id: int, op: Any, exc: BiosAPIError) -> None:
        exc.request_id = request_id
        frames = self._encode_done(m.RequestDone(request_id, error=RemoteError.from_exception(exc)))
        self.store.add_rejected(request_id, model_id, seq_id, type(op).__name__, frames)
        self.metrics.request_rejected(request_id, op, exc.message)

    async def _resubmitted(self, peer: bytes, stored: Any) -> m.Accepted:
        if stored.status == "rejected":
            error = self.codec.decode(stored.result).body.error
            raise ERROR_TYPES.get(error.type, BadRequestError)(error.message, field=error.field,
                                                               request_id=stored.request_id)
        if stored.result is not None:
            await self.push(peer, stored.result)
        else:
            self.waiters.setdefault(stored.request_id, set()).add(peer)
        return m.Accepted(stored.request_id)

    def _check_owner(self, model_id: str, owner: str) -> None:
        """NotFoundError for a run of another key, before anything (even a stored result) is revealed about it."""
        run = self.runs.get(model_id)
        stored_owner = run.owner if run is not None else getattr(self.store.get_run(model_id), "owner", owner)
        if stored_owner != owner:
            raise NotFoundError(f"no training run {model_id!r}; create one with create_lora_training_client",
                                field="model_id")

    def _check_session(self, session_id: str, owner: str) -> None:
        """Runs and samplers are named after the creating session, which must be the caller's own."""
        if self.store.session_owner(session_id) != owner:
            raise NotFoundError(f"no session {session_id!r}: create runs through a ServiceClient",
                                field="session_id")

    def _create_run(self, model_id: str, op: m.CreateModel, owner: str) -> tuple[m.CreateModel, Run]:
        self._check_session(op.session_id, owner)
        if model_id in self.runs:
            raise BadRequestError(f"model {model_id} already exists", field="model_seq_id")
        if op.from_path is not None:
            state = self.catalog.load(op.from_path, owner, field="path")
            meta = state.metadata
            lora = t.LoraConfig(rank=int(meta["rank"]), seed=meta.get("seed"),
                                train_unembed=bool(meta.get("train_unembed", True)),
                                train_mlp=bool(meta.get("train_mlp", True)),
                                train_attn=bool(meta.get("train_attn", True)))
            op = dataclasses.replace(op, base_model=op.base_model or str(meta["base_model"]), lora=lora, state=state)
        elif op.state is not None:  # starting weights come from the caller's own checkpoints only
            op = dataclasses.replace(op, state=None)
        run = Run(model_id, op.session_id, owner, op.base_model, op.lora)
        self.runs[model_id] = run
        self.store.add_run(model_id, op.session_id, owner, op.base_model, dataclasses.asdict(op.lora))
        return op, run

    def _run_for(self, model_id: str, owner: str | None) -> Run:
        run = self.runs.get(model_id)
        if run is None or (owner is not None and run.owner != owner):
            raise NotFoundError(f"no training run {model_id!r}; create one with create_lora_training_client",
                                field="model_id")
        if run.status == "failed":
            raise BadRequestError(f"training run {model_id} failed to start; create a new one", field="model_id")
        return run

    def _sampler_for(self, sampling_session_id: str, owner: str) -> Sampler:
        sampler = self.samplers.get(sampling_session_id)
        if sampler is None or sampler.owner != owner:
            raise NotFoundError(f"no sampling session {sampling_session_id!r}; create one with create_sampling_client",
                                field="sampling_session_id")
        return sampler

    def _prepare(self, op: Any, run: Run, owner: str) -> Any:
        """Validate a request against its run and fill in what only the coordinator knows."""
        if isinstance(op, m.CreateModel):
            validate_lora_rank(op.lora.rank)
            if not op.base_model:
                raise BadRequestError("base_model is empty", field="base_model")
            self._plan(op.base_model, op.lora)
        elif isinstance(op, m.ForwardBackward):
            self.ledger.check_tokens(sum(datum.model_input.length for datum in op.data), "data")
            if run.info is not None:
                validate_forward_backward(op.data, op.loss_fn, op.loss_fn_config, run.info)
        elif isinstance(op, m.OptimStep):
            validate_adam_params(op.adam_params)
        elif isinstance(op, m.SaveWeights):
            name = op.name if op.name is not None else f"{op.seq_id:06d}-{uuid.uuid4().hex[:8]}"
            check_name(name)
            path = CheckpointPath(run.model_id, op.kind, name)
            self.catalog.check_free(path, overwrite=op.overwrite or op.kind == "sampler_weights")
            return dataclasses.replace(op, name=name, path=str(path))
        elif isinstance(op, m.LoadWeights):
            state = self.catalog.load(op.path, owner)
            if state.metadata.get("base_model") != run.base_model:
                raise BadRequestError(
                    f"checkpoint {op.path} is for base model {state.metadata.get('base_model')}, "
                    f"but run {run.model_id} trains {run.base_model}",
                    field="path",
                )
            if op.optimizer and state.optimizer is None:
                raise BadRequestError(f"{op.path} holds no optimizer state (it is a sampler checkpoint); "
                                      "use load_state instead", field="path")
            return dataclasses.replace(op, state=state)
        return op

    # ------------------------------------------------------------------------------------ memory plans

    def _plan(self, base_model: str, lora: t.LoraConfig) -> None:
        """Pick (or re-pick, one adapter more) the plan of `base_model` from the live workers' budgets.

        BadRequestError, refusing the run, when no plan fits. The pool's tensor-parallel size only grows: its
        runs' adapters are split that way, and every base model of the pool is split alike.
        """
        workers = self.workers()
        shape = model_shape(base_model)
        if shape is None:
            self.plans[base_model] = None
            self.plan_notes[base_model] = "replicate (not planned: the coordinator cannot read its config.json)"
            return
        if not workers:
            self.plans[base_model] = None
            self.plan_notes[base_model] = "waiting for workers to plan"
            self.waiting_plans[base_model] = lora
            return
        budget = min(worker.memory_bytes for worker in workers)
        overheads = [worker.runtime_bytes for worker in workers if worker.runtime_bytes]
        adapters = sum(1 for run in self.runs.values() if run.base_model == base_model and run.status != "failed")
        plan = choose_plan(
            shape, budget, lora_rank=lora.rank, batch_tokens=PLAN_TOKENS_PER_PASS, workers=len(workers),
            num_adapters=adapters, device_type="cuda" if workers[0].device.startswith("cuda") else "cpu",
            allow_bf16=False,  # bf16 changes results: the workers' hardware decides it (BIOS_BASE_DTYPE), not a plan
            model_name=base_model, overhead_bytes=max(overheads) if overheads else None,
        )
        tp = max(self.tp, plan.tp)
        for other, other_plan in {**self.plans, base_model: plan}.items():
            problem = model_shape(other).tensor_parallel_problem(tp) if other_plan is not None and tp > 1 else None
            if problem:
                raise BadRequestError(
                    f"{base_model} needs {plan.name} but the pool already splits its models over {self.tp} "
                    f"workers and {other} cannot be split over {tp}: {problem}", field="base_model")
        held = sum(1 for run in self.runs.values() if run.status == "ready")
        if tp != self.tp and held:
            # Live adapters are split the pool's current way; re-splitting them is not implemented, and
            # another user's run must never be lost to this one's plan.
            raise BadRequestError(
                f"{base_model} needs {plan.name}, which would split every base model of the pool over {tp} "
                f"workers, but the pool holds {held} live run(s) split over {self.tp}; re-splitting live runs "
                f"is not supported: create this run when they are done, or serve {base_model} from another "
                f"cluster", field="base_model")
        self.plans[base_model] = plan
        self.plan_notes[base_model] = plan.describe()
        if tp != self.tp:
            log.info("the pool now splits base models over %d workers: %s needs %s", tp, base_model, plan.name)
        self.tp = tp

    async def _plan_waiting(self) -> None:
        """Plan the base models whose runs were created before any worker joined; if one fits nowhere, its
        runs fail with the planner's error, as `create_lora_training_client` would have."""
        if not self.workers():
            return
        waiting, self.waiting_plans = self.waiting_plans, {}
        for base_model, lora in waiting.items():
            try:
                self._plan(base_model, lora)
            except BadRequestError as exc:
                error = RemoteError.from_exception(exc)
                for run in [r for r in self.runs.values() if r.base_model == base_model and r.status == "creating"]:
                    run.status = "failed"
                    self.store.set_run_status(run.model_id, "failed")
                    for queued in run.queue.values():
                        if not queued.rejected:
                            await self._finished(m.ItemDone(0, queued.request_id, error=error))
                    run.queue.clear()

    def _model_plans(self) -> list[m.ModelPlan]:
        return [
            m.ModelPlan(name, plan.activation_checkpointing, plan.batch_tokens)
            for name, plan in self.plans.items() if plan is not None
        ]

    # ------------------------------------------------------------------------------------ cycles

    def _select(self) -> list[m.WorkItem]:
        items: list[m.WorkItem] = []
        for run in self.runs.values():
            taken = run.take_cycle()
            items.extend(m.WorkItem(q.request_id, q.op) for q in taken)
            if taken and isinstance(taken[-1].op, m.OptimStep):
                items.extend(self._automatic_checkpoint(run))
        items.extend(m.WorkItem(q.request_id, q.op) for q in self.samples)
        self.samples = []
        self.running = {item.request_id: item.op for item in items}
        if any(run.runnable() for run in self.runs.values()):
            self.on_work()
        return items

    def _automatic_checkpoint(self, run: Run) -> list[m.WorkItem]:
        step = self.steps[run.model_id] = self.steps.get(run.model_id, 0) + 1
        every = self.config.checkpoint_every
        if every <= 0 or step % every:
            return []
        path = CheckpointPath(run.model_id, "weights", f"auto-{step:06d}")
        op = m.SaveWeights(run.model_id, -1, path.name, "weights", overwrite=True, path=str(path))
        return [m.WorkItem(f"{run.model_id}#auto-{step}", op)]

    async def _finished(self, done: m.ItemDone) -> None:
        request_id = done.request_id
        op = self.running.get(request_id)
        result, error = done.result, done.error
        if isinstance(result, m.SavedState) and isinstance(op, m.SaveWeights):
            result, error = self._store_checkpoint(op, result, request_id)
        if "#auto-" in request_id:
            return
        self.metrics.request_finished(request_id, op, result, error)
        model_id = request_id.rpartition("#")[0]
        run = self.runs.get(model_id)
        if isinstance(result, m.ModelCreated) and run is not None:
            run.info, run.status = result.info, "ready"
            self.base_infos[run.base_model] = result.info
            self.store.set_run_status(model_id, "ready", dataclasses.asdict(result.info))
        elif error is not None and run is not None and run.status == "creating":
            run.status = "failed"
            self.store.set_run_status(model_id, "failed")
        frames = self._encode_done(m.RequestDone(request_id, result, error, done.cycle_id))
        self.store.finish_request(request_id, "failed" if error else "done", frames)
        self.ledger.release(request_id)
        for peer in self.waiters.pop(request_id, ()):
            await self.push(peer, frames)

    def _store_checkpoint(self, op: m.SaveWeights, saved: m.SavedState, request_id: str) -> tuple[Any, Any]:
        path = CheckpointPath.parse(op.path)
        automatic = "#auto-" in request_id
        run = self.runs.get(op.model_id)
        try:
            self.catalog.save(path, saved.state, owner=run.owner if run else "", automatic=automatic)
        except OSError as exc:
            log.exception("could not write checkpoint %s", path)
            return None, RemoteError("RequestFailedError", f"could not write checkpoint {path}: {exc}",
                                     request_id=request_id)
        if automatic:
            self.catalog.prune_automatic(op.model_id, self.config.keep_checkpoints)
        if op.kind == "weights":
            return t.SaveWeightsResponse(str(path)), None
        return t.SaveWeightsForSamplerResponse(str(path)), None

    def _cycle_ended(self, ended: CycleEnded) -> None:
        for run in self.runs.values():
            if ended.aborted:
                run.cycle_aborted(set(ended.finished))
            else:
                run.cycle_committed()
        if ended.aborted:
            self.samples = [Queued(rid, op) for rid, op in self.running.items()
                            if isinstance(op, m.Sample) and rid not in ended.finished] + self.samples
        self.running = {}
        if self.samples or any(run.runnable() for run in self.runs.values()):
            self.on_work()

    async def _runs_lost(self, model_ids: tuple[str, ...]) -> None:
        for model_id in model_ids:
            run = self.runs.get(model_id)
            if run is None:
                continue
            run.status = "failed"
            self.store.set_run_status(model_id, "failed")
            error = RemoteError("RequestFailedError",
                                f"training run {model_id} was lost with every worker that held it and has no "
                                "automatic checkpoint (start the coordinator with --checkpoint-every N); "
                                "create a new run or load a saved state")
            for queued in run.queue.values():
                if not queued.rejected:
                    await self._finished(m.ItemDone(0, queued.request_id, error=error))
            run.queue.clear()

    def _encode_done(self, done: m.RequestDone) -> list[bytes]:
        return [bytes(f) for f in self.codec.encode(Envelope(next_message_id(), done))]

    # ------------------------------------------------------------------------------------ queries

    def _query(self, owner: str, body: Any) -> Any:
        if isinstance(body, m.GetInfo):
            return self._describe(self._run_for(body.model_id, owner))
        if isinstance(body, m.CreateSamplingSession):
            return self._create_sampler(owner, body)
        if isinstance(body, m.GetSamplingSession):
            sampler = self._sampler_for(body.sampling_session_id, owner)
            return m.SamplingSession(body.sampling_session_id, sampler.base_model, sampler.model_path)
        if isinstance(body, m.ListTrainingRuns):
            runs = self.store.list_runs(owner)
            page = runs[body.offset: body.offset + body.limit]
            return t.TrainingRunsResponse([self.catalog.training_run(r) for r in page],
                                          t.Cursor(body.offset, body.limit, len(runs)))
        if isinstance(body, m.GetTrainingRun):
            return self.catalog.training_run(self._stored_run(body.training_run_id, owner))
        if isinstance(body, m.ListCheckpoints):
            self._stored_run(body.training_run_id, owner)
            return t.CheckpointsListResponse(self.catalog.checkpoints(body.training_run_id))
        if isinstance(body, m.DeleteCheckpoint):
            self.catalog.delete(body.path, owner)
            return m.Ack()
        if isinstance(body, m.FetchCheckpoint):
            return self.catalog.load(body.path, owner)
        raise BadRequestError(f"the scheduler does not answer {type(body).__name__}", field="kind")

    def _stored_run(self, run_id: str, owner: str) -> Any:
        run = self.store.get_run(run_id)
        if run is None or run.owner != owner:
            raise NotFoundError(f"no training run {run_id!r}", field="training_run_id")
        return run

    def _create_sampler(self, owner: str, body: m.CreateSamplingSession) -> m.SamplingSession:
        self._check_session(body.session_id, owner)
        if body.model_path is None and not body.base_model:
            raise BadRequestError("give a model_path (a sampler checkpoint) or a base_model", field="model_path")
        base_model, model_path = body.base_model, None
        if body.model_path is not None:
            record = self.catalog.find(body.model_path, owner, field="model_path")
            model_path = record.path
            run = self.store.get_run(record.run_id)
            base_model = run.base_model if run is not None else base_model
        sampling_session_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        self.samplers[sampling_session_id] = Sampler(owner, str(base_model), model_path)
        self.store.add_sampling_session(sampling_session_id, owner, str(base_model), model_path)
        return m.SamplingSession(sampling_session_id, str(base_model), model_path)

    def _describe(self, run: Run) -> t.GetInfoResponse:
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
            memory_plan=self.plan_notes.get(run.base_model),
            base_dtype=info.base_dtype if info else None,
        )
