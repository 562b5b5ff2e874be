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
need. A first pass has nothing to go by: a loop that no longer fits runs its leanest plan
and the budget warns (`BudgetWarning`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PlanRows = Sequence[Any]  # an `Estimate`'s rows: each with `peak_tape_bytes` and `seconds`


class SharedBudget:
    """One thread's loops under one budget: those still holding their tape, and the loops
    of the current and the previous pass (each as (name, rows, bytes the budget's imperative
    pool held when it was planned))."""

    def __init__(self) -> None:
        self.reservations: list[tuple[list[Any], int]] = []  # (executor refs, bytes)
        self.current: list[tuple[Any, PlanRows, int]] = []
        self.previous: list[tuple[Any, PlanRows, int]] = []

    def loops_held(self) -> int:
        """Bytes of the loops whose executors still hold their tape (alive, their backward
        not run), at each loop's planned peak."""
        self.reservations[:] = [r for r in self.reservations if _holding(r[0])]
        return sum(size for _, size in self.reservations)

    def reserve(self, holders: list[Any], size: int) -> None:
        """Count `size` bytes while any executor in `holders` (weak references, added as
        the loop makes them) holds the loop's tape."""
        self.reservations.append((holders, size))

    def later(self, name: Any) -> tuple[list[PlanRows], int]:
        """A loop named `name` is about to be planned: the rows of the loops that followed it
        in the previous pass, if this pass has repeated that one so far (else none), and how
        much more the imperative pool held by the last of them than at this one (values
        saved between the loops: a layer's input projection). With nothing held, a new
        pass begins."""
        if not self.loops_held():
            if self.current:
                self.previous = self.current
            self.current = []
        at = len(self.current)
        previous = self.previous
        if name is None or len(previous) <= at or previous[at][0] != name or any(
            mine[0] != theirs[0] for mine, theirs in zip(self.current, previous)
        ):
            return [], 0
        after = previous[at + 1:]
        growth = max((pool for _, _, pool in after), default=0) - previous[at][2]
        return [rows for _, rows, _ in after], max(growth, 0)

    def planned(self, name: Any, rows: PlanRows, pool_bytes: int) -> None:
        """The loop named `name` was planned from `rows`, the pool holding `pool_bytes`:
        part of this pass."""
        self.current.append((name, rows, pool_bytes))


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
