"""How the pool holds its base models: each one's memory plan, the pool's tensor-parallel size, and which
workers wait because their budget cannot hold the plans (`bios.coordinator.worker_fit`).

`choose` decides and changes nothing, so admission can refuse a run with the planner's reason and leave no
trace; the scheduler `adopt`s a choice once the run is accepted and `forget`s a base model no run uses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from bios import messages as m
from bios import types as t
from bios.exceptions import BadRequestError
from bios.models.memory_plan import USABLE_FRACTION, GiB, Plan, choose_plan, model_shape

from .worker_fit import fit_workers

log = logging.getLogger(__name__)

Workers = Callable[[], list[Any]]  # the live workers (membership Members: worker_id, memory_bytes, runtime_bytes, device)

# Plans are sized for forward/backward passes of at least PLAN_TOKENS_PER_PASS (padded) tokens, and of up to
# MAX_TOKENS_PER_PASS where the workers' memory holds them; workers split bigger batches into passes of the
# plan's size, so a plan holds whatever the batch.
PLAN_TOKENS_PER_PASS = 4096
MAX_TOKENS_PER_PASS = 16384
MIN_TOKENS_PER_PASS = 256


@dataclass(frozen=True)
class PlanChoice:
    base_model: str
    plan: Plan | None  # None: not planned (no config here, or no worker yet)
    note: str
    tp: int
    waiting: t.LoraConfig | None = None  # planned again once workers join


class PoolPlanner:
    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.plans: dict[str, Plan | None] = {}
        self.notes: dict[str, str] = {}  # base model -> the plan and estimate, or why there is none
        self.tp = 1  # grows when a model needs it, never shrinks under live runs
        self.waiting: dict[str, t.LoraConfig] = {}  # base models whose runs came before any worker

    def choose(self, base_model: str, lora: t.LoraConfig, *, adapters: int, live_runs: int) -> PlanChoice:
        """The plan of `base_model` with one adapter more; BadRequestError when none fits.

        `adapters`: runs of this base model already there; `live_runs`: runs of the pool whose adapters are
        held (split the pool's current way, which cannot change under them).
        """
        shape = model_shape(base_model)
        if shape is None:
            return PlanChoice(base_model, None, "replicate (not planned: the coordinator cannot read its "
                                                "config.json)", self.tp)
        workers = self.workers()
        if not workers:
            return PlanChoice(base_model, None, "waiting for workers to plan", self.tp, waiting=lora)
        overheads = [worker.runtime_bytes for worker in workers if worker.runtime_bytes]
        plan_for = partial(
            choose_plan, shape, lora_rank=lora.rank, batch_tokens=PLAN_TOKENS_PER_PASS, num_adapters=adapters,
            device_type="cuda" if workers[0].device.startswith("cuda") else "cpu",
            allow_bf16=False,  # bf16 changes results: the workers' hardware decides it (BIOS_BASE_DTYPE), not a plan
            model_name=base_model, overhead_bytes=max(overheads) if overheads else None,
            max_batch_tokens=MAX_TOKENS_PER_PASS,
        )
        serving = self._serving(base_model, {worker.worker_id: worker.memory_bytes for worker in workers}, plan_for)
        plan = plan_for(min(serving.values()), workers=len(serving))
        tp = max(self.tp, plan.tp)
        for other, other_plan in {**self.plans, base_model: plan}.items():
            problem = model_shape(other).tensor_parallel_problem(tp) if other_plan is not None and tp > 1 else None
            if problem:
                raise BadRequestError(
                    f"{base_model} needs {plan.name} but the pool already splits its models over {self.tp} "
                    f"workers and {other} cannot be split over {tp}: {problem}", field="base_model")
        if tp != self.tp and live_runs:
            # Live adapters are split the pool's current way; re-splitting them is not implemented, and
            # another user's run must never be lost to this one's plan.
            raise BadRequestError(
                f"{base_model} needs {plan.name}, which would split every base model of the pool over {tp} "
                f"workers, but the pool holds {live_runs} live run(s) split over {self.tp}; re-splitting live "
                f"runs is not supported: create this run when they are done, or serve {base_model} from another "
                f"cluster", field="base_model")
        return PlanChoice(base_model, plan, plan.describe(), tp)

    def _serving(self, base_model: str, budgets: dict[str, int], plan_for: Callable[..., Plan]) -> dict[str, int]:
        """The workers (id -> budget) a plan of `base_model` is sized for: of those that hold the pool's other
        plans (all, if none does), the ones that can hold `base_model` replicated; all of those when none can,
        and tensor parallelism then splits it over them. The rest wait (`parked`)."""
        held = fit_workers(budgets, partial(self._plans_problem, skip=base_model)).serving or tuple(budgets)
        replicated = fit_workers({worker: budgets[worker] for worker in held},
                                 partial(_replicate_problem, plan_for)).serving or held
        return {worker: budgets[worker] for worker in replicated}

    def _plans_problem(self, budget: int, skip: str = "") -> str | None:
        """Why a worker of `budget` bytes cannot hold some plan of the pool (None: it holds them all)."""
        for base_model, plan in self.plans.items():
            if plan is not None and base_model != skip and plan.estimate.total > USABLE_FRACTION * budget:
                return f"{base_model} needs {plan.estimate.total / USABLE_FRACTION / GiB:.2f} GiB per worker ({plan.name})"
        return None

    def parked(self) -> tuple[tuple[str, str], ...]:
        """The live workers whose budget cannot hold the pool's plans, each with why it waits: they stay out of
        the next generation. Every worker is parked when none can hold them (the runs then wait for one)."""
        budgets = {worker.worker_id: worker.memory_bytes for worker in self.workers()}
        return tuple(sorted(fit_workers(budgets, self._plans_problem).parked.items()))

    def adopt(self, choice: PlanChoice) -> None:
        self.plans[choice.base_model] = choice.plan
        self.notes[choice.base_model] = choice.note
        if choice.waiting is not None:
            self.waiting[choice.base_model] = choice.waiting
        if choice.tp != self.tp:
            log.info("the pool now splits base models over %d workers: %s needs %s", choice.tp,
                     choice.base_model, choice.plan.name if choice.plan else "it")
        self.tp = choice.tp

    def forget(self, base_model: str) -> None:
        """No run uses `base_model` any more: drop its plan and its line in `bios status`."""
        self.plans.pop(base_model, None)
        self.notes.pop(base_model, None)
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
            self.notes[base_model] = self.plans[base_model].describe() + " (halved after a worker died)"
            log.warning("%s: passes of at most %d tokens from now on (a worker died running its requests)",
                        base_model, tokens)
            shrunk = tokens
        return shrunk

    def model_plans(self) -> list[m.ModelPlan]:
        return [m.ModelPlan(name, plan.activation_checkpointing, plan.batch_tokens)
                for name, plan in self.plans.items() if plan is not None]


def _replicate_problem(plan_for: Callable[..., Plan], budget: int) -> str | None:
    """Why a worker of `budget` bytes cannot hold a model replicated, whatever its plan (None: it can)."""
    try:
        plan_for(budget, workers=1)  # one worker: only replicated plans are tried
    except BadRequestError as exc:
        return exc.message
    return None
