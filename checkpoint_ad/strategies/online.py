"""Online checkpointing: plans for loops whose number of steps is known only when they end.

Why: a ``while`` loop (an adaptive solver, a sampler that stops on a condition) cannot be given
a binomial plan up front. The planner is told of each step as it comes and answers with the
snapshots to take or drop now; when the loop ends it returns the reversal, and the whole
sequence is a plan that :func:`~checkpoint_ad.strategies.revolve.simulate_plan` accepts.

The rule, after P. Stumm and A. Walther, "New algorithms for optimal online checkpointing",
SIAM J. Sci. Comput. 32(2), 2010, and the dynamic checkpointing of Q. Wang, P. Moin and
G. Iaccarino, SIAM J. Sci. Comput. 31(4), 2009: with stored states ``c_0 = 0 < ... < c_k``,
segment ``i`` is later reversed with ``s - i`` snapshots, and the binomial optimum with
repetition number ``r`` is reached exactly when every segment needs at most ``r - 1``
repetitions, i.e. ``len_i <= C(s - i + r - 1, r - 1)`` (the last one counted without the
state in hand). Free slots are filled with the newest state; once all are used, a state is
snapshotted only when the last segment outgrows its bound, and the snapshot it replaces is
the first one whose two segments, merged, still fit the bound (or the shortest merge).
This is optimal while every state can be stored (``n <= s + 1``); beyond, it is a heuristic
(measured: within 15-30% of the offline optimum up to 10**5 steps for s = 8..64). In this
accounting no online rule matches the optimum for every ``n <= C(s + 2, 2)``: the tests show
it by exhaustion for s = 2 (n = 3, 4, 5).

>>> planner = OnlinePlanner(2)
>>> actions = [a for _ in range(5) for a in planner.advance()]
>>> plan = actions + planner.finish(5)
>>> from checkpoint_ad.strategies.revolve import simulate_plan, optimal_evaluations
>>> simulate_plan(plan, 5, 2).evaluations == optimal_evaluations(5, 2)
True
"""

from __future__ import annotations

import itertools
from math import comb

import numpy as np

from ..errors import ScheduleError
from .revolve import (
    _BOTH,
    Action,
    Advance,
    Free,
    Restore,
    Reverse,
    Snapshot,
    _binomial_codes,
    _count,
    _decode,
    _repetitions,
    optimal_evaluations,
)

__all__ = ["OnlinePlanner"]


class OnlinePlanner:
    """Plans the checkpoints of a loop of unknown length with at most ``snapshots`` stored.

    Call :meth:`advance` once for every step the loop takes, before it runs, and run the
    actions it returns; call :meth:`finish` with the number of steps when the loop ends and
    run the reversal it returns. The executor may run each step with its tape and drop the
    previous step's tape: the ``Advance`` of step ``i`` comes with the announcement of step
    ``i + 1``, and the last step's ``Reverse`` can reuse the tape of the forward run.

    >>> planner = OnlinePlanner(1)
    >>> planner.advance(), planner.advance()
    ([Snapshot(step=0)], [Advance(start=0, stop=1)])
    >>> planner.finish(2)
    [Reverse(step=1), Restore(step=0), Free(step=0), Reverse(step=0)]
    """

    def __init__(self, snapshots: int) -> None:
        self.snapshots = _count(snapshots, "snapshots", minimum=1)
        self.steps = 0
        self.stored: list[int] = []  # states held as snapshots, oldest first
        self.finished = False

    def __repr__(self) -> str:
        return f"OnlinePlanner(snapshots={self.snapshots})"

    def _bound(self, index: int, r: int) -> int:
        """The longest segment ``index`` may be for ``r`` repetitions overall."""
        return comb(self.snapshots - index + r - 1, r - 1)

    def advance(self) -> list[Action]:
        """The loop takes one more step (step ``self.steps``); the actions to run before it."""
        if self.finished:
            raise ScheduleError("OnlinePlanner.advance() after finish(); make a new planner")
        x = self.steps  # the state in hand once the actions ran
        self.steps += 1
        actions: list[Action] = [] if x == 0 else [Advance(x - 1, x)]
        stored, s = self.stored, self.snapshots
        if len(stored) < s:
            stored.append(x)
            return [*actions, Snapshot(x)]
        r = max(_repetitions(x + 1, s), 1)
        k = len(stored) - 1
        lengths = [b - a for a, b in itertools.pairwise([*stored, x])]
        # Move a snapshot to x as soon as two segments merged still fit their bound: the
        # earliest segments fill up to their bounds, as in the offline binomial sweep.
        drop = next(
            (j for j in range(1, k + 1) if lengths[j - 1] + lengths[j] <= self._bound(j - 1, r)),
            None,
        )
        if drop is None:
            if k == 0 or lengths[-1] <= self._bound(k, r):
                return actions  # the last segment still fits (or only state 0 is stored)
            drop = 1 + int(np.argmin(np.add(lengths[:-1], lengths[1:])))
        freed = stored.pop(drop)
        stored.append(x)
        return [*actions, Free(freed), Snapshot(x)]

    def finish(self, n_steps: int) -> list[Action]:
        """The loop ended after ``n_steps`` steps (as many as :meth:`advance` calls): the rest."""
        n = _count(n_steps, "n_steps")
        if n != self.steps or self.finished:
            raise ScheduleError(
                f"OnlinePlanner.finish({n}) after {self.steps} advance() calls"
                + (" and a finish()" if self.finished else "")
                + "; call advance() once per step and finish() once with that count"
            )
        self.finished = True
        if n == 0:
            return []
        actions: list[Action] = [Reverse(n - 1)]
        ends = [*self.stored[1:], n - 1]
        for index in range(len(self.stored) - 1, -1, -1):
            start, end = self.stored[index], ends[index]
            actions.append(Restore(start) if end > start else Free(start))
            if end > start:
                actions.extend(_segment(start, end, self.snapshots - index))
        return actions

    def evaluations(self, n_steps: int) -> int:
        """Step evaluations of the whole plan if the loop ended after ``n_steps`` (now)."""
        if n_steps != self.steps:
            raise ScheduleError("evaluations(n) needs n equal to the steps announced so far")
        ends = [*self.stored[1:], n_steps - 1]
        total = 2 * n_steps - 1 if n_steps else 0  # the forward sweep and the taped steps
        for index, (start, end) in enumerate(zip(self.stored, ends)):
            length = end - start
            if length:
                total += optimal_evaluations(length, self.snapshots - index) - length
        return total


def _segment(start: int, end: int, budget: int) -> list[Action]:
    """Reverse [start, end) from the stored, restored ``start`` within ``budget`` snapshots."""
    if end - start == 1:
        return [Free(start), Reverse(start)]
    codes, _, _ = _binomial_codes(end - start, budget)
    # The binomial plan opens with Snapshot(0); here the start is stored already.
    return [_decode(code + start * _BOTH) for code in codes[1:]]
