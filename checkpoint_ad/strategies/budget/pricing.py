"""Pricing a `scan` from a dry run of its first steps: what `Budget` and `estimate` plan from.

Why measure rather than count: what a step saves depends on the forms its primitives record,
on values shared between consecutive steps (a tanh's output is the next matmul's input, kept
once) and on what the caller holds anyway (parameters, the input data), and its time depends on
the machine. So the real step function runs on the real carry, once per saved-value strategy
priced: steps 0 and 1 with a tape (step 1 shows what each further step adds in a chain), then
their backward sweep, timed; plus the steps without a tape, and the carry packed as a snapshot.

A loop runs most of its steps replayed from a step program (`step_program.py`), far faster
than recording them, so the dry run also traces steps 0 and 1 the way the executor does
(`traced_call`, `program_of`) and times the program's three replays per step: without a tape
(`run`, what an `Advance` costs), with one (`tape`), and that tape's backward (`pull_back_steps`).
A step that refuses tracing (an `.item()`, an in-place change, ...) is recorded by the loop,
and the recorded times price it. Last, a trial: the loop's first few steps run for real by
the plan executor and pulled back, measured (tracemalloc on the host, cupy's pool on a
GPU), for what the engine itself holds beyond the arrays a plan is priced from (`Trial`).
With ``disk=True``, one disk write and read of the carry is timed too (for plans with disk
snapshots).

The dry run changes nothing the loop computes afterwards: randomness it draws is replayed from
the state before it (the engine's generator and numpy's global one are left as they were), its
tape is its own (gradients are captured, never added to `.grad`; what was recorded before it is
not touched), and the loop's evaluation count is restored. It does run the user's step: side
effects the step has outside the tape (a Python counter) happen on each of its calls (a few
dozen, each timed phase repeating up to `TIMING_SECONDS`).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from statistics import median
from typing import Any

import numpy as np

from ... import random
from ...autograd import Capture, backpropagate
from ...backend import device_name, is_floating, namespace
from ...backend import nbytes as array_nbytes
from ...errors import InplaceError
from ...grad_mode import _state, enable_grad
from ...object_bytes import added_bytes
from ...profiler.memory import CupyHookProbe, TracemallocProbe, probe_for
from ...profiler.recorder import profile
from ...pytree import flatten, unflatten
from ...saved import KEEP, SavedBuffer, Strategy, use_packer
from ...tape import Entry, edge_of, next_sequence
from ...tensor import Tensor
from ..loops.hoisted_rows import program_chunk_bytes
from ..loops.loop import StepLoop, row_tensor
from ..loops.output_rows import OutputRows
from ..loops.plan_executor import PlannedLoop, replay_forward, snapshot_object_bytes
from ..loops.step_program import StepProgram, program_of, traced_call
from ..loops.step_pull_back import pull_back_steps
from ..loops.step_tape import tape_steps
from ..plans.loop_strategies import Binomial, Periodic
from ..quantized import Quantized
from ..selective import Selective, regions_run
from ..storage.offload import Offload

REPEATS = 3  # dry runs per strategy priced; each phase's time is the median measured
TIMING_SECONDS = 0.02
"""Each timed phase repeats (at least `REPEATS`, at most `MOST_REPEATS` times) until this long
is spent: the median of many is a steady figure of what a step typically costs on the machine
as it is, and cheap steps cost little."""
MOST_REPEATS = 30
REPLAYED_STEPS = 8
"""Steps the untaped replay is timed over (fewer in a shorter loop)."""
TRIAL_STEPS = 4
"""Steps of the trial run of the plan executor (`_trial_run`; fewer in a shorter loop)."""
DRY_ROWS = max(REPLAYED_STEPS, TRIAL_STEPS, 2)
"""Rows of xs the dry run reads (copied: `_dry_copies`)."""


@dataclass(frozen=True)
class FormCost:
    """One step's tape when every value it saves goes through one saved-value strategy."""

    first_bytes: int
    """Saved bytes step 0's tape owns, its carry-in left out (the caller's, or a snapshot's)."""
    step_bytes: int
    """Saved bytes each further step adds when steps are recorded one after another."""
    carry_saved_bytes: int
    """Bytes of the carry-in the step saves: owned by the tape once the carry is its own."""
    taped_seconds: float
    """One step's forward with a tape."""
    backward_seconds: float
    """One step's backward sweep."""
    replayed_taped_seconds: float | None = None
    """One step's forward with a tape, replayed from the step program (None: not traced)."""
    replayed_backward_seconds: float | None = None
    """One replayed step's backward (None: not traced)."""
    step_object_bytes: int = 0
    """Memory a replayed taped step holds until its backward beyond the arrays it saves (the
    engine's Python objects: its lists of saved values, its buffers, their array headers),
    sized by walking the dry run's second step (0: not traced). Not tape bytes; a plan's
    device peak counts it once per step taped at its peak."""
    backward_working_bytes: int = 0
    """The most a replayed step's backward allocates for a while beyond the gradients it
    hands out (its rules' temporaries), traced in the dry run (0: not traced). Reached once,
    in the device peak."""
    rerun_bytes: int = 0
    """Tape bytes the backward holds beyond what the forward saved, while it re-runs a
    checkpointed region of the last step (`Selective`'s attention core: its recomputed
    values), as the profiler counts them over the dry run's two steps; 0 for other forms."""


@dataclass(frozen=True)
class SnapshotCost:
    """One stored carry under a snapshot storage."""

    bytes: int
    pack_seconds: float
    unpack_seconds: float
    object_bytes: int = 0
    """The engine's objects per snapshot beyond the stored bytes (in the device peak)."""


