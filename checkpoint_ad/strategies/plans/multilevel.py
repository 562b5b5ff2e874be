"""Two-level plans: RAM snapshots that are free to write and read, plus disk snapshots that cost.

Why: when the RAM budget makes binomial checkpointing re-run the loop many times, a few slower
snapshots on disk (or in host memory, or on another node) cut the re-runs, as long as what
they cost to write and read is less than the steps they save. The plan is the H-Revolve
schedule of J. Herrmann and G. Pallez (Aupy), "H-Revolve: a framework for adjoint computation
on synchronous hierarchical platforms", ACM TOMS 46(2), 2020, for two levels (the setting of
P. Stumm and A. Walther, "MultiStage approaches for optimal offline checkpointing", SIAM J.
Sci. Comput. 31(3), 2009), in the actions of ``revolve.py`` plus ``DiskSnapshot`` and
``DiskRestore``.

The recurrence (H-Revolve's Opt and Opt^bar tables of Section 3.1, with the loop counted in
``x`` reversed steps, H-Revolve's ``l = x - 1``; unit forward step, backward steps left out,
RAM writes and reads free). ``R(x)`` is the binomial optimum with ``s`` RAM snapshots
(``optimal_evaluations(x, s) - x``), the disk level has ``m`` slots, a write costs ``w`` and
a read ``r``::

    D_0(x) = R(x)
    D_m(x) = min(R(x), w + P_m(x))                      # write the start to disk, or not
    P_m(x) = min(R(x),                                   # start on disk and in hand
                 min_{1 <= j < x} j + D_{m-1}(x - j) + r + P_m(j))

``P_m`` either moves the start to RAM and reverses the segment binomially (disk free then), or
advances ``j`` steps, reverses ``[j, x)`` with one disk slot less, reads the start back and
reverses ``[0, j)``. RAM is free whenever a disk-level sub-problem starts, so leaves are
plain binomial plans. Unlimited disk (``disk=None``) uses ``m - 1 = m = infinity``.

The tables cost ``O(d * x**2)``; up to ``EXACT_STEPS`` steps (fewer past 3 disk slots) every
split is tried and the plan is the H-Revolve optimum. Longer loops put disk splits on a grid of
``ceil(n / cells)`` steps (binomial leaves stay exact), which bounds the build time; the plan
then says ``exact=False`` and its cost is an upper bound on the optimum (the tests measure the
gap). H-Revolve's own tables are the same ``O(d * n**2)`` and stop at a few thousand steps.

>>> from checkpoint_ad.strategies.plans.revolve import optimal_evaluations, simulate_plan
>>> plan = multilevel_plan(20, snapshots=2, disk=2, write_cost=2.0, read_cost=2.0)
>>> plan.cost < optimal_evaluations(20, 2) - 20  # cheaper than RAM alone
True
>>> stats = simulate_plan(plan)
>>> stats.cost(write=2.0, read=2.0) == plan.cost
True
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from math import ceil, comb, isfinite

import numpy as np

from ...errors import ScheduleError
from .revolve import (
    _ADVANCE,
    _BOTH,
    _DISK_RESTORE,
    _DISK_SNAPSHOT,
    _FIRST,
    _FREE,
    _SECOND,
    Plan,
    _binomial_codes,
    _checked_budget,
    _count,
)

__all__ = ["EXACT_STEPS", "MultiLevel", "MultiLevelPlan", "multilevel_cost", "multilevel_plan"]

EXACT_STEPS = 4096
"""The most disk-level DP cells (loop lengths) for up to 3 disk slots or unlimited disk: loops
up to this many steps get the exact optimum. Each slot past 3 costs a table, so the cells
shrink to keep the build under a second: ``3 * EXACT_STEPS // disk``, at least 128; a disk
budget of at least the cell count is as good as unlimited."""


def _cells(d: int | None) -> int:
    levels = 3 if d is None else max(d, 3)
    return max(128, 3 * EXACT_STEPS // levels)


@dataclass(frozen=True, eq=False, repr=False, slots=True)
class MultiLevelPlan(Plan):
    """A :class:`Plan` using RAM and disk snapshots, with what its disk traffic costs."""

    write_cost: float = 0.0
    read_cost: float = 0.0
    disk_writes: int = 0
    disk_reads: int = 0
    max_live_disk_snapshots: int = 0
    exact: bool = True
    """True when every disk split was tried (the H-Revolve optimum); False on a grid."""

    @property
    def cost(self) -> float:
        """Advanced steps + disk writes x write cost + disk reads x read cost (taped left out)."""
        return (
            self.advanced_steps
            + self.disk_writes * self.write_cost
            + self.disk_reads * self.read_cost
        )


@dataclass(frozen=True)
class MultiLevel:
    """The planner for two-level checkpointing: ``snapshots`` RAM slots, ``disk`` disk slots.

    Not (yet) a loop strategy; ``plan(n)`` gives the plan an executor would run.

    >>> MultiLevel(2, disk=1, write_cost=1.0, read_cost=1.0).plan(6).cost
    8.0
    """

    snapshots: int
    disk: int | None = None
    write_cost: float = 1.0
    read_cost: float = 1.0

    def __post_init__(self) -> None:
        _count(self.snapshots, "snapshots", minimum=1)
        if self.disk is not None:
            _count(self.disk, "disk")
        _cost(self.write_cost, "write_cost")
        _cost(self.read_cost, "read_cost")

    def plan(self, n_steps: int) -> MultiLevelPlan:
        return multilevel_plan(n_steps, self.snapshots, self.disk, self.write_cost, self.read_cost)


def _cost(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of forward steps, got {value!r}")
    number = float(value)
    if not isfinite(number) or number < 0:
        raise ScheduleError(f"{name} must be a finite number >= 0 (in forward steps), got {value}")
    return number


def _checked(
    n_steps: object, snapshots: object, disk: object, write_cost: object, read_cost: object
) -> tuple[int, int, int | None, float, float]:
    n, s = _checked_budget(n_steps, snapshots, "multilevel_plan")
    d = None if disk is None else _count(disk, "disk")
    return n, s, d, _cost(write_cost, "write_cost"), _cost(read_cost, "read_cost")


def _ram_advances(lengths: np.ndarray, s: int) -> np.ndarray:
    """``optimal_evaluations(x, s) - x`` for every x in ``lengths`` (x >= 0), as float64."""
    top = int(lengths.max(initial=0))
    if s == 1:
        return lengths * (lengths - 1) / 2.0
    reach = [1]  # reach[r] = C(s + r, s): the most steps r repetitions reverse
    while reach[-1] < top:
        reach.append(comb(s + len(reach), s))
    reps = np.searchsorted(np.array(reach, dtype=np.float64), lengths)
    binoms = np.array([comb(s + r, s + 1) for r in range(len(reach))], dtype=np.float64)
    return np.where(lengths > 0, reps * lengths - binoms[reps], 0.0)


class _Tables:
    """H-Revolve's tables for one (n, s, d, w, r), over the lengths the plan can meet.

    Lengths are ``k * grid`` (family 0) and ``k * grid + rem`` (family 1, when rem > 0):
    splits are multiples of ``grid``, so a sub-problem of family f splits into a family-f
    right part and a family-0 left part. ``grid == 1`` tries every split.
    """

    def __init__(self, n: int, s: int, d: int | None, w: float, r: float) -> None:
        self.w, self.r = w, r
        cells = _cells(d)
        if d is not None and d >= n:
            d, cells = None, _cells(None)  # a slot per state is as good as unlimited
        elif d is not None and d >= cells:
            # Disk-level positions are multiples of the grid, at most cells + 1 of them: with
            # cells = d - 1 the unlimited table never holds more than d disk snapshots.
            d, cells = None, min(_cells(None), d - 1)
        self.grid = max(1, ceil(n / cells))
        self.disk = d  # the budget the tables were made for (None once as good as unlimited)
        self.rem = n % self.grid
        self.cells = n // self.grid
        k = np.arange(self.cells + 1)
        self.families = [k * self.grid] + ([k * self.grid + self.rem] if self.rem else [])
        self.ram = [_ram_advances(x, s) for x in self.families]
        # Per disk budget m (None: unlimited): per family, (P_m, split cells, writes to disk).
        self.levels: dict[int | None, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        if d is None:
            self.top: int | None = None
            self.levels[None] = self._level(None)
            return
        below = list(self.ram)  # D_0 = R
        self.top = 0
        for m in range(1, d + 1):
            level = self._level(below)
            totals = [np.where(disk, w + p, ram) for (p, _, disk), ram in zip(level, self.ram)]
            self.levels[m] = level
            self.top = m
            if all(np.array_equal(a, b) for a, b in zip(totals, below)):
                break  # D_m == D_{m-1}: more disk slots change nothing
            below = totals

    def _level(
        self, below: list[np.ndarray] | None
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """P_m, its splits and D_m's choice for each family, given D_{m-1} (None: D_m itself)."""
        g, w, r = self.grid, self.w, self.r
        level = []
        left = None  # family 0's P_m, which every left part uses
        for family, ram in enumerate(self.ram):
            best = ram.copy()
            splits = np.zeros(len(ram), dtype=np.int64)
            right = below[family] if below is not None else ram.copy()  # D_{m-1}, or D_m so far
            lefts = best if family == 0 else left
            first = 2 if family == 0 else 1  # family 0 needs a right part of >= 1 cell
            for k in range(first, len(ram)):
                cells = np.arange(1, k - first + 2)
                trial = cells * g + r + right[k - cells] + lefts[cells]
                at = int(np.argmin(trial))
                if trial[at] < best[k]:
                    best[k], splits[k] = trial[at], cells[at]
                if below is None:
                    right[k] = min(ram[k], w + best[k])
            if family == 0:
                left = best
            level.append((best, splits, w + best < ram))
        return level

    def where(self, length: int) -> tuple[int, int]:
        family = 1 if self.rem and length % self.grid == self.rem else 0
        return family, length // self.grid

    def total(self, length: int, m: int | None) -> float:
        """D_m(length): the cost of reversing ``length`` steps from the start in hand."""
        family, k = self.where(length)
        if m == 0:
            return float(self.ram[family][k])
        p, _, disk = self.levels[self._key(m)][family]
        return float(self.w + p[k] if disk[k] else self.ram[family][k])

    def _key(self, m: int | None) -> int | None:
        return None if self.top is None else min(m, self.top)  # type: ignore[type-var]

    def split(self, length: int, m: int | None) -> int:
        """P_m's first advance for ``length`` steps, or 0 to move the start to RAM."""
        family, k = self.where(length)
        return int(self.levels[self._key(m)][family][1][k]) * self.grid

    def writes(self, length: int, m: int | None) -> bool:
        """Whether D_m writes the start of ``length`` steps to disk."""
        if m == 0:
            return False
        family, k = self.where(length)
        return bool(self.levels[self._key(m)][family][2][k])


