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
fits runs its leanest plan, a value the pool cannot fit goes over, and the budget warns
(`BudgetWarning`).
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
        not run), at each loop's planned peak."""
        self.reservations[:] = [r for r in self.reservations if _holding(r[0])]
        return sum(size for _, size in self.reservations)

    def reserve(self, holders: list[Any], size: int) -> None:
        """Count `size` bytes while any executor in `holders` (weak references, added as
        the loop makes them) holds the loop's tape."""
        self.reservations.append((holders, size))

    def later(self, name: Any, pool: Any = None) -> tuple[list[PlanRows], int]:
        """A loop named `name` is about to be planned (`pool`: the budget's imperative pool,
        if it has one): the rows of the loops that followed it in the previous pass, if this
        pass has repeated that one so far (else none), and how much more than now the pool
        held at most from this loop on in that pass (values saved between and after the
        loops). With nothing held, a new pass begins."""
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
            mine.name != theirs.name for mine, theirs in zip(self.current, previous)
        ):
            return [], 0
        growth = max(p.pool_most for p in previous[at:]) - previous[at].pool_at
        return [p.table.rows for p in previous[at + 1:]], max(growth, 0)

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
                     ) -> tuple[Any, int] | None:
    """The row of `first` in the fastest combination of one row per loop (`first`, then each
    of `later`) whose peaks sum to at most `room`, and the bytes its later rows take; None if
    no combination fits. Exact: the later loops' combinations are kept as a Pareto frontier
    of (bytes, seconds), pruned as each loop is added (a few dozen points)."""
    frontier: list[tuple[int, float]] = [(0, 0.0)]
    for rows in later:
        combined = sorted((size + r.peak_tape_bytes, seconds + r.seconds)
                          for size, seconds in frontier for r in rows
                          if size + r.peak_tape_bytes <= room)
        frontier = []
        for size, seconds in combined:  # by bytes: keep each point faster than all before
            if not frontier or seconds < frontier[-1][1]:
                frontier.append((size, seconds))
        if not frontier:
            return None
    best: tuple[float, int, Any, int] | None = None
    for row in first:
        left = room - row.peak_tape_bytes
        fitting = [point for point in frontier if point[0] <= left]
        if not fitting:
            continue
        size, seconds = fitting[-1]  # the fastest of the frontier that fits
        total = row.seconds + seconds
        if best is None or (total, row.peak_tape_bytes) < best[:2]:
            best = (total, row.peak_tape_bytes, row, size)
    return None if best is None else (best[2], best[3])