@dataclass(frozen=True)
class Trial:
    """Short real runs of a loop's plan executor over its first steps, forward and backward
    (`Binomial(1)`, and `Periodic` keeping them all as a plain `scan` does), as the loop's
    device measured it (`_meter`), above the level before it: what the engine itself holds,
    whatever the plan, which counting arrays does not see (on the host the step program,
    the executor's state, the traced first steps, the allocator's small blocks; on a GPU
    the rules' temporaries and the pool's rounding)."""

    steps: int
    forward_bytes: int
    """The most the forward took: tracing the first steps and compiling their program, when
    little else is held. A planned loop's device peak is at least this."""
    backward_bytes: int
    """The most the run took from the backward's start to its end."""
    named_bytes: int
    """Of `backward_bytes`, what a plan's device peak names apart from the engine: the
    gradients handed out, the outputs and two carries."""
    kept_backward_bytes: int
    """`backward_bytes` of the run that kept every step taped (no re-runs): a plan that
    re-runs steps holds more at its peak than one that keeps them (a re-run carry, a sum
    beside its new term), which one residual for both over-counted by 8-15% for keep-all at
    batch 512, hidden 1,024 (see `candidates.engine_bytes`)."""


@dataclass(frozen=True)
class StepCost:
    """Everything a plan's price is computed from, measured on one loop."""

    n_steps: int
    carry_bytes: int
    untaped_seconds: float
    """One step's forward without a tape (what `Advance` costs per step)."""
    forms: Mapping[str, FormCost]
    snapshots: Mapping[str, SnapshotCost]
    gradient_bytes: int
    """Gradients the loop's backward hands out: captured tensors, carry and xs that need one."""
    output_bytes: int
    """The stacked per-step outputs (ys) of the whole loop."""
    trial: Trial | None = None
    """A short real run of the loop under the plan executor (None: on the host the caller
    traces with tracemalloc already, or a profile listens): what the engine holds beyond
    what a plan is priced from, and the least a first call's device peak is (see
    `candidates.engine_bytes`)."""
    dry_run_bytes: int = 0
    """The most saved bytes the dry run held at once (every buffer of its two steps): a
    profiler around the loop's first run sees them, before the loop, once."""
    mode: str = "recorded: not traced"
    """How a planned loop runs its steps, as its tape entry will say: "replayed", or
    "recorded: <why>" (the step refused tracing)."""
    replayed_untaped_seconds: float | None = None
    """One step replayed without a tape (None when the loop records): a backward's re-run."""
    replayed_forward_seconds: float | None = None
    """One step of a plan's forward replayed without a tape: the replay, the step counted and
    its outputs written into their rows (None when the loop records)."""
    disk: SnapshotCost | None = None
    """One carry written to disk and read back (None unless measured: ``disk=True``)."""
    snapshot_overhead_seconds: float = 0.0
    """What the plan executor adds per snapshot it takes (see `overhead.py`)."""
    reverse_overhead_seconds: float = 0.0
    """What the plan executor adds per reverse action (see `overhead.py`)."""
    advance_overhead_seconds: float = 0.0
    """What the plan executor adds per re-run after a restore (see `overhead.py`)."""
    row_seconds: float = 0.0
    """One step's outputs written into the loop's rows (`OutputRows`) where a plan's forward
    writes them apart from its replayed advances, whose `replayed_forward_seconds` has them
    already: its taped steps (every step of a loop keeping them all), and every step of a
    loop that records. Unpriced, a replayed keep-all forward read 1.13-1.2x its prediction
    (RNN, 256 steps: 0.34 ms of 9 ms writing rows)."""
    call_seconds: float = 0.0
    """What the plan executor spends once per call of a planned loop beyond its steps,
    snapshots and reverse actions (see `overhead.py`)."""
    kept_call_seconds: float = 0.0
    """The same for a replayed loop keeping every step (no loop strategy: `kept_loop.py`)."""
    until_step_seconds: float = 0.0
    """Per step of a loop keeping every step that stops on `until` (see `overhead.py`)."""
    batched_bytes: int = 0
    """A chunk of the step's batched products (`loops/hoisted_rows.py`), held while the loop
    runs, or of the rows its backward stacks (gradients, products' left operands), the
    larger; a plan re-running steps holds both (counted as twice this)."""
    online_step_seconds: float = 0.0
    """Per step of a binomial plan placed online, beyond its taped step and its planner."""
    planner_step_seconds: float = 0.0
    """The online planner's time: this per step, and `planner_snapshot_seconds` per step
    and snapshot held (see `candidates.planner_seconds`)."""
    planner_snapshot_seconds: float = 0.0
    call_overhead_seconds: float = 0.0
    """What each call of a replayed loop pays beyond its priced steps when no call can reuse
    the step program an earlier one compiled: its step captures a value made anew on every
    call (heat's diffusivity), so steps 0 and 1 are traced and a program is compiled again
    (measured in the dry run, beyond recording the two steps). 0 where later calls reuse
    the program. Unpriced, heat's keep-all read 1.03-1.12x its prediction, least of 9 runs."""

    @property
    def replays(self) -> bool:
        """Whether a planned loop replays its steps (priced with the replayed times)."""
        return self.mode == "replayed"


def relative_error_bound(storage: Strategy | None) -> float | None:
    """The most a stored value moves, relative to the range of its group (max - min), for
    lossy storage; None for lossless storage. Round to nearest moves a value at most half a
    quantization step, stochastic rounding at most one; a step is range / (2**bits - 1)."""
    if isinstance(storage, Quantized):
        return (1.0 if storage.stochastic else 0.5) / (2**storage.bits - 1)
    if storage is None or storage.lossless:
        return None
    return float("inf")  # a lossy strategy of the user's whose error is not known here


