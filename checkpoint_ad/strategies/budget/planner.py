"""`Budget(limit)`: say how many bytes the tape may hold; get the fastest plan that fits.

For a `scan`, the budget prices every candidate plan (`candidates.py`) from a dry run of the
loop's first steps (`pricing.py`: recorded, and traced into a step program whose replays are
timed, since a loop replays every step after the first two unless the step refuses tracing)
and runs the one with the least predicted time whose predicted peak tape fits; `estimate`
shows the same table without running the loop, and `Budget.explain()` shows it for the last
loop a budget planned. The limit counts what the
profiler counts as the tape's own bytes (`Profile.peak_tape_bytes`): snapshots and saved
values. The bytes any plan needs besides (gradients, the stacked outputs, the gradient of the
final carry) are named in the table as fixed bytes, and so are the bytes the dry run holds
once before the loop (a profiler around the first run sees them; the next loop of the same
step and shapes, under this budget or another, or in `estimate`, reuses the measurement and
holds none: `forget_dry_runs()` makes the next one measure again).

>>> import checkpoint_ad as cad
>>> w = cad.tensor(0.5, requires_grad=True)
>>> xs = cad.tensor([[1.0] * 64] * 32)
>>> step = lambda h, x: (cad.tanh(h * w + x),) * 2
>>> with cad.use(cad.strategies.Budget("4KiB")):
...     h, ys = cad.scan(step, cad.zeros(64), xs)
>>> ys.sum().backward()
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from ... import events, loop_log
from ...errors import BudgetError, BudgetWarning, StrategyConfigError
from ...grad_mode import DRY_RUN, step_scope
from ...origins import user_frame_from_caller
from ...pytree import flatten, unflatten
from ...saved import KEEP, Strategy
from ..kinds import LoopPlanner, LoopStrategy
from ..loops.loop import StepLoop, loop_length
from ..loops.program_cache import step_identity
from .candidates import (
    FAMILIES,
    SNAPSHOT_FORMS,
    STEP_FORMS,
    Candidate,
    Family,
    binomial,
    binomial_online,
    engine_bytes,
    keep_every_step,
    keep_every_step_until,
    rerun_engine_bytes,
)
from .dtr import Rematerializing
from .overhead import with_overhead
from .pricing import StepCost, measure, relative_error_bound
from .shared_budget import SharedBudget, fastest_together, least_together

__all__ = ["Budget", "BudgetError", "Estimate", "PlanRow", "estimate", "forget_dry_runs",
           "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_BYTES = 2**63  # a budget above this is a typo, not a machine
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(limit: int | str) -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5GB"``, ``"512 KiB"``.

    >>> parse_bytes("1.5KiB"), parse_bytes("2MB"), parse_bytes(100)
    (1536, 2000000, 100)

    A size that is not a whole number of bytes (``"1.5B"``) or larger than any machine's
    memory (``"1e400B"``) is refused, not rounded or overflowed.
    """
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise StrategyConfigError(
            f"Budget(limit={limit!r}): give the budget in bytes (an int) or as a string such "
            "as '64MiB' or '1.5GB'")
    if isinstance(limit, int):
        value = _whole_bytes(limit, Fraction(limit))
    else:
        match = _SIZE.fullmatch(limit)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise StrategyConfigError(
                f"Budget(limit={limit!r}): not a size; write a number and a unit such as "
                f"'64MiB' or '1.5GB' (units: {', '.join(u for u in _UNITS if u)})")
        value = _whole_bytes(limit, Fraction(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise StrategyConfigError(f"Budget(limit={limit!r}): a budget must be at least 1 byte")
    return value


def _whole_bytes(limit: int | str, value: Fraction) -> int:
    """`value` (exact) as an int, or StrategyConfigError: a budget counts whole bytes."""
    if value > MAX_BYTES:
        raise StrategyConfigError(
            f"Budget(limit={limit!r}): more than {MAX_BYTES} bytes (2**63); give a size a "
            "machine can have, such as '64MiB' or '16GiB'")
    if value.denominator != 1:
        raise StrategyConfigError(
            f"Budget(limit={limit!r}) is not a whole number of bytes ({float(value):g}); give "
            "whole bytes or a larger unit, e.g. '2B' or '1.5KiB'")
    return int(value)


def format_bytes(count: float) -> str:
    """``12.3 MiB``: bytes in the largest binary unit that keeps the number above 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


@dataclass(frozen=True)
class PlanRow:
    """One candidate plan and its predicted figures (an `Estimate`'s row)."""

    name: str
    strategy: LoopStrategy | None
    """The loop strategy to run (None: record every step, as a plain `scan`)."""
    storage: Strategy
    """The saved-value strategy of every step's values."""
    peak_tape_bytes: int
    device_peak_bytes: int
    """`peak_tape_bytes` plus the estimate's fixed bytes and `engine_bytes`, or what tracing
    the first steps took in the dry run's trial if more (it happens before the plan holds
    much): the peak of the loop's first call (a later call reusing its step program traces
    one step fewer)."""
    forward_seconds: float
    backward_seconds: float
    evaluations: int
    error_bound: float | None
    """Lossy plans: the most a stored value moves, relative to its group's range; None for
    lossless plans, whose gradients equal keeping everything bit for bit."""
    fits: bool
    engine_bytes: int = 0
    """Memory of the engine's own at the peak beyond the tape's arrays, as the dry run
    traced it: the objects (lists, output rows) the steps taped at the peak hold, and one
    step's backward temporaries (0 when the loop records its steps, or ran under the
    caller's own tracemalloc); for a plan that re-runs steps, what re-running holds more
    (`candidates.rerun_engine_bytes`)."""

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def lossless(self) -> bool:
        return self.error_bound is None


@dataclass(frozen=True)
class Estimate:
    """The predicted peak, time and error of every candidate plan for one loop, fastest first,
    and the plan a budget runs (`chosen`: the fastest that fits, the leanest of those
    predicted equally fast; None if none does)."""

    n_steps: int
    limit_bytes: int | None
    rows: tuple[PlanRow, ...]
    chosen: PlanRow | None
    fixed_bytes: Mapping[str, int]
    cost: StepCost = field(repr=False)
    until: str | None = None
    """For a loop that ends when `until` says so: "at most" (`n_steps` is its longest run,
    its xs or length=) or "unknown" (neither: priced at `OPEN_LOOP_STEPS`); None otherwise."""
    held_bytes: int = 0
    """Tape bytes the budget's earlier loops (and its imperative pool) still held when this
    loop was planned (`Budget.held_bytes`): its plans fit in `limit_bytes` less these."""
    later_loops: int = 0
    later_bytes: int = 0
    """The loops that followed this one in the budget's previous pass, and the bytes left for
    them (their plans in the fastest combination that fits with this loop's `chosen`) and
    for the values its imperative pool saved beside them (see `shared_budget.py`); 0 when
    planned alone."""

    @property
    def minimum_bytes(self) -> int:
        """The least budget that works: the smallest predicted peak tape over the candidates,
        plus what was held when the loop was planned."""
        return min((r.peak_tape_bytes for r in self.rows), default=0) + self.held_bytes

    def table(self) -> str:
        """The rows as text; ``*`` marks the chosen plan, ``x`` those over the budget."""
        limit = "no limit" if self.limit_bytes is None else format_bytes(self.limit_bytes)
        fixed = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.fixed_bytes.items())
        trial = self.cost.trial
        tracing = ("" if trial is None else
                   f"; tracing the first steps takes {format_bytes(trial.forward_bytes)} "
                   "(no device peak is less)")
        head = (f"   {'plan':<32}{'peak tape':>12}{'device peak':>13}{'forward s':>11}"
                f"{'backward s':>11}{'total s':>10}{'steps run':>10}{'error bound':>12}")
        length = {None: f"scan of {self.n_steps} steps",
                  "at most": f"scan until `until` stops it, at most {self.n_steps} steps "
                             "(priced at that many)",
                  "unknown": "scan until `until` stops it, of unknown length (priced at "
                             f"{self.n_steps} steps; the peak tape of a binomial plan holds "
                             "at any length)"}[self.until]
        limit += " of tape"
        if self.held_bytes and self.limit_bytes is not None:
            limit += (f" ({format_bytes(self.held_bytes)} of it held by earlier loops and "
                      "values under this budget until their backward sweep: plans fit in "
                      f"{format_bytes(max(self.limit_bytes - self.held_bytes, 0))})")
        if self.later_loops or self.later_bytes:
            loops = (f"the {self.later_loops} loop(s) that followed it and " if
                     self.later_loops else "")
            limit += (f", planned to leave {format_bytes(self.later_bytes)} for {loops}the "
                      "values saved beside it last time")
        lines = [f"{length}, budget {limit}; fixed bytes in every "
                 f"plan: {fixed}; the dry run held {format_bytes(self.cost.dry_run_bytes)} "
                 f"once, before the loop{tracing}", head, "-" * len(head)]
        for r in self.rows:
            mark = "*" if r is self.chosen else (" " if r.fits else "x")
            bound = "exact" if r.error_bound is None else f"{r.error_bound:.2e}"
            lines.append(
                f" {mark} {r.name:<32}{format_bytes(r.peak_tape_bytes):>12}"
                f"{format_bytes(r.device_peak_bytes):>13}{r.forward_seconds:>11.4f}"
                f"{r.backward_seconds:>11.4f}{r.seconds:>10.4f}{r.evaluations:>10}{bound:>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def plan_table(
    cost: StepCost,
    limit_bytes: int | None,
    families: Iterable[Family] = FAMILIES,
    admit: Callable[[Candidate], bool] = lambda c: c.lossless,
    until: str | None = None,
    held_bytes: int = 0,
) -> Estimate:
    """Every admitted candidate of `families` priced from `cost`, and the fastest that fits
    in `limit_bytes` less `held_bytes` (`until`, `held_bytes`: see `Estimate`)."""
    fixed = {"gradients": cost.gradient_bytes, "outputs": cost.output_bytes,
             # what the caller's loss hands the loop's final carry, held through its backward;
             # the dry run's trial holds that and the final carry itself, but a loss need not
             # keep the carry (an RNN's sum of outputs seeds none): counted twice, a plan's
             # device peak read 0.82-0.92 of its prediction at batch 512, hidden 1,024
             "gradient of the final carry": cost.carry_bytes,
             "engine (program, executor state)": engine_bytes(cost)}
    if cost.batched_bytes:  # (a table without batched rows reads as before)
        fixed["batched rows (a chunk of products, or of their gradients)"] = cost.batched_bytes
    extra = sum(fixed.values())
    least = cost.trial.forward_bytes if cost.trial is not None else 0
    rerun = rerun_engine_bytes(cost)
    traced = cost.call_overhead_seconds if cost.replays else 0.0  # every plan traces anew
    # the executor's own part of a call (a loop keeping every step runs one when it replays)
    kept_call = traced + (cost.kept_call_seconds if cost.replays else 0.0)
    planned_call = traced + cost.call_seconds
    rows = []
    for family in families:
        for c in family(cost):
            if not admit(c):
                continue
            fits = limit_bytes is None or c.peak_tape_bytes <= limit_bytes - held_bytes
            # a plan re-running steps makes products again while it holds their gradients
            engine = c.engine_bytes + (rerun + cost.batched_bytes if c.loop is not None else 0)
            rows.append(PlanRow(c.name, c.loop, c.storage, c.peak_tape_bytes,
                                max(least, c.peak_tape_bytes + extra + engine),
                                c.forward_seconds + (kept_call if c.loop is None
                                                     else planned_call),
                                c.backward_seconds, c.evaluations, c.error_bound, fits,
                                engine))
    rows.sort(key=lambda r: (r.seconds, r.peak_tape_bytes))
    fitting = [r for r in rows if r.fits]
    # the fastest that fits (the sort put the leanest first among equal times): a budget is
    # memory the caller can spare, so trading predicted time for unasked-for savings loses
    chosen = fitting[0] if fitting else None
    return Estimate(cost.n_steps, limit_bytes, tuple(rows), chosen, fixed, cost, until,
                    held_bytes)


@dataclass(frozen=True)
class Budget(LoopPlanner):
    """A memory budget for the tape: each `scan` runs the fastest plan predicted to fit.

    `limit` is bytes (an int) or a size such as ``"64MiB"`` or ``"1.5GB"``. Plans are lossless
    unless `lossy=True` (quantized saved values and snapshots admitted) or `max_rel_error` is
    given (only quantized forms whose stored values move at most that fraction of their
    group's range). A budget below the smallest plan raises `BudgetError` naming the least
    budget that works. Gradients under a lossless budget are bitwise those of keeping
    everything; under any budget, those of running the chosen plan directly.

    Loops run one after another (the layers of a stacked RNN) share the budget: each is
    planned in what the loops before it, still holding their tape until the backward sweep,
    left (`held_bytes`), and from the second pass on (a training loop's next step) each is
    planned together with the loops that followed it last time: the fastest combination that
    fits. A first pass cannot know the later loops; where one is left too little, it runs the
    fastest plan within a tenth of the budget of its leanest (`FIRST_PASS_SLACK`) and the
    budget warns (`BudgetWarning`) by how much the tape passes it.

    Outside `scan` (your own Python loops), saved values are kept by a `Rematerializing`
    pool of `limit` bytes, one per thread: past the limit it evicts values DTR-style and
    recomputes them when the backward sweep needs them (gradients bitwise those of keep-all).

    With `disk=True`, plans that also write snapshots to disk (``binomial s=4 + disk``:
    `Binomial` with a disk level, H-Revolve) are priced too, from a disk write and read of
    the carry timed in the dry run: a small budget then runs far fewer re-runs. Disk bytes
    are not tape bytes (the profiler counts them in `level_peak_bytes`); the files are gone
    after the backward sweep. Off by default: writing to disk is the user's call.

    >>> Budget("64MiB").limit_bytes
    67108864
    """

    limit: int | str
    lossy: bool = False
    max_rel_error: float | None = None
    disk: bool = False
    families: tuple[Family, ...] = field(default=FAMILIES, repr=False)
    _memory: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        parse_bytes(self.limit)
        if not isinstance(self.lossy, bool):
            raise StrategyConfigError(f"Budget(lossy={self.lossy!r}): lossy must be True or False")
        if not isinstance(self.disk, bool):
            raise StrategyConfigError(
                f"Budget(disk={self.disk!r}): disk must be True (also price plans with disk "
                "snapshots) or False")
        bound = self.max_rel_error
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not bound > 0 or math.isnan(bound)):
            raise StrategyConfigError(
                f"Budget(max_rel_error={bound!r}): give a positive number (e.g. 0.01 admits "
                "8-bit codes, whose values move at most 0.2% of their group's range)")
        object.__setattr__(self, "_memory", {})

    @property
    def limit_bytes(self) -> int:
        return parse_bytes(self.limit)

    @property
    def admits_lossy(self) -> bool:
        return self.lossy or self.max_rel_error is not None

    def admits(self, candidate: Candidate) -> bool:
        return _admitted(candidate.error_bound, self.lossy, self.max_rel_error)

    def for_primitive(self, prim: Any) -> Strategy:
        """Imperative code: the thread's eviction pool (made on first use)."""
        pools = self._memory.setdefault("pools", {})
        thread = threading.get_ident()
        pool = pools.get(thread)
        if pool is None:
            # it keeps to what this thread's loops under the budget leave
            # and to the process's memory, not the saved arrays alone (`process`), and
            # folds periodic Python loops into loop entries (`fold`: their steps' records
            # would pass the budget on objects alone)
            pool = pools[thread] = Rematerializing(self.limit_bytes,
                                                   reserved=self._shared().loops_held,
                                                   process=True, fold=True)
        return pool

    def for_leaf(self) -> Strategy:
        return KEEP

    def choose(self, loop: Any, carry_leaves: list[Any]) -> tuple[LoopStrategy | None, Strategy]:
        """The plan for `loop`: the fastest candidate predicted to fit (see `explain`)."""
        return self._choose(loop, carry_leaves)

    def choose_open(self, loop: StepLoop, carry_leaves: list[Any], limit: int | None,
                    ) -> tuple[LoopStrategy | None, Strategy]:
        """The plan for a loop that ends when `until` says so (`scan(..., until=...)`,
        `while_loop`): only keep-all and `Binomial(s)`, which places its snapshots online,
        run such a loop. Keep-all only when the loop's longest run (`limit`: its xs or
        length=) kept whole fits; a binomial plan's peak (s snapshots and one step's tape)
        holds at any length, so with no limit the budget runs the fastest number of snapshots
        that fits (up to `OPEN_LOOP_STEPS` - 1; the online planner's decisions cost O(s) a
        step, so that is not always the most). Priced from a dry run of its first steps, as
        any loop."""
        return self._choose(_sized(loop, limit), carry_leaves,
                            _online_families(self.families, limit, repr(self)),
                            "unknown" if limit is None else "at most", holders_of=loop)

    def _choose(self, loop: StepLoop, carry_leaves: list[Any],
                families: tuple[Family, ...] | None = None, until: str | None = None,
                holders_of: StepLoop | None = None) -> tuple[LoopStrategy | None, Strategy]:
        """The plan `choose` and `choose_open` run, in what this budget's earlier loops
        left (see `shared_budget.py`): the fastest that fits, or, where the previous pass
        ran loops after this one, this loop's part of the fastest combination that fits
        them all. Counted against the budget until its tape is let go of."""
        shared = self._shared()
        named = _loop_key(loop, carry_leaves)
        name = None if named is None else (named[0], until)
        pool = self._pool()
        later, extras = shared.later(name, pool)
        result = self._table(loop, carry_leaves, families, until, named)
        chosen, later_bytes = result.chosen, 0
        room = self.limit_bytes - result.held_bytes
        if later or any(extras):
            together = fastest_together(result.rows, later, room, extras)
            if together is None:
                raise _budget_error(self, result, later, extras)
            chosen, later_bytes = together
            later_bytes += max(extras)
        if chosen is None:
            alone = [r for r in result.rows if r.peak_tape_bytes <= self.limit_bytes]
            if not alone or not result.held_bytes:
                raise _budget_error(self, result)
            # a first pass: the loops before this one took the room this one needs. Run the
            # fastest plan within FIRST_PASS_SLACK of the budget above the leanest (the
            # leanest alone, binomial s=1, re-runs n**2 / 2 steps), and plan them together
            # next time
            leanest = min(r.peak_tape_bytes for r in alone)
            near = leanest + int(self.limit_bytes * FIRST_PASS_SLACK)
            chosen = min((r for r in alone if r.peak_tape_bytes <= near),
                         key=lambda r: (r.seconds, r.peak_tape_bytes))
            code, line = user_frame_from_caller()  # the warning names the user's line
            warnings.warn_explicit(BudgetWarning(
                f"{self!r}: earlier loops and values under this budget hold "
                f"{format_bytes(result.held_bytes)} until their backward sweep, and this "
                f"loop's leanest plan needs {format_bytes(leanest)}; it runs {chosen.name} "
                f"({format_bytes(chosen.peak_tape_bytes)}): the tape passes the budget by up to "
                f"{format_bytes(chosen.peak_tape_bytes - room)} this once. The next pass "
                "plans these loops together (fastest combination that fits); if they can "
                "never fit together, it raises BudgetError"), BudgetWarning,
                "<unknown>" if code is None else code.co_filename, line)
        if chosen is not result.chosen or later_bytes:
            result = replace(result, chosen=chosen, later_bytes=later_bytes,
                             later_loops=len(later))
            self._memory["last"] = result
        shared.planned(name, result, pool)
        holder = holders_of if holders_of is not None else loop
        holder.holders = []
        shared.reserve(holder.holders, chosen.peak_tape_bytes)
        return chosen.strategy, chosen.storage

    def estimate_open(self, loop: StepLoop, carry_leaves: list[Any],
                      limit: int | None) -> Estimate:
        """`choose_open`'s table (see `estimate_loop`)."""
        return self.estimate_loop(_sized(loop, limit), carry_leaves,
                                  _online_families(self.families, limit, repr(self)),
                                  "unknown" if limit is None else "at most")

    def estimate_loop(self, loop: StepLoop, carry_leaves: list[Any],
                      families: tuple[Family, ...] | None = None,
                      until: str | None = None) -> Estimate:
        """The table for `loop` (its dry run kept for the next loop of the same step and
        shapes, so a training loop pays it once); remembered for `explain`. `families` and
        `until`: those of a loop that ends when `until` says so (`estimate_open`)."""
        return self._table(loop, carry_leaves, families, until,
                           _loop_key(loop, carry_leaves))

    def _table(self, loop: StepLoop, carry_leaves: list[Any],
               families: tuple[Family, ...] | None, until: str | None,
               named: tuple[Any, tuple[weakref.ref[Any], ...]] | None) -> Estimate:
        """`estimate_loop`, the loop named (`_loop_key`) by the caller."""
        held = self.held_bytes()
        key = None if named is None else (named[0], until, held)
        # the tables of the loops planned lately (the layers of a stacked RNN take turns)
        tables: OrderedDict[Any, Any] = self._memory.setdefault("tables", OrderedDict())
        cached = tables.get(key) if key is not None else None
        if cached is not None and _alive(cached[0]):
            result = cached[1]  # the same loop again (a training loop): its table, as it was
            with contextlib.suppress(KeyError):  # another thread may have let it go
                tables.move_to_end(key)
        else:
            # a disk level is priced for loops of known length only (an online plan does
            # not weigh its write and read costs)
            cost = dry_run(loop, carry_leaves, self.lossy, self.max_rel_error,
                           self.disk and until is None)
            result = plan_table(cost, self.limit_bytes, families or self.families,
                                self.admits, until, held)
            if key is not None:
                tables[key] = (named[1], result)  # type: ignore[index]
                while len(tables) > DRY_RUNS_KEPT:
                    tables.popitem(last=False)
        self._memory["last"] = result
        return result

    def held_bytes(self) -> int:
        """Tape bytes held now, in this thread, under this budget: the planned peak of each
        loop it planned whose tape is still held (until the loop's backward sweep, or until
        its graph is dropped) and what its imperative pool holds. A loop planned now fits in
        the limit less these, so loops run one after another (the layers of a stacked RNN)
        share the budget rather than each take all of it."""
        pool = self._pool()
        return self._shared().loops_held() + (pool.held_bytes if pool is not None else 0)

    def block_ended(self) -> None:
        """A `use` block of this budget ended: this thread's pool stops any loop it was
        folding (and lets go of the entries it watched for one)."""
        pool = self._pool()
        if pool is not None:
            pool.block_ended()

    def _pool(self) -> Rematerializing | None:
        """This thread's imperative pool, if it has one yet."""
        return self._memory.get("pools", {}).get(threading.get_ident())

    def _shared(self) -> SharedBudget:
        """This thread's loops under this budget (a loop that records every step, its step
        refusing tracing, has no executor to hold its tape, and is not counted)."""
        per_thread = self._memory.setdefault("shared", {})
        thread = threading.get_ident()
        shared = per_thread.get(thread)
        if shared is None:
            shared = per_thread[thread] = SharedBudget()
        return shared

    @property
    def last(self) -> Estimate | None:
        """The table of the last loop this budget planned, or None."""
        return self._memory.get("last")

    @property
    def last_pass(self) -> tuple[Estimate, ...]:
        """The tables of the loops this thread's latest pass planned, in order (the layers
        of a stacked RNN: each one's plan, what was held as it was planned, what it left for
        the loops after it); see `held_bytes`."""
        return self._shared().last_pass()

    def explain(self, *args: Any, **kwargs: Any) -> Estimate:
        """Print the table of the last loop planned, or, given `estimate`'s arguments
        (``step, init, xs, length=...``), of that loop; returns it."""
        if args or kwargs:
            result = estimate(*args, budget=self, **kwargs)
        elif self.last is None:
            raise StrategyConfigError(
                f"{self!r}.explain(): this budget has planned no loop yet; run a scan under it "
                "first, or pass the loop: explain(step, init, xs)")
        else:
            result = self.last
        print(result.table())
        return result


def _admitted(bound: float | None, lossy: bool, max_rel_error: float | None) -> bool:
    if bound is None:
        return True
    if max_rel_error is not None:
        return bound <= max_rel_error
    return lossy


def _forms(
    lossy: bool, max_rel_error: float | None
) -> tuple[dict[str, Strategy], dict[str, Strategy | None]]:
    """The step forms and snapshot storages worth measuring: lossy ones only when admitted."""
    forms = {k: s for k, s in STEP_FORMS.items()
             if _admitted(relative_error_bound(s), lossy, max_rel_error)}
    snapshots = {k: s for k, s in SNAPSHOT_FORMS.items()
                 if _admitted(relative_error_bound(s), lossy, max_rel_error)}
    return forms, snapshots


def _loop_key(loop: StepLoop, carry_leaves: list[Any],
              ) -> tuple[Any, tuple[weakref.ref[Any], ...]] | None:
    """(key, refs) naming `loop` across calls, or None (then it is measured every time).

    The step is named as the step-program cache names it (`step_identity`): a function made
    anew on every call (`while_loop`'s wrapper of the body, a lambda written inside a
    training loop) by its code and the identities of what it closes over, so a loop run
    again plans from its first call's dry run instead of measuring on every call. The key
    adds the carry's and scanned inputs' shapes, dtypes and gradient needs and the length;
    it holds no step, model or tensor. `refs`: weak references to the code and to those
    captured objects that can be held weakly; once one has died the key is stale (another
    object may now have its id)."""
    held: list[Any] = []
    owner, identities = step_identity(loop.step, held)
    meta = tuple(None if t is None else (t.shape, str(t.dtype), t.requires_grad)
                 for t in [*carry_leaves, *loop.xs_leaves])
    key = (id(owner), identities, str(loop.carry_spec), str(loop.xs_spec), meta, loop.n)
    try:
        hash(key)
        refs = [weakref.ref(owner)]
    except TypeError:  # a step that cannot be named so is measured every time
        return None
    for part in held:
        with contextlib.suppress(TypeError):  # a number, a tuple: named by its id alone
            refs.append(weakref.ref(part))
    return key, tuple(refs)


def _alive(refs: tuple[weakref.ref[Any], ...]) -> bool:
    return all(ref() is not None for ref in refs)


def _online_families(families: Iterable[Family], limit: int | None,
                     who: str) -> tuple[Family, ...]:
    """Of `families`, those whose plans run a loop that ends when `until` says so, priced as
    they run it: binomial plans online; keeping every step only if the loop's length is
    bounded (`limit`)."""
    online = {binomial: binomial_online}
    if limit is not None:
        online[keep_every_step] = keep_every_step_until
    chosen = tuple(online[f] for f in families if f in online)
    if not chosen:
        raise StrategyConfigError(
            f"{who}: this loop ends when `until` says so, and of the plan families only "
            f"{', '.join(f.__name__ for f in online)} run such a loop; admit one")
    return chosen


def _sized(loop: StepLoop, limit: int | None) -> StepLoop:
    """`loop` (of unknown length) as priced: at most `limit` steps, or `OPEN_LOOP_STEPS`."""
    return replace(loop, n=limit if limit is not None else OPEN_LOOP_STEPS)


FIRST_PASS_SLACK = 0.1
"""In a first pass, a loop left too little by the loops before it may pass the budget by this
fraction of it more than its leanest plan would, for a faster plan (see `Budget`)."""

OPEN_LOOP_STEPS = 4097
"""The length a loop of unknown length is priced at (`Budget.choose_open`): binomial plans
of up to 4,096 snapshots, whose peak tape does not grow with the length."""

_DRY_RUNS: OrderedDict[Any, tuple[Any, StepCost]] = OrderedDict()
DRY_RUNS_KEPT = 16
"""Dry runs remembered across budgets and `estimate` calls (the least recently used goes)."""


def dry_run(loop: StepLoop, carry_leaves: list[Any], lossy: bool,
            max_rel_error: float | None, disk: bool) -> StepCost:
    """The measured costs of `loop`, shared by every budget and `estimate` call that prices
    the same step on the same shapes with the same forms: a second budget for one loop (a
    sweep over limits, `estimate` then `Budget`) plans from the same figures, so its choices
    differ only by the limit, not by the machine's noise between two dry runs. The step is
    held by weak reference: a remembered dry run keeps no model alive."""
    forms, snapshots = _forms(lossy, max_rel_error)
    named = _loop_key(loop, carry_leaves)
    key = refs = None
    if named is not None:  # the step named by the ids of what identifies it, not held
        key, refs = (named[0], tuple(forms), tuple(snapshots), disk), named[1]
    held = _DRY_RUNS.get(key) if key is not None else None
    if held is not None and _alive(held[0]):
        with contextlib.suppress(KeyError):  # another thread may have let it go
            _DRY_RUNS.move_to_end(key)
        return held[1]
    # the library's work, not the program's: a profile neither counts it nor slows it (its
    # figures are those of an unprofiled run, so the plan does not depend on whether the run
    # is profiled), `inspect.loops` does not list its loops, and one 'planned' event tells
    # its time and tape instead (the executor's calibration, on a process's first, within)
    began = time.perf_counter()
    with events.muted(), loop_log.muted(), step_scope(DRY_RUN):  # the step's hooks dropped
        cost = with_overhead(measure(loop, carry_leaves, forms, snapshots, disk=disk))
    if events.listeners:
        events.emit("planned", (time.perf_counter() - began, cost.dry_run_bytes))
    if key is not None:
        _DRY_RUNS[key] = (refs, cost)
        while len(_DRY_RUNS) > DRY_RUNS_KEPT:
            _DRY_RUNS.popitem(last=False)
    return cost


def forget_dry_runs() -> None:
    """Drop every remembered dry run: the next budget or `estimate` that prices a loop
    measures again (after the machine's load changed, say). A budget that already planned
    the same loop keeps the table it made."""
    _DRY_RUNS.clear()


def _budget_error(budget: Budget, result: Estimate, later: Sequence[Any] = (),
                  extras: Sequence[int] = ()) -> BudgetError:
    smallest = min(result.rows, key=lambda r: r.peak_tape_bytes)
    if later or any(extras):  # the loops of a pass, together, and what was saved beside them
        least = result.held_bytes + least_together(result.rows, list(later), extras)
        growth = max(extras, default=0)
        others = f" and the {len(later)} loop(s) that followed it" if later else ""
        return BudgetError(
            f"{budget!r}: this scan{others} cannot fit in "
            f"{format_bytes(result.limit_bytes or 0)} of tape beside what was held with them "
            f"last time (earlier loops and values hold {format_bytes(result.held_bytes)}, and "
            f"the values saved while they ran up to {format_bytes(growth)} more): their leanest "
            f"plans need {format_bytes(least)} ({least} bytes) in all; raise the budget to "
            "at least that; Budget(...).explain() shows this loop's plans", least)
    hint = "" if budget.admits_lossy else (
        ", or admit quantized storage with lossy=True (or max_rel_error=...)")
    loop = ("of unknown length" if result.until == "unknown" else
            f"of {'at most ' if result.until else ''}{result.n_steps} steps")
    held = result.held_bytes
    if held:
        room = (f"the {format_bytes(max((result.limit_bytes or 0) - held, 0))} left of "
                f"{format_bytes(result.limit_bytes or 0)} of tape ({format_bytes(held)} are "
                "held by earlier loops and values under this budget until their backward "
                "sweep)")
        least = (f"raise the budget to at least {format_bytes(result.minimum_bytes)} "
                 f"({result.minimum_bytes} bytes), or run the earlier loops' backward first")
    else:
        room = f"{format_bytes(result.limit_bytes or 0)} of tape"
        least = "raise the budget to at least that"
    return BudgetError(
        f"{budget!r}: no plan for this scan {loop} fits in {room}; the smallest, "
        f"{smallest.name}, needs {format_bytes(smallest.peak_tape_bytes)} "
        f"({smallest.peak_tape_bytes} bytes): {least}{hint}; Budget(...).explain() shows "
        "every plan",
        result.minimum_bytes,
    )


def estimate(
    step: Callable[[Any, Any], Any],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    budget: Budget | int | str | None = None,
    *,
    reverse: bool = False,
    until: Callable[[Any], Any] | None = None,
    lossy: bool = False,
    max_rel_error: float | None = None,
    disk: bool = False,
    families: tuple[Family, ...] = FAMILIES,
) -> Estimate:
    """Predict every candidate plan of ``scan(step, init, xs, length)`` without running it.

    One dry run of the first steps prices them (see `checkpoint_ad.strategies.budget.pricing`). With
    a `budget` (a `Budget`, or bytes / a size string) the table marks the plan `scan` would run
    under it (a `Budget` brings its own `lossy`, `max_rel_error`, `disk` and `families`);
    without one, every plan fits and `chosen` is the fastest. Times are those of the steps as
    the loop will run them: replayed from a step program where the step traces, recorded
    where it refuses (`StepCost.mode` says which). `disk=True` also prices plans with disk
    snapshots (one write and read of the carry is timed; see `Budget`). With `until` (the
    predicate `scan` would stop on; only its presence matters here) the loop is priced as
    one that ends when it says so: keep-all at its longest run, if xs or length= bounds it,
    and binomial plans placing their snapshots online (see `Budget.choose_open`).

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor(0.5, requires_grad=True)
    >>> table = cad.estimate(lambda h, x: (cad.tanh(h * w + x), None), cad.zeros(256),
    ...                      xs=cad.ones((40, 256)), budget="16KiB")
    >>> table.chosen.peak_tape_bytes <= 16 * 1024
    True
    """
    if isinstance(budget, Budget):
        planner = budget
    elif budget is not None:
        planner = Budget(budget, lossy=lossy, max_rel_error=max_rel_error, disk=disk,
                         families=families)
    else:
        planner = None
    if reverse and xs is not None:
        leaves, spec = flatten(xs)
        xs = unflatten(spec, [None if t is None else t[::-1] for t in leaves])
    carry_leaves, carry_spec = flatten(init)
    xs_leaves, xs_spec = ([], None) if xs is None else flatten(xs)
    limit = loop_length(xs_leaves, length, open_ended=until is not None)
    loop = StepLoop(step, carry_spec, xs_leaves, xs_spec, limit or 0)
    if limit == 0:
        raise StrategyConfigError("estimate: the loop has no steps; there is nothing to plan")
    if planner is not None:
        if until is not None:
            return planner.estimate_open(loop, carry_leaves, limit)
        return planner.estimate_loop(loop, carry_leaves)
    if not isinstance(disk, bool):
        raise StrategyConfigError(f"estimate(disk={disk!r}): disk must be True or False")
    admit = lambda c: _admitted(c.error_bound, lossy, max_rel_error)
    if until is not None:
        cost = dry_run(_sized(loop, limit), carry_leaves, lossy, max_rel_error, False)
        return plan_table(cost, None, _online_families(families, limit, "estimate"), admit,
                          "unknown" if limit is None else "at most")
    cost = dry_run(loop, carry_leaves, lossy, max_rel_error, disk)
    return plan_table(cost, None, families, admit)