def multilevel_cost(
    n_steps: int, snapshots: int, disk: int | None, write_cost: float, read_cost: float
) -> float:
    """The cost of :func:`multilevel_plan` without building it (the optimum when exact).

    >>> multilevel_cost(10, 1, None, 0.0, 0.0)  # free disk: as good as 9 RAM snapshots
    9.0
    """
    n, s, d, w, r = _checked(n_steps, snapshots, disk, write_cost, read_cost)
    if n < 2:
        return 0.0
    return _Tables(n, s, d, w, r).total(n, d)


def multilevel_plan(
    n_steps: int,
    snapshots: int,
    disk: int | None = None,
    write_cost: float = 1.0,
    read_cost: float = 1.0,
) -> MultiLevelPlan:
    """The H-Revolve plan for ``snapshots`` RAM and ``disk`` disk slots (None: unlimited).

    Costs are in forward steps; ``plan.cost`` is advanced steps plus disk traffic, which
    :meth:`PlanStats.cost` measures the same way. See the module docstring for the
    recurrence; the plan is optimal among all plans when ``plan.exact``.

    >>> plan = multilevel_plan(3, snapshots=1, disk=1, write_cost=0.5, read_cost=0.0)
    >>> list(plan)  # doctest: +NORMALIZE_WHITESPACE
    [DiskSnapshot(step=0), Advance(start=0, stop=1), Snapshot(step=1),
     Advance(start=1, stop=2), Reverse(step=2), Restore(step=1), Free(step=1), Reverse(step=1),
     DiskRestore(step=0), Free(step=0), Reverse(step=0)]
    >>> plan.cost
    2.5
    """
    n, s, d, w, r = _checked(n_steps, snapshots, disk, write_cost, read_cost)
    recipe = (
        f"multilevel_plan(n_steps={n}, snapshots={s}, disk={d}, write_cost={w!r}, read_cost={r!r})"
    )
    tables = _Tables(n, s, d, w, r) if n > 1 else None
    build = _Builder(s, tables)
    if tables is not None:
        build.run(n, tables.disk)
    else:
        build.leaf(0, n)
    return MultiLevelPlan(
        recipe=recipe,
        n_steps=n,
        snapshots=s,
        advanced_steps=build.advanced,
        taped_steps=n,
        max_live_snapshots=build.max_live,
        longest_tape=min(n, 1),
        _codes=build.codes,
        disk_snapshots=d,
        write_cost=w,
        read_cost=r,
        disk_writes=build.writes,
        disk_reads=build.reads,
        max_live_disk_snapshots=build.max_disk,
        exact=tables is None or tables.grid == 1,
    )