def measure(
    loop: StepLoop,
    carry_leaves: list[Any],
    forms: Mapping[str, Strategy],
    snapshots: Mapping[str, Strategy | None],
    disk: bool = False,
) -> StepCost:
    """Price `loop` from a dry run (see the module docstring): each strategy in `forms` as the
    saved-value strategy of every step, each storage in `snapshots` for stored carries; with
    `disk`, a disk snapshot's write and read. (`budget.dry_run` runs it unheard by the
    caller's profile and loop log: see there.)"""
    numpy_state = np.random.get_state()
    engine_state = random.get_state()
    caller_loop, xs_bytes = loop, _xs_gradient_bytes(loop)
    loop, carry_leaves = _dry_copies(loop, carry_leaves)
    _refuse_captured_writes(loop, carry_leaves, engine_state, numpy_state)
    evaluations = loop.evaluations
    mode, replayed_untaped, replayed_forward = "recorded: not traced", None, None
    batched = 0
    replayed_runs: list[float] = []
    forward_runs: list[float] = []
    opened = regions_run()
    try:
        untaped = median(_untaped(loop, carry_leaves, engine_state, numpy_state)
                         for _ in _repeating())
        priced: dict[str, FormCost] = {}
        gradient_bytes = output_bytes = dry_run_bytes = 0
        for name, storage in forms.items():
            if isinstance(storage, Selective) and regions_run() == opened:
                continue  # the step opens no region: selective storage is keep-all here
            costs = []
            for _ in _repeating():
                np.random.set_state(numpy_state)
                cost, gradient_bytes, output_bytes, held, nested = _taped(
                    loop, carry_leaves, storage, engine_state, xs_bytes)
                costs.append(cost)
                dry_run_bytes = max(dry_run_bytes, held)
            priced[name] = _typical(costs)
            if nested or isinstance(storage, Selective):
                # values inside an inner loop's entry, or a checkpointed region's inputs: the
                # walk over slots missed them
                profiled = _profiled_bytes(loop, carry_leaves, storage, engine_state)
                priced[name] = _with_nested_bytes(priced[name], *profiled, loop.n)
                if isinstance(storage, Selective):  # a region re-run in the backward
                    peak = _backward_peak_bytes(loop, carry_leaves, storage, engine_state)
                    priced[name] = replace(priced[name], rerun_bytes=max(0, peak - profiled[1]))
        calls: list[float] = []
        anew = False
        for name, storage in forms.items():
            if name not in priced:
                continue
            np.random.set_state(numpy_state)
            program, traced_mode, seconds, traced_anew = _traced(loop, carry_leaves, storage,
                                                                 engine_state)
            if program is None:
                if not calls:  # the step refuses tracing: every form records its steps
                    mode = traced_mode
                    break
                continue  # this form alone records (a `Selective` region drawing randoms)
            mode, anew = traced_mode, traced_anew
            if loop.batch_rows:  # (the caller's xs: the dry run's are a few rows)
                batched = max(batched, program_chunk_bytes(
                    program, [None if x is None else x._data for x in caller_loop.xs_leaves]))
            calls.append(seconds - _steps(loop) * priced[name].taped_seconds)
            run, forward, taped, backward, held = _replayed(program, loop, carry_leaves,
                                                            engine_state)
            dry_run_bytes = max(dry_run_bytes, held)
            replayed_runs.append(run)
            forward_runs.append(forward)
            objects, working = _traced_step_bytes(program, loop, carry_leaves, engine_state)
            priced[name] = replace(
                priced[name], replayed_taped_seconds=taped, replayed_backward_seconds=backward,
                step_object_bytes=objects, backward_working_bytes=working)
        if replayed_runs:
            replayed_untaped = median(replayed_runs)
            replayed_forward = median(forward_runs)
        np.random.set_state(numpy_state)
        rows = _row_seconds(loop, carry_leaves, engine_state)
        np.random.set_state(numpy_state)
        trial = _trial_run(loop, carry_leaves, engine_state)
    finally:
        np.random.set_state(numpy_state)
        loop.evaluations = evaluations
        if caller_loop.y_spec is None:  # what the steps return, as running them finds
            caller_loop.y_spec = loop.y_spec
    carry = [c._data for c in carry_leaves if c is not None]
    return StepCost(
        n_steps=loop.n,
        carry_bytes=sum(array_nbytes(a) for a in carry),
        untaped_seconds=untaped,
        forms=priced,
        snapshots={name: _snapshot_cost(carry, storage) for name, storage in snapshots.items()},
        gradient_bytes=gradient_bytes,
        output_bytes=output_bytes * loop.n,
        trial=trial,
        dry_run_bytes=dry_run_bytes,
        mode=mode,
        replayed_untaped_seconds=replayed_untaped,
        replayed_forward_seconds=replayed_forward,
        disk=_disk_cost(carry) if disk else None,
        call_overhead_seconds=max(0.0, median(calls)) if calls and anew else 0.0,
        row_seconds=rows,
        batched_bytes=batched,
    )


def _traced(
    loop: StepLoop, carry_leaves: list[Any], storage: Strategy, engine_state: Any
) -> tuple[StepProgram | None, str, float, bool]:
    """Steps 0 and 1 traced with a tape under `storage`, as the executor traces them: the
    program they give (None if the step refuses), the loop's mode, the seconds tracing them
    and compiling the program took, and whether every call must do so again (see
    `StepCost.call_overhead_seconds`)."""
    carry = _carry_tensors(carry_leaves, grad=True)
    traces = {}
    began = time.perf_counter()
    with random.replaying(engine_state), enable_grad(), use_packer(storage):
        for t in range(_steps(loop)):
            carry, _, traces[t] = traced_call(loop, t, carry, _x_tensors(loop, t))
    program, mode = program_of(traces, loop.n, len(carry_leaves))
    seconds = time.perf_counter() - began
    # a captured graph value (heat's diffusivity, made from a parameter before the loop) is
    # a new tensor on every call: no later call can reuse this program
    anew = any(tensor._entry is not None for trace in traces.values()
               for tensor in trace.constants.values())
    return program, mode, seconds, anew


