"""The placement rule (bios.coordinator.placement): pure, so each situation of the placement issue is a few
lines: S then L, L then S, three models one per worker, a leave and a join with two live models."""

from __future__ import annotations

import dataclasses

from bios.coordinator.placement import ModelNeed, Placement, fits, needed_bytes, place
from bios.models.memory_plan import GiB, MemoryEstimate, Plan

BUDGET = 4 * GiB
FOUR = {f"w{i}": BUDGET for i in range(1, 5)}


def plan(weights_gib: float, tp: int = 1, pass_gib: float = 0.2) -> Plan:
    estimate = MemoryEstimate(int(weights_gib * GiB), int(0.05 * GiB), int(pass_gib * GiB), 0, int(0.4 * GiB))
    return Plan(tp, 1, "float32", False, 4096, estimate, BUDGET)


S = ModelNeed("S", plan(1.0))
L = ModelNeed("L", plan(2.4, tp=2))  # its shard of 2


def test_sum_of_models_counts_runtime_once_and_the_largest_pass():
    a, b = plan(1.0, pass_gib=0.5), plan(1.0, pass_gib=0.2)
    assert needed_bytes([a, b]) == int(0.4 * GiB) + 2 * (GiB + int(0.05 * GiB)) + int(0.5 * GiB)
    assert fits(BUDGET, [a, b]) and not fits(BUDGET, [a, b, plan(1.5)])


def test_small_model_first_then_large_one_takes_two_of_its_replicas():
    first = place(FOUR, [S])
    assert first.groups[0].workers == ("w1", "w2", "w3", "w4") and first.groups[0].tp == 1
    second = place(FOUR, [S, L], first)
    assert second.group_of_model("S").workers == ("w1", "w2")
    assert second.group_of_model("L").workers == ("w4", "w3") and second.group_of_model("L").tp == 2
    assert not second.unplaced and not second.parked
    assert any("leave S's group" in why for why in second.reasons)


def test_large_model_first_then_small_one_runs_unsplit_on_its_own_workers():
    first = place(FOUR, [L])
    assert first.group_of_model("L").replicas == 2
    second = place(FOUR, [L, S], first)
    assert second.group_of_model("L").workers == ("w1", "w2")
    assert second.group_of_model("S").tp == 1 and set(second.group_of_model("S").workers) == {"w3", "w4"}


def test_three_models_that_do_not_fit_together_get_a_worker_each():
    needs = [ModelNeed(name, plan(1.2)) for name in ("A", "B", "C")]
    assert not fits(BUDGET, [n.plan for n in needs])
    placement = Placement()
    for n in range(1, 4):
        placement = place(FOUR, needs[:n], placement)
    held = [g.workers for g in placement.groups]
    assert sorted(w for ws in held for w in ws) == ["w1", "w2", "w3", "w4"]
    assert all(len(set(ws) & set(other)) == 0 for ws in held for other in held if other is not ws)
    assert not placement.unplaced


def test_models_that_fit_together_share_a_worker_when_workers_are_scarce():
    needs = [ModelNeed("A", plan(0.8)), ModelNeed("B", plan(0.8))]
    placement = place({"w1": BUDGET}, needs[:1])
    placement = place({"w1": BUDGET}, needs, placement)
    assert placement.groups[0].models == ("A", "B") and placement.groups[0].workers == ("w1",)


def test_a_shared_model_gets_a_group_of_its_own_once_a_second_replica_holds_its_runs_state():
    """Workers join a shared group as replicas; once a generation of them formed (they hold both models' runs'
    state), the model that came second leaves with the newest replicas, as many as its share of the work."""
    needs = [ModelNeed("A", plan(0.8), demand=3.0), ModelNeed("B", plan(0.8), demand=1.0)]
    shared = place({"w1": BUDGET}, needs, place({"w1": BUDGET}, needs[:1]))
    grown = place(FOUR, needs, shared)
    assert [(g.models, g.workers) for g in grown.groups] == [(("A", "B"), ("w1", "w2", "w3", "w4"))]  # joining
    formed = grown.formed("A", ("w1", "w2", "w3", "w4"))
    split = place(FOUR, needs, formed)
    assert [(g.group_id, g.models, g.workers) for g in split.groups] == [("A", ("A",), ("w1", "w2", "w3")),
                                                                         ("B", ("B",), ("w4",))]
    assert any("B leaves A's group for one of its own on w4" in why for why in split.reasons), split.reasons
    assert place(FOUR, needs, split).layout() == split.layout()  # and it stays so
    # Only formed replicas go: a newcomer still joining holds nothing yet; and never the group's first replica
    assert len(place(FOUR, needs, grown.formed("A", ("w1",))).groups) == 1
    two = place({"w1": BUDGET, "w2": BUDGET}, needs, shared)
    assert [g.workers for g in place({"w1": BUDGET, "w2": BUDGET}, needs, two.formed("A", ("w1", "w2"))).groups] == [
        ("w1",), ("w2",)]