class _Builder:
    """Writes the packed actions of the plan the tables chose, on an explicit stack."""

    def __init__(self, s: int, tables: _Tables | None) -> None:
        self.s, self.tables = s, tables
        self.codes = array("q")
        self.advanced = self.writes = self.reads = 0
        self.max_live = self.max_disk = self.disk_live = 0
        self.leaves: dict[int, tuple[np.ndarray, int, int]] = {}

    def leaf(self, pos: int, length: int) -> None:
        """Reverse [pos, pos + length) binomially in RAM, from state ``pos`` in hand."""
        if length not in self.leaves:
            codes, advanced, live = _binomial_codes(length, self.s)
            self.leaves[length] = (np.frombuffer(codes, dtype=np.int64), advanced, live)
        codes, advanced, live = self.leaves[length]
        self.codes.frombytes((codes + pos * _BOTH).tobytes())
        self.advanced += advanced
        self.max_live = max(self.max_live, live)

    def run(self, n: int, d: int | None) -> None:
        tables = self.tables
        assert tables is not None
        # Tasks: (on_disk, pos, length, m). on_disk False: D_m from state pos in hand;
        # True: P_m with pos in hand and on disk (a read, if needed, is already written).
        stack: list[tuple[bool, int, int, int | None, bool]] = [(False, 0, n, d, False)]
        while stack:
            on_disk, pos, length, m, read_first = stack.pop()
            if read_first:
                self.codes.append(_DISK_RESTORE + pos * _BOTH)
                self.reads += 1
            if not on_disk:
                if tables.writes(length, m):
                    self.codes.append(_DISK_SNAPSHOT + pos * _BOTH)
                    self.writes += 1
                    self.disk_live += 1
                    self.max_disk = max(self.max_disk, self.disk_live)
                    stack.append((True, pos, length, m, False))
                else:
                    self.leaf(pos, length)
                continue
            j = tables.split(length, m)
            if j == 0:  # the last use of the disk snapshot: move the start to RAM
                self.codes.append(_FREE + pos * _BOTH)
                self.disk_live -= 1
                self.leaf(pos, length)
                continue
            self.codes.append(_ADVANCE + pos * _FIRST + (pos + j) * _SECOND)
            self.advanced += j
            below = None if m is None else m - 1
            stack.append((True, pos, j, m, True))
            stack.append((False, pos + j, length - j, below, False))