def _trial_run(
    loop: StepLoop, carry_leaves: list[Any], engine_state: Any
) -> Trial | None:
    """The loop's first `TRIAL_STEPS` steps run for real by the plan executor and pulled
    back from every output, as a first call runs them (tracing, a program compiled, not kept
    for later calls), twice: under `Binomial(1)` and keeping every step (see `Trial`). Only
    where the loop's device can be measured (`_meter`); else None. (A dry run is unheard by
    the caller's profile, see `budget.dry_run`: a profile would otherwise hear a loop the
    caller did not run, and its own records would be measured as the engine's.) None too
    where the step changes its row or carry in place, which a plan re-running steps refuses
    (`PlannedLoop._changes`)."""
    meter = _meter(carry_leaves)
    if meter is None:
        return None
    steps = min(loop.n, TRIAL_STEPS)
    try:
        forward, backward, named = _trial_of(meter, loop, carry_leaves, engine_state, steps,
                                             Binomial(1))
    except InplaceError:  # the step changes its x in place: a plan re-running it refuses
        return None
    _, kept, _ = _trial_of(meter, loop, carry_leaves, engine_state, steps, Periodic(steps))
    return Trial(steps, forward, backward, named, kept)


def _trial_of(
    meter: TracemallocProbe | CupyHookProbe, loop: StepLoop, carry_leaves: list[Any],
    engine_state: Any, steps: int, plan: Any,
) -> tuple[int, int, int]:
    """(forward bytes, backward bytes, named bytes) of one trial run under `plan`, measured
    by `meter` (started and stopped here)."""
    xs = [None if x is None else _row_tensor(x, x._data[:steps]) for x in loop.xs_leaves]
    trial = StepLoop(loop.step, loop.carry_spec, xs, loop.xs_spec, steps,
                     planned_by_budget=loop.planned_by_budget, batch_rows=loop.batch_rows)
    carry_in = [None if c is None else _row_tensor(c, c._data) for c in carry_leaves]
    seq_before = next_sequence()
    _empty_free_lists()  # as after a collection: what the loop makes, tracemalloc then sees
    meter.start()
    try:
        with random.replaying(engine_state), enable_grad(), use_packer(KEEP):
            carry, ys = PlannedLoop(trial, plan, cached=False).run(carry_in)
            forward = meter.peak()
            meter.reset_peak()
            outputs = [o for o in flatten(carry)[0] + _leaves(ys) if o is not None]
            roots = _ones_at(outputs)
            externals = _externals(_entries(outputs, seq_before), [])
            sink = Capture({key: k for k, key in enumerate(externals)}, newer_than=seq_before)
            if roots:
                backpropagate(roots, retain_graph=False, create_graph=False, capture=sink)
            backward = meter.peak()
    finally:
        meter.stop()
    named = sum(array_nbytes(g) for g in sink.values if g is not None)
    named += sum(array_nbytes(y._data) for y in _leaves(ys))
    named += 2 * sum(array_nbytes(c._data) for c in carry_leaves if c is not None)
    return max(0, forward), max(0, backward), named


def _on_host(arrays: list[Any]) -> bool:
    """Whether the loop's arrays (None: absent) are in host memory (numpy), where the
    engine's Python objects share the device peak with them; on a GPU they do not."""
    return all(a is None or device_name(a) == "cpu" for a in arrays)


def _meter(carry_leaves: list[Any]) -> TracemallocProbe | CupyHookProbe | None:
    """What measures the dry run's allocations on the loop's device: tracemalloc on the
    host, only when it is off (it is started for the measurement; resetting its peak would
    spoil a caller's own), or cupy's pool hook on a GPU (tracemalloc sees none of the
    arrays there: a budget's device peak for the RNN at batch 512, hidden 1,024 read 1.63
    of its prediction on an H200 while only the host was measured); None where neither can."""
    if _on_host([None if c is None else c._data for c in carry_leaves]):
        return None if tracemalloc.is_tracing() else TracemallocProbe()
    probe = probe_for("cuda")
    return probe if isinstance(probe, CupyHookProbe) else None


def _empty_free_lists() -> None:
    """Empty the interpreter's free lists (of tuples, lists, floats...), as a full collection
    does: objects taken from them are invisible to tracemalloc, and a caller measuring a loop
    after `gc.collect()` finds them empty. What is alive is frozen first (unless the caller
    froze some), so the collection scans nothing: 10 us, not a full collection's 0.15 s in a
    heap of two million objects."""
    if gc.get_freeze_count():
        gc.collect()
        return
    gc.freeze()
    try:
        gc.collect()
    finally:
        gc.unfreeze()


def _row_tensor(like: Tensor, array: Any) -> Tensor:
    """`array` as a leaf needing a gradient where `like` does."""
    t = Tensor._wrap(array)
    t._requires_grad = like.requires_grad
    return t


