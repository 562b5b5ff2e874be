"""Two-level (RAM + disk) plans: every plan replays in the simulator at the H-Revolve optimum.

H-Revolve: J. Herrmann and G. Pallez (Aupy), ACM TOMS 46(2), 2020; two-level setting of
P. Stumm and A. Walther, SIAM J. Sci. Comput. 31(3), 2009. The reference is the
``checkpoint_schedules`` package (firedrake), whose ``HRevolve`` schedule we replay: its
``Forward`` actions include the taped forward of each step (``write_adj_deps``), so its
forward steps are our advanced + ``n``; with unit forward and backward costs its makespan is
our ``cost`` + ``n``. The recurrence itself is checked against an exhaustive search.
"""

from __future__ import annotations

import doctest
import heapq
import itertools
import re

import pytest

from checkpoint_ad.strategies.plans import multilevel
from checkpoint_ad.strategies.plans.multilevel import (
    MultiLevel,
    MultiLevelPlan,
    multilevel_cost,
    multilevel_plan,
)
from checkpoint_ad.strategies.plans.revolve import (
    Advance,
    DiskRestore,
    DiskSnapshot,
    Free,
    PlanInvariantError,
    Reverse,
    ScheduleError,
    binomial_plan,
    optimal_evaluations,
    simulate_plan,
)

checkpoint_schedules = pytest.importorskip("checkpoint_schedules")
from checkpoint_schedules import HRevolve, StorageType  # noqa: E402
from checkpoint_schedules import schedule as cs  # noqa: E402

COSTS = [(2.0, 2.0), (0.5, 1.5), (3.0, 0.0), (0.0, 4.0)]


def check(n: int, s: int, d: int | None, w: float, r: float) -> float:
    plan = multilevel_plan(n, s, d, w, r)
    stats = simulate_plan(plan)
    assert stats.max_live_snapshots == plan.max_live_snapshots <= s
    assert d is None or stats.max_live_disk_snapshots <= d
    assert (stats.disk_snapshots_taken, stats.disk_restores) == (plan.disk_writes, plan.disk_reads)
    assert stats.advanced_steps == plan.advanced_steps
    assert stats.taped_steps == n
    assert stats.cost(1.0, w, r) == pytest.approx(plan.cost)
    return plan.cost


def hrevolve_cost(n: int, s: int, d: int, w: float, r: float) -> tuple[float, float]:
    """Our cost of checkpoint_schedules' HRevolve schedule, and its makespan (uf = ub = 1)."""
    forward = taped = writes = reads = 0
    for action in HRevolve(n, s, d, 1, 1, w, r):
        if isinstance(action, cs.Forward):
            forward += len(action)
            taped += action.write_adj_deps
            writes += action.write_ics and action.storage == StorageType.DISK
        elif isinstance(action, (cs.Copy, cs.Move)):
            reads += action.args[1] == StorageType.DISK
        elif isinstance(action, cs.Reverse):
            assert action.args[0] - action.args[1] == 1
    assert taped == n  # one taped forward per reversed step
    advanced = forward - n
    return advanced + w * writes + r * reads, advanced * 1 + n * 1 + w * writes + r * reads


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_plans_cost_the_hrevolve_optimum(s: int) -> None:
    for n in [2, 3, 4, 7, 12, 20, 33, 60]:
        for d in [0, 1, 2, 3, None]:
            for w, r in COSTS:
                ours = check(n, s, d, w, r)
                theirs, makespan = hrevolve_cost(n, s, n if d is None else d, w, r)
                assert ours == pytest.approx(theirs), (n, s, d, w, r)
                assert makespan == pytest.approx(ours + n)


def brute_force(n: int, s: int, d: int | None, w: float, r: float) -> float:
    """Dijkstra over every plan of the two-level model: (next step to reverse, state in hand,
    RAM snapshots, disk snapshots), with each action's cost; no structure assumed."""
    start = (n - 1, 0, frozenset(), frozenset())
    best = {start: 0.0}
    heap, tie = [(0.0, 0, start)], itertools.count()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        t, hand, ram, disk = state
        if t < 0:
            return cost
        moves = []
        if 0 <= hand < t:
            moves.append((1.0, (t, hand + 1, ram, disk)))
        if hand == t:
            keep = frozenset(x for x in ram if x < t), frozenset(x for x in disk if x < t)
            moves.append((0.0, (t - 1, -1, *keep)))
        if hand >= 0 and hand not in ram | disk:
            if len(ram) < s:
                moves.append((0.0, (t, hand, ram | {hand}, disk)))
            if d is None or len(disk) < d:
                moves.append((w, (t, hand, ram, disk | {hand})))
        for x in ram:
            moves += [(0.0, (t, x, ram, disk)), (0.0, (t, hand, ram - {x}, disk))]
        for x in disk:
            moves += [(r, (t, x, ram, disk)), (0.0, (t, hand, ram, disk - {x}))]
        for step, nxt in moves:
            if cost + step < best.get(nxt, float("inf")) - 1e-12:
                best[nxt] = cost + step
                heapq.heappush(heap, (cost + step, next(tie), nxt))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("d", [0, 1, 2, None])