def test_a_model_blocked_by_live_runs_says_who_holds_the_workers():
    first = place({"w1": BUDGET, "w2": BUDGET}, [S])
    second = place({"w1": BUDGET, "w2": BUDGET}, [S, L], first)
    (model, why), = second.unplaced
    assert model == "L" and "S holds w1, w2" in why and "it waits for workers to join" in why
    assert second.blocked == ("L",)  # it waits (accepted), where a model no worker can hold is refused
    assert second.group_of_model("S").workers == ("w1", "w2")  # nothing moved for a model that cannot go
    assert place({"w1": BUDGET}, [S, L], place({"w1": BUDGET}, [S])).blocked == ()  # one worker: never fits
    # workers join: it gets them (one replica of S stays)
    third = place(FOUR, [S, L], second)
    assert third.group_of_model("L").tp == 2 and not third.unplaced and third.group_of_model("S").workers


def cut(weights_gib: float):
    """A model's `plan_at`: over tp workers each holds 1/tp of its weights."""
    return lambda tp: plan(weights_gib / tp, tp=tp)


def test_a_model_blocked_by_an_unsplit_group_shares_it_with_the_group_s_models_cut_as_many_ways():
    """S holds both workers unsplit; L needs two: S's adapters are cut in two and L joins its group, where both
    fit split. L first, then S: S is cut to L's size. Too big together even cut: L waits as before. A split
    group is cut another number of ways the same way."""
    two = {"w1": BUDGET, "w2": BUDGET}
    small = ModelNeed("S", plan(0.6), plan_at=cut(0.6))
    second = place(two, [small, L], place(two, [small]))
    group = second.group_of_model("L")
    assert (group.group_id, group.models, group.workers, group.tp) == ("S", ("S", "L"), ("w1", "w2"), 2)
    assert not second.unplaced and not second.blocked
    assert any("S cut over 2 workers, so L shares S's group (w1, w2)" in why for why in second.reasons), \
        second.reasons
    assert place(two, [small, L], second).layout() == second.layout()  # and it stays so
    after_l = place(two, [L, small], place(two, [L]))
    assert [(g.models, g.tp) for g in after_l.groups] == [(("L", "S"), 2)] and not after_l.unplaced
    big = ModelNeed("S", plan(2.5), plan_at=cut(2.5))
    blocked = place(two, [big, L], place(two, [big]))
    assert blocked.blocked == ("L",) and blocked.group_of_model("S").tp == 1
    uncut = ModelNeed("S", plan(0.6), plan_at=lambda tp: None)  # its plan cannot be split (heads, say)
    assert place(two, [uncut, L], place(two, [uncut])).blocked == ("L",)
    # A split group is cut anew too: two replicas of 2 become one of 4 beside a model that needs 4
    medium = ModelNeed("M", plan(1.2, tp=2), plan_at=cut(2.4))
    huge = ModelNeed("H", plan(1.5, tp=4))
    both = place(FOUR, [medium, huge], place(FOUR, [medium]))
    assert [(g.models, g.tp, len(g.workers)) for g in both.groups] == [(("M", "H"), 4, 4)] and not both.unplaced


def test_a_cut_group_splits_again_once_a_second_replica_holds_both_models():
    """S was cut in two to share two workers with L. Two workers join as a replica of both; once a generation
    of the four formed, L leaves with that replica (its shards go with it), and S, alone, is cut back whole."""
    two = {"w1": BUDGET, "w2": BUDGET}
    small = ModelNeed("S", plan(0.6), plan_at=cut(0.6))
    shared = place(two, [small, L], place(two, [small]))
    small = dataclasses.replace(small, plan=cut(0.6)(2))  # as the planner plans it in that group
    grown = place(FOUR, [small, L], shared)
    assert [(g.models, g.workers, g.tp) for g in grown.groups] == [(("S", "L"), ("w1", "w2", "w3", "w4"), 2)]
    split = place(FOUR, [small, L], grown.formed("S", ("w1", "w2", "w3", "w4")))
    assert [(g.group_id, g.models, g.workers, g.tp) for g in split.groups] == [
        ("S", ("S",), ("w1", "w2"), 1), ("L", ("L",), ("w3", "w4"), 2)]
    assert any("L leaves S's group for one of its own on w3, w4" in why for why in split.reasons), split.reasons
    assert any("S cut back to one worker a replica" in why for why in split.reasons), split.reasons