def _replayed(
    program: StepProgram, loop: StepLoop, carry_leaves: list[Any], engine_state: Any
) -> tuple[float, float, float, float, int]:
    """Seconds per step of `program` replayed without a tape, the same as a plan's forward
    runs it, with a tape, and that tape's backward, each the median of `_repeating()`; and
    the bytes the replayed tape held. The steps run as a plan runs them (the executor's rows
    of xs; `step_tape.tape_steps`). Untaped, over the first `REPLAYED_STEPS` (an `Advance`
    runs many in a row; two in a burst priced them 10-25% high); in the forward, through the
    executor's own `replay_forward` (each step also counted and its outputs written into
    their rows), which the backward's re-runs do without: priced as the bare replay, a
    plan's forward read 1.25-1.33x its prediction (heat, 256 steps). Taped and back, over
    the first two, as `_taped` records them: a pull-back's fixed cost is paid per segment,
    and most plans' segments are short (binomial plans reverse one step at a time)."""
    steps = min(loop.n, REPLAYED_STEPS)
    taped = _steps(loop)
    initial = [None if c is None else c._data for c in carry_leaves]
    x_arrays = loop.x_arrays
    keys = _pull_back_keys(program, loop, taped)
    runs, forwards, tapes, backwards = [], [], [], []
    held = 0
    for _ in _repeating():
        with random.replaying(engine_state):
            start = time.perf_counter()
            arrays = initial
            for t in range(steps):
                arrays, _ = program.run(arrays, x_arrays(t))
            runs.append(time.perf_counter() - start)
        with random.replaying(engine_state):
            rows = OutputRows(steps)
            start = time.perf_counter()
            replay_forward(program, loop, initial, 0, steps, rows)
            forwards.append(time.perf_counter() - start)
            del rows
        with random.replaying(engine_state):
            start = time.perf_counter()
            segment, y_out, arrays = tape_steps(program, initial, x_arrays, 0, taped)
            tapes.append(time.perf_counter() - start)
        held = max(held, _replay_held(segment))
        roots = _replay_roots(program, arrays, y_out)
        start = time.perf_counter()
        if roots:
            pull_back_steps(program, segment, roots,
                            Capture({}, initial=[None] * len(keys), owned={}), keys)
        backwards.append(time.perf_counter() - start)
    return (median(runs) / steps, median(forwards) / steps, median(tapes) / taped,
            median(backwards) / taped, held)


def _pull_back_keys(program: StepProgram, loop: StepLoop, steps: int) -> dict[Any, int]:
    """Positions of the gradients a pull-back of `steps` replayed steps hands out."""
    keys: dict[Any, int] = {}
    for k in range(len(program.carry_in)):
        if program.requires_grad[k]:
            keys[("carry", k)] = len(keys)
    for t in range(steps):
        for k, x in enumerate(loop.xs_leaves):
            if x is not None and x.requires_grad:
                keys[("x", t, k)] = len(keys)
    for slot in program.external_keys:
        keys[("ext", slot)] = len(keys)
    return keys


def _traced_step_bytes(
    program: StepProgram, loop: StepLoop, carry_leaves: list[Any], engine_state: Any
) -> tuple[int, int]:
    """(objects, working): bytes the second of two taped replayed steps keeps beyond the
    arrays it saves, and the most the pull-back of both allocates for a while beyond the
    gradients it hands out. The objects are the engine's own per taped step, which a plan
    holding many taped steps holds as many times: sized by walking the step
    (`object_bytes.added_bytes`: what the second step holds that the first does not), since
    tracemalloc misses the small objects the interpreter's free lists hand out, and a long
    loop drains those lists (it traced 764 of the 1,573 bytes a heat step holds). The working
    bytes are a step's backward temporaries, reached once, as the device measures them
    (`_meter`; 0 where it cannot). On a GPU the objects are 0: they are in host memory, not
    in the device peak."""
    steps = _steps(loop)
    if steps < 2:
        return 0, 0
    initial = [None if c is None else c._data for c in carry_leaves]
    keys = _pull_back_keys(program, loop, steps)
    meter = _meter(carry_leaves)
    if meter is not None:
        meter.start()
    try:
        with random.replaying(engine_state):
            segment, y_out, arrays = tape_steps(program, initial, loop.x_arrays, 0, steps)
            objects = added_bytes(segment[1], segment[0]) if _on_host(initial) else 0
            if meter is None:
                return objects, 0
            roots = _replay_roots(program, arrays, y_out)
            # sums added into in place, as the plan executor's are (its `owned`)
            sink = Capture({}, initial=[None] * len(keys), owned={})
            before = meter.current()
            meter.reset_peak()
            if roots:
                pull_back_steps(program, segment, roots, sink, keys)
            peak = meter.peak()
    finally:
        if meter is not None:
            meter.stop()
    handed_out = sum(array_nbytes(g) for g in sink.values if g is not None)
    return objects, max(0, peak - before - handed_out)


def _replay_held(segment: list[tuple[int, Any]]) -> int:
    """Every byte the replayed steps keep for their backward, each buffer counted once, as a
    profiler counts them."""
    seen: set[int] = set()
    total = 0
    for _, step in segment:
        for kept in step.saved:
            for value in kept or ():
                if id(value) in seen:
                    continue
                seen.add(id(value))
                if isinstance(value, SavedBuffer):
                    total += value.stored_nbytes
                else:
                    total += array_nbytes(value)
    return total


def _replay_roots(
    program: StepProgram, carry: list[Any], y_out: list[tuple[int, list[Any]]]
) -> list[tuple[tuple[int, int], Any]]:
    """Ones pulled back from the last step's carry and every step's outputs."""
    last = y_out[-1][0]
    found = [((last, slot), a) for slot, a in zip(program.carry_out, carry)]
    found += [((t, slot), a) for t, ys in y_out for slot, a in zip(program.y_out, ys)]
    return [(key, namespace(a).ones_like(a)) for key, a in found
            if a is not None and key[1] >= 0 and program.requires_grad[key[1]]
            and is_floating(a.dtype)]


