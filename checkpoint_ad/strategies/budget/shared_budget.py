"""One budget, several loops: what a `Budget` knows of the loops it planned in one thread.

Why: loops run one after another (the layers of a stacked RNN, an encoder then a decoder)
each hold their tape until the backward sweep reaches them, so the second is planned while
the first still holds its bytes. Planned alone, each took the whole budget, and the program's
tape peaked at the sum (a two-layer RNN under a 1 MiB budget: 1.6 MiB). Here each planned
loop is counted at its planned peak while its executors hold its tape (`reserve`), a loop is
planned in what is left, and the loops of one *pass* (from a loop planned with nothing held
until all are released: one forward of a training step) are remembered, so that the next
pass plans each loop together with the loops that followed it (`fastest_together`): the
fastest combination whose peaks fit, rather than the first loop taking what the later ones
need. Values the budget's imperative pool saves between and after the loops (a layer's
input projection, the loss) are remembered too, as how much the pool grew while each loop
held its tape, and left room for. A first pass has nothing to go by: a loop that no longer
fits runs a lean plan (`budget.FIRST_PASS_SLACK`), a value the pool cannot fit goes over,
and the budget warns (`BudgetWarning`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PlanRows = Sequence[Any]  # an `Estimate`'s rows: each with `peak_tape_bytes` and `seconds`


class _Planned:
    """A loop of a pass: its name, its table (an `Estimate`: its plans and the chosen one),
    and the bytes the budget's pool held as it was planned (`pool_at`) and at most until the
    next loop or pass (`pool_most`)."""

    __slots__ = ("name", "pool_at", "pool_most", "table")

    def __init__(self, name: Any, table: Any, pool_at: int) -> None:
        self.name, self.table, self.pool_at, self.pool_most = name, table, pool_at, pool_at


class SharedBudget:
    """One thread's loops under one budget: those still holding their tape, and the loops
    of the current and the previous pass."""

    def __init__(self) -> None:
        self.reservations: list[tuple[list[Any], int]] = []  # (executor refs, bytes)
        self.current: list[_Planned] = []
        self.previous: list[_Planned] = []

    def last_pass(self) -> tuple[Any, ...]:
        """The tables of the loops of the current pass, or of the last one if none is open."""
        return tuple(p.table for p in (self.current or self.previous))

    def loops_held(self) -> int:
        """Bytes of the loops whose executors still hold their tape (alive, their backward
        not run), at each loop's planned peak. (The eviction pool asks on every saved
        value: none held is the quick case.)"""
        if not self.reservations:
            return 0
        self.reservations[:] = [r for r in self.reservations if _holding(r[0])]
        return sum(size for _, size in self.reservations)

    def reserve(self, holders: list[Any], size: int) -> None:
        """Count `size` bytes while any executor in `holders` (weak references, added as
        the loop makes them) holds the loop's tape."""
        self.reservations.append((holders, size))

    def later(self, name: Any, pool: Any = None) -> tuple[list[PlanRows], list[int]]:
        """A loop named `name` is about to be planned (`pool`: the budget's imperative pool,
        if it has one): the rows of the loops that followed it in the previous pass, if this
        pass has repeated that one so far (else none), and for this loop and each of those,
        how much more than as this one was planned the pool held at most while it was the
        newest loop (values saved between and after the loops: a layer's input projection,
        the loss). With nothing held, a new pass begins."""
        if self.current and pool is not None:  # how far the pool grew since the last loop
            last = self.current[-1]
            last.pool_most = max(last.pool_most, pool.peak_since_mark)
        if not self.loops_held():
            if self.current:
                self.previous = self.current
            self.current = []
        at = len(self.current)
        previous = self.previous
        if name is None or len(previous) <= at or previous[at].name != name or any(
            mine.name is None or mine.name != theirs.name
            for mine, theirs in zip(self.current, previous)
        ):
            return [], []
        base = previous[at].pool_at
        extras = [max(p.pool_most - base, 0) for p in previous[at:]]
        return [p.table.rows for p in previous[at + 1:]], extras

    def planned(self, name: Any, table: Any, pool: Any = None) -> None:
        """The loop named `name` was planned as `table` says: part of this pass (the pool's
        growth is watched from now)."""
        self.current.append(_Planned(name, table, pool.held_bytes if pool is not None else 0))
        if pool is not None:
            pool.mark()


def _holding(holders: list[Any]) -> bool:
    for ref in holders:
        executor = ref()
        if executor is not None and not executor.consumed:
            return True
    return False


def fastest_together(first: PlanRows, later: list[PlanRows], room: int,
                     extras: Sequence[int] = ()) -> tuple[Any, int] | None:
    """The row of `first` in the fastest combination of one row per loop (`first`, then each
    of `later`) that fits, and the bytes its later rows take; None if none fits.

    The loops hold their tape until the backward sweep, so while loop j runs (and until the
    next is planned) loops 0..j are held together, beside `extras[j]` bytes of other values
    (what a budget's pool saved by then; 0 where not given): each such prefix must fit in
    `room`. Exact: the combinations so far are kept as a Pareto frontier of (bytes,
    seconds), pruned as each loop is added; what the next loops may take depends only on
    the bytes so far."""
    def extra(j: int) -> int:
        return extras[j] if j < len(extras) else 0

    states = [(r.peak_tape_bytes, r.seconds, r) for r in first
              if r.peak_tape_bytes + extra(0) <= room]
    for j, rows in enumerate(later, start=1):
        limit = room - extra(j)
        states = [(size + r.peak_tape_bytes, seconds + r.seconds, head)
                  for size, seconds, head in _frontier(states) for r in rows
                  if size + r.peak_tape_bytes <= limit]
    if not states:
        return None
    size, _, head = min(states, key=lambda state: (state[1], state[0]))
    return head, size - head.peak_tape_bytes


def least_together(first: PlanRows, later: list[PlanRows], extras: Sequence[int] = ()) -> int:
    """The least `room` in which `fastest_together` finds a combination: every loop's
    leanest plan, the largest of the prefixes' needs."""
    need, most = 0, 0
    for j, rows in enumerate([first, *later]):
        need += min(r.peak_tape_bytes for r in rows)
        most = max(most, need + (extras[j] if j < len(extras) else 0))
    return most


def _frontier(states: list[tuple[int, float, Any]]) -> list[tuple[int, float, Any]]:
    """The states no other beats in both bytes and seconds, by bytes."""
    kept: list[tuple[int, float, Any]] = []
    for state in sorted(states, key=lambda state: (state[0], state[1])):
        if not kept or state[1] < kept[-1][1]:
            kept.append(state)
    return kept
