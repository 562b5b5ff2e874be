"""Checkpointing plans for reversing an unrolled loop: binomial (Revolve), periodic, store-all.

Why plans: deciding *which* states to keep is pure combinatorics, while keeping them is the
engine's business. A plan is a sequence of small immutable actions that an executor replays
against real states, so every plan can be checked by :func:`simulate_plan` before a step runs.

The setting: a loop of ``n_steps`` steps, where step ``i`` maps state ``i`` to state ``i + 1``
and state 0 is the initial carry, which the executor holds in hand when the plan starts. To
reverse the loop the executor needs state ``i`` in hand for ``i = n_steps - 1, ..., 0`` in turn.
A *snapshot* is a stored copy of a state; the state in hand is not a snapshot.

Actions and what the executor does for each:

=========================  ===================================================================
``Snapshot(step)``         store the state in hand, which is state ``step``, as a snapshot
``Advance(start, stop)``   the state in hand is ``start``; run steps ``start..stop-1`` without
                           a tape; the state in hand becomes ``stop``
``Restore(step)``          the state in hand becomes the snapshot of ``step`` (which stays)
``Free(step)``             drop the snapshot of ``step``
``Reverse(step)``          the state in hand is ``step``; run step ``step`` with a tape and
                           pull the adjoint of state ``step + 1`` back to state ``step``; the
                           state in hand is consumed
``ReverseSegment(a, b)``   the state in hand is ``a``; run steps ``a..b-1`` with one tape and
                           pull the adjoint of state ``b`` back to state ``a``; consumed
``DiskSnapshot(step)``     like ``Snapshot``, but to the second level (disk), at a write cost
``DiskRestore(step)``      like ``Restore``, from the disk snapshot, at a read cost
=========================  ===================================================================

Every plan reverses each step exactly once and frees every snapshot it takes. A snapshot is
freed right after the restore that is its last use, so it does not sit next to the tape.

>>> plan = binomial_plan(4, snapshots=2)
>>> plan.evaluations == optimal_evaluations(4, 2)
True
>>> simulate_plan(plan).max_live_snapshots <= 2
True
"""

from __future__ import annotations

import functools
import operator
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any, ClassVar, overload

import numpy as np

from ...errors import PlanInvariantError, ScheduleError

__all__ = [
    "Action",
    "Snapshot",
    "Advance",
    "Restore",
    "Free",
    "Reverse",
    "ReverseSegment",
    "DiskSnapshot",
    "DiskRestore",
    "Plan",
    "PlanStats",
    "ScheduleError",
    "PlanInvariantError",
    "MAX_STEPS",
    "binomial_plan",
    "periodic_plan",
    "store_all_plan",
    "optimal_evaluations",
    "simulate_plan",
]


# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Action:
    """Base class of plan actions; an executor dispatches on the concrete type."""


@dataclass(frozen=True, slots=True)
class Snapshot(Action):
    """Store the state in hand, which is state ``step``, as a snapshot."""

    step: int


@dataclass(frozen=True, slots=True)
class Advance(Action):
    """Run steps ``start..stop-1`` without a tape, from state ``start`` to state ``stop``."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Restore(Action):
    """Take the snapshot of state ``step`` in hand; the snapshot stays stored."""

    step: int


@dataclass(frozen=True, slots=True)
class Free(Action):
    """Drop the snapshot of state ``step``; it is never needed again."""

    step: int


@dataclass(frozen=True, slots=True)
class Reverse(Action):
    """Run step ``step`` with a tape from the state in hand and back-propagate through it."""

    step: int


@dataclass(frozen=True, slots=True)
class ReverseSegment(Action):
    """Run steps ``start..stop-1`` with one tape from state ``start`` and back-propagate."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class DiskSnapshot(Action):
    """Write the state in hand, which is state ``step``, to the second storage level (disk).

    Multi-level plans (see ``multilevel.py``) use it; a disk write costs ``write_cost`` in
    units of one step. ``Free(step)`` drops the snapshot of ``step`` on whichever level holds
    it (a state is held on one level at a time).
    """

    step: int


@dataclass(frozen=True, slots=True)
class DiskRestore(Action):
    """Read the disk snapshot of state ``step`` into hand; the disk snapshot stays stored."""

    step: int