def _disk_cost(carry: list[Any]) -> SnapshotCost:
    """One carry written to the disk level a plan's disk snapshots use, and read back."""
    level = Offload("disk", planned=True)
    write = read = 0.0
    for a in carry:
        w, r = level.time_io(a)
        write, read = write + w, read + r
    return SnapshotCost(sum(array_nbytes(a) for a in carry), write, read)


def _repeating() -> Iterator[int]:
    """Repeat numbers of one timed phase: at least `REPEATS`, then more while the phase has
    taken less than `TIMING_SECONDS` (at most `MOST_REPEATS`)."""
    began = time.perf_counter()
    for repeat in range(MOST_REPEATS):
        if repeat >= REPEATS and time.perf_counter() - began > TIMING_SECONDS:
            return
        yield repeat


def _typical(costs: list[FormCost]) -> FormCost:
    """The last cost's bytes, and the median time of each phase: the loop that is priced
    runs as long as a typical step, on a machine as busy as it is (the least of the repeats
    predicted the best case, which a busy machine's run rarely is)."""
    return replace(costs[-1], taped_seconds=median(c.taped_seconds for c in costs),
                   backward_seconds=median(c.backward_seconds for c in costs))


def _steps(loop: StepLoop) -> int:
    return min(2, loop.n)


def _x_tensors(loop: StepLoop, t: int) -> Any:
    """Step t's scanned input as a plan re-run makes it: rows of xs, needing a gradient when
    xs does."""
    if loop.xs_spec is None:
        return None
    parts = [None if x is None else row_tensor(x, t, x.requires_grad) for x in loop.xs_leaves]
    return unflatten(loop.xs_spec, iter(parts))


def _carry_tensors(carry_leaves: list[Any], grad: bool) -> list[Any]:
    out = []
    for c in carry_leaves:
        if c is None:
            out.append(None)
            continue
        t = Tensor._wrap(c._data)
        t._requires_grad = grad and (c.requires_grad or is_floating(c.dtype))
        out.append(t)
    return out


def _xs_gradient_bytes(loop: StepLoop) -> int:
    return sum(array_nbytes(x._data) for x in loop.xs_leaves
               if x is not None and x.requires_grad)


def _copy_of(like: Tensor, array: Any) -> Tensor:
    """A copy of `array` as a leaf needing a gradient where `like` does."""
    return _row_tensor(like, namespace(array).array(array, copy=True))


def _dry_copies(loop: StepLoop, carry_leaves: list[Any]) -> tuple[StepLoop, list[Any]]:
    """The loop over copies of the rows of xs its dry run reads (the first `DRY_ROWS`, of
    however many steps: cheap), and a copy of its carry: a step that changes its `x` or its
    carry in place then changes nothing of the caller's, however often the dry run runs it
    (a step doubling its row in place left 524288 in place of 1 in the caller's xs)."""
    rows = min(loop.n, DRY_ROWS)
    xs = [None if x is None else _copy_of(x, x._data[:rows]) for x in loop.xs_leaves]
    carry = [None if c is None else _copy_of(c, c._data) for c in carry_leaves]
    return replace(loop, xs_leaves=xs, holders=loop.holders), carry


class _Writes:
    """The storages a step changes in place while watched (`_state.inplace_watch`), each
    with its values and version before the first change, held by weak reference: those
    still alive once the step's own values are let go of belong to someone else (a tensor
    the step captures), and are put back as they were."""

    def __init__(self, own: list[Any]) -> None:
        self.own = {id(_root(t._data)) for t in own if t is not None}
        self.before: dict[int, tuple[Any, Any, Any, int, str]] = {}

    def __call__(self, tensor: Tensor) -> None:
        root = _root(tensor._data)
        if id(root) in self.own or id(root) in self.before:
            return
        try:
            ref = weakref.ref(root)
        except TypeError:  # an array type without weak references: hold its tensor's
            ref = weakref.ref(tensor)
        what = f"{tensor.dtype}{list(tensor.shape)}"
        self.before[id(root)] = (ref, namespace(root).array(root, copy=True),
                                 tensor._version, tensor._version.value, what)

    def restore(self) -> list[str]:
        """Put back every storage still alive; what each is (dtype and shape)."""
        found = []
        for ref, values, counter, version, what in self.before.values():
            alive = ref()
            if alive is None:
                continue
            root = alive if not isinstance(alive, Tensor) else _root(alive._data)
            root[...] = values
            counter.value = version
            found.append(what)
        self.before.clear()
        return found


def _refuse_captured_writes(
    loop: StepLoop, carry_leaves: list[Any], engine_state: Any, numpy_state: Any
) -> None:
    """Run the dry loop's first steps once, untimed, watching in-place writes: a step that
    changes a tensor it captures (``counter.add_(1)``) would change it on each of the dry
    run's few dozen calls, and a plan that re-runs steps reads it changed; such a tensor is
    put back as it was, and `InplaceError` says so."""
    own = [*carry_leaves, *loop.xs_leaves]
    writes = _Writes(own)
    previous = _state.inplace_watch
    _state.inplace_watch = writes
    try:
        _untaped(loop, carry_leaves, engine_state, numpy_state)
    finally:
        _state.inplace_watch = previous
        np.random.set_state(numpy_state)
        if any(ref() is not None for ref, *_ in writes.before.values()):
            gc.collect()  # the step's own values caught in reference cycles go first
        found = writes.restore()
    if found:
        raise InplaceError(
            f"the step changes a tensor it captures in place ({found[0]}), which a budget "
            "cannot price by re-running the step (its dry run would change it again on each "
            "run, and a plan that re-runs steps reads it changed: the tensor is left as it "
            "was). Carry the value instead (return its new value as part of the carry), or "
            "run the loop with strategy=None, which runs each step once")


