"""A planned loop's forward: the plan run up to its first reverse action.

The steps run without a tape, the plan's snapshots taken on the way, except the last step
(or segment) when it is the first reverse action's: that one runs with a tape, kept for the
backward, so a loop costs exactly the plan's step evaluations (`run_forward_prefix`). A loop
of unknown length (``until=``) grows its plan as it goes (`run_growing_plan`), or keeps every
step's tape in one segment (`run_kept_until`). What the forward leaves for the backward is a
`ForwardState`; the same functions rebuild it when an earlier backward broke off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import random
from ...grad_mode import no_grad
from ...pytree import unflatten
from ...saved import use_packer
from ..plans.revolve import (
    _ADVANCE,
    _DISK_SNAPSHOT,
    _FREE,
    _REVERSE,
    _REVERSE_SEGMENT,
    _SNAPSHOT,
    DiskSnapshot,
    Free,
    Reverse,
    Snapshot,
    periodic_plan,
    plan_codes,
    split_code,
)
from .loop import StepLoop
from .loop_snapshots import CarrySnapshot, numpy_state, take_snapshot
from .loop_steps import (
    ReplayedSegment,
    TapedSegment,
    arrays_of,
    as_tensors,
    discover_from,
    tape_steps,
    values_step,
)
from .output_rows import OutputRows
from .step_program import StepProgram

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


@dataclass
class ForwardState:
    """What the forward leaves for the backward: snapshots, the plan position, the taped end."""

    snapshots: dict[int, CarrySnapshot] = field(default_factory=dict)
    cursor: int = 0
    current: list[Any] | None = None  # state in hand at `cursor`, and its random states
    current_engine_state: random.GeneratorState | None = None
    current_numpy_state: Any = None
    kept: TapedSegment | ReplayedSegment | None = None  # the first reverse action's steps
    # the hooks `kept`'s steps registered (a loop stopped by `until`): taken back if the
    # backward runs those steps again rather than reverse `kept` (`loop_backward`)
    kept_hooks: list[Any] | None = None


def replay_forward(program: StepProgram, loop: StepLoop, arrays: list[Any], start: int,
                   stop: int, rows: OutputRows) -> list[Any]:
    """Steps start..stop-1 of a plan's forward replayed from the carry `arrays` without a
    tape, each counted and its outputs written into `rows`: the new carry's arrays. One
    function for the executor and for a budget's dry run, which times it (`pricing`), so the
    price of a forward step is what the forward runs."""
    run, x_arrays, count, append = program.run, loop.rows_for(program), loop.count, rows.append
    for t in range(start, stop):
        count()
        arrays, ys = run(arrays, x_arrays(t))
        append(ys)
    return arrays


def stops(until: Callable[[Any], Any], carry_spec: Any, carry_leaves: list[Any]) -> bool:
    """Whether `until` says the loop ends at this carry; asked without recording."""
    with no_grad():
        return bool(until(unflatten(carry_spec, iter(carry_leaves))))


def span(action: Any) -> tuple[int, int]:
    """The steps a reverse action covers, as (start, stop)."""
    if isinstance(action, Reverse):
        return action.step, action.step + 1
    return action.start, action.stop


def move_rows(kept: TapedSegment | ReplayedSegment, rows: OutputRows) -> None:
    """The outputs of a forward's taped end written into the loop's `rows` (a replayed
    segment taped with `on_outputs=rows.append` wrote its own as it ran); a replayed
    segment lets go of its own (stacked by `run()`: not kept twice)."""
    rows.extend(arrays_of(ys) for _, ys in kept.y_out)
    if isinstance(kept, ReplayedSegment):
        kept.y_out = []


def run_forward_prefix(executor: PlannedLoop, discover: bool,
                       rows: OutputRows | None = None) -> OutputRows:
    """Run the plan up to its first reverse action from the initial carry, taking its
    snapshots, and tape the steps of that reverse action when they end the loop; returns
    every step's outputs (arrays) up to where it stopped. The loop's first run draws from
    the caller's generator, as a plain loop would; a rebuild replays those draws."""
    per_step = OutputRows(executor.loop.n, lead=executor.lead_rows) if rows is None else rows
    executor.lead_rows = ()  # written into the outputs: the entry holds no rows of its own
    if discover:
        return forward_prefix(executor, discover, per_step)
    np.random.set_state(executor.initial_numpy_state)
    with random.replaying(executor.initial_engine_state), use_packer(executor.step_packer):
        return forward_prefix(executor, discover, per_step)


def forward_prefix(executor: PlannedLoop, discover: bool, per_step: OutputRows) -> OutputRows:
    """`run_forward_prefix` under the random state it chose: the plan's actions up to its
    first reverse action, leaving `executor.state`."""
    loop = executor.loop
    state = ForwardState()
    arrays = list(executor.initial)
    actions = executor.plan
    codes = plan_codes(actions)  # read packed: a 10^6-step plan stays compact
    cursor = 0
    while cursor < len(codes):
        kind, step, stop = split_code(codes[cursor])
        if kind in (_REVERSE, _REVERSE_SEGMENT):
            break
        if kind == _SNAPSHOT:
            state.snapshots[step] = take_snapshot(executor, arrays)
        elif kind == _DISK_SNAPSHOT:
            state.snapshots[step] = take_snapshot(executor, arrays, executor.disk_storage)
        elif kind == _ADVANCE:
            t = step
            while t < stop and (executor.program is None or (t == 0 and discover)):
                arrays, ys = forward_step(executor, t, arrays, discover)  # recorded, traced
                per_step.append(ys)
                t += 1
            if t < stop:
                assert executor.program is not None
                arrays = replay_forward(executor.program, loop, arrays, t, stop, per_step)
        elif kind == _FREE:  # online plans drop snapshots in their forward
            del state.snapshots[step]
        cursor += 1
    state.cursor = cursor
    start, stop = span(actions[cursor]) if cursor < len(actions) else (loop.n, loop.n)
    if start == len(per_step) and stop == loop.n and start < stop:
        executor.step_hooks = []
        # each replayed step's outputs go into the rows as it ends: the rows of a long
        # segment under a compressing strategy are not held twice (issue 37)
        state.kept = tape_steps(executor, start, stop, arrays, on_outputs=per_step.append)
        state.kept_hooks, executor.step_hooks = executor.step_hooks, None
        if discover and start == 0:
            discover_from(executor, state.kept)
        move_rows(state.kept, per_step)
        state.current = None
    else:
        state.current = arrays
        state.current_engine_state = random.get_state()
        state.current_numpy_state = numpy_state(executor)
    executor.state = state
    return per_step


