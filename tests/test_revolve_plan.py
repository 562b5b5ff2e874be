"""Checkpointing plans: every plan replays cleanly in the simulator and costs what theory says.

The binomial plan must match the Griewank-Walther optimum exactly; the optimum itself is checked
against a brute-force search, so the formula is not trusted on its own word.
"""

from __future__ import annotations

import doctest
import math
import re
from dataclasses import FrozenInstanceError, fields
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint_ad.strategies.plans import revolve
from checkpoint_ad.strategies.plans.revolve import (
    MAX_STEPS,
    Action,
    Advance,
    Free,
    Plan,
    PlanInvariantError,
    PlanStats,
    Restore,
    Reverse,
    ReverseSegment,
    ScheduleError,
    Snapshot,
    binomial_plan,
    optimal_evaluations,
    periodic_plan,
    simulate_plan,
    store_all_plan,
)


def check_binomial(n: int, s: int) -> PlanStats:
    """Plan, replay, and compare the replay with the plan's own accounting and the optimum."""
    plan = binomial_plan(n, s)
    stats = simulate_plan(plan, n, s)
    assert stats.evaluations == optimal_evaluations(n, s), (n, s)
    assert stats.evaluations == plan.evaluations
    assert stats.advanced_steps == plan.advanced_steps
    assert stats.taped_steps == plan.taped_steps == n
    assert stats.max_live_snapshots == plan.max_live_snapshots <= s
    assert stats.longest_tape == plan.longest_tape == min(n, 1)
    assert stats.actions == len(plan)
    return stats


# --------------------------------------------------------------------------------------------
# The optimum itself, against brute force
# --------------------------------------------------------------------------------------------


@cache
def brute_force_advances(m: int, c: int) -> int:
    """Fewest advanced steps to reverse m steps from a stored start, with c snapshots in all."""
    if m == 1:
        return 0
    if c == 1:
        return m * (m - 1) // 2
    return min(
        k + brute_force_advances(m - k, c - 1) + brute_force_advances(k, c) for k in range(1, m)
    )


@pytest.mark.parametrize("c", range(1, 7))
def test_optimal_evaluations_matches_brute_force(c: int) -> None:
    for m in range(1, 61):
        assert optimal_evaluations(m, c) == brute_force_advances(m, c) + m, (m, c)


@pytest.mark.parametrize("c", range(2, 7))
def test_split_bounds_are_exactly_the_optimal_splits(c: int) -> None:
    for m in range(2, 61):
        best = brute_force_advances(m, c)
        optimal = [
            k
            for k in range(1, m)
            if k + brute_force_advances(m - k, c - 1) + brute_force_advances(k, c) == best
        ]
        low, high = revolve._split_bounds(m, c)
        assert optimal == list(range(low, high + 1)), (m, c)


def test_optimal_evaluations_small_values() -> None:
    assert optimal_evaluations(0, 0) == 0
    assert optimal_evaluations(0, 3) == 0
    assert optimal_evaluations(1, 1) == 1
    assert optimal_evaluations(2, 1) == 3
    assert optimal_evaluations(3, 1) == 6
    assert optimal_evaluations(5, 2) == 11
    assert optimal_evaluations(10, 1) == 55  # n (n + 1) / 2: re-advance from state 0 every time
    assert optimal_evaluations(10, 9) == optimal_evaluations(10, 100) == 19  # 2n - 1


# --------------------------------------------------------------------------------------------
# Hand-checked plans
# --------------------------------------------------------------------------------------------


def test_one_step_needs_no_snapshot() -> None:
    plan = binomial_plan(1, 1)
    assert list(plan) == [Reverse(0)]
    assert (plan.evaluations, plan.max_live_snapshots) == (1, 0)
    check_binomial(1, 1)


def test_two_steps_one_snapshot() -> None:
    assert list(binomial_plan(2, 1)) == [
        Snapshot(0),
        Advance(0, 1),
        Reverse(1),
        Restore(0),
        Free(0),
        Reverse(0),
    ]
    assert binomial_plan(2, 1).evaluations == 3


def test_three_steps_one_snapshot_re_advances_from_the_start() -> None:
    plan = binomial_plan(3, 1)
    assert list(plan) == [
        Snapshot(0),
        Advance(0, 2),
        Reverse(2),
        Restore(0),
        Advance(0, 1),
        Reverse(1),
        Restore(0),
        Free(0),
        Reverse(0),
    ]
    assert plan.evaluations == 6
    assert check_binomial(3, 1).restores == 2