def _untaped(
    loop: StepLoop, carry_leaves: list[Any], engine_state: Any, numpy_state: Any
) -> float:
    np.random.set_state(numpy_state)
    carry = _carry_tensors(carry_leaves, grad=False)
    with random.replaying(engine_state):
        start = time.perf_counter()
        for t in range(_steps(loop)):
            carry, _ = loop.call_for_values(t, carry, loop.x_at(t))
        return (time.perf_counter() - start) / _steps(loop)


def _row_seconds(loop: StepLoop, carry_leaves: list[Any], engine_state: Any) -> float:
    """Seconds per step writing one step's outputs into rows as a plan's forward does
    (`OutputRows`), the median of `_repeating()`, each over `REPLAYED_STEPS` rows."""
    carry = _carry_tensors(carry_leaves, grad=False)
    with random.replaying(engine_state):
        _, ys = loop.call_for_values(0, carry, loop.x_at(0))
    arrays = [None if y is None else y._data for y in ys]
    if not any(a is not None for a in arrays):
        return 0.0
    runs = []
    for _ in _repeating():
        rows = OutputRows(REPLAYED_STEPS)
        start = time.perf_counter()
        for _ in range(REPLAYED_STEPS):
            rows.append(arrays)
        runs.append(time.perf_counter() - start)
    return median(runs) / REPLAYED_STEPS


