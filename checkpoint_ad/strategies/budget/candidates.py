"""The plans a budget chooses from, each priced from a measured `StepCost`.

A *family* is a function ``family(cost) -> iterable of Candidate``: one way to run a loop, over
its parameter (periodic over k, binomial over s). `FAMILIES` lists the built-in ones; adding a
way (offloaded snapshots, a multi-level plan) is one more function passed in `families=` to
`Budget` and `estimate` (or appended to a copy of `FAMILIES`), with no change elsewhere.

Peak tape bytes are what the profiler counts as the tape's own (`Profile.peak_tape_bytes`): the
snapshots alive at once plus the longest tape recorded at once. Times add the measured step
costs as the executor spends them: ``n`` taped steps and their backward, every re-run
(`Advance`) at the untaped cost, and packing / unpacking of stored carries. A planned loop
whose step traces to a step program (`StepCost.replays`) records step 0 (with a tape, to find
what the step captures) and step 1 (without, traced) and replays every later step, re-run and
backward, so those are priced at the replayed costs; a step that refuses tracing is priced at
the recorded ones. A plain `scan` (keep-all and the every-step forms) replays too when
`PLAIN_SCAN_REPLAYS` says it does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ...saved import KEEP, Strategy
from ..base import StoreInputs, StoreOutputs
from ..kinds import LoopStrategy
from ..plans.loop_strategies import Binomial, Periodic
from ..plans.revolve import (
    Advance,
    DiskSnapshot,
    Reverse,
    ReverseSegment,
    Snapshot,
    optimal_evaluations,
    simulate_plan,
)
from ..quantized import Quantized
from ..selective import Selective
from .pricing import FormCost, StepCost, relative_error_bound

# the saved-value strategies a step's values may go through (lossy ones only when admitted)
STEP_FORMS: dict[str, Strategy] = {
    "keep": KEEP,
    "store-inputs": StoreInputs(),
    "store-outputs": StoreOutputs(),
    "int8": Quantized(bits=8),
    "int4": Quantized(bits=4),
    # the attention core re-run in backward (priced only where the step opens such a region;
    # its steps are recorded, not replayed: see `_replays`)
    "selective": Selective(),
}
# how stored carries (snapshots) may be kept; None keeps them as they are
SNAPSHOT_FORMS: dict[str, Strategy | None] = {"keep": None, "int8": Quantized(bits=8),
                                              "int4": Quantized(bits=4)}
_SIMULATED_UP_TO = 100_000  # step evaluations; longer plans estimate their pack counts

PLAIN_SCAN_REPLAYS = True
"""Whether a plain `scan` (no loop strategy, grad enabled, ``trace=True``) replays its steps
after the first two (`kept_loop.py`), as planned loops replay theirs: keep-all and the
every-step forms are then priced at replayed costs after two recorded steps."""


@dataclass(frozen=True)
class Candidate:
    """One way to run the loop, with its predicted figures."""

    name: str
    loop: LoopStrategy | None
    """The loop strategy (None: record every step, as a plain `scan`)."""
    storage: Strategy
    """The saved-value strategy every step's values go through."""
    peak_tape_bytes: int
    forward_seconds: float
    backward_seconds: float
    evaluations: int
    """Step evaluations, taped and re-run."""
    error_bound: float | None
    """Lossy plans: the most a stored value moves, relative to its group's range."""
    engine_bytes: int = 0
    """Memory of the engine's own at the peak beyond the tape's arrays: the objects its taped
    steps hold and one step's backward temporaries (in the device peak, not the tape's)."""

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def lossless(self) -> bool:
        return self.error_bound is None


Family = Callable[[StepCost], Iterable[Candidate]]


def _replays(cost: StepCost, form: FormCost) -> bool:
    """Whether a loop replays its steps under `form` (a form whose step refuses tracing,
    a `Selective` region's, records them while the others replay)."""
    return cost.replays and form.replayed_taped_seconds is not None