# Plans hold millions of actions, so they are stored packed, one int64 each:
# ``kind + first * _FIRST + second * _SECOND`` with 30 bits per step field. A one-step action
# repeats its step in the second field, so that adding ``pos * _BOTH`` to every code of a
# sub-plan moves it ``pos`` steps along the loop; the binomial planner reuses sub-plans that way.
_KIND_BITS = 3
_STEP_BITS = 30
_KIND_MASK = (1 << _KIND_BITS) - 1
_STEP_MASK = (1 << _STEP_BITS) - 1
_FIRST = 1 << _KIND_BITS
_SECOND = 1 << (_KIND_BITS + _STEP_BITS)
_BOTH = _FIRST + _SECOND
MAX_STEPS = _STEP_MASK
"""The longest loop a plan can describe (2**30 - 1 steps), a limit of the packed storage."""

_SNAPSHOT, _ADVANCE, _RESTORE, _FREE, _REVERSE, _REVERSE_SEGMENT = range(6)
_DISK_SNAPSHOT, _DISK_RESTORE = 6, 7  # the last two kinds that fit in _KIND_BITS
_DECODERS = (
    lambda first, second: Snapshot(first),
    Advance,
    lambda first, second: Restore(first),
    lambda first, second: Free(first),
    lambda first, second: Reverse(first),
    ReverseSegment,
    lambda first, second: DiskSnapshot(first),
    lambda first, second: DiskRestore(first),
)


_KINDS = {Snapshot: _SNAPSHOT, Advance: _ADVANCE, Restore: _RESTORE, Free: _FREE,
          Reverse: _REVERSE, ReverseSegment: _REVERSE_SEGMENT, DiskSnapshot: _DISK_SNAPSHOT,
          DiskRestore: _DISK_RESTORE}


def _encode(action: Action) -> int:
    """The packed code of one action (the inverse of `_decode`)."""
    if isinstance(action, (Advance, ReverseSegment)):
        first, second = action.start, action.stop
    else:
        first = second = action.step  # type: ignore[attr-defined]
    return _KINDS[type(action)] + first * _FIRST + second * _SECOND


_SECOND_SHIFT = _KIND_BITS + _STEP_BITS


def plan_codes(actions: Sequence[Action]) -> Sequence[int]:
    """The packed code of each action (kind, first step, second step; see `_decode`): a
    `Plan`'s own, read in place, or those of any other sequence of actions. An executor that
    walks a plan reads these: building each action object costs more than a small step's
    bookkeeping."""
    codes = getattr(actions, "_codes", None)
    return codes if codes is not None else array("q", map(_encode, actions))


def split_code(code: int) -> tuple[int, int, int]:
    """(kind, first step, second step) of one packed action."""
    return code & _KIND_MASK, (code >> _KIND_BITS) & _STEP_MASK, code >> _SECOND_SHIFT