def test_five_steps_two_snapshots() -> None:
    # r = 2 since C(2 + 2, 2) = 6 >= 5; cost 3 * 5 - C(4, 3) = 11. Split at 3 = C(3, 2): [3, 5)
    # is reversed from one snapshot, then [0, 3) stores every state it needs.
    assert list(binomial_plan(5, 2)) == [
        Snapshot(0),
        Advance(0, 3),
        Snapshot(3),
        Advance(3, 4),
        Reverse(4),
        Restore(3),
        Free(3),
        Reverse(3),
        Restore(0),
        Advance(0, 1),
        Snapshot(1),
        Advance(1, 2),
        Reverse(2),
        Restore(1),
        Free(1),
        Reverse(1),
        Restore(0),
        Free(0),
        Reverse(0),
    ]
    stats = check_binomial(5, 2)
    assert (stats.evaluations, stats.max_live_snapshots, stats.snapshots_taken) == (11, 2, 3)


def test_enough_snapshots_store_every_needed_state() -> None:
    for n in range(2, 40):
        plan = binomial_plan(n, n - 1)
        assert plan.evaluations == 2 * n - 1
        assert plan.max_live_snapshots == n - 1
        assert plan == binomial_plan(n, n) == binomial_plan(n, 10**12)
        check_binomial(n, n)


def test_zero_steps_is_an_empty_plan() -> None:
    for plan in (binomial_plan(0, 0), binomial_plan(0, 5), periodic_plan(0, 3), store_all_plan(0)):
        assert len(plan) == 0
        assert list(plan) == []
        assert (plan.evaluations, plan.max_live_snapshots, plan.longest_tape) == (0, 0, 0)
        assert simulate_plan(plan).evaluations == 0


def test_numpy_integers_are_accepted() -> None:
    assert binomial_plan(np.int64(7), np.int32(2)) == binomial_plan(7, 2)


# --------------------------------------------------------------------------------------------
# The optimum over a grid, random budgets, and long loops
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 81))
def test_dense_grid_replays_at_the_optimum(n: int) -> None:
    for s in range(1, min(n, 64) + 1):
        check_binomial(n, s)


@pytest.mark.parametrize("n", range(81, 301, 9))
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 6, 8, 11, 16, 23, 32, 45, 64])
def test_sparse_grid_replays_at_the_optimum(n: int, s: int) -> None:
    check_binomial(n, s)


def test_every_budget_up_to_300_steps_costs_the_optimum() -> None:
    # Planning is cheap, replaying is not: past the dense grid, the plan's own accounting
    # covers every budget.
    for n in range(81, 301):
        for s in range(1, min(n, 64) + 1):
            plan = binomial_plan(n, s)
            assert plan.evaluations == optimal_evaluations(n, s), (n, s)
            assert plan.max_live_snapshots <= s


@pytest.mark.parametrize("n", [500, 1000, 1025, 2500, 5000, 10_000])
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 8, 16, 32, 64])
def test_long_loops_replay_at_the_optimum(n: int, s: int) -> None:
    check_binomial(n, s)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 10_000), s=st.integers(1, 64))
def test_random_budgets_replay_at_the_optimum(n: int, s: int) -> None:
    check_binomial(n, s)


@pytest.mark.parametrize("template_steps", [0, 1, 5, 17])
def test_reused_sub_plans_change_nothing(
    monkeypatch: pytest.MonkeyPatch, template_steps: int
) -> None:
    # Loops up to _TEMPLATE_STEPS are planned directly; longer ones copy shifted sub-plans.
    # Shrinking the threshold sends small loops down the copying path too.
    direct = {(n, s): binomial_plan(n, s) for n in (30, 77, 200) for s in (2, 3, 5, 9)}
    monkeypatch.setattr(revolve, "_TEMPLATE_STEPS", template_steps)
    for (n, s), plan in direct.items():
        copied = binomial_plan(n, s)
        assert copied == plan, (n, s)
        assert (copied.advanced_steps, copied.max_live_snapshots) == (
            plan.advanced_steps,
            plan.max_live_snapshots,
        )
        check_binomial(n, s)