def _tape(form: FormCost, steps: int, stored: int = 0) -> int:
    """Bytes of `steps` consecutive steps on one tape. Its carry-in counts only where no
    snapshot is stored: a plan's peak comes when its forward holds every snapshot and tapes
    the last steps from a carry it does not own, or when a re-run step saves a carry that
    replaced a freed snapshot."""
    carry = form.carry_saved_bytes if stored == 0 else 0
    return form.first_bytes + carry + (steps - 1) * form.step_bytes


def _engine(cost: StepCost, form: FormCost, taped_steps: int) -> int:
    """Bytes of the engine's objects `taped_steps` replayed taped steps hold, and one step's
    backward temporaries (0 when the loop records its steps: not traced)."""
    if not _replays(cost, form):
        return 0
    return taped_steps * form.step_object_bytes + form.backward_working_bytes


def _speeds(cost: StepCost, form: FormCost) -> tuple[float, float, float]:
    """Seconds per step a planned loop spends replaying it (or recording it, when the step
    refuses tracing): (without a tape, with one, backward)."""
    if _replays(cost, form):
        assert form.replayed_taped_seconds is not None
        assert cost.replayed_untaped_seconds is not None
        assert form.replayed_backward_seconds is not None
        return (cost.replayed_untaped_seconds, form.replayed_taped_seconds,
                form.replayed_backward_seconds)
    return cost.untaped_seconds, form.taped_seconds, form.backward_seconds


def keep_every_step(cost: StepCost) -> Iterator[Candidate]:
    """Every step recorded (a plain `scan`), its values in each measured form; replayed after
    the first two when `PLAIN_SCAN_REPLAYS` (and the step traces)."""
    n = cost.n_steps
    for name, form in cost.forms.items():
        recorded = n
        if PLAIN_SCAN_REPLAYS and _replays(cost, form):
            recorded = min(n, 2)
        _, taped, backward = _speeds(cost, form) if recorded < n else (0.0, 0.0, 0.0)
        yield Candidate(
            name=name if name != "keep" else "keep-all",
            loop=None,
            storage=STEP_FORMS[name],
            peak_tape_bytes=_tape(form, n) + form.rerun_bytes,
            forward_seconds=(recorded * form.taped_seconds + (n - recorded) * taped
                             + n * cost.row_seconds),
            backward_seconds=recorded * form.backward_seconds + (n - recorded) * backward,
            evaluations=n,
            error_bound=relative_error_bound(STEP_FORMS[name]),
            engine_bytes=_engine(cost, form, n - recorded),
        )


def _geometric(top: int, extra: Iterable[int] = ()) -> list[int]:
    """1, 2, 3, 4, 5, 6, 8, 10, 12, 16, ... up to `top`, and `extra`: the parameter values
    a family is priced at (plans between two neighbours differ by under 25%)."""
    values = set(v for v in extra if 1 <= v <= top)
    v = 1
    while v <= top:
        values.add(v)
        v = max(v + 1, int(v * 1.25))
    if top >= 1:
        values.add(top)
    return sorted(values)


