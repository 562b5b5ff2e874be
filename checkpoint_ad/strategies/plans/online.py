"""Online checkpointing: plans for loops whose number of steps is known only when they end.

Why: a ``while`` loop (an adaptive solver, a sampler that stops on a condition) cannot be given
a binomial plan up front. The planner is told of each step as it comes and answers with the
snapshots to take or drop now; when the loop ends it returns the reversal, and the whole
sequence is a plan that :func:`~checkpoint_ad.strategies.plans.revolve.simulate_plan` accepts.

Timing: the executor runs every step with its tape and keeps only the newest step's tape (the
plan holds one step's tape anyway). So the state a step started from is still at hand, inside
that tape, when the loop learns whether the step was the last, and the planner decides about
state ``x`` only once step ``x + 1`` is announced. Deciding one step later is what makes the
offline optimum reachable online: with the decision taken before the step runs, no rule is
optimal for every ``n <= C(s + 2, 2)`` (the tests show it by exhaustion for s = 2).

The rule. With stored states ``c_0 = 0 < ... < c_k``, segment ``i`` is later reversed with
``s - i`` snapshots, and a loop of ``n`` steps costs ``2n - 1`` plus each segment's binomial
advances. The offline optimum with repetition number ``r`` holds exactly when every segment
lies between its bounds for ``r - 1`` and ``r`` repetitions (P. Stumm and A. Walther, "New
algorithms for optimal online checkpointing", SIAM J. Sci. Comput. 32(2), 2010; the dynamic
checkpointing of Q. Wang, P. Moin and G. Iaccarino, SIAM J. Sci. Comput. 31(4), 2009, is the
same idea). The longest loop with ``r`` repetitions, ``C(s + r, s)`` steps, has its
snapshots at fixed *targets* (every segment at its upper bound). The planner fills free slots
with the newest state; once all are used, it stores the newest state when it is a target of
the current ``r`` or when the last segment outgrows its bound, and drops the non-target
snapshot whose removal costs least for a loop ending now. Measured (``bench/online.py``):
optimal for every ``n <= C(s + 2, 2)``, and within 1% of the offline optimum up to 10**5
steps for s = 8..64.

>>> planner = OnlinePlanner(2)
>>> actions = [a for _ in range(5) for a in planner.advance()]
>>> plan = actions + planner.finish(5)
>>> from checkpoint_ad.strategies.plans.revolve import simulate_plan, optimal_evaluations
>>> simulate_plan(plan, 5, 2).evaluations == optimal_evaluations(5, 2)
True
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from functools import cache, lru_cache
from math import comb

from ...errors import ScheduleError
from .multilevel import MultiLevelPlan
from .revolve import (
    _BOTH,
    _FREE,
    _RESTORE,
    _REVERSE,
    Action,
    Advance,
    DiskRestore,
    DiskSnapshot,
    Free,
    Plan,
    Restore,
    Snapshot,
    _binomial_codes,
    _count,
    _decode,
    _encode,
)

__all__ = ["OnlinePlanner", "TwoLevelOnlinePlanner"]


class OnlinePlanner:
    """Plans the checkpoints of a loop of unknown length with at most ``snapshots`` stored.

    Call :meth:`advance` once for every step the loop takes, before it runs, and run the
    actions it returns; call :meth:`finish` with the number of steps when the loop ends and
    run the reversal it returns. The actions of step ``t`` concern state ``t - 1``: the
    executor runs each step with its tape and keeps that tape until the next step is
    announced, so ``Snapshot(t - 1)`` copies the state the kept tape started from and
    ``Advance(t - 1, t)`` drops that tape; the last step's tape serves the first ``Reverse``.

    >>> planner = OnlinePlanner(1)
    >>> planner.advance(), planner.advance()
    ([], [Snapshot(step=0), Advance(start=0, stop=1)])
    >>> planner.finish(2)
    [Reverse(step=1), Restore(step=0), Free(step=0), Reverse(step=0)]
    """

    def __init__(self, snapshots: int, keep_plan: bool = True) -> None:
        """`keep_plan=False`: the actions `advance` returns are not kept (a caller that runs
        them as they come and reverses with `reversal`, a folded Python loop: a plan of every
        step would grow with the loop); `finish` and `finish_plan` then refuse."""
        self.snapshots = _count(snapshots, "snapshots", minimum=1)
        self.keep_plan = keep_plan
        self.steps = 0
        self.stored: list[int] = []  # states held as snapshots, oldest first
        self.finished = False
        # per closed segment i (all but the last): its advances at budget s - i, and at
        # s - i + 1 (what it costs once a drop before it moves it one place down)
        self._here: list[int] = []
        self._shifted: list[int] = []
        self._r = 0  # repetitions of the shortest loop still unplanned, and its reach
        self._reach = 1
        self._targets: frozenset[int] = frozenset({0})
        self._codes = array("q")  # the whole plan so far, packed as `revolve.Plan` keeps it
        self._advanced = 0  # steps the reversal will advance, once finished
        self._max_live = 0

    def __repr__(self) -> str:
        return f"OnlinePlanner(snapshots={self.snapshots})"

    def advance(self) -> list[Action]:
        """The loop takes one more step (step ``self.steps``); the actions to run before it."""
        if self.finished:
            raise ScheduleError("OnlinePlanner.advance() after finish(); make a new planner")
        t = self.steps
        self.steps += 1
        if t == 0:
            return []
        x = t - 1  # the state decided on now: the loop has at least x + 2 steps
        dropped = self._decide(x)
        actions: list[Action] = [] if dropped is None else [Free(dropped)]
        if self.stored[-1] == x:
            actions.append(Snapshot(x))
        actions.append(Advance(x, t))
        if self.keep_plan:
            self._codes.extend(_encode(action) for action in actions)
        self._max_live = max(self._max_live, len(self.stored))
        return actions

    def _decide(self, x: int) -> int | None:
        """Store state x or not; returns the snapshot dropped to make room (or None)."""
        s, stored = self.snapshots, self.stored
        while self._reach < x + 2:  # the repetitions a loop of x + 2 steps needs at least
            self._r += 1
            self._reach = comb(s + self._r, s)
            self._targets = _targets(s, self._r)
        if len(stored) < s:
            if stored:
                self._close(x - stored[-1], len(stored) - 1)
            stored.append(x)
            return None
        k = len(stored) - 1
        bound = comb(s - k + self._r - 1, self._r - 1)
        if k == 0 or (x not in self._targets and x + 1 - stored[-1] <= bound):
            return None  # the last segment still fits (or only state 0 can be stored)
        j = self._cheapest_drop(x)
        dropped = stored.pop(j)
        self._merge(j, x)
        stored.append(x)
        return dropped

    def _close(self, length: int, index: int) -> None:
        s = self.snapshots
        self._here.append(_advances(length, s - index))
        self._shifted.append(_advances(length, s - index + 1))

    def _cheapest_drop(self, x: int) -> int:
        """The stored state (not state 0, not a target if avoidable) whose drop, with x
        stored, leaves the cheapest reversal for a loop ending at x + 2 steps."""
        s, stored, k = self.snapshots, self.stored, len(self.stored) - 1
        last = x - stored[k]  # the last segment, closed at x
        here = [*self._here, _advances(last, s - k)]
        shifted = [*self._shifted, _advances(last, s - k + 1)]
        ends = [*stored[1:], x]
        targets = self._targets
        any_state = all(c in targets for c in stored[1:])  # no choice: any but state 0
        best, best_delta, gain = k, None, 0
        for j in range(k, 0, -1):  # later first: `gain` sums the moves of segments after j
            if any_state or stored[j] not in targets:
                merged = _advances(ends[j] - stored[j - 1], s - j + 1)
                delta = merged - here[j - 1] - here[j] + gain
                if best_delta is None or delta <= best_delta:
                    best, best_delta = j, delta
            gain += shifted[j] - here[j]
        return best

    def _merge(self, j: int, x: int) -> None:
        """Segments j - 1 and j become one (snapshot j dropped); the later ones move down one
        place, so each is reversed with one snapshot more: its cost there is what `_shifted`
        held for it, and only its next shift is new."""
        stored = self.stored  # stored[j] is already removed
        ends = [*stored[1:], x]
        here, shifted, s = self._here, self._shifted, self.snapshots
        moved = shifted[j + 1:]  # the closed segments after the two merged
        del here[j - 1:], shifted[j - 1:]
        self._close(ends[j - 1] - stored[j - 1], j - 1)  # the merged segment
        for i, cost in enumerate(moved, start=j):
            here.append(cost)
            shifted.append(_advances(ends[i] - stored[i], s - i + 1))
        last = len(stored) - 1  # the segment that was open, closed at x
        if last > j - 1:
            self._close(ends[last] - stored[last], last)

    def finish(self, n_steps: int) -> list[Action]:
        """The loop ended after ``n_steps`` steps (as many as :meth:`advance` calls): the rest."""
        start = len(self._codes)
        self._end(n_steps)
        return [_decode(code) for code in self._codes[start:]]

    def finish_plan(self, n_steps: int) -> Plan:
        """Like :meth:`finish`, but returns the whole plan (the actions :meth:`advance`
        returned, then the reversal) packed: a 10**6-step loop's plan stays a few MB."""
        self._end(n_steps)
        return Plan(
            recipe=f"{self!r}.finish_plan({n_steps})",
            n_steps=n_steps,
            snapshots=self.snapshots,
            advanced_steps=self._advanced,
            taped_steps=n_steps,
            max_live_snapshots=self._max_live,
            longest_tape=min(n_steps, 1),
            _codes=self._codes,
        )

    def _end(self, n_steps: int) -> None:
        n = _count(n_steps, "n_steps")
        if n != self.steps or self.finished or not self.keep_plan:
            raise ScheduleError(
                f"OnlinePlanner.finish({n}) after {self.steps} advance() calls"
                + (" and a finish()" if self.finished else "")
                + (" of a planner that keeps no plan (use reversal())"
                   if not self.keep_plan else "")
                + "; call advance() once per step and finish() once with that count"
            )
        self.finished = True
        if n == 0:
            return
        self._advanced = max(n - 1, 0)
        for part in self._reversal(n):
            self._codes.extend(part)

    def reversal(self, n_steps: int) -> Iterator[Sequence[int]]:
        """The reversal of the loop after ``n_steps`` steps (as many as :meth:`advance`
        calls), as the packed codes `finish_plan` would end with, one segment's at a time
        (a long loop's reversal is not held whole). Asked again, it gives the same."""
        n = _count(n_steps, "n_steps")
        if n != self.steps:
            raise ScheduleError(
                f"OnlinePlanner.reversal({n}) after {self.steps} advance() calls; call "
                "advance() once per step and reversal() with that count")
        self.finished = True
        return self._reversal(n) if n else iter(())

    def _reversal(self, n: int) -> Iterator[Sequence[int]]:
        yield (_REVERSE + (n - 1) * _BOTH,)
        stored = list(self.stored)
        ends = [*stored[1:], n - 1]
        for index in range(len(stored) - 1, -1, -1):
            start, end = stored[index], ends[index]
            if end == start:
                yield (_FREE + start * _BOTH,)
                continue
            if end - start == 1:
                yield (_RESTORE + start * _BOTH, _FREE + start * _BOTH,
                       _REVERSE + start * _BOTH)
                continue
            # the binomial plan of the segment opens with Snapshot(0): here the start is stored
            part, advanced, live = _binomial_codes(end - start, self.snapshots - index)
            self._advanced += advanced
            self._max_live = max(self._max_live, index + live)
            yield array("q", [_RESTORE + start * _BOTH,
                              *(code + start * _BOTH for code in part[1:])])

    def evaluations(self, n_steps: int) -> int:
        """Step evaluations of the whole plan if the loop ended after ``n_steps`` (now)."""
        if n_steps != self.steps:
            raise ScheduleError("evaluations(n) needs n equal to the steps announced so far")
        if n_steps == 0:
            return 0
        ends = [*self.stored[1:], n_steps - 1]
        total = 2 * n_steps - 1  # the forward sweep and the taped steps
        for index, (start, end) in enumerate(zip(self.stored, ends)):
            total += _advances(end - start, self.snapshots - index)
        return total