def _taped(
    loop: StepLoop, carry_leaves: list[Any], storage: Strategy, engine_state: Any,
    xs_bytes: int,
) -> tuple[FormCost, int, int, int, bool]:
    """Steps 0 and 1 with a tape under `storage`, then their backward; (cost, gradient bytes,
    one step's output bytes, every byte the two steps saved, whether the steps ran a loop of
    their own with a tape: its one entry holds values no slot shows, see `_profiled_bytes`).
    `xs_bytes`: the gradient bytes of the caller's whole xs (the dry loop holds its first
    rows only)."""
    carry_in = _carry_tensors(carry_leaves, grad=True)
    x_in = [_x_tensors(loop, t) for t in range(_steps(loop))]
    seq_before = next_sequence()
    marks, outputs = [], []
    with random.replaying(engine_state), enable_grad(), use_packer(storage):
        carry = carry_in
        start = time.perf_counter()
        for t in range(_steps(loop)):
            carry, ys = loop.call(t, carry, x_in[t])
            outputs.extend(ys)
            marks.append(next_sequence())
        taped = (time.perf_counter() - start) / _steps(loop)
    outputs.extend(carry)
    entries = _entries(outputs, seq_before)
    inside = [c for c in carry_in if c is not None]
    inside += [p for x in x_in for p in _leaves(x)]
    caller = {id(_root(c._data)) for c in inside}
    caller |= {id(_root(x._data)) for x in loop.xs_leaves if x is not None}
    externals = _externals(entries, inside)
    caller |= {id(_root(node._data)) for node, _ in externals.values() if type(node) is not Entry}
    carry_roots = {id(_root(c._data)) for c in carry_in if c is not None}
    first, total, carry_saved, held = _saved_bytes(entries, marks[0], caller, carry_roots)
    step_bytes = total - first if loop.n > 1 else first
    backward = _timed_backward(outputs, carry_in, x_in, externals, seq_before) / _steps(loop)
    gradient_bytes = sum(_edge_nbytes(node, index) for node, index in externals.values())
    gradient_bytes += sum(array_nbytes(c._data) for c in carry_leaves
                          if c is not None and c.requires_grad)
    gradient_bytes += xs_bytes
    n_y = len(outputs) - len(carry)
    y_bytes = sum(array_nbytes(y._data) for y in outputs[: n_y // _steps(loop)] if y is not None)
    cost = FormCost(first, step_bytes, carry_saved, taped, backward)
    nested = any(isinstance(entry.op, PlannedLoop) for entry in entries)
    return cost, gradient_bytes, y_bytes, held, nested


def _profiled_bytes(
    loop: StepLoop, carry_leaves: list[Any], storage: Strategy, engine_state: Any
) -> tuple[int, int]:
    """Owned tape bytes after step 0 and after steps 0 and 1, taped under `storage`, as the
    profiler counts them. A step that runs a loop of its own (a nested `scan`) saves values
    inside that loop's one tape entry (its snapshots, its replayed steps), where the dry
    run's walk over the entries' slots does not see them; the profiler hears them. (Run
    apart from the timed steps: a profile slows what it measures.)"""
    held = []
    for steps in range(1, _steps(loop) + 1):  # step 0 alone, then steps 0 and 1
        carry = _carry_tensors(carry_leaves, grad=True)
        with profile() as prof, random.replaying(engine_state), enable_grad(), \
                use_packer(storage):
            for t in range(steps):
                carry, _ = loop.call(t, carry, _x_tensors(loop, t))
        # what the steps' tape holds at their end (a value saved by work the step threw
        # away was freed with it, as the walk over what the outputs reach leaves it out)
        held.append(prof.timeline_bytes[-1])
        del carry
    return held[0], held[-1]


def _backward_peak_bytes(
    loop: StepLoop, carry_leaves: list[Any], storage: Strategy, engine_state: Any
) -> int:
    """The profiler's peak tape over steps 0 and 1 taped under `storage` and their backward
    (run apart from the timed steps: a profile slows them). Beyond the tape at the forward's
    end (`_profiled_bytes`), it is what re-running a checkpointed region holds."""
    carry = _carry_tensors(carry_leaves, grad=True)
    outputs = []
    with profile() as prof:
        with random.replaying(engine_state), enable_grad(), use_packer(storage):
            for t in range(_steps(loop)):
                carry, ys = loop.call(t, carry, _x_tensors(loop, t))
                outputs.extend(ys)
            outputs.extend(carry)
        roots = _ones_at([o for o in outputs if o is not None])
        if roots:
            backpropagate(roots, retain_graph=False, create_graph=False,
                          capture=Capture({}, newer_than=next_sequence()))
    return prof.peak_tape_bytes


def _with_nested_bytes(cost: FormCost, first: int, total: int, n: int) -> FormCost:
    """`cost` with the profiler's counts where they exceed the slots' (see `_profiled_bytes`:
    the bytes of loops nested in the step); `n` the loop's steps, as `_taped` counts them."""
    step = total - first if n > 1 else first
    if first <= cost.first_bytes and step <= cost.step_bytes:
        return cost
    return replace(cost, first_bytes=max(cost.first_bytes, first),
                   step_bytes=max(cost.step_bytes, step))


def _leaves(tree: Any) -> list[Any]:
    return [] if tree is None else [p for p in flatten(tree)[0] if p is not None]


def _entries(outputs: list[Any], seq_before: int) -> list[Entry]:
    """The entries the dry steps recorded that their outputs reach, oldest first."""
    found: dict[int, Entry] = {}
    stack = [edge_of(o)[0] for o in outputs
             if o is not None and edge_of(o) is not None and type(edge_of(o)[0]) is Entry]
    while stack:
        entry = stack.pop()
        if id(entry) in found or entry.seq <= seq_before:
            continue
        found[id(entry)] = entry
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)
    return sorted(found.values(), key=lambda e: e.seq)


def _externals(entries: list[Entry], inside: list[Any]) -> dict[tuple[int, int], Any]:
    """Edges from the dry steps to what lies outside them: captured parameters, tensors made
    before the loop."""
    ours = {id(e) for e in entries} | {id(t) for t in inside}
    found = {}
    for entry in entries:
        for edge in entry.edges:
            if edge is not None and id(edge[0]) not in ours:
                found[(id(edge[0]), edge[1])] = edge
    return found


def _saved_bytes(
    entries: list[Entry], first_mark: int, caller: set[int], carry_roots: set[int]
) -> tuple[int, int, int, int]:
    """(owned bytes saved by step 0, by both steps, bytes of the carry-in step 0 saved, all
    bytes saved), each buffer counted once, as the profiler counts them: a value stored by
    reference in memory the caller holds anyway is not the tape's."""
    seen: set[int] = set()
    first = total = carry_saved = held = 0
    for entry in entries:
        for slot in entry.slots or ():
            buffer = slot.buffer
            if buffer is None or buffer.stored_id in seen:
                continue
            seen.add(buffer.stored_id)
            held += buffer.stored_nbytes
            root = id(_root(buffer.packed)) if buffer.source is None else None
            if root in carry_roots:
                if entry.seq < first_mark:
                    carry_saved += buffer.stored_nbytes
                continue
            if root in caller:
                continue
            total += buffer.stored_nbytes
            if entry.seq < first_mark:
                first += buffer.stored_nbytes
    return first, total, carry_saved, held


def _timed_backward(
    outputs: list[Any], carry_in: list[Any], x_in: list[Any],
    externals: dict[tuple[int, int], Any], seq_before: int,
) -> float:
    """Seconds to pull ones back through the dry steps, into a capture (no `.grad` moves)."""
    roots = _ones_at([o for o in outputs if o is not None])
    if not roots:
        return 0.0
    keys: dict[tuple[int, int], int] = {}
    for t in [c for c in carry_in if c is not None] + [p for x in x_in for p in _leaves(x)]:
        if t.requires_grad:
            keys[(id(t), 0)] = len(keys)
    for key in externals:
        keys.setdefault(key, len(keys))
    start = time.perf_counter()
    backpropagate(roots, retain_graph=False, create_graph=False,
                  capture=Capture(keys, newer_than=seq_before))
    return time.perf_counter() - start


def _ones_at(outputs: list[Any]) -> list[tuple[Any, Any]]:
    """Roots of a backward sweep: a gradient of ones at each output that can take one."""
    return [(edge_of(o), namespace(o._data).ones_like(o._data)) for o in outputs
            if o.requires_grad and is_floating(o.dtype)]


def _edge_nbytes(node: Any, index: int) -> int:
    if type(node) is Entry:
        shape, dtype = node.out_meta[index]
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return array_nbytes(node._data)


def _snapshot_cost(carry: list[Any], storage: Strategy | None) -> SnapshotCost:
    objects = 0  # the engine's objects: in the device peak only on the host
    if _on_host(carry):
        objects = snapshot_object_bytes(carry, storage if storage is not None else KEEP)
    if storage is None:
        return SnapshotCost(sum(array_nbytes(a) for a in carry), 0.0, 0.0, objects)
    start = time.perf_counter()
    packed = [storage.pack(a) for a in carry]
    packed_at = time.perf_counter()
    for p in packed:
        storage.unpack(p)
    unpacked_at = time.perf_counter()
    stored = 0
    for a, p in zip(carry, packed):
        size = storage.stored_nbytes(p)
        stored += array_nbytes(a) if size is None else int(size)
    return SnapshotCost(stored, packed_at - start, unpacked_at - packed_at, objects)


def _root(array: Any) -> Any:
    """The array that owns `array`'s memory (views keep it as `.base`)."""
    base = getattr(array, "base", None)
    while base is not None and hasattr(base, "shape"):
        array, base = base, getattr(base, "base", None)
    return array