def periodic(cost: StepCost) -> Iterator[Candidate]:
    """`Periodic(k)`: a carry stored every k steps, each segment re-run on one tape."""
    n = cost.n_steps
    form, snap = cost.forms["keep"], cost.snapshots["keep"]
    for k in _geometric(n - 1, [round(math.sqrt(n)), 16, 32, 64]):
        segments = -(-n // k)
        stored = segments - 1
        last = n - stored * k
        advanced = n - last
        forward, backward = _planned_seconds(cost, form, advanced, last, advanced, 0)
        yield Candidate(
            name=f"periodic k={k}",
            loop=Periodic(k),
            storage=KEEP,
            peak_tape_bytes=_periodic_peak(form, snap.bytes, k, stored, last),
            forward_seconds=forward + stored * cost.snapshot_overhead_seconds,
            backward_seconds=backward + segments * cost.reverse_overhead_seconds,
            evaluations=n + advanced,
            error_bound=None,
            engine_bytes=_engine(cost, form, k),
        )


def _periodic_peak(form: FormCost, snapshot_bytes: int, k: int, stored: int, last: int) -> int:
    """Peak tape of `Periodic(k)` over `stored` snapshots and a last segment of `last` <= k
    steps. Its forward ends holding every snapshot and the last segment taped. Then the
    backward drops the last segment's snapshot, and re-runs each earlier segment from a
    snapshot it restores and drops, whose carry the re-run's first step saves: the first
    re-run (the largest) holds `stored - 2` snapshots beside a k-step tape. So a full
    segment and every snapshot are held together only when k divides the loop (priced as
    together, a periodic plan's peak read 0.875 of its prediction for the RNN at 16 steps,
    k = 3, and for heat at 64 steps, k = 6)."""
    forward_end = stored * snapshot_bytes + _tape(form, last, stored)
    if stored == 0:
        return forward_end
    if stored == 1:  # the one re-run starts from the caller's carry
        return max(forward_end, _tape(form, k, stored))
    return max(forward_end, (stored - 2) * snapshot_bytes + _tape(form, k, 0))


def _planned_seconds(
    cost: StepCost, form: FormCost, advanced: int, last: int, retaped: int, rerun: int
) -> tuple[float, float]:
    """(forward, backward) seconds of a plan whose forward advances `advanced` steps without
    a tape and tapes the `last` ones (kept for the first reverse), and whose backward re-runs
    `retaped` steps with a tape and `rerun` without, as the executor runs them: step 0 with a
    tape (to find what the step captures), step 1 without (both recorded and traced), then
    replayed steps once the program is known; a segment taped before that is recorded."""
    untaped, taped, backward = _speeds(cost, form)
    n = advanced + last
    rows = cost.row_seconds  # each forward step writes its outputs into their rows
    if not _replays(cost, form):
        discovery = form.taped_seconds - untaped if advanced else 0.0
        return (advanced * untaped + last * taped + discovery + n * rows,
                n * backward + retaped * taped + rerun * untaped)
    written = n  # the steps whose rows are priced apart
    if advanced >= 2:  # the program is known before the kept steps are taped
        step = cost.replayed_forward_seconds
        forward = (form.taped_seconds + cost.untaped_seconds
                   + (advanced - 2) * (untaped if step is None else step) + last * taped)
        if step is not None:  # a replayed advance's price has its rows already
            written = 2 + last
        kept_backward = last * backward
    else:  # the kept segment starts before step 2: it is recorded
        forward = advanced * form.taped_seconds + last * form.taped_seconds
        kept_backward = last * form.backward_seconds
    forward += written * rows
    return forward, advanced * backward + kept_backward + retaped * taped + rerun * untaped


def binomial(cost: StepCost) -> Iterator[Candidate]:
    """`Binomial(s)` (Revolve), snapshots in each measured snapshot storage."""
    for storage_name in cost.snapshots:
        for s in _geometric(max(cost.n_steps - 1, 1), [4, 8, 16, 32]):
            yield _binomial(cost, s, storage_name)


def _binomial(cost: StepCost, s: int, storage_name: str) -> Candidate:
    n = cost.n_steps
    form, snap = cost.forms["keep"], cost.snapshots[storage_name]
    storage = SNAPSHOT_FORMS[storage_name]
    advanced = optimal_evaluations(n, s) - n
    stored = min(s, n - 1)
    suffix = "" if storage is None else f" {storage_name} snapshots"
    # a quantized snapshot comes back as a new full-size carry, which the re-run saves
    tape = _tape(form, 1, stored if storage is None else 0)
    forward, backward = _planned_seconds(cost, form, n - 1, 1, n - 1, advanced - (n - 1))
    packs, restores = backward_snapshots(n, s)
    return Candidate(
        name=f"binomial s={s}{suffix}",
        loop=Binomial(s, storage),
        storage=KEEP,
        peak_tape_bytes=stored * snap.bytes + tape,
        forward_seconds=forward + stored * (snap.pack_seconds + cost.snapshot_overhead_seconds),
        backward_seconds=(backward + packs * (snap.pack_seconds + cost.snapshot_overhead_seconds)
                          + restores * (snap.unpack_seconds + cost.advance_overhead_seconds)
                          + n * cost.reverse_overhead_seconds),
        evaluations=n + advanced,
        error_bound=relative_error_bound(storage),
        # the plan (8 bytes an action) and each snapshot's objects, held throughout
        engine_bytes=(_engine(cost, form, 1) + 8 * binomial_actions(n, s)
                      + stored * snap.object_bytes),
    )


def binomial_online(cost: StepCost) -> Iterator[Candidate]:
    """`Binomial(s)` on a loop that ends when `until` says so, its snapshots placed online
    (`online.OnlinePlanner`): the forward tapes every step and keeps the newest tape until
    the next step tells whether to snapshot its starting state, so the peak holds that
    state twice (in the kept tape and in the snapshot taken from it) and the forward pays a
    taped step for each untaped one. Step evaluations are the offline optimum's (online is
    optimal up to C(s + 2, 2) steps and measured within 1% of it up to 10**5)."""
    n = cost.n_steps
    for storage_name in cost.snapshots:
        for s in _geometric(max(n - 1, 1), [4, 8, 16, 32]):
            offline = _binomial(cost, s, storage_name)
            form = cost.forms["keep"]
            untaped, taped, _ = _speeds(cost, form)
            # a quantized snapshot's plan is priced with a full carry on the tape already
            twice = form.carry_saved_bytes if SNAPSHOT_FORMS[storage_name] is None else 0
            online = n * cost.online_step_seconds + planner_seconds(
                n, s, cost.planner_step_seconds, cost.planner_snapshot_seconds)
            yield replace(offline, peak_tape_bytes=offline.peak_tape_bytes + twice,
                          forward_seconds=(offline.forward_seconds + (n - 1) * (taped - untaped)
                                           + online))


def planner_seconds(n: int, s: int, per_step: float, per_snapshot: float) -> float:
    """The online planner's time over `n` steps with `s` snapshots, as `per_step` and
    `per_snapshot` (`StepCost.planner_step_seconds`, `planner_snapshot_seconds`) model it
    (`overhead._planner_model`): unpriced, a 600-step loop's forward under an online
    `Binomial(293)` read 4x its prediction."""
    return n * per_step + per_snapshot * s * max(0, n - s)


def keep_every_step_until(cost: StepCost) -> Iterator[Candidate]:
    """`keep_every_step`, of a loop that stops on `until`: `until` asked after every step."""
    extra = cost.n_steps * cost.until_step_seconds
    for c in keep_every_step(cost):
        yield replace(c, forward_seconds=c.forward_seconds + extra)


def engine_bytes(cost: StepCost) -> int:
    """What the engine holds at a loop's peak beyond what its plan is priced from, whatever
    the plan: the dry run's trial that kept its steps (`pricing.Trial`) took this much more
    in its backward than its gradients, outputs and carries, and than keeping its steps is
    priced at here. The step program, the executor's state (its keys, guards, random
    states), what the traced first steps leave and the allocator's small blocks are in it;
    before it was measured, a budget's device peak for the RNN (batch 64, hidden 256) read
    0.81-0.97 of what it held, for heat (grid 128) 0.50-0.98. 0 without a trial."""
    trial = cost.trial
    if trial is None:
        return 0
    form = cost.forms["keep"]
    priced = _tape(form, trial.steps) + _engine(cost, form, trial.steps)
    return max(0, trial.kept_backward_bytes - trial.named_bytes - priced)


def rerun_engine_bytes(cost: StepCost) -> int:
    """What a plan that re-runs steps (a `Binomial` or `Periodic` plan) holds at its peak
    beyond `engine_bytes`: the trial under `Binomial(1)` left this much more than its price
    and the engine's share (a re-run carry beside the tape, a gradient's new term beside its
    running sum: 4 MiB for the RNN at batch 512, hidden 1,024)."""
    if cost.trial is None:
        return 0
    return max(0, _rerun_residual(cost) - engine_bytes(cost))


def _rerun_residual(cost: StepCost) -> int:
    """The trial's `Binomial(1)` backward beyond its named bytes and its own price."""
    trial = cost.trial
    assert trial is not None
    priced = _binomial(replace(cost, n_steps=trial.steps), 1, "keep")
    return max(0, trial.backward_bytes - trial.named_bytes - priced.peak_tape_bytes
               - priced.engine_bytes)


@functools.lru_cache(maxsize=4096)
def binomial_actions(n: int, s: int) -> int:
    """Actions in `Binomial(s)`'s plan of n steps (packed, 8 bytes each), counted where the
    plan is simulated anyway (`backward_snapshots`), else about four a step (an advance, a
    snapshot, a restore, a reverse)."""
    if optimal_evaluations(n, s) <= _SIMULATED_UP_TO:
        return len(Binomial(s).plan(n))
    return 4 * n


@functools.lru_cache(maxsize=4096)
def backward_snapshots(n: int, s: int) -> tuple[int, int]:
    """(snapshots taken, snapshots restored) in the backward sweep of `Binomial(s)`."""
    if optimal_evaluations(n, s) <= _SIMULATED_UP_TO:
        stats = simulate_plan(Binomial(s).plan(n))
        return max(stats.snapshots_taken - min(s, n - 1), 0), stats.restores
    return n - 1, n - 1  # each reverse after the first follows one restore; packs as many


DISK_RAM_SNAPSHOTS = (1, 2, 3, 4, 6, 8, 12, 16)
"""RAM snapshots of the RAM + disk plans priced: the small budgets they are for."""


def binomial_disk(cost: StepCost) -> Iterator[Candidate]:
    """`Binomial(s, disk=None)`: s RAM snapshots plus the disk snapshots that pay for their
    measured write and read (H-Revolve, `multilevel.py`); disk bytes are not tape bytes. Only
    when the dry run timed the disk (``Budget(limit, disk=True)``): writing files is the
    user's call. A plan that writes nothing to disk is `binomial`'s, and left out."""
    if cost.disk is None:
        return
    n = cost.n_steps
    form, snap = cost.forms["keep"], cost.snapshots["keep"]
    step = max(_speeds(cost, form)[0], 1e-9)  # the plan's costs are in re-run steps
    write, read = cost.disk.pack_seconds / step, cost.disk.unpack_seconds / step
    for s in DISK_RAM_SNAPSHOTS:
        if s >= n - 1:
            break
        strategy = Binomial(s, disk=None, write_cost=round(write, 3), read_cost=round(read, 3))
        plan = strategy.plan(n)
        if plan.disk_writes == 0:
            continue
        advanced, last, forward_writes, forward_snapshots = _forward_part(plan)
        forward, backward = _planned_seconds(cost, form, advanced, last, n - last,
                                             plan.advanced_steps - advanced)
        forward += forward_snapshots * cost.snapshot_overhead_seconds
        backward += n * cost.reverse_overhead_seconds
        stored = plan.max_live_snapshots
        yield Candidate(
            name=f"binomial s={s} + disk",
            loop=strategy,
            storage=KEEP,
            peak_tape_bytes=stored * snap.bytes + _tape(form, 1, stored),
            forward_seconds=forward + forward_writes * cost.disk.pack_seconds,
            backward_seconds=backward + (plan.disk_writes - forward_writes)
            * cost.disk.pack_seconds + plan.disk_reads * cost.disk.unpack_seconds,
            evaluations=n + plan.advanced_steps,
            error_bound=None,
            engine_bytes=_engine(cost, form, 1),
        )


def _forward_part(plan: Any) -> tuple[int, int, int, int]:
    """(steps advanced, steps taped, disk writes, snapshots) of a plan's forward: its actions
    up to and including its first reverse action."""
    advanced = writes = snapshots = 0
    for action in plan:
        if isinstance(action, Advance):
            advanced += action.stop - action.start
        elif isinstance(action, DiskSnapshot):
            writes += 1
            snapshots += 1
        elif isinstance(action, Snapshot):
            snapshots += 1
        elif isinstance(action, Reverse):
            return advanced, 1, writes, snapshots
        elif isinstance(action, ReverseSegment):
            return advanced, action.stop - action.start, writes, snapshots
    return advanced, 0, writes, snapshots


FAMILIES: tuple[Family, ...] = (keep_every_step, periodic, binomial, binomial_disk)