@lru_cache(maxsize=1 << 10)
def _advances(length: int, budget: int) -> int:
    """Steps advanced (re-run without a tape) to reverse ``length`` steps from their stored
    start with ``budget`` snapshots: the binomial optimum less its taped steps. Cached: the
    planner asks it for every segment at each drop, mostly for lengths asked before."""
    if length <= 1:
        return 0
    if budget == 1:  # re-advance from the one stored state for every step
        return length * (length - 1) // 2
    reach, paid = _tables(budget)
    if reach[-1] < length:  # grown as far as the lengths asked, not to MAX_STEPS: two
        with _growing:  # snapshots reach 2**30 steps at r = 46,340, 3.7 MB of ints for good
            r = len(reach) - 1
            while reach[r] < length:
                r += 1
                paid.append(comb(budget + r, budget + 1))
                reach.append(comb(budget + r, budget))  # (last: read unlocked above)
    r = bisect_left(reach, length)  # the smallest r with C(budget + r, budget) >= length
    return r * length - paid[r]


_growing = threading.Lock()  # one thread at a time grows a budget's tables


@cache
def _tables(budget: int) -> tuple[list[int], list[int]]:
    """``C(budget + r, budget)`` and ``C(budget + r, budget + 1)`` for r = 0, 1, ...: the
    planner asks for them at every step (`_advances` grows them as far as it needs)."""
    return [1], [0]


