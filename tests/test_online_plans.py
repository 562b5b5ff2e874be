"""Online plans (loops of unknown length): every plan replays in the simulator within budget.

References: Q. Wang, P. Moin and G. Iaccarino, SIAM J. Sci. Comput. 31(4), 2009; P. Stumm and
A. Walther, SIAM J. Sci. Comput. 32(2), 2010. The gap to the offline binomial optimum
(Griewank & Walther, ACM TOMS 26(1), 2000) is measured; the planner decides about a state one
step late (the executor tapes every step and keeps the newest tape), and the tests below show
by exhaustion that deciding before the step runs could not reach the optimum for every
n <= C(s + 2, 2), while the planner does.
"""

from __future__ import annotations

import doctest
from math import comb

import pytest

from checkpoint_ad.strategies.plans import online
from checkpoint_ad.strategies.plans.online import OnlinePlanner
from checkpoint_ad.strategies.plans.revolve import ScheduleError, optimal_evaluations, simulate_plan


def run(s: int, n: int) -> tuple[int, int]:
    planner = OnlinePlanner(s)
    plan = [a for _ in range(n) for a in planner.advance()]
    predicted = planner.evaluations(n) if n else 0
    plan += planner.finish(n)
    stats = simulate_plan(plan, n, s)
    assert stats.max_live_snapshots <= s
    return stats.evaluations, predicted


@pytest.mark.parametrize("s", [1, 2, 3, 5, 8, 13])
def test_every_online_plan_replays(s: int) -> None:
    for n in range(0, 90):
        evaluations, predicted = run(s, n)
        assert evaluations == predicted
        assert evaluations >= (optimal_evaluations(n, s) if n else 0)


def test_enough_snapshots_store_every_state_at_the_optimum() -> None:
    for s in (1, 4, 9):
        for n in range(1, s + 2):
            assert run(s, n)[0] == optimal_evaluations(n, s)


def config_evaluations(stored: tuple[int, ...], n: int, s: int) -> int:
    ends = [*stored[1:], n - 1]
    extra = sum(
        optimal_evaluations(e - b, s - i) - (e - b)
        for i, (b, e) in enumerate(zip(stored, ends))
        if e > b
    )
    return 2 * n - 1 + extra


def online_paths(s: int, first: int, last: int):
    """Every sequence of online choices for states first..last: keep the stored set, or store
    the state (in a free slot, or replacing one of the stored states after state 0)."""

    def paths(stored: tuple[int, ...], x: int):
        if x > last:
            yield ()
            return
        options = [stored] if len(stored) == s else [(*stored, x)]
        if len(stored) == s:
            options += [(*stored[:j], *stored[j + 1 :], x) for j in range(1, s)]
        for option in options:
            for rest in paths(option, x + 1):
                yield (option, *rest)

    return paths((0,), first)


def test_deciding_before_the_step_runs_cannot_be_optimal() -> None:
    # Decided before step x runs, state x's choice is in the configuration of a loop of x + 1
    # steps. For s = 2 no sequence is optimal at n = 3, 4 and 5 together (C(4, 2) = 6).
    s, best = 2, {n: optimal_evaluations(n, 2) for n in (3, 4, 5)}
    for path in online_paths(s, 1, 4):
        at = {x + 1: cfg for x, cfg in zip(range(1, 5), path)}
        assert any(config_evaluations(at[n], n, s) > best[n] for n in (3, 4, 5)), path


def test_deciding_one_step_late_can_be_and_is_optimal() -> None:
    # Decided once step x + 1 is announced, state x's choice is in the configuration of a
    # loop of x + 2 steps: then a sequence optimal for every n <= C(s + 2, 2) exists, and the
    # planner finds one.
    s, top = 2, 6
    found = False
    for path in online_paths(s, 1, top - 2):
        at = {x + 2: cfg for x, cfg in zip(range(1, top - 1), path)}
        found |= all(config_evaluations(at[n], n, s) == optimal_evaluations(n, s) for n in at)
    assert found
    for s in (2, 3, 5, 8, 13, 21):
        planner = OnlinePlanner(s)
        for n in range(1, comb(s + 2, 2) + 1):
            planner.advance()
            assert planner.evaluations(n) == optimal_evaluations(n, s), (s, n)


def worst_ratio(s: int, n_max: int, every: int) -> float:
    planner, worst = OnlinePlanner(s), 1.0
    for n in range(1, n_max + 1):
        planner.advance()
        if n % every == 0:
            worst = max(worst, planner.evaluations(n) / optimal_evaluations(n, s))
    return worst


@pytest.mark.parametrize("s", [8, 16, 32, 64])
def test_measured_gap_to_the_offline_optimum(s: int) -> None:
    # Measured with bench/online.py (every n up to 10**5): worst ratios 1.0077 (s=8), 1.0016
    # (16), 1.0005 (32), 1.0002 (64). The issue asks for 10%; this checks 1% on a shorter
    # range, every 7th n.
    assert worst_ratio(s, 20_000, 7) < 1.01


def test_misuse_is_refused() -> None:
    planner = OnlinePlanner(2)
    planner.advance()
    with pytest.raises(ScheduleError, match=r"finish\(3\) after 1 advance\(\) calls"):
        planner.finish(3)
    planner.finish(1)
    with pytest.raises(ScheduleError, match="after finish"):
        planner.advance()
    with pytest.raises(ScheduleError, match="snapshots must be >= 1"):
        OnlinePlanner(0)
    assert repr(OnlinePlanner(3)) == "OnlinePlanner(snapshots=3)"
    assert OnlinePlanner(1).advance() == []  # step 0: nothing is known about any state yet


def test_docstring_examples_run() -> None:
    result = doctest.testmod(online, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_finish_plan_packs_the_same_actions_and_counts_them() -> None:
    for s in (1, 2, 3, 6):
        for n in range(0, 70, 3):
            listed, packed = OnlinePlanner(s), OnlinePlanner(s)
            actions = [a for _ in range(n) for a in listed.advance()]
            for _ in range(n):
                packed.advance()
            actions += listed.finish(n)
            plan = packed.finish_plan(n)
            assert list(plan) == actions
            stats = simulate_plan(actions, n, s)
            assert plan.evaluations == stats.evaluations
            assert plan.max_live_snapshots == stats.max_live_snapshots