# --------------------------------------------------------------------------------------------
# Periodic and store-all plans
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 41))
def test_periodic_plans_replay(n: int) -> None:
    for every in range(1, n + 2):
        plan = periodic_plan(n, every)
        segments = math.ceil(n / every)
        stats = simulate_plan(plan)
        assert stats.evaluations == plan.evaluations == n + every * (segments - 1)
        assert stats.max_live_snapshots == plan.max_live_snapshots == segments - 1
        assert plan.snapshots == segments - 1
        assert stats.longest_tape == plan.longest_tape == min(every, n)
        assert stats.actions == len(plan)


def test_periodic_plan_actions() -> None:
    assert list(periodic_plan(7, 3)) == [
        Snapshot(0),
        Advance(0, 3),
        Snapshot(3),
        Advance(3, 6),
        ReverseSegment(6, 7),
        Restore(3),
        Free(3),
        ReverseSegment(3, 6),
        Restore(0),
        Free(0),
        ReverseSegment(0, 3),
    ]


def test_store_all_is_periodic_with_one_segment() -> None:
    for n in range(1, 20):
        plan = store_all_plan(n)
        assert list(plan) == [ReverseSegment(0, n)]
        assert plan == periodic_plan(n, n) == periodic_plan(n, n + 3)
        assert (plan.evaluations, plan.max_live_snapshots, plan.longest_tape) == (n, 0, n)
        assert simulate_plan(plan, n, 0).evaluations == n


def test_large_plans_are_planned_without_recursion() -> None:
    plan = binomial_plan(200_000, 6)
    assert plan.evaluations == optimal_evaluations(200_000, 6)
    assert plan.max_live_snapshots <= 6
    assert plan[0] == Snapshot(0)
    assert plan[-1] == Reverse(0)
    assert len(periodic_plan(200_000, 450)) == 5 * (math.ceil(200_000 / 450) - 1) + 1