def test_recurrence_is_the_optimum_of_every_plan(d: int | None) -> None:
    # Exhaustive search over all two-level plans (not only H-Revolve's shape): n <= 6.
    for n in range(1, 7):
        for s in (1, 2):
            for w, r in [*COSTS, (1.0, 0.5)]:
                assert multilevel_cost(n, s, d, w, r) == brute_force(n, s, d, w, r), (n, s, d)
                assert check(n, s, d, w, r) == multilevel_cost(n, s, d, w, r)


def test_free_disk_is_more_ram_and_costly_disk_is_unused() -> None:
    for n in (5, 17, 40):
        for s, d in ((1, 2), (2, 3)):
            assert check(n, s, d, 0.0, 0.0) == optimal_evaluations(n, s + d) - n
            plan = multilevel_plan(n, s, d, 1e9, 1e9)
            assert plan == binomial_plan(n, s)
            assert plan.disk_writes == 0


def test_a_small_plan_by_hand() -> None:
    plan = multilevel_plan(3, 1, 1, 0.5, 0.0)
    assert [a for a in plan if isinstance(a, (DiskSnapshot, DiskRestore))] == [
        DiskSnapshot(0),
        DiskRestore(0),
    ]
    assert plan[-2:] == (Free(0), Reverse(0))
    assert (plan.cost, plan.disk_writes, plan.disk_reads, plan.exact) == (2.5, 1, 1, True)


def test_long_loops_build_fast_and_replay() -> None:
    for args in [(10**6, 4, 3, 2.0, 2.0), (10**6, 16, None, 1.0, 1.0), (10**6, 8, 20, 1.0, 1.0)]:
        plan = multilevel_plan(*args)  # build time: bench/planning.py (timed there, not here)
        assert not plan.exact
        assert plan.cost < optimal_evaluations(10**6, args[1]) - 10**6
    stats = simulate_plan(multilevel_plan(20_000, 3, 2, 2.0, 2.0))
    assert stats.max_live_disk_snapshots <= 2


def test_grid_gap_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past EXACT_STEPS, disk splits sit on a grid; measure what that costs against the exact
    # tables on loops where both can be built.
    exact = {
        args: multilevel_cost(*args) for args in [(1500, 3, 2, 2.0, 2.0), (1500, 2, 3, 1.0, 1.0)]
    }
    monkeypatch.setattr(multilevel, "EXACT_STEPS", 100)
    for args, best in exact.items():
        plan = multilevel_plan(*args)
        assert not plan.exact
        assert best <= plan.cost <= 1.02 * best, (args, plan.cost / best)
        assert simulate_plan(plan).cost(1.0, args[3], args[4]) == plan.cost


def test_disk_budget_as_big_as_the_grid_is_kept() -> None:
    plan = multilevel_plan(100_000, 8, 200, 1.0, 1.0)
    assert simulate_plan(plan).max_live_disk_snapshots <= 200


def test_multilevel_planner_object() -> None:
    planner = MultiLevel(2, disk=1, write_cost=1.0, read_cost=1.0)
    assert planner == MultiLevel(2, 1, 1.0, 1.0)
    assert repr(planner) == "MultiLevel(snapshots=2, disk=1, write_cost=1.0, read_cost=1.0)"
    plan = planner.plan(6)
    assert isinstance(plan, MultiLevelPlan)
    assert repr(plan) == (
        "multilevel_plan(n_steps=6, snapshots=2, disk=1, write_cost=1.0, read_cost=1.0)"
    )
    assert eval(repr(plan), vars(multilevel)) == plan
    assert multilevel_plan(0, 1).n_steps == 0 and list(multilevel_plan(1, 1)) == [Reverse(0)]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: multilevel_plan(5, 0, 2), ScheduleError, "at least one snapshot"),
        (lambda: multilevel_plan(5, 1, -1), ScheduleError, "disk must be >= 0"),
        (lambda: multilevel_plan(5, 1, 1, -1.0), ScheduleError, "write_cost must be a finite"),
        (lambda: multilevel_plan(5, 1, 1, 1.0, float("nan")), ScheduleError, "read_cost"),
        (lambda: multilevel_plan(5, 1, 1, "2"), TypeError, "write_cost must be a number"),
        (lambda: MultiLevel(0), ScheduleError, "snapshots must be >= 1"),
        (lambda: MultiLevel(1, disk=2.5), TypeError, "disk must be an int"),
        (lambda: MultiLevel(1, read_cost=True), TypeError, "read_cost must be a number"),
    ],
)
def test_bad_arguments(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_simulator_checks_the_disk() -> None:
    def broken(plan: list, disk: int | None) -> PlanInvariantError:
        with pytest.raises(PlanInvariantError) as info:
            simulate_plan(plan, 3, 1, disk=disk)
        return info.value

    two = [DiskSnapshot(0), Advance(0, 1), DiskSnapshot(1)]
    assert broken(two, 1).invariant == "disk-limit"
    assert broken([DiskRestore(0)], 1).invariant == "snapshot-stored"
    assert broken([DiskSnapshot(0), DiskSnapshot(0)], 2).invariant == "no-overwrite"
    assert broken([DiskSnapshot(0)], 0).invariant == "disk-limit"
    assert broken([DiskSnapshot(0), Advance(0, 2), Reverse(2)], None).invariant == "complete"
    assert repr(DiskSnapshot(3)) == "DiskSnapshot(step=3)"
    assert repr(DiskRestore(3)) == "DiskRestore(step=3)"


def test_docstring_examples_run() -> None:
    result = doctest.testmod(
        multilevel, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0
