"""Which workers hold which base models: the cluster cut into groups, one rule in one place.

A *group* is a set of workers that hold the same base models, with one tensor-parallel size: `replicas` copies
of `tp` shard holders. Each group has its own generation, collective group and cycle loop
(`bios.coordinator.groups`), so runs of different groups never wait for each other. A worker is in at most one
group, and a group holds several base models only when workers are scarce and the *sum* of what its workers
hold fits each of them (`fits`).

`place` is pure: from the live workers' budgets, the base models in use (their memory plans and queued work) and
today's placement, the next placement, with a reason for each change. It keeps what it can (a group keeps its
workers, so nobody reloads and every adapter keeps a holder) and:

- dissolves the groups whose base models no run uses any more, and drops dead workers;
- gives each new base model a group of its own, of the plan's tensor-parallel size: from idle workers, else
  from replicas other groups can spare (a donor keeps at least one replica, and so a holder of every shard),
  else inside a group of the same size whose workers hold it too, else inside a group where, cut the same
  number of ways (the group's adapters cut anew, or the model cut to the group's size), they fit together
  (`_recut_into`); else the model stays unplaced, with why;
- hands idle workers to the groups, a whole replica at a time, the busiest group (queued work per replica)
  first; a worker that can hold nothing waits (parked), with why;
- gives a model that shares a group a group of its own once two of the group's replicas hold its runs' state
  (`_unshare`): the workers that move take its adapters (or shards) with them; a split group whose models all
  fit one worker each again is cut back (`_uncut`).

A group keeps its tensor-parallel size while it lives, but for `_recut_into`: its runs' adapters are cut that
way, and a model's plan only chooses the size when its group is made. When a group is cut anew, its next
generation puts each adapter together on rank 0 from the holders of its shards and cuts it the new way
(`bios.worker.adapter_kinds.whole_on_rank_zero`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bios.models.memory_plan import USABLE_FRACTION, GiB, Plan


@dataclass(frozen=True)
class ModelNeed:
    """A base model in use, as placement weighs it."""

    base_model: str
    plan: Plan | None  # None: not planned (the coordinator cannot read its config): one worker a replica
    demand: float = 0.0  # its recent and queued work (tokens x its size: only ratios count), which replicas follow
    # its plan cut over that many workers (None: it cannot be), for a group cut anew (`_recut_into`)
    plan_at: Callable[[int], Plan | None] | None = field(default=None, compare=False)

    @property
    def tp(self) -> int:
        return self.plan.tp if self.plan is not None else 1

    def at(self, tp: int) -> Plan | None:
        """Its plan over `tp` workers a replica: its own if of that size, else cut (`plan_at`); None if it cannot
        be (or is not planned)."""
        if self.tp == tp:
            return self.plan
        return self.plan_at(tp) if self.plan_at else None


@dataclass(frozen=True)
class Group:
    group_id: str  # its first base model's name: stable while the group lives
    models: tuple[str, ...]
    workers: tuple[str, ...]  # rank order of the last placement: holders first, newcomers after
    tp: int
    formed: tuple[str, ...] = ()  # the workers of its last generation formed: they hold its runs' state

    @property
    def replicas(self) -> int:
        return len(self.workers) // self.tp


@dataclass(frozen=True)
class Placement:
    groups: tuple[Group, ...] = ()
    parked: tuple[tuple[str, str], ...] = ()  # (worker id, why it holds nothing)
    unplaced: tuple[tuple[str, str], ...] = ()  # (base model, why no group holds it)
    blocked: tuple[str, ...] = ()  # unplaced models that workers could hold, were they not serving other runs
    reasons: tuple[str, ...] = ()  # what this placement changed, and why
    rebalanced: bool = False  # a replica moved to follow the work (callers space such moves out)

    def group_of_model(self, base_model: str) -> Group | None:
        return next((g for g in self.groups if base_model in g.models), None)

    def samples(self, base_model: str, models: tuple[str, ...]) -> bool:
        """Whether the group of `models` samples `base_model`: its own, or any model no group holds (the first
        group's workers load it for the sample)."""
        if base_model in models:
            return True
        return self.group_of_model(base_model) is None and bool(self.groups) and self.groups[0].models == models

    def group_of_worker(self, worker_id: str) -> Group | None:
        return next((g for g in self.groups if worker_id in g.workers), None)

    def group(self, group_id: str) -> Group | None:
        return next((g for g in self.groups if g.group_id == group_id), None)

    def formed(self, group_id: str, ranked: Sequence[str]) -> Placement:
        """This placement with `group_id`'s workers in the rank order its runner formed them (replica r is
        ranks r*tp .. r*tp+tp-1, one holder of each shard), so spare replicas are taken whole."""
        groups = tuple(dataclasses.replace(g, workers=(*[w for w in ranked if w in g.workers],
                                                       *[w for w in g.workers if w not in ranked]),
                                           formed=tuple(ranked))
                       if g.group_id == group_id else g for g in self.groups)
        return dataclasses.replace(self, groups=groups)

    def layout(self) -> dict[str, tuple[str, ...]]:
        """Group id -> its workers: what the cycle runners form (reasons and notes aside)."""
        return {g.group_id: g.workers for g in self.groups}


REBALANCE_RATIO = 2.0  # replicas move only toward a group with at least this much more work per worker


def needed_bytes(plans: Sequence[Plan | None]) -> int:
    """What one worker needs to hold these base models' plans together: the runtime once, every model's weights
    and adapters, and the largest single pass (passes of different models never run at once on a worker)."""
    known = [plan.estimate for plan in plans if plan is not None]
    if not known:
        return 0
    return (max(e.overhead for e in known) + sum(e.weights + e.adapters for e in known)
            + max(e.activations + e.logits for e in known))


def fits(budget: int, plans: Sequence[Plan | None]) -> bool:
    return needed_bytes(plans) <= USABLE_FRACTION * budget


def smallest_budget(plans: Sequence[Plan | None]) -> str:
    """The budget a worker needs to hold these plans together, for messages ("1.26 GiB")."""
    return f"{needed_bytes(plans) / USABLE_FRACTION / GiB:.2f} GiB"


@dataclass
class _Group:
    group_id: str
    models: list[str]
    workers: list[str]
    tp: int
    formed: tuple[str, ...] = ()

    @property
    def replicas(self) -> int:
        return len(self.workers) // self.tp

    def frozen(self) -> Group:
        return Group(self.group_id, tuple(self.models), tuple(self.workers), self.tp,
                     tuple(w for w in self.formed if w in self.workers))


@dataclass
class _Placing:
    """The placement being built: groups, idle workers, and what changed."""

    budgets: Mapping[str, int]
    needs: dict[str, ModelNeed]
    groups: list[_Group] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    affinity: Mapping[str, frozenset[str]] = field(default_factory=dict)  # worker -> base models it holds runs of

    def idle_for(self, models: Sequence[str]) -> list[str]:
        """The idle workers that can hold `models`, those already holding their runs' adapters first."""
        able = [w for w in self.idle if self.holds(w, models)]
        return sorted(able, key=lambda w: not (self.affinity.get(w, frozenset()) & set(models)))

    def plans(self, models: Sequence[str]) -> list[Plan | None]:
        return [self.needs[name].plan for name in models]

    def holds(self, worker: str, models: Sequence[str]) -> bool:
        return fits(self.budgets[worker], self.plans(models))

    def demand(self, group: _Group) -> float:
        return sum(self.needs[name].demand for name in group.models)

    def cut(self, models: Sequence[str], tp: int, workers: Sequence[str]) -> bool:
        """Plan `models` over `tp` workers a replica (`ModelNeed.at`) if each of `workers` then holds them all;
        whether it did."""
        plans = {name: self.needs[name].at(tp) for name in models}
        if any(plan is None for plan in plans.values()) or \
                not all(fits(self.budgets[w], list(plans.values())) for w in workers):
            return False
        for name, plan in plans.items():
            self.needs[name] = dataclasses.replace(self.needs[name], plan=plan)
        return True


def place(budgets: Mapping[str, int], needs: Sequence[ModelNeed], current: Placement = Placement(),
          affinity: Mapping[str, frozenset[str]] | None = None, rebalance: bool = False) -> Placement:
    """The next placement of `needs` on the live workers (`budgets`: worker id -> bytes), starting from
    `current` (see the module docstring). `affinity`: the base models whose adapters a worker already holds (it
    kept them across a coordinator restart): a new group takes those workers first, so nothing is reloaded.
    `rebalance`: also move whole replicas from the group with the least work per worker to the one with the
    most, when it has at least REBALANCE_RATIO times as much (hysteresis: groups do not thrash)."""
    state = _Placing(budgets, {need.base_model: need for need in needs}, affinity=affinity or {})
    _keep(state, current)
    placed = {name for group in state.groups for name in group.models}
    unplaced: dict[str, str] = {}
    blocked: list[str] = []
    for need in sorted((n for n in needs if n.base_model not in placed),
                       key=lambda n: (-n.tp, -(n.plan.estimate.total if n.plan else 0), n.base_model)):
        missed = _place_model(state, need)
        if missed is not None:
            unplaced[need.base_model], only_by_runs = missed
            if only_by_runs:
                blocked.append(need.base_model)
    for group in state.groups:
        if len(group.workers) < group.tp:
            _fill(state, group)
    _hand_out_idle(state)
    _unshare(state)
    moved = rebalance and _rebalance(state)
    parked = _parked(state)
    return Placement(tuple(g.frozen() for g in state.groups), tuple(sorted(parked.items())),
                     tuple(sorted(unplaced.items())), tuple(sorted(blocked)), tuple(state.reasons), moved)


def _keep(state: _Placing, current: Placement) -> None:
    """Today's groups, less the models no run uses and the workers gone; the rest of the workers are idle."""
    for group in current.groups:
        models = [name for name in group.models if name in state.needs]
        if not models:
            state.reasons.append(f"{group.group_id}'s group is dissolved: no run uses {', '.join(group.models)}")
            continue
        workers = [w for w in group.workers if w in state.budgets]
        gone = [w for w in group.workers if w not in state.budgets]
        if gone:
            state.reasons.append(f"{', '.join(gone)} left {group.group_id}'s group")
        if not workers:  # nobody holds its runs' state any more: it is placed anew, as its plan is now
            continue
        state.groups.append(_Group(group.group_id, models, workers, group.tp, group.formed))
    held = {w for g in state.groups for w in g.workers}
    state.idle = sorted((w for w in state.budgets if w not in held), key=lambda w: (-state.budgets[w], w))


def _place_model(state: _Placing, need: ModelNeed) -> tuple[str, bool] | None:
    """Give `need` a group: its own (idle workers, then spare replicas), else a share of one; None when placed,
    else why not, and whether only other runs' groups stand in its way (enough workers could hold it)."""
    name, tp = need.base_model, need.tp
    own = state.idle_for([name])[:tp]
    if len(own) < tp:
        own += _spare(state, [name], tp - len(own))
    if len(own) >= tp:
        for worker in own:
            if worker in state.idle:
                state.idle.remove(worker)
        state.groups.append(_Group(name, [name], own, tp))
        state.reasons.append(f"{name} gets a group of its own: {', '.join(own)}"
                             + (f" (tensor-parallel over {tp})" if tp > 1 else ""))
        return None
    for group in sorted(state.groups, key=lambda g: (state.demand(g), g.group_id)):
        if group.tp == tp and group.workers and all(state.holds(w, [*group.models, name]) for w in group.workers):
            group.models.append(name)
            state.reasons.append(f"{name} shares {group.group_id}'s group ({', '.join(group.workers)}): no "
                                 f"{tp} worker(s) are free, and theirs hold both")
            return None
    for group in sorted(state.groups, key=lambda g: (state.demand(g), g.group_id)):
        if _recut_into(state, group, need):
            return None
    holders = [w for w in state.budgets if state.holds(w, [name])]
    if len(holders) < tp:
        return (f"{name} needs {tp} worker(s) with {smallest_budget([need.plan])} "
                f"each; {len(holders)} such worker(s) are connected"), False
    busy = "; ".join(f"{g.group_id} holds {', '.join(g.workers)} ({g.replicas} replica(s) of {g.tp})"
                     for g in state.groups)
    return (f"{name} needs {tp} worker(s) to itself, or a group of {tp} whose workers hold it too, and every "
            f"worker that could hold it serves other live runs ({busy}): it waits for workers to join or for "
            "those runs to end (no group of theirs takes it, even with its models cut another number of ways)"), True


def _recut_into(state: _Placing, group: _Group, need: ModelNeed) -> bool:
    """Place `need` in `group` with everything cut the larger of their tensor-parallel ways: the group's models
    (their adapters are put together and cut anew when it forms again), or the new model to the group's size;
    when every worker of the group's first whole replicas of that size then holds them all (`fits`). The
    group's other workers go idle. Nothing waits for another run's plan. True if placed."""
    tp = max(group.tp, need.tp)
    if len(group.workers) < tp:
        return False
    models = [*group.models, need.base_model]
    kept = group.workers[:len(group.workers) // tp * tp]
    recut = [name for name in models if state.needs[name].tp != tp]
    if not state.cut(models, tp, kept):
        return False
    state.idle.extend(w for w in group.workers if w not in kept)
    group.workers[:], group.tp = kept, tp
    group.models.append(need.base_model)
    state.reasons.append(f"{', '.join(recut)} cut over {tp} workers, so {need.base_model} shares "
                         f"{group.group_id}'s group ({', '.join(kept)}): no {need.tp} worker(s) are free, and each "
                         f"holds them all split {tp} ways")
    return True


def _spare(state: _Placing, models: list[str], count: int) -> list[str]:
    """Up to `count` workers that hold `models`, taken whole replicas at a time from the groups with the most
    replicas (each keeps its first, so every shard keeps a holder), newest replicas first; none unless `count`
    can be reached."""
    offers: list[tuple[_Group, list[str]]] = []
    found = 0
    for group in sorted(state.groups, key=lambda g: (-g.replicas, state.demand(g), g.group_id)):
        for r in range(group.replicas - 1, 0, -1):
            if found >= count:
                break
            replica = group.workers[r * group.tp:(r + 1) * group.tp]
            usable = sum(1 for w in replica if state.holds(w, models))
            if usable:
                offers.append((group, replica))
                found += usable
    if found < count:
        return []
    out: list[str] = []
    for group, replica in offers:
        for worker in replica:
            group.workers.remove(worker)
            if state.holds(worker, models) and len(out) < count:
                out.append(worker)
            else:
                state.idle.append(worker)
        state.reasons.append(f"{', '.join(replica)} leave {group.group_id}'s group ({group.replicas} replica(s) "
                             f"left) for {', '.join(models)}")
    return out


def _fill(state: _Placing, group: _Group) -> None:
    """A group short of one whole replica (a shard holder left): idle workers first, then spare replicas."""
    short = group.tp - len(group.workers)
    new = state.idle_for(group.models)[:short]
    if len(new) < short:
        new += _spare(state, group.models, short - len(new))
    if len(new) >= short:
        for worker in new:
            if worker in state.idle:
                state.idle.remove(worker)
        group.workers.extend(new)
        state.reasons.append(f"{', '.join(new)} join {group.group_id}'s group to complete a replica of {group.tp}")


def _hand_out_idle(state: _Placing) -> None:
    """Idle workers join groups a whole replica at a time, the busiest group per replica first."""
    while True:
        candidates = []
        for group in state.groups:
            able = [w for w in state.idle if state.holds(w, group.models)]
            if len(able) >= group.tp and len(group.workers) >= group.tp:
                candidates.append(((-(state.demand(group) + 1) / (group.replicas + 1), group.replicas,
                                    group.group_id), group, able[:group.tp]))
        if not candidates:
            break
        _, group, joining = min(candidates, key=lambda c: c[0])
        for worker in joining:
            state.idle.remove(worker)
        group.workers.extend(joining)
        state.reasons.append(f"{', '.join(joining)} join {group.group_id}'s group as a replica "
                             f"(its work: {_share(state, group)} of the cluster's)")


def _unshare(state: _Placing) -> None:
    """A base model that shares a group (workers were scarce when it came, or it was cut to share one) gets a
    group of its own once the group has two whole replicas whose workers hold its runs' state: the newest ones,
    as many as its share of the group's work (at least one, the group keeping at least one). Its adapters (or
    their shards: the group keeps its size) go with those workers (they hold them as last committed:
    `bios.coordinator.roster`), so its runs stop waiting for the others' cycles. Then `_uncut`."""
    for group in list(state.groups):
        if len(group.models) < 2:
            continue
        replicas = [group.workers[r * group.tp:(r + 1) * group.tp] for r in range(1, group.replicas)]
        holding = [replica for replica in replicas if all(w in group.formed for w in replica)]
        if not holding:
            continue
        name, total = group.models[-1], state.demand(group)
        share = state.needs[name].demand / total if total else 0.5
        count = min(len(holding), max(1, round(share * group.replicas)), group.replicas - 1)
        moving = [w for replica in holding[-count:] for w in replica]
        group.models.remove(name)
        group.workers[:] = [w for w in group.workers if w not in moving]
        state.groups.append(_Group(name, [name], moving, group.tp))
        state.reasons.append(f"{name} leaves {group.group_id}'s group for one of its own on {', '.join(moving)}, "
                             f"which hold its runs' state ({len(group.workers)} worker(s) keep {group.group_id})")
    _uncut(state)


def _uncut(state: _Placing) -> None:
    """A split group whose models all fit each of its workers whole again (a model cut to share a group, left
    alone in it) is cut back to one worker a replica: its adapters are put together when it forms again."""
    for group in state.groups:
        if group.tp == 1 or not group.workers or not state.cut(group.models, 1, group.workers):
            continue
        group.tp = 1
        state.reasons.append(f"{', '.join(group.models)} cut back to one worker a replica: each of "
                             f"{', '.join(group.workers)} holds it whole again")


def _share(state: _Placing, group: _Group) -> str:
    total = sum(state.demand(g) for g in state.groups)
    return f"{state.demand(group) / total:.0%}" if total else "none"


def _rebalance(state: _Placing) -> bool:
    """Move whole replicas toward the work, once: from the group with the least work per worker to one with at
    least REBALANCE_RATIO times as much, as many of the donor's newest replicas as make whole replicas of the
    receiver (one of tp 1 to one of tp 2: two), the donor keeping one; True if any moved."""
    movable = [g for g in state.groups if g.workers]
    load = {g.group_id: state.demand(g) / len(g.workers) for g in movable}
    for receiver in sorted(movable, key=lambda g: -load[g.group_id]):
        for donor in sorted(movable, key=lambda g: load[g.group_id]):
            if (donor is receiver or not load[receiver.group_id]
                    or load[receiver.group_id] < REBALANCE_RATIO * load[donor.group_id]):
                continue
            count = receiver.tp // math.gcd(donor.tp, receiver.tp)  # donor replicas that make whole ones
            replicas = [donor.workers[r * donor.tp:(r + 1) * donor.tp] for r in range(donor.replicas - 1, 0, -1)]
            able = [replica for replica in replicas if all(state.holds(w, receiver.models) for w in replica)]
            if len(able) < count:
                continue
            moving = [w for replica in able[:count] for w in replica]
            donor.workers[:] = [w for w in donor.workers if w not in moving]
            receiver.workers.extend(moving)
            state.reasons.append(f"{', '.join(moving)} move from {donor.group_id}'s group to {receiver.group_id}'s, "
                                 f"which has {_share(state, receiver)} of the cluster's work on "
                                 f"{len(receiver.workers) - len(moving)} worker(s) (the other {_share(state, donor)} "
                                 f"on {len(donor.workers) + len(moving)})")
            return True
    return False


def _parked(state: _Placing) -> dict[str, str]:
    """Why each worker left idle waits (none while no run needs a worker)."""
    if not state.needs:
        return {}
    serving = sum(len(g.workers) for g in state.groups)
    served = f"; {serving} worker(s) with room serve it" if serving else "; no worker with room is connected"
    parked: dict[str, str] = {}
    for worker in state.idle:
        waits = f"worker {worker} ({state.budgets[worker] / GiB:.2f} GiB) waits"
        holdable = [g for g in state.groups if state.holds(worker, g.models)]
        if holdable:
            parked[worker] = (f"{waits} for another worker to form a replica of {holdable[0].group_id}'s group "
                              f"(tensor-parallel over {holdable[0].tp})")
            continue
        sized = ([(g.group_id, state.plans(g.models)) for g in state.groups] if state.groups
                 else [(name, [need.plan]) for name, need in state.needs.items()])
        needs = "; ".join(f"{name} needs {smallest_budget(plans)} per worker" for name, plans in sized)
        parked[worker] = f"{waits}: {needs}{served}"
    return parked