def run_kept_until(executor: PlannedLoop) -> OutputRows:
    """Run a loop that keeps every step until `until` stops it (at most `limit` steps):
    one taped segment from the initial carry, as long as `until` lets it run; the plan is
    then `Periodic(n)`'s for the n steps run (one segment, reversed at once)."""
    loop = executor.loop
    state = ForwardState()
    lead, executor.lead_rows = executor.lead_rows, ()
    program, most = executor.program, executor.limit
    # saved values stored packed, at most len(xs) steps: each replayed step's outputs go
    # into rows made at that size as it ends, not held at full precision by the segment
    # until `until` stops it and then copied (issue 37); an early stop leaves the rest of
    # the rows unused. (Where values are kept as they are, the outputs are mostly saved
    # values anyway: moved into rows once the length is known.)
    written = (OutputRows(most, lead=lead) if program is not None
               and program.tape_as_is is None and most and loop.xs_leaves else None)
    kept = tape_steps(executor, 0, most, list(executor.initial),
                      until=partial(stops_at, executor),
                      on_outputs=None if written is None else written.append)
    n = loop.n = kept.stop
    per_step = OutputRows(n, lead=lead) if written is None else written
    move_rows(kept, per_step)
    if written is not None:
        written.ended_at(n)
    executor.plan = periodic_plan(n, n)
    state.kept = kept
    executor.state = state
    return per_step


def stops_at(executor: PlannedLoop, arrays: list[Any]) -> bool:
    """Whether `until` ends the loop at the carry `arrays`."""
    return stops(executor.until, executor.loop.carry_spec, as_tensors(executor, arrays, grad=False))


def run_growing_plan(executor: PlannedLoop) -> OutputRows:
    """Run a loop of unknown length from the initial carry, each step with a tape, under
    the online planner; leaves the whole plan in `executor.plan` and the last step's tape
    kept for its first reverse action; returns every step's outputs (arrays)."""
    loop, planner = executor.loop, executor.planner
    assert planner is not None and executor.until is not None
    state = ForwardState()
    forward_actions = 0
    arrays = list(executor.initial)
    per_step = OutputRows(None)  # its length is found as it runs: rows go into chunks
    kept: TapedSegment | None = None
    kept_random = random.get_state()
    t = 0
    while executor.limit is None or t < executor.limit:
        actions = planner.advance()
        for action in actions:  # each concerns state t - 1, where the kept tape starts
            if isinstance(action, (Snapshot, DiskSnapshot)):
                assert kept is not None
                level = executor.disk_storage if isinstance(action, DiskSnapshot) else None
                state.snapshots[action.step] = take_snapshot(
                    executor, arrays_of(kept.carry_in), level, engine_state=kept_random)
            elif isinstance(action, Free):
                del state.snapshots[action.step]
        forward_actions += len(actions)
        kept_random = random.get_state()
        let_go, executor.step_hooks = executor.step_hooks, []
        kept = tape_steps(executor, t, t + 1, arrays)
        for handle in let_go or ():  # the previous step's tape, never reversed: its steps
            handle.remove()  # run again in the backward and register their hooks there
        if t == 0:
            discover_from(executor, kept)
        per_step.append(arrays_of(kept.y_out[0][1]))
        arrays = arrays_of(kept.carry_out)
        t += 1
        if stops(executor.until, loop.carry_spec, as_tensors(executor, arrays, grad=False)):
            break
    state.kept_hooks, executor.step_hooks = executor.step_hooks, None
    loop.n = t
    state.cursor = forward_actions
    state.kept = kept
    executor.plan = planner.finish_plan(t)  # packed: a 10**6-step plan stays compact
    executor.state = state
    return per_step


def forward_step(
    executor: PlannedLoop, t: int, arrays: list[Any], discover: bool
) -> tuple[list[Any], list[Any]]:
    """Step t of the forward, for its new carry and outputs (arrays): taped once at step 0
    (`discover`), replayed where there is a program, else recorded without a tape."""
    loop = executor.loop
    if t == 0 and discover:  # step 0 runs with a tape once, to find what it captures
        segment = tape_steps(executor, 0, 1, arrays, pulled_back=False)
        discover_from(executor, segment)
        return arrays_of(segment.carry_out), arrays_of(segment.y_out[0][1])
    if executor.program is not None:
        loop.count()
        return executor.program.run(arrays, loop.rows_for(executor.program)(t))
    return values_step(executor, t, arrays)


def take_back_kept_hooks(state: ForwardState) -> None:
    """Remove the hooks the steps of `state.kept` registered: a tape that will not be
    reversed (its steps run again, and register them again there)."""
    for handle in state.kept_hooks or ():
        handle.remove()
    state.kept_hooks = None