def _decode(code: int) -> Action:
    kind, first, second = split_code(code)
    return _DECODERS[kind](first, second)


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, slots=True)
class Plan(Sequence[Action]):
    """An immutable sequence of actions that reverses a loop of ``n_steps`` steps.

    Made by :func:`binomial_plan`, :func:`periodic_plan` or :func:`store_all_plan`; it prints
    as the call that made it. Two plans are equal when they do the same actions for the same
    loop, whatever budget they were asked for. Actions are kept packed and built on access.

    >>> plan = binomial_plan(3, snapshots=1)
    >>> plan
    binomial_plan(n_steps=3, snapshots=1)
    >>> len(plan), plan.evaluations, plan[1]
    (9, 6, Advance(start=0, stop=2))
    """

    recipe: str
    """The call that made the plan, e.g. ``binomial_plan(n_steps=10, snapshots=3)``."""
    n_steps: int
    snapshots: int
    """The snapshot budget the plan was made for (never exceeded)."""
    advanced_steps: int
    """Step evaluations without a tape (``Advance``), i.e. forward work spent on recomputing."""
    taped_steps: int
    """Step evaluations with a tape (``Reverse`` / ``ReverseSegment``); always ``n_steps``."""
    max_live_snapshots: int
    """The most snapshots stored at one time while the plan runs."""
    longest_tape: int
    """The most steps recorded on one tape (1 for binomial plans)."""
    _codes: array = field(repr=False)
    """The packed actions (see the module source); read-only by convention."""
    disk_snapshots: int | None = 0
    """The disk snapshot budget of a multi-level plan (None: unlimited); 0 for one level."""

    @property
    def evaluations(self) -> int:
        """All step evaluations the plan costs: advances plus taped steps."""
        return self.advanced_steps + self.taped_steps

    def __len__(self) -> int:
        return len(self._codes)

    @overload
    def __getitem__(self, index: int) -> Action: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Action, ...]: ...

    def __getitem__(self, index: int | slice) -> Action | tuple[Action, ...]:
        if isinstance(index, slice):
            return tuple(map(_decode, self._codes[index]))
        return _decode(self._codes[index])

    def __iter__(self) -> Iterator[Action]:
        return map(_decode, self._codes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.n_steps == other.n_steps and self._codes == other._codes

    def __hash__(self) -> int:
        return hash((self.n_steps, len(self._codes), self.advanced_steps))

    def __repr__(self) -> str:
        return self.recipe

    def describe(self, limit: int = 40) -> str:
        """A summary of the plan's costs followed by its actions, one per line.

        At most ``limit`` actions are listed (the first and last halves); pass ``limit=0`` for
        the summary alone or ``limit=len(plan)`` for all of them.

        >>> print(binomial_plan(2, snapshots=1).describe())
        binomial_plan(n_steps=2, snapshots=1): 6 actions, 3 step evaluations (1 advanced + 2 taped), at most 1 snapshot alive, longest tape 1 step
            0  Snapshot(step=0)
            1  Advance(start=0, stop=1)
            2  Reverse(step=1)
            3  Restore(step=0)
            4  Free(step=0)
            5  Reverse(step=0)
        """  # noqa: E501
        plural = "" if self.max_live_snapshots == 1 else "s"
        tape_plural = "" if self.longest_tape == 1 else "s"
        lines = [
            f"{self.recipe}: {len(self)} actions, {self.evaluations} step evaluations "
            f"({self.advanced_steps} advanced + {self.taped_steps} taped), "
            f"at most {self.max_live_snapshots} snapshot{plural} alive, "
            f"longest tape {self.longest_tape} step{tape_plural}"
        ]
        width = len(str(max(len(self) - 1, 0)))
        head = range(len(self)) if len(self) <= limit else range((limit + 1) // 2)
        lines.extend(f"    {i:>{width}}  {self[i]!r}" for i in head)
        if len(self) > limit:
            tail = range(len(self) - limit // 2, len(self))
            lines.append(f"    {'':>{width}}  ... {len(self) - len(head) - len(tail)} more")
            lines.extend(f"    {i:>{width}}  {self[i]!r}" for i in tail)
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _count(value: object, name: str, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum], or a TypeError / ScheduleError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if number < minimum:
        raise ScheduleError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ScheduleError(f"{name}={number} is above the supported maximum of {maximum}")
    return number


def _checked_budget(n_steps: object, snapshots: object, caller: str) -> tuple[int, int]:
    n = _count(n_steps, "n_steps", maximum=MAX_STEPS)
    s = _count(snapshots, "snapshots")
    if n > 0 and s == 0:
        raise ScheduleError(
            f"{caller}(n_steps={n}, snapshots=0): no snapshot is allowed, but reversing the loop "
            "needs state 0 again after the forward sweep, so at least one snapshot must hold the "
            f"initial state; pass snapshots >= 1 (snapshots={max(n - 1, 1)} already stores every "
            "state the reversal needs)"
        )
    return n, s


# --------------------------------------------------------------------------------------------
# Binomial (Revolve) plan
# --------------------------------------------------------------------------------------------


def _repetitions(n: int, s: int) -> int:
    """The smallest r with C(s + r, s) >= n: how often the busiest step is re-advanced."""
    if s == 1:
        return max(n - 1, 0)
    r, reach = 0, 1
    while reach < n:
        r += 1
        reach = reach * (s + r) // r
    return r


def optimal_evaluations(n_steps: int, snapshots: int) -> int:
    """The fewest step evaluations that reverse ``n_steps`` steps with ``snapshots`` snapshots.

    Counts advanced steps plus the ``n_steps`` taped ones: ``(r + 1) * n - C(s + r, s + 1)``
    with ``r`` the smallest integer such that ``C(s + r, s) >= n``: Griewank and Walther's
    minimal forward-step count ``r * n - beta(s + 1, r - 1)``, ``beta(s, r) = C(s + r, s)``
    (ACM TOMS 26(1), 2000), plus the taped steps; their checkpoints include the initial one.

    >>> optimal_evaluations(3, 1), optimal_evaluations(10, 3), optimal_evaluations(10, 9)
    (6, 25, 19)
    """
    n, s = _checked_budget(n_steps, snapshots, "optimal_evaluations")
    if n == 0:
        return 0
    r = _repetitions(n, s)
    return (r + 1) * n - comb(s + r, s + 1)


def binomial_plan(n_steps: int, snapshots: int) -> Plan:
    """The plan with the fewest step evaluations that keeps at most ``snapshots`` states stored.

    This is the binomial checkpointing schedule of A. Griewank and A. Walther, "Algorithm 799:
    Revolve: an implementation of checkpointing for the reverse or adjoint mode of
    computational differentiation", ACM TOMS 26(1):19-45, 2000. Its cost,
    :func:`optimal_evaluations`, grows like ``n * log(n)`` for a fixed budget, against
    ``n**2 / 2`` for storing only the initial state. ``snapshots`` counts every stored state,
    the initial one included; with ``snapshots >= n_steps - 1`` the plan stores every state
    it needs and costs ``2 * n_steps - 1`` evaluations.

    Planning is iterative and packs each action in 8 bytes; actions are built on access. A
    plan for 10**6 steps and 16 snapshots (4.3 million actions, 35 MB) takes tens of ms.

    >>> list(binomial_plan(3, snapshots=2))  # doctest: +NORMALIZE_WHITESPACE
    [Snapshot(step=0), Advance(start=0, stop=1), Snapshot(step=1), Advance(start=1, stop=2),
     Reverse(step=2), Restore(step=1), Free(step=1), Reverse(step=1), Restore(step=0),
     Free(step=0), Reverse(step=0)]
    """
    n, s = _checked_budget(n_steps, snapshots, "binomial_plan")
    if n <= _CACHED_STEPS:
        return _cached_binomial_plan(n, s)
    return _make_binomial_plan(n, s)


# A loop called again (every training step) asks for the same plan: planning 256 steps takes
# about a millisecond, a tenth of a small step's share of the run. Plans are immutable, so the
# few most recent small ones are kept (at most about 1 MB each); long ones are made anew.
_CACHED_STEPS = 16_384


@functools.lru_cache(maxsize=4)
def _cached_binomial_plan(n: int, s: int) -> Plan:
    return _make_binomial_plan(n, s)


def _make_binomial_plan(n: int, s: int) -> Plan:
    codes, advanced, max_live = _binomial_codes(n, s)
    return Plan(
        recipe=f"binomial_plan(n_steps={n}, snapshots={s})",
        n_steps=n,
        snapshots=s,
        advanced_steps=advanced,
        taped_steps=n,
        max_live_snapshots=max_live,
        longest_tape=min(n, 1),
        _codes=codes,
    )


def _binomial_codes(n: int, s: int) -> tuple[array, int, int]:
    """Packed actions of the binomial plan, its advanced steps and its peak live snapshots."""
    codes = array("q")
    if n <= 1:
        codes.extend([_REVERSE] * n)  # nothing to restore, so nothing to store
        return codes, 0, 0
    codes.append(_SNAPSHOT)  # Snapshot(0)
    templates = {} if n > _TEMPLATE_STEPS else None
    advanced, max_live = _reverse_stored(codes, n, s, templates)
    return codes, advanced, max_live


# Segments up to this many steps are planned once per (length, budget) and then copied: a plan
# for 10**6 steps has only a few hundred distinct sub-problems.
_TEMPLATE_STEPS = 1024


def _reverse_stored(
    out: array, n: int, s: int, templates: dict[tuple[int, int], tuple[array, int, int]] | None
) -> tuple[int, int]:
    """Append actions reversing [0, n) with state 0 stored and in hand, within ``s`` snapshots.

    The recursion "advance from the stored state ``pos`` to a split point, snapshot it, reverse
    [split, end) with one snapshot less, then reverse [pos, split)" runs on an explicit stack
    of stored states. Segments needing no split (one snapshot left, or enough to store every
    state) are written out in one go; with ``templates``, short segments are copied from a
    plan made once per (length, budget). Returns the advanced steps and peak live snapshots.
    """
    stored = [0]  # states held as snapshots, oldest first
    reps = [_repetitions(n, s)]  # per snapshot: repetitions its segment still needs, or more
    max_live = 1
    advanced = 0
    end = n  # steps end..n-1 are reversed; the next to reverse is end - 1
    in_hand = 0  # the state in hand, or -1 once a reverse has consumed it
    while end:
        pos = stored[-1]
        length = end - pos
        budget = s - len(stored) + 1  # snapshots for [pos, end), the one holding pos included
        if in_hand != pos:
            out.append(_RESTORE + pos * _BOTH)
        if templates is not None and length <= _TEMPLATE_STEPS:
            # Budgets beyond length - 1 all give the same plan, so they share a template.
            key = (length, max(1, min(budget, length - 1)))
            if key not in templates:
                part = array("q")
                templates[key] = (part, *_reverse_stored(part, *key, templates=None))
            part, part_advanced, part_live = templates[key]
            shifted = np.frombuffer(part, dtype=np.int64) + pos * _BOTH
            out.frombytes(shifted.tobytes())
            advanced += part_advanced
            max_live = max(max_live, len(stored) - 1 + part_live)
        elif budget == 1:
            out.extend(_from_one_snapshot(pos, end))
            advanced += length * (length - 1) // 2
        elif length <= budget + 1:
            out.extend(_store_every_state(pos, end))
            advanced += length - 1
            max_live = max(max_live, len(stored) + length - 2)
        else:
            # Lower r while r - 1 repetitions still cover the (shrinking) segment; r >= 2 here.
            r = reps[-1]
            reach_below = comb(budget + r - 1, budget)
            while reach_below >= length:
                r -= 1
                reach_below = comb(budget + r - 1, budget)
            reps[-1] = r
            # The farthest optimal split (see _split_bounds); it leaves end - split >= budget.
            split = pos + min(reach_below, length - comb(budget + r - 2, budget - 1))
            out.append(_ADVANCE + pos * _FIRST + split * _SECOND)
            out.append(_SNAPSHOT + split * _BOTH)
            advanced += split - pos
            stored.append(split)
            reps.append(r)
            max_live = max(max_live, len(stored))
            in_hand = split
            continue
        # [pos, end) is reversed and the snapshot of pos freed.
        stored.pop()
        reps.pop()
        end = pos
        in_hand = -1
    return advanced, max_live


def _from_one_snapshot(pos: int, end: int) -> list[int]:
    """Reverse [pos, end) from the snapshot of ``pos`` alone, in hand: re-advance every time."""
    codes = [
        code
        for step in range(end - 1, pos, -1)
        for code in (
            _ADVANCE + pos * _FIRST + step * _SECOND,
            _REVERSE + step * _BOTH,
            _RESTORE + pos * _BOTH,
        )
    ]
    codes += (_FREE + pos * _BOTH, _REVERSE + pos * _BOTH)
    return codes


def _store_every_state(pos: int, end: int) -> list[int]:
    """Reverse [pos, end) from ``pos`` in hand, storing each state up to the last but one."""
    if end - pos == 1:
        return [_FREE + pos * _BOTH, _REVERSE + pos * _BOTH]
    codes = [
        code
        for state in range(pos + 1, end - 1)
        for code in (_ADVANCE + (state - 1) * _FIRST + state * _SECOND, _SNAPSHOT + state * _BOTH)
    ]
    codes += (_ADVANCE + (end - 2) * _FIRST + (end - 1) * _SECOND, _REVERSE + (end - 1) * _BOTH)
    codes += [
        code
        for state in range(end - 2, pos - 1, -1)
        for code in (_RESTORE + state * _BOTH, _FREE + state * _BOTH, _REVERSE + state * _BOTH)
    ]
    return codes


def _split_bounds(length: int, budget: int) -> tuple[int, int]:
    """All optimal first advances when reversing ``length`` steps with ``budget`` snapshots.

    Why these bounds: let ``r(j, c)`` be the smallest r with C(c + r, c) >= j. The optimal cost
    is the sum of ``r(j, c)`` over j = 1..length, and splitting at k costs
    ``sum_{j<=k} (1 + r(j, c)) + sum_{j<=length-k} r(j, c - 1)``. Pascal's rule makes the two
    sums draw from exactly the multiset of the optimal one, so k is optimal exactly when
    neither part takes a value above ``r = r(length, c)`` nor leaves one below it. Kept for
    tests and readers; the planner inlines the upper bound.
    """
    r = _repetitions(length, budget)
    low = max(1, comb(budget + r - 2, budget), length - comb(budget + r - 1, budget - 1))
    high = min(comb(budget + r - 1, budget), length - comb(budget + r - 2, budget - 1))
    return low, high


# --------------------------------------------------------------------------------------------
# Periodic and store-all plans
# --------------------------------------------------------------------------------------------


def periodic_plan(n_steps: int, every: int) -> Plan:
    """Snapshot every ``every``-th state, then reverse each segment on one tape.

    The forward sweep stores states 0, k, 2k, ... (not the last segment's start, which is in
    hand); each segment is then restored and reversed whole. Costs ``n + k * (ceil(n / k) - 1)``
    step evaluations (under ``2n``), ``ceil(n / k) - 1`` snapshots and a tape of ``k`` steps;
    ``k`` near ``sqrt(n)`` balances the two memories. ``every >= n_steps`` is
    :func:`store_all_plan`.

    >>> list(periodic_plan(5, every=2))  # doctest: +NORMALIZE_WHITESPACE
    [Snapshot(step=0), Advance(start=0, stop=2), Snapshot(step=2), Advance(start=2, stop=4),
     ReverseSegment(start=4, stop=5), Restore(step=2), Free(step=2),
     ReverseSegment(start=2, stop=4), Restore(step=0), Free(step=0),
     ReverseSegment(start=0, stop=2)]
    """
    n = _count(n_steps, "n_steps", maximum=MAX_STEPS)
    k = _count(every, "every", minimum=1)
    return _segment_plan(n, k, f"periodic_plan(n_steps={n}, every={k})")


def store_all_plan(n_steps: int) -> Plan:
    """Record the whole loop on one tape: ``n_steps`` evaluations, no snapshots, most memory.

    >>> list(store_all_plan(3))
    [ReverseSegment(start=0, stop=3)]
    """
    n = _count(n_steps, "n_steps", maximum=MAX_STEPS)
    return _segment_plan(n, max(n, 1), f"store_all_plan(n_steps={n})")


def _segment_plan(n: int, every: int, recipe: str) -> Plan:
    codes = array("q")
    starts = range(0, n, every)
    stored = starts[:-1]
    for start in stored:
        codes.append(_SNAPSHOT + start * _BOTH)
        codes.append(_ADVANCE + start * _FIRST + (start + every) * _SECOND)
    if n:
        codes.append(_REVERSE_SEGMENT + starts[-1] * _FIRST + n * _SECOND)
    for start in reversed(stored):
        codes.append(_RESTORE + start * _BOTH)
        codes.append(_FREE + start * _BOTH)
        codes.append(_REVERSE_SEGMENT + start * _FIRST + (start + every) * _SECOND)
    return Plan(
        recipe=recipe,
        n_steps=n,
        snapshots=len(stored),
        advanced_steps=starts[-1] if n else 0,
        taped_steps=n,
        max_live_snapshots=len(stored),
        longest_tape=min(n, every),
        _codes=codes,
    )


# --------------------------------------------------------------------------------------------
# Simulator
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What replaying a plan cost, as measured by :func:`simulate_plan`."""

    n_steps: int
    snapshots: int
    actions: int
    advanced_steps: int
    taped_steps: int
    max_live_snapshots: int
    longest_tape: int
    snapshots_taken: int
    restores: int
    disk_snapshots: int | None = 0
    """The disk budget checked (None: unlimited)."""
    disk_snapshots_taken: int = 0
    """``DiskSnapshot`` actions: disk writes."""
    disk_restores: int = 0
    """``DiskRestore`` actions: disk reads."""
    max_live_disk_snapshots: int = 0

    @property
    def evaluations(self) -> int:
        """All step evaluations: advanced plus taped."""
        return self.advanced_steps + self.taped_steps

    def cost(self, step: float = 1.0, write: float = 0.0, read: float = 0.0) -> float:
        """Advanced steps x ``step`` + disk writes x ``write`` + disk reads x ``read``.

        The ``n_steps`` taped steps, which every plan pays once, are left out; H-Revolve's
        makespan with unit forward and backward costs is this cost plus ``n_steps``.

        >>> simulate_plan([DiskSnapshot(0), Advance(0, 1), Reverse(1), DiskRestore(0),
        ...                Free(0), Reverse(0)], 2, 0, disk=1).cost(write=3, read=2)
        6.0
        """
        return (
            self.advanced_steps * step
            + self.disk_snapshots_taken * write
            + self.disk_restores * read
        )


_AS_PLANNED: Any = object()


def simulate_plan(
    plan: Iterable[Action],
    n_steps: int | None = None,
    snapshots: int | None = None,
    disk: int | None = _AS_PLANNED,
) -> PlanStats:
    """Replay ``plan`` on bookkeeping alone and check every invariant after each action.

    Why: an executor trusts its plan; this finds a wrong plan without running a model. The
    invariants: each action starts from the state it names; only stored snapshots are restored
    or freed; no snapshot is overwritten while alive; never more than ``snapshots`` alive;
    steps are reversed once each, from ``n_steps - 1`` down to 0, and nothing is advanced past
    the next step to reverse; at the end every step is reversed and every snapshot freed.
    ``n_steps`` and ``snapshots`` default to those of a :class:`Plan`; ``disk`` (the budget of
    ``DiskSnapshot`` snapshots, None for unlimited) to its ``disk_snapshots``, else 0. A state
    is stored on one level at a time, and the disk budget is checked like the RAM one. Raises
    :class:`PlanInvariantError` naming the action's index and the invariant.

    >>> simulate_plan([Reverse(0)], n_steps=1, snapshots=0).evaluations
    1
    >>> simulate_plan([Reverse(1)], n_steps=2, snapshots=1)
    Traceback (most recent call last):
    ...
    checkpoint_ad.errors.PlanInvariantError: action 0 Reverse(step=1) breaks invariant 'state-in-hand': it needs state 1 in hand, but the state in hand is state 0
    """  # noqa: E501
    if n_steps is None or snapshots is None:
        if not isinstance(plan, Plan):
            raise TypeError("simulate_plan needs n_steps and snapshots when the plan is not a Plan")
        n_steps = plan.n_steps if n_steps is None else n_steps
        snapshots = plan.snapshots if snapshots is None else snapshots
    if disk is _AS_PLANNED:
        disk = plan.disk_snapshots if isinstance(plan, Plan) else 0
    replay = _Replay(_count(n_steps, "n_steps"), _count(snapshots, "snapshots"))
    replay.disk = None if disk is None else _count(disk, "disk")
    for action in plan:
        replay.apply(action)
    return replay.finish()


class _Replay:
    """The bookkeeping of :func:`simulate_plan`: which state is in hand, which are stored."""

    def __init__(self, n: int, s: int) -> None:
        self.n, self.s = n, s
        self.index = 0
        self.action: object = None
        self.in_hand: int | None = 0
        self.live: set[int] = set()
        self.next_reverse = n - 1
        self.advanced = self.taped = self.longest_tape = 0
        self.max_live = self.taken = self.restores = 0
        self.disk: int | None = 0
        self.disk_live: set[int] = set()
        self.disk_taken = self.disk_restores = self.max_disk_live = 0

    def apply(self, action: object) -> None:
        self.action = action
        handler = self._HANDLERS.get(type(action))
        if handler is None:
            raise self.fail("action-type", f"{type(action).__name__} is not a plan action")
        handler(self, action)
        self.index += 1

    def snapshot(self, action: Snapshot) -> None:
        self.need_in_hand(action.step)
        if action.step in self.live or action.step in self.disk_live:
            raise self.fail("no-overwrite", f"a snapshot of state {action.step} is alive already")
        if len(self.live) >= self.s:
            raise self.fail(
                "snapshot-limit",
                f"the snapshot budget ({self.s}) is used up by states {sorted(self.live)}",
            )
        self.live.add(action.step)
        self.taken += 1
        self.max_live = max(self.max_live, len(self.live))

    def advance(self, action: Advance) -> None:
        self.need_in_hand(action.start)
        if not action.start < action.stop <= self.next_reverse:
            raise self.fail(
                "needed-states",
                f"an advance must go forward and stop at or before state {self.next_reverse}, "
                "the next one to reverse",
            )
        self.advanced += action.stop - action.start
        self.in_hand = action.stop

    def restore(self, action: Restore) -> None:
        self.need_stored(action.step)
        self.restores += 1
        self.in_hand = action.step

    def free(self, action: Free) -> None:
        if action.step in self.disk_live:
            self.disk_live.remove(action.step)
            return
        self.need_stored(action.step)
        self.live.remove(action.step)

    def disk_snapshot(self, action: DiskSnapshot) -> None:
        self.need_in_hand(action.step)
        if action.step in self.live or action.step in self.disk_live:
            raise self.fail("no-overwrite", f"a snapshot of state {action.step} is alive already")
        if self.disk is not None and len(self.disk_live) >= self.disk:
            raise self.fail(
                "disk-limit",
                f"the disk budget ({self.disk}) is used up by states {sorted(self.disk_live)}",
            )
        self.disk_live.add(action.step)
        self.disk_taken += 1
        self.max_disk_live = max(self.max_disk_live, len(self.disk_live))

    def disk_restore(self, action: DiskRestore) -> None:
        if action.step not in self.disk_live:
            raise self.fail("snapshot-stored", f"no disk snapshot of state {action.step} is alive")
        self.disk_restores += 1
        self.in_hand = action.step

    def reverse(self, action: Reverse) -> None:
        self.reverse_steps(action.step, action.step + 1)

    def reverse_segment(self, action: ReverseSegment) -> None:
        if not 0 <= action.start < action.stop:
            raise self.fail("needed-states", "a segment needs 0 <= start < stop")
        self.reverse_steps(action.start, action.stop)

    _HANDLERS: ClassVar[dict[type, Callable[[_Replay, Any], None]]] = {
        Snapshot: snapshot,
        Advance: advance,
        Restore: restore,
        Free: free,
        Reverse: reverse,
        ReverseSegment: reverse_segment,
        DiskSnapshot: disk_snapshot,
        DiskRestore: disk_restore,
    }

    def reverse_steps(self, start: int, stop: int) -> None:
        if stop - 1 != self.next_reverse:
            wanted = "none" if self.next_reverse < 0 else f"step {self.next_reverse}"
            raise self.fail(
                "reverse-order",
                f"it reverses step {stop - 1} next, but the next step to reverse is {wanted} "
                "(each step once, from the last down to 0)",
            )
        self.need_in_hand(start)
        self.taped += stop - start
        self.longest_tape = max(self.longest_tape, stop - start)
        self.next_reverse, self.in_hand = start - 1, None

    def need_in_hand(self, state: int) -> None:
        if self.in_hand != state:
            have = (
                "none (a reverse consumed it)"
                if self.in_hand is None
                else (f"state {self.in_hand}")
            )
            raise self.fail(
                "state-in-hand", f"it needs state {state} in hand, but the state in hand is {have}"
            )

    def need_stored(self, state: int) -> None:
        if state not in self.live:
            raise self.fail("snapshot-stored", f"no snapshot of state {state} is alive")

    def fail(self, invariant: str, detail: str) -> PlanInvariantError:
        return PlanInvariantError(self.index, self.action, invariant, detail)

    def finish(self) -> PlanStats:
        self.action = None
        if self.next_reverse >= 0:
            raise self.fail("complete", f"steps {self.next_reverse}..0 were never reversed")
        if self.live or self.disk_live:
            alive = sorted(self.live | self.disk_live)
            raise self.fail("complete", f"snapshots of states {alive} are still alive; free them")
        return PlanStats(
            n_steps=self.n,
            snapshots=self.s,
            actions=self.index,
            advanced_steps=self.advanced,
            taped_steps=self.taped,
            max_live_snapshots=self.max_live,
            longest_tape=self.longest_tape,
            snapshots_taken=self.taken,
            restores=self.restores,
            disk_snapshots=self.disk,
            disk_snapshots_taken=self.disk_taken,
            disk_restores=self.disk_restores,
            max_live_disk_snapshots=self.max_disk_live,
        )
