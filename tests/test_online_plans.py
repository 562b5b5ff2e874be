"""Online plans (loops of unknown length): every plan replays in the simulator within budget.

References: Q. Wang, P. Moin and G. Iaccarino, SIAM J. Sci. Comput. 31(4), 2009; P. Stumm and
A. Walther, SIAM J. Sci. Comput. 32(2), 2010. The gap to the offline binomial optimum
(Griewank & Walther, ACM TOMS 26(1), 2000) is measured, and the test below shows that in our
accounting no online rule can match it for every n <= C(s + 2, 2).
"""

from __future__ import annotations

import doctest
import itertools

import pytest

from checkpoint_ad.strategies import online
from checkpoint_ad.strategies.online import OnlinePlanner
from checkpoint_ad.strategies.revolve import ScheduleError, optimal_evaluations, simulate_plan


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


def test_no_online_rule_is_optimal_for_every_n_up_to_c_s_plus_2_2() -> None:
    # Every online choice for s = 2: at each state x, keep the stored set or replace one of
    # its later states by x. No sequence is optimal at n = 3, 4 and 5 together (C(4, 2) = 6).
    s, best = 2, {n: optimal_evaluations(n, 2) for n in (3, 4, 5)}

    def paths(stored: tuple[int, ...], x: int):
        if x == 5:
            yield ()
            return
        options = [stored] if len(stored) == s else [(*stored, x)]
        if len(stored) == s:
            options += [(*stored[:j], *stored[j + 1 :], x) for j in range(1, s)]
        for option in options:
            for rest in paths(option, x + 1):
                yield (option, *rest)

    for path in paths((0,), 1):
        at = {x + 1: cfg for x, cfg in zip(range(1, 5), path)}
        assert any(config_evaluations(at[n], n, s) > best[n] for n in (3, 4, 5)), path


def worst_ratio(s: int, n_max: int, every: int) -> float:
    planner, worst = OnlinePlanner(s), 1.0
    for n in range(1, n_max + 1):
        planner.advance()
        if n % every == 0:
            worst = max(worst, planner.evaluations(n) / optimal_evaluations(n, s))
    return worst


@pytest.mark.parametrize("s", [8, 16, 32, 64])
def test_measured_gap_to_the_offline_optimum(s: int) -> None:
    # Measured (n up to 10**5, every 97th n): worst ratios 1.15 (s=8), 1.20 (16), 1.26 (32),
    # 1.30 (64). The 10% target of the issue is NOT met yet; this pins today's figure.
    assert worst_ratio(s, 20_000, 97) < 1.31


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
    assert list(itertools.islice(OnlinePlanner(1).advance(), 1))


def test_docstring_examples_run() -> None:
    result = doctest.testmod(online, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
