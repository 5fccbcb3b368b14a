"""How the cluster holds its base models: each one's memory plan (its own tensor-parallel size) and where it
runs (`bios.coordinator.placement`: a group of workers per base model).

`choose` decides and changes nothing, so admission can refuse a run with the planner's reason and leave no
trace; the scheduler `adopt`s a choice once the run is accepted, `forget`s a base model no run uses, and
`replace`s the models whenever the workers change.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from bios import messages as m
from bios import spec
from bios import types as t
from bios.exceptions import BadRequestError
from bios.models.memory_plan import Plan, choose_plan, model_shape

from .placement import Group, ModelNeed, Placement, place
from .runs import Run
from .worker_fit import fit_workers

log = logging.getLogger(__name__)

Workers = Callable[[], list[Any]]  # the live workers (membership Members: worker_id, memory_bytes, runtime_bytes, device)

# Plans are sized for forward/backward passes of at least PLAN_TOKENS_PER_PASS (padded) tokens, and of up to
# MAX_TOKENS_PER_PASS where the workers' memory holds them; workers split bigger batches into passes of the
# plan's size, so a plan holds whatever the batch.
PLAN_TOKENS_PER_PASS = 4096
MAX_TOKENS_PER_PASS = 16384
MIN_TOKENS_PER_PASS = 256
UNPLANNED = "replicate (not planned: the coordinator cannot read its config.json)"
# Replicas follow the work of the last DEMAND_WINDOW_S (tokens a model's cycles ran, plus what its queues hold),
# and a replica moves between groups at most once every MOVE_INTERVAL_S.
DEMAND_WINDOW_S = 60.0
MOVE_INTERVAL_S = 10.0


def _forward_rows(op: m.ForwardBackward) -> list[tuple[int, bool]]:
    """Each row of a forward(-backward) request: its length, and whether it may be split over workers."""
    return [(datum.model_input.length, spec.splits_rows(op.loss_fn, op.custom_loss, datum.model_input))
            for datum in op.data]


@dataclass(frozen=True)
class PlanChoice:
    base_model: str
    plan: Plan | None  # None: not planned (no config here, or no worker yet)
    note: str
    placement: Placement | None = None  # the placement with this model placed (None: unchanged)
    waiting: t.LoraConfig | None = None  # planned again once workers join
    cut: Callable[[int], Plan | None] | None = None  # its plan over that many tensor-parallel workers (or None)


class PoolPlanner:
    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.plans: dict[str, Plan | None] = {}
        self.notes: dict[str, str] = {}  # base model -> its plan as first chosen, or why there is none
        self.halved: set[str] = set()  # base models whose passes were halved after a worker died
        self.waiting: dict[str, t.LoraConfig] = {}  # base models whose runs came before any worker
        self.placement = Placement()
        self.base_of: dict[str, str] = {}  # run (model id) -> its base model, kept by the scheduler
        self.whole_rows: set[str] = set()  # base models whose long rows run whole on one worker (`loaded`)
        self.cutters: dict[str, Callable[[int], Plan | None]] = {}  # base model -> `PlanChoice.cut`
        self._ran: deque[tuple[float, str, int]] = deque()  # (when, base model, tokens) of recent cycles
        self._moved_at = float("-inf")

    def choose(self, base_model: str, lora: t.LoraConfig, *, adapters: int) -> PlanChoice:
        """The plan of `base_model` with one adapter more, and where it runs; BadRequestError when it fits no
        worker (`adapters`: runs of this base model already there). When the workers that could hold it all serve
        other live runs, the placement leaves it unplaced (`Placement.blocked`): its runs wait, told why."""
        shape = model_shape(base_model)
        workers = self.workers()
        if shape is None:
            return PlanChoice(base_model, None, UNPLANNED, self._placed(base_model, None) if workers else None)
        if not workers:
            return PlanChoice(base_model, None, "waiting for workers to plan", waiting=lora)
        overheads = [worker.runtime_bytes for worker in workers if worker.runtime_bytes]
        plan_for = partial(
            choose_plan, shape, lora_rank=lora.rank, batch_tokens=PLAN_TOKENS_PER_PASS, num_adapters=adapters,
            device_type="cuda" if workers[0].device.startswith("cuda") else "cpu",
            allow_bf16=False,  # bf16 changes results: the workers' hardware decides it (BIOS_BASE_DTYPE), not a plan
            model_name=base_model, overhead_bytes=max(overheads) if overheads else None,
            max_batch_tokens=MAX_TOKENS_PER_PASS,
        )
        budgets = self._budgets()
        group = self.placement.group_of_model(base_model)
        if group is not None and group.workers:  # its runs' adapters are cut group.tp ways already
            plan = plan_for(min((budgets[w] for w in group.workers if w in budgets), default=max(budgets.values())),
                            workers=group.tp, tp=group.tp)
        else:
            serving = _serving(budgets, plan_for)
            plan = plan_for(min(serving.values()), workers=len(serving))
        cut = partial(_cut, plan_for, plan.budget_bytes)
        return PlanChoice(base_model, plan, plan.describe(), self._placed(base_model, plan, cut), cut=cut)

    def _placed(self, base_model: str, plan: Plan | None,
                cut: Callable[[int], Plan | None] | None = None) -> Placement:
        placement = place(self._budgets(), self._needs({base_model: plan}, cuts={base_model: cut} if cut else None),
                          self.placement, self._affinity())
        why = dict(placement.unplaced).get(base_model)
        if why is not None and base_model not in placement.blocked:
            raise BadRequestError(why, field="base_model")
        return placement

    def _needs(self, extra: dict[str, Plan | None] | None = None, demand: dict[str, float] | None = None,
               cuts: dict[str, Callable[[int], Plan | None]] | None = None) -> list[ModelNeed]:
        plans = {**{name: plan for name, plan in self.plans.items() if name not in self.waiting}, **(extra or {})}
        cutters = {**self.cutters, **(cuts or {})}
        return [ModelNeed(name, plan, (demand or {}).get(name, 0), cutters.get(name)) for name, plan in plans.items()]

    def _budgets(self) -> dict[str, int]:
        return {worker.worker_id: worker.memory_bytes for worker in self.workers()}

    def _affinity(self) -> dict[str, frozenset[str]]:
        """Worker -> the base models of the adapters it reported holding when it registered."""
        return {worker.worker_id: frozenset(self.base_of[model_id] for model_id in worker.holdings
                                            if model_id in self.base_of) for worker in self.workers()}

    def ran(self, tokens: dict[str, int]) -> None:
        """The tokens a cycle put through each base model: the recent work replicas follow."""
        now = time.monotonic()
        self._ran.extend((now, base_model, count) for base_model, count in tokens.items() if count)
        while self._ran and self._ran[0][0] < now - DEMAND_WINDOW_S:
            self._ran.popleft()

    def plan_runs(self, runs: list[Run]) -> dict[str, BadRequestError]:
        """Plan the base models of `runs` (each with its runs' adapters); returns those that fit nowhere, with why."""
        failed = {}
        for base_model, lora in {run.base_model: run.lora for run in runs}.items():
            same_base = sum(1 for run in runs if run.base_model == base_model)
            try:
                self.adopt(self.choose(base_model, lora, adapters=same_base - 1))
            except BadRequestError as exc:
                failed[base_model] = exc
        return failed

    def place_sampled(self, trained: set[str], sampled: set[str]) -> dict[str, BadRequestError]:
        """A base model only samples use (`sampled`, no run trains it) is placed like a run's while samples
        want it or it ran lately (`idle`), so a sample never waits for a run that may never come; after that it
        is forgotten. Returns the ones that fit nowhere while no group runs, with why (their samples fail); with
        groups running, such a model is sampled by the first group (`Placement.samples`)."""
        if not self.workers():
            return {}
        unplaceable = {}
        for base_model in sampled - trained - self.plans.keys():
            try:
                self.adopt(self.choose(base_model, t.LoraConfig(), adapters=0))
            except BadRequestError as exc:
                if not self.placement.groups:
                    unplaceable[base_model] = exc
        for base_model in self.plans.keys() - trained - sampled:
            if self.idle(base_model):
                self.forget(base_model)
        return unplaceable

    def idle(self, base_model: str) -> bool:
        """Whether no cycle put tokens through `base_model` in the last DEMAND_WINDOW_S."""
        cutoff = time.monotonic() - DEMAND_WINDOW_S
        return not any(when >= cutoff and name == base_model for when, name, _ in self._ran)

    def _demand(self, queued: dict[str, int]) -> dict[str, float]:
        """Each base model's recent and queued tokens, times its weight bytes (a token's cost grows with them)."""
        tokens = dict(queued)
        for _, base_model, count in self._ran:
            tokens[base_model] = tokens.get(base_model, 0) + count
        return {name: count * (plan.estimate.weights if (plan := self.plans.get(name)) is not None else 1)
                for name, count in tokens.items()}

    def replace(self, queued: dict[str, int]) -> Placement:
        """Place the base models anew on the live workers (after a join, a leave, a new or a finished model, or
        as the work moves); `queued`: tokens waiting per base model."""
        now = time.monotonic()
        placement = place(self._budgets(), self._needs(demand=self._demand(queued)), self.placement,
                          self._affinity(), rebalance=now - self._moved_at >= MOVE_INTERVAL_S)
        if placement.rebalanced:
            self._moved_at = now
        if placement.layout() != self.placement.layout():
            for why in placement.reasons:
                log.info("placement: %s", why)
        else:  # nothing moved: the reasons shown stay those of the last change
            placement = dataclasses.replace(placement, reasons=self.placement.reasons)
        self.placement = placement
        self._follow_groups()
        return placement

    def adopt(self, choice: PlanChoice) -> None:
        self.plans[choice.base_model] = choice.plan
        self.notes[choice.base_model] = choice.note
        if choice.cut is not None:
            self.cutters[choice.base_model] = choice.cut
        if choice.waiting is not None:
            self.waiting[choice.base_model] = choice.waiting
        if choice.placement is not None:
            for why in choice.placement.reasons:
                log.info("placement: %s", why)
            self.placement = choice.placement
            self._follow_groups()

    def _follow_groups(self) -> None:
        """A model placed in a group cut another number of ways (`placement._recut_into`) takes its plan at the
        group's tensor-parallel size."""
        for group in self.placement.groups:
            for name in group.models:
                plan, cut = self.plans.get(name), self.cutters.get(name)
                if plan is not None and plan.tp != group.tp and cut is not None and (cut_plan := cut(group.tp)):
                    self.plans[name], self.notes[name] = cut_plan, cut_plan.describe()
                    log.info("%s is planned over %d tensor-parallel workers now: %s", name, group.tp,
                             cut_plan.describe())

    def forget(self, base_model: str) -> None:
        """No run uses `base_model` any more: drop its plan and its line in `bios status`."""
        self.plans.pop(base_model, None)
        self.notes.pop(base_model, None)
        self.cutters.pop(base_model, None)
        self.halved.discard(base_model)
        self.waiting.pop(base_model, None)

    def take_waiting(self) -> dict[str, t.LoraConfig]:
        """The base models to plan now that workers are here (none while there are none)."""
        if not self.workers():
            return {}
        waiting, self.waiting = self.waiting, {}
        return waiting

    def budgets(self) -> list[int]:
        """The live workers' memory budgets (bytes)."""
        return [worker.memory_bytes for worker in self.workers()]

    def parked(self) -> tuple[tuple[str, str], ...]:
        """The live workers in no group, each with why it waits."""
        return self.placement.parked

    def describe(self, base_model: str) -> str | None:
        """The plan as run: its group's replicas, not the ones it was first sized for."""
        plan, group = self.plans.get(base_model), self.placement.group_of_model(base_model)
        if plan is None:
            return self.notes.get(base_model)
        shown = dataclasses.replace(plan, replicas=group.replicas) if group is not None else plan
        return (shown.describe(split_over=self._split_over(base_model))
                + (" (halved after a worker died)" if base_model in self.halved else ""))

    def longest_row(self, base_model: str, *, splits: bool = True, forward_only: bool = False) -> int | None:
        """The longest row (tokens) `base_model`'s group trains, or with `forward_only` runs without a graph:
        split over its replicas (`splits`: its loss allows, `spec.splits_rows`; `_split_over`), else on one
        replica. None: not planned."""
        plan = self.plans.get(base_model)
        if plan is None:
            return None
        return plan.longest_row(self._split_over(base_model) if splits else 1, forward_only=forward_only)

    def loaded(self, base_model: str, info: t.BaseModelInfo) -> None:
        """A worker loaded `base_model`: whether its long rows split over workers (it runs Bios's attention)."""
        if info.splits_long_rows is False:
            self.whole_rows.add(base_model)
        else:
            self.whole_rows.discard(base_model)

    def _split_over(self, base_model: str) -> int:
        """How many replicas a long row of `base_model` is split over: its group's (each of one worker, or of a
        tensor-parallel group), when the model runs Bios's attention (else one)."""
        group = self.placement.group_of_model(base_model)
        return group.replicas if group is not None and base_model not in self.whole_rows else 1

    def longest_rows(self, *, forward_only: bool = False) -> dict[str, int]:
        return {name: longest for name in self.plans
                if (longest := self.longest_row(name, forward_only=forward_only)) is not None}

    def check_rows(self, base_model: str, op: m.ForwardBackward) -> None:
        """BadRequestError naming the first row of `op` longer than `base_model`'s group holds (`too_long`): it
        would run a worker out of memory."""
        if (found := self.too_long(base_model, op)) is not None:
            index, why = found
            raise BadRequestError(f"{why}; shorten or split the row, or add workers or memory",
                                  field=f"data[{index}].model_input")

    def too_long(self, base_model: str, op: m.ForwardBackward) -> tuple[int, str] | None:
        """The first row of `op` longer than `base_model`'s group holds now (`longest_row`: each row's length,
        whether it may split, and whether `op` trains), with why; None when every row fits."""
        forward_only = op.forward_only
        for index, (length, splits) in enumerate(_forward_rows(op)):
            longest = self.longest_row(base_model, splits=splits, forward_only=forward_only)
            if longest is None or length <= longest:
                continue
            runs = "runs forward-only rows" if forward_only else "trains rows"
            return index, (f"data[{index}] has {length} tokens, and {base_model} {runs} of at most {longest} "
                           f"tokens {self._where_rows_run(base_model, splits)} "
                           f"({self.plans[base_model].budget_bytes / 2**30:.2f} GiB each, activation checkpointing "
                           "included)")
        return None

    def _where_rows_run(self, base_model: str, splits: bool) -> str:
        """Where a long row of `base_model` runs, for `too_long`'s message (`splits`: its request allows)."""
        if not splits:
            return "on one worker (its loss or its images need the whole row on one worker)"
        if base_model in self.whole_rows:
            return "on one worker (its attention is not Bios's, which splits rows)"
        replicas, group = self._split_over(base_model), self.placement.group_of_model(base_model)
        if replicas == 1:
            return "on one worker"
        return f"split over its {replicas} " + ("worker(s)" if group.tp == 1 else f"replicas of {group.tp} workers")

    def check_sample(self, base_model: str, prompt_tokens: int, new_tokens: int, samples: int) -> None:
        """BadRequestError when `samples` continuations of a prompt would not fit a worker's key/value cache
        (`Plan.longest_sample`): they would run it out of memory mid-decode."""
        plan = self.plans.get(base_model)
        longest = plan.longest_sample(samples) if plan is not None else None
        if longest is None or prompt_tokens + new_tokens <= longest:
            return
        raise BadRequestError(
            f"{samples} sample(s) of a {prompt_tokens}-token prompt and {new_tokens} new tokens need "
            f"{(prompt_tokens + new_tokens) * samples * plan.kv_bytes_per_token / 2**30:.2f} GiB of key/value cache; "
            f"{base_model}'s workers ({plan.budget_bytes / 2**30:.2f} GiB each) hold {samples} sample(s) of at most "
            f"{longest} tokens in all: shorten the prompt or max_tokens, or ask for fewer samples",
            field="sampling_params.max_tokens")

    def sample_batch(self, samples: list[tuple[str, int, int]]) -> list[int]:
        """Which of `samples` (each one's base model, positions per row, prompt and new tokens, and rows) one
        cycle decodes together: per base model, in order, as many as a worker's key/value cache holds together,
        every row as long as its batch's longest (`Plan.longest_sample`; each alone fit when it was accepted)."""
        taken: list[int] = []
        batches: dict[str, list[tuple[int, int]]] = {}
        for index, (base_model, positions, rows) in enumerate(samples):
            batch = [*batches.get(base_model, []), (positions, rows)]
            plan = self.plans.get(base_model)
            longest = plan.longest_sample(sum(r for _, r in batch)) if plan is not None else None
            if len(batch) == 1 or longest is None or max(p for p, _ in batch) <= longest:
                batches[base_model] = batch
                taken.append(index)
        return taken

    def descriptions(self) -> dict[str, str]:
        return {name: self.describe(name) or "" for name in self.notes}

    def shrink_passes(self, base_models: set[str]) -> int | None:
        """Halve the per-pass token budget of `base_models` (a worker died running their requests: plans err on
        the safe side of measured peaks from now on); the new budget, or None when none had a plan."""
        shrunk = None
        for base_model in base_models:
            plan = self.plans.get(base_model)
            if plan is None:
                continue
            tokens = max(MIN_TOKENS_PER_PASS, plan.batch_tokens // 2)
            self.plans[base_model] = dataclasses.replace(plan, batch_tokens=tokens)
            self.halved.add(base_model)
            log.warning("%s: passes of at most %d tokens from now on (a worker died running its requests)",
                        base_model, tokens)
            shrunk = tokens
        return shrunk

    def model_plans(self, group: Group) -> list[m.ModelPlan]:
        """How the workers of `group` hold its base models (a default plan for those not planned)."""
        plans = []
        for name in group.models:
            plan = self.plans.get(name)
            plans.append(m.ModelPlan(name) if plan is None else
                         m.ModelPlan(name, plan.activation_checkpointing, plan.batch_tokens))
        return plans


def _cut(plan_for: Callable[..., Plan], budget: int, tp: int) -> Plan | None:
    """The plan over `tp` tensor-parallel workers of `budget` bytes (`PlanChoice.cut`); None if none fits."""
    try:
        return plan_for(budget, workers=tp, tp=tp)
    except BadRequestError:
        return None


def _serving(budgets: dict[str, int], plan_for: Callable[..., Plan]) -> dict[str, int]:
    """The workers (id -> budget) a new model's plan is sized for: those that can hold it replicated; all of
    them when none can, and tensor parallelism then splits it over them."""
    replicated = fit_workers(budgets, partial(_replicate_problem, plan_for)).serving or tuple(budgets)
    return {worker: budgets[worker] for worker in replicated}


def _replicate_problem(plan_for: Callable[..., Plan], budget: int) -> str | None:
    """Why a worker of `budget` bytes cannot hold a model replicated, whatever its plan (None: it can)."""
    try:
        plan_for(budget, workers=1)  # one worker: only replicated plans are tried
    except BadRequestError as exc:
        return exc.message
    return None