def test_a_leave_replaces_from_spares_and_a_join_goes_to_the_busiest_group():
    needs = [ModelNeed("S", S.plan, demand=0), ModelNeed("L", L.plan, demand=40)]
    both = place(FOUR, [S, L], place(FOUR, [S]))
    three = {w: b for w, b in FOUR.items() if w != "w3"}  # w3 held a shard of L
    after = place(three, needs, both)
    assert after.group_of_model("L").workers == ("w4", "w2") and after.group_of_model("S").workers == ("w1",)
    assert not after.parked  # nobody stands by
    back = place({**three, "w5": BUDGET}, needs, after)
    assert back.group_of_model("L").workers == ("w4", "w2") and back.group_of_model("S").workers == ("w1", "w5")


def test_idle_workers_go_a_whole_replica_at_a_time_and_the_odd_one_says_why_it_waits():
    placement = place({"w1": BUDGET, "w2": BUDGET, "w3": BUDGET}, [L])
    assert placement.group_of_model("L").workers == ("w1", "w2")
    (worker, why), = placement.parked
    assert worker == "w3" and "form a replica of L's group" in why


def test_a_worker_too_small_for_every_group_waits_with_the_sizes():
    placement = place({"w1": BUDGET, "tiny": GiB // 2}, [S])
    assert placement.group_of_model("S").workers == ("w1",)
    assert dict(placement.parked)["tiny"].startswith("worker tiny (0.50 GiB) waits: S needs")


def test_a_model_no_run_uses_frees_its_group():
    both = place(FOUR, [S, L], place(FOUR, [S]))
    after = place(FOUR, [S], both)
    assert set(after.group_of_model("S").workers) == {"w1", "w2", "w3", "w4"}
    assert any("dissolved" in why for why in after.reasons)


def test_a_replica_moves_toward_the_work_only_past_the_hysteresis_ratio():
    a, b = ModelNeed("A", plan(0.5)), ModelNeed("B", plan(0.5))
    both = place(FOUR, [a, b], place(FOUR, [a]))
    assert [g.replicas for g in both.groups] == [3, 1]
    idle = [ModelNeed("A", a.plan), ModelNeed("B", b.plan)]  # no work anywhere: nothing moves
    assert place(FOUR, idle, both, rebalance=True).layout() == both.layout()
    even = [ModelNeed("A", a.plan, demand=3.0), ModelNeed("B", b.plan, demand=1.9)]  # 1.0 vs 1.9 per replica
    assert place(FOUR, even, both, rebalance=True).layout() == both.layout()
    busy = [ModelNeed("A", a.plan, demand=3.0), ModelNeed("B", b.plan, demand=2.0)]  # 1.0 vs 2.0: moves one
    moved = place(FOUR, busy, both, rebalance=True)
    assert moved.rebalanced and [g.replicas for g in moved.groups] == [2, 2]
    assert any("move from A's group to B's" in why for why in moved.reasons)
    assert not place(FOUR, busy, both).rebalanced  # only when asked (the planner spaces moves out)
    alone = [ModelNeed("A", a.plan, demand=0.0), ModelNeed("B", b.plan, demand=9.0)]
    last = place(FOUR, alone, place(FOUR, alone, moved, rebalance=True), rebalance=True)
    assert [g.replicas for g in last.groups] == [1, 3]  # A keeps one replica whatever the work elsewhere


def test_a_split_groups_last_replica_never_moves():
    needs = [ModelNeed("L", L.plan, demand=0.0), ModelNeed("S", S.plan, demand=100.0)]
    first = place(FOUR, needs, place(FOUR, needs[:1]))
    assert place(FOUR, needs, first, rebalance=True).layout() == first.layout()


def test_whole_replicas_move_between_split_and_unsplit_groups_toward_the_work():
    """A group of tp 2 takes two of an unsplit group's replicas as one of its own, and gives one back as two."""
    six = {f"w{i}": BUDGET for i in range(1, 7)}
    idle_l = [ModelNeed("L", L.plan, demand=0.0), ModelNeed("S", S.plan, demand=0.0)]
    first = place(six, idle_l, place(six, idle_l[:1]))
    assert [(g.group_id, g.tp, g.replicas) for g in first.groups] == [("L", 2, 2), ("S", 1, 2)]
    busy_l = [ModelNeed("L", L.plan, demand=10.0), ModelNeed("S", S.plan, demand=0.1)]
    assert place(six, busy_l, first, rebalance=True).layout() == first.layout()  # S would keep no replica
    busy_s = [ModelNeed("L", L.plan, demand=0.1), ModelNeed("S", S.plan, demand=10.0)]
    moved = place(six, busy_s, first, rebalance=True)
    assert [(g.group_id, g.replicas) for g in moved.groups] == [("L", 1), ("S", 4)]
    assert moved.group_of_model("S").workers[2:] == first.group_of_model("L").workers[2:]  # L's newest replica
    back = place(six, busy_l, moved, rebalance=True)
    assert [(g.group_id, g.replicas) for g in back.groups] == [("L", 2), ("S", 2)]