# --------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [binomial_plan, optimal_evaluations])
def test_no_snapshot_for_the_initial_state_is_an_error(make) -> None:
    with pytest.raises(ScheduleError, match="at least one snapshot") as info:
        make(5, 0)
    assert isinstance(info.value, ValueError)
    assert "snapshots >= 1" in str(info.value)
    assert "n_steps=5, snapshots=0" in str(info.value)
    with pytest.raises(ScheduleError, match="at least one snapshot"):
        make(1, 0)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 2), ScheduleError, "n_steps must be >= 0, got -1"),
        ((5, -2), ScheduleError, "snapshots must be >= 0, got -2"),
        ((5.0, 2), TypeError, "n_steps must be an int, got float 5.0"),
        ((5, 2.5), TypeError, "snapshots must be an int, got float 2.5"),
        (("5", 2), TypeError, "n_steps must be an int, got str '5'"),
        ((True, 2), TypeError, "n_steps must be an int, got the bool True"),
        ((None, 2), TypeError, "n_steps must be an int, got NoneType None"),
        ((MAX_STEPS + 1, 2), ScheduleError, "above the supported maximum"),
    ],
)
def test_bad_binomial_arguments(args: tuple, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        binomial_plan(*args)
    with pytest.raises(error, match=re.escape(message)):
        optimal_evaluations(*args)


def test_bad_periodic_arguments() -> None:
    with pytest.raises(ScheduleError, match="every must be >= 1, got 0"):
        periodic_plan(10, 0)
    with pytest.raises(TypeError, match=r"every must be an int, got float 2\.0"):
        periodic_plan(10, 2.0)
    with pytest.raises(ScheduleError, match="n_steps must be >= 0, got -3"):
        periodic_plan(-3, 2)
    with pytest.raises(ScheduleError, match="n_steps must be >= 0, got -3"):
        store_all_plan(-3)


def test_simulating_a_plain_list_needs_the_loop_and_budget() -> None:
    with pytest.raises(TypeError, match="needs n_steps and snapshots"):
        simulate_plan([Reverse(0)])
    with pytest.raises(ScheduleError, match="snapshots must be >= 0"):
        simulate_plan([Reverse(0)], 1, -1)


# --------------------------------------------------------------------------------------------
# The simulator catches every broken invariant, naming the action and the rule
# --------------------------------------------------------------------------------------------


def broken(plan: list, n: int, s: int) -> PlanInvariantError:
    with pytest.raises(PlanInvariantError) as info:
        simulate_plan(plan, n, s)
    return info.value


BROKEN_PLANS = [
    # (plan, n, s, index of the failing action, invariant, part of the message)
    ([Reverse(1)], 2, 1, 0, "state-in-hand", "but the state in hand is state 0"),
    ([Advance(1, 2)], 3, 1, 0, "state-in-hand", "needs state 1 in hand"),
    ([Snapshot(1)], 3, 1, 0, "state-in-hand", "needs state 1 in hand"),
    ([Advance(0, 1), Reverse(1), Reverse(0)], 2, 1, 2, "state-in-hand", "a reverse consumed it"),
    ([Restore(0)], 2, 1, 0, "snapshot-stored", "no snapshot of state 0 is alive"),
    ([Snapshot(0), Free(0), Free(0)], 2, 1, 2, "snapshot-stored", "no snapshot of state 0"),
    ([Snapshot(0), Snapshot(0)], 2, 2, 1, "no-overwrite", "state 0 is alive already"),
    ([Snapshot(0), Advance(0, 1), Snapshot(1)], 3, 1, 2, "snapshot-limit", "budget (1) is used"),
    ([Snapshot(0)], 2, 0, 0, "snapshot-limit", "budget (0) is used up by states []"),
    ([Advance(0, 1), Reverse(1)], 3, 1, 1, "reverse-order", "next step to reverse is step 2"),
    ([Reverse(0), Reverse(0)], 1, 1, 1, "reverse-order", "next step to reverse is none"),
    ([Advance(0, 3)], 3, 1, 0, "needed-states", "stop at or before state 2"),
    ([Advance(0, 0)], 3, 1, 0, "needed-states", "must go forward"),
    ([ReverseSegment(2, 2)], 2, 1, 0, "needed-states", "0 <= start < stop"),
    ([ReverseSegment(1, 3)], 3, 1, 0, "state-in-hand", "needs state 1 in hand"),
    (["Reverse(0)"], 1, 1, 0, "action-type", "str is not a plan action"),
    ([Action()], 1, 1, 0, "action-type", "Action is not a plan action"),
    ([Advance(0, 1), Reverse(1)], 2, 1, 2, "complete", "steps 0..0 were never reversed"),
    ([], 2, 1, 0, "complete", "steps 1..0 were never reversed"),
    ([Snapshot(0), Reverse(0)], 1, 1, 2, "complete", "states [0] are still alive; free them"),
]


@pytest.mark.parametrize(("plan", "n", "s", "index", "invariant", "message"), BROKEN_PLANS)
def test_simulator_names_action_and_invariant(
    plan: list, n: int, s: int, index: int, invariant: str, message: str
) -> None:
    error = broken(plan, n, s)
    assert (error.index, error.invariant) == (index, invariant)
    assert message in str(error)
    assert f"invariant '{invariant}'" in str(error)
    assert isinstance(error, ScheduleError)
    if index < len(plan):
        assert error.action is plan[index]
        assert str(error).startswith(f"action {index} {plan[index]!r} breaks")
    else:
        assert error.action is None
        assert str(error).startswith(f"the end of the plan (after {index} actions)")


def test_simulator_rejects_a_binomial_plan_given_a_smaller_budget() -> None:
    error = broken(list(binomial_plan(20, 4)), 20, 3)
    assert error.invariant == "snapshot-limit"


def test_simulator_stats() -> None:
    stats = simulate_plan(periodic_plan(10, 4))
    assert stats == PlanStats(
        n_steps=10,
        snapshots=2,
        actions=11,
        advanced_steps=8,
        taped_steps=10,
        max_live_snapshots=2,
        longest_tape=4,
        snapshots_taken=2,
        restores=2,
    )
    assert stats.evaluations == 18
    with pytest.raises(FrozenInstanceError):
        stats.actions = 0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Actions and plans as values: repr, equality, immutability, sequence behaviour
# --------------------------------------------------------------------------------------------

ACTIONS = [Snapshot(3), Advance(0, 5), Restore(3), Free(3), Reverse(4), ReverseSegment(2, 6)]


def test_action_reprs_read_like_constructors() -> None:
    assert [repr(a) for a in ACTIONS] == [
        "Snapshot(step=3)",
        "Advance(start=0, stop=5)",
        "Restore(step=3)",
        "Free(step=3)",
        "Reverse(step=4)",
        "ReverseSegment(start=2, stop=6)",
    ]
    namespace = vars(revolve)
    assert [eval(repr(a), namespace) for a in ACTIONS] == ACTIONS


def test_actions_compare_by_kind_and_steps() -> None:
    assert Advance(0, 5) == Advance(start=0, stop=5)
    assert hash(Advance(0, 5)) == hash(Advance(0, 5))
    assert Advance(0, 5) != Advance(0, 4)
    assert Advance(0, 5) != ReverseSegment(0, 5)
    assert Snapshot(3) != Restore(3) != Free(3)
    assert Reverse(1) != 1
    assert len(set(ACTIONS + ACTIONS)) == len(ACTIONS)
    assert all(isinstance(a, Action) for a in ACTIONS)


def test_actions_are_frozen() -> None:
    for action in ACTIONS:
        for name in [f.name for f in fields(action)]:
            with pytest.raises(FrozenInstanceError):
                setattr(action, name, 9)
        assert not hasattr(action, "__dict__")


def test_plan_prints_as_the_call_that_made_it() -> None:
    plans = [binomial_plan(12, 3), periodic_plan(12, 5), store_all_plan(12)]
    assert [repr(p) for p in plans] == [
        "binomial_plan(n_steps=12, snapshots=3)",
        "periodic_plan(n_steps=12, every=5)",
        "store_all_plan(n_steps=12)",
    ]
    namespace = vars(revolve)
    assert [eval(repr(p), namespace) for p in plans] == plans


def test_plan_equality_and_hash() -> None:
    assert binomial_plan(12, 3) == binomial_plan(12, 3)
    assert hash(binomial_plan(12, 3)) == hash(binomial_plan(12, 3))
    assert binomial_plan(12, 3) != binomial_plan(12, 4)
    assert binomial_plan(12, 11) == binomial_plan(12, 50)  # same actions, any bigger budget
    assert binomial_plan(3, 1) != list(binomial_plan(3, 1))
    assert binomial_plan(0, 1) == store_all_plan(0)  # no actions for the same (empty) loop
    assert len({binomial_plan(12, 3), binomial_plan(12, 3), store_all_plan(12)}) == 2


def test_plan_is_an_immutable_sequence() -> None:
    plan = binomial_plan(6, 2)
    actions = list(plan)
    assert len(plan) == len(actions)
    assert [plan[i] for i in range(len(plan))] == actions
    assert plan[-1] == actions[-1] == Reverse(0)
    assert plan[2:5] == tuple(actions[2:5])
    assert plan[::-1] == tuple(reversed(actions))
    assert list(reversed(plan)) == actions[::-1]
    assert Snapshot(0) in plan
    assert Reverse(7) not in plan
    assert plan.index(Reverse(5)) == actions.index(Reverse(5))
    assert plan.count(Restore(0)) == actions.count(Restore(0))
    with pytest.raises(IndexError):
        plan[len(plan)]
    with pytest.raises(FrozenInstanceError):
        plan.n_steps = 3  # type: ignore[misc]


def test_describe_lists_costs_and_actions() -> None:
    plan = binomial_plan(5, 2)
    text = plan.describe(limit=len(plan))
    lines = text.splitlines()
    assert lines[0] == (
        "binomial_plan(n_steps=5, snapshots=2): 19 actions, 11 step evaluations "
        "(6 advanced + 5 taped), at most 2 snapshots alive, longest tape 1 step"
    )
    assert lines[1:] == [f"    {i:>2}  {a!r}" for i, a in enumerate(plan)]
    short = plan.describe(limit=4).splitlines()
    assert short[1:] == [
        "     0  Snapshot(step=0)",
        "     1  Advance(start=0, stop=3)",
        "        ... 15 more",
        "    17  Free(step=0)",
        "    18  Reverse(step=0)",
    ]
    assert plan.describe(limit=0).splitlines()[1] == "        ... 19 more"
    assert "longest tape 3 steps" in periodic_plan(7, 3).describe()
    assert "at most 1 snapshot alive" in binomial_plan(4, 1).describe()


def test_docstring_examples_run() -> None:
    result = doctest.testmod(revolve, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_plan_type() -> None:
    assert isinstance(binomial_plan(4, 2), Plan)