def _targets(s: int, r: int) -> frozenset[int]:
    """Where the longest loop with ``r`` repetitions keeps its snapshots: segment ``i`` at its
    upper bound ``C(s - i + r - 1, r - 1)``."""
    points, at = [0], 0
    for i in range(s - 1):
        at += comb(s - i + r - 1, r - 1)
        points.append(at)
    return frozenset(points)


class TwoLevelOnlinePlanner:
    """Online checkpointing with RAM and disk snapshots: the `OnlinePlanner` over ``snapshots
    + disk`` slots, each snapshot it takes kept in RAM while fewer than ``snapshots`` RAM
    snapshots are live, on disk otherwise (restores follow: a disk snapshot is read back).

    Why this rule: an online planner cannot weigh write and read costs against re-runs the way
    the offline H-Revolve tables do (it does not know the length), but more slots always mean
    fewer re-runs, and RAM holds at most ``snapshots``. Its step evaluations are those of
    ``OnlinePlanner(snapshots + disk)``.

    >>> planner = TwoLevelOnlinePlanner(1, disk=2)
    >>> actions = [a for _ in range(6) for a in planner.advance()]
    >>> plan = planner.finish_plan(6)
    >>> from checkpoint_ad.strategies.plans.revolve import simulate_plan
    >>> stats = simulate_plan(plan)
    >>> stats.max_live_snapshots <= 1 and stats.max_live_disk_snapshots <= 2
    True
    """

    def __init__(self, snapshots: int, disk: int) -> None:
        self.snapshots = _count(snapshots, "snapshots", minimum=1)
        self.disk = _count(disk, "disk", minimum=1)
        self.inner = OnlinePlanner(self.snapshots + self.disk)
        self._levels = _Levels(self.snapshots)

    def __repr__(self) -> str:
        return f"TwoLevelOnlinePlanner(snapshots={self.snapshots}, disk={self.disk})"

    @property
    def steps(self) -> int:
        return self.inner.steps

    def advance(self) -> list[Action]:
        """As `OnlinePlanner.advance`, with the snapshots placed on their level."""
        return [self._levels.place(a) for a in self.inner.advance()]

    def finish_plan(self, n_steps: int) -> Plan:
        """The whole plan, every snapshot and restore on its level (RAM or disk)."""
        plan = self.inner.finish_plan(n_steps)
        levels = _Levels(self.snapshots)  # the same rule again, over the whole plan
        codes = array("q", (_encode(levels.place(_decode(c))) for c in plan._codes))
        return MultiLevelPlan(
            recipe=f"{self!r}.finish_plan({n_steps})",
            n_steps=plan.n_steps,
            snapshots=self.snapshots,
            advanced_steps=plan.advanced_steps,
            taped_steps=plan.taped_steps,
            max_live_snapshots=min(plan.max_live_snapshots, self.snapshots),
            longest_tape=plan.longest_tape,
            _codes=codes,
            disk_snapshots=self.disk,
            disk_writes=levels.writes,
            disk_reads=levels.reads,
            max_live_disk_snapshots=levels.max_disk,
            exact=False,
        )


class _Levels:
    """Which level each live snapshot is on, placed as it is taken (RAM while there is room)."""

    def __init__(self, ram: int) -> None:
        self.ram = ram
        self.on_disk: dict[int, bool] = {}
        self.writes = self.reads = self.max_disk = 0

    def place(self, action: Action) -> Action:
        if isinstance(action, Snapshot):
            in_ram = sum(1 for disk in self.on_disk.values() if not disk)
            disk = in_ram >= self.ram
            self.on_disk[action.step] = disk
            if disk:
                self.writes += 1
                self.max_disk = max(self.max_disk, sum(self.on_disk.values()))
                return DiskSnapshot(action.step)
        elif isinstance(action, Restore) and self.on_disk.get(action.step):
            self.reads += 1
            return DiskRestore(action.step)
        elif isinstance(action, Free):
            self.on_disk.pop(action.step, None)
        return action
