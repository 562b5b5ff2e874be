"""A step program's taped replay: a step run keeping what its backward rules read, packed as
recording the step would pack it (`tape`), and a segment of such steps (`tape_steps`).

A taped step shares with the next the buffers of the carry it made (the next step saves the
same values), lets go of each value after its last use unless it is saved, and keeps its saved
values in a `ReplayedStep` for `step_pull_back.pull_back_steps`. Three paths give the same
saved values: every value kept as it is and nobody listening (`tape_as_is`: the arrays
themselves, nothing packed); the same with a profiler listening alone (`tape_kept`: the
buffers made after the step, in bulk); any other strategy or listener (`tape`'s own loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ... import events
from ...saved import KEEP, KeepAll, buffer_for, pack_value
from .compiled_step import namespace_of
from .kept_slabs import KeptSlabs
from .replayed_step import NO_BUFFERS, ReplayedStep, carried_buffers
from .step_profiled import kept_layout, step_begins
from .step_trace import Draw

if TYPE_CHECKING:
    from .step_program import StepProgram


def tape(program: StepProgram, carry: list[Any], x: list[Any],
         previous: ReplayedStep | None = None,
         carry_tensors: list[Any] | None = None,
         slabs: KeptSlabs | None = None, t: int = 0) -> ReplayedStep:
    """One step keeping what its backward rules read, packed as recording would. With
    `previous` (the step before, in the same taped segment), the carry is that step's
    output: saved with the primitive's packer, not as a leaf, sharing its buffers;
    `carry_tensors` says the same of a carry made by a step recorded on the tape (these
    are its tensors, whose buffers the step shares). `slabs`: where step `t`'s kept values
    go when nothing listens (`kept_slabs.py`)."""
    announce = events.hears("replayed")
    core = len(x) != len(program.x_in)  # given the rows of its batched products too
    if program.tape_as_is is not None:
        if not announce:
            return tape_as_is(program, carry, x, slabs, t)
        if events.taken_directly():
            return tape_kept(program, carry, x, previous, carry_tensors)
    values = program._start(carry, x)
    xp = namespace_of(values)
    saved: list[Any] = [None] * len(program.instructions)
    described = step_begins(program) if announce else None
    chained = carry_tensors is not None or previous is not None
    buffers = carried_buffers(program.carry_out, previous)
    forwards = program.core_forwards if core else program.forwards
    tape_frees = program.tape_frees
    for i, ins in enumerate(program.instructions):
        prim = ins.prim
        values[ins.output] = forwards[i](values, xp)
        for s in tape_frees[i]:  # (never a slot this instruction saves: see `tape_frees`)
            values[s] = None
        if prim is None or type(prim) is Draw:
            continue
        if not ins.taped or program.region_of[i] >= 0:  # (a region's: re-run instead)
            continue
        kept = []
        for s in ins.saved:
            slot = ins.output if s.position < 0 else ins.inputs[s.position]
            packer = s.chained if chained and slot in program.carry_in else s.packer
            if type(packer) is KeepAll and not announce:
                kept.append(values[slot])
                continue
            constant = program.constant_tensors.get(slot)
            if constant is None and carry_tensors is not None and slot in program.carry_in:
                constant = carry_tensors[slot]
            if constant is not None:
                kept.append(buffer_for(constant, packer))
                continue
            key = (slot, id(packer))
            buffer = buffers.get(key)
            if buffer is None:
                buffer = buffers[key] = pack_value(values[slot], packer)
            kept.append(buffer)
        saved[i] = kept
    regions = None
    if program.regions:
        regions = (region_buffers(program, values, buffers, carry_tensors, None) if announce
                   else region_inputs(program, values))
    if announce:
        events.emit("replayed", (described, saved, values,
                                 program.carry_in if chained else (), None))
    return ReplayedStep(values, saved, announce, buffers, regions=regions)


def region_inputs(program: StepProgram, values: list[Any]) -> list[Any] | None:
    """What a taped step keeps of each selective region: its inputs' arrays (None: no
    region). The backward re-runs the region from them (`step_pull_back.rerun_region`)."""
    if not program.regions:
        return None
    return [get(values) for get in program.region_inputs]


def region_buffers(program: StepProgram, values: list[Any], buffers: dict[Any, Any],
                   carry_tensors: Any, made: list[Any] | None) -> list[Any]:
    """`region_inputs` for a step a profiler hears: each input in a buffer kept as is (shared
    with an instruction saving the same value, as a recorded region's input shares its
    tensor's), so the profiler counts the region's inputs as a recorded `checkpoint`'s."""
    tensors = {} if carry_tensors is None else dict(zip(program.carry_in, carry_tensors))
    kept_inputs = []
    for region in program.regions:
        kept = []
        for slot in region.inputs:
            tensor = tensors.get(slot)
            if tensor is not None:
                kept.append(buffer_for(tensor, KEEP, made))
                continue
            key = (slot, id(KEEP))
            buffer = buffers.get(key)
            if buffer is None:
                buffer = buffers[key] = pack_value(values[slot], KEEP, made)
            kept.append(buffer)
        kept_inputs.append(kept)
    return kept_inputs


def tape_steps(
    program: StepProgram, arrays: list[Any], x_arrays: Callable[[int], list[Any]], start: int,
    stop: int | None, carry_tensors: list[Any] | None = None,
    count: Callable[[], None] | None = None,
    until: Callable[[list[Any]], bool] | None = None,
    on_outputs: Callable[[list[Any]], None] | None = None,
) -> tuple[list[tuple[int, ReplayedStep]], list[tuple[int, list[Any]]], list[Any]]:
    """Steps start..stop-1 taped from the carry `arrays`, as a taped segment of a loop
    holds them: (the steps as (t, step), their outputs as (t, arrays), the last carry's
    arrays). Each step shares the carry buffers the one before it packed, then lets go of
    its values but what its backward reads. `x_arrays(t)`: step t's scanned rows;
    (with the rows of its batched products, `hoisted_rows.RowSource.at`);
    `carry_tensors`: the first step's carry as a recorded step's output tensors (see
    `tape`); `count()` is called per step; `until(carry arrays)`, asked after each
    step, ends the segment early (`stop` None: only it does). The plan executor tapes
    its segments here, and a budget's dry run times the same loop."""
    steps: list[tuple[int, ReplayedStep]] = []
    y_out: list[tuple[int, list[Any]]] = []
    previous = None
    carry_out, ys_out = program.carry_out, program.y_out
    # rows for the kept values of all steps but the last (whose carry the caller may keep:
    # it is not to hold a slab alive)
    slabs = (KeptSlabs.for_segment(program, start, stop - 1)
             if stop is not None and program.tape_as_is is not None
             and not events.hears("replayed") else None)
    t = start
    while stop is None or t < stop:
        if count is not None:
            count()
        step = tape(program, arrays, x_arrays(t), previous,
                    carry_tensors if t == start else None, slabs, t)
        arrays = step.output(carry_out)
        if on_outputs is None:
            y_out.append((t, step.output(ys_out)))
        else:
            on_outputs(step.output(ys_out))
        step.drop_values(carry_out)
        steps.append((t, step))
        if previous is not None and previous.buffers:
            previous.buffers = NO_BUFFERS  # shared with this step: only its slots hold them
        previous = step
        t += 1
        if until is not None and until(arrays):
            break
    if previous is not None and previous.buffers:
        previous.buffers = NO_BUFFERS
    return steps, y_out, arrays


def tape_as_is(program: StepProgram, carry: list[Any], x: list[Any],
               slabs: KeptSlabs | None = None, t: int = 0) -> ReplayedStep:
    """`tape` where every saved value is kept as it is (`KeepAll`) and no profiler hears
    entries: the step's saved values are its arrays, nothing is packed or shared (with
    `slabs`, the new ones are moved into step `t`'s rows of them as they are made)."""
    values = program._start(carry, x)
    xp = namespace_of(values)
    saved: list[Any] = [None] * len(program.instructions)
    rows = program.tape_as_is if len(x) == len(program.x_in) else program.core_tape_as_is
    assert rows is not None
    slots = slabs.slots if slabs is not None else ()
    for i, forward, output, saved_of, frees in rows:
        if output in slots:
            values[output] = slabs.place(output, t, forward(values, xp))  # type: ignore[union-attr]
        else:
            values[output] = forward(values, xp)
        if saved_of is not None:
            saved[i] = saved_of(values)
        for s in frees:
            values[s] = None
    return ReplayedStep(values, saved, False, NO_BUFFERS, as_is=True,
                        regions=region_inputs(program, values))


def tape_kept(program: StepProgram, carry: list[Any], x: list[Any],
              previous: ReplayedStep | None, carry_tensors: list[Any] | None) -> ReplayedStep:
    """`tape` where every value is kept as it is and a profiler listens alone: the step
    runs as `tape_as_is` (its backward reads the arrays), then makes its buffers in the order
    `tape` would (`step_profiled.KeptLayout`: each distinct buffer once), held per
    instruction until its backward rules ran, and hands the new ones to the profiler in its
    'replayed' event rather than one 'pack' event each. They are `tape`'s buffers, shared as
    `tape` shares them, so the profile and the order of frees are the same."""
    described = step_begins(program)
    step = tape_as_is(program, carry, x)
    values = step.values
    mode = 2 if carry_tensors is not None else 1 if previous is not None else 0
    layout = program.layouts[mode]
    if layout is None:
        layout = program.layouts[mode] = kept_layout(program, mode)
    tensors = program.constant_tensors if carry_tensors is None else {
        **program.constant_tensors, **dict(zip(program.carry_in, carry_tensors))}
    made: list[Any] = []
    buffers = step.buffers = carried_buffers(program.carry_out, previous)
    ordered = []
    for slot, key, packer in layout.sources:
        if key is None:  # a tensor's array: its buffer, shared with its recorded entries
            buffer = buffer_for(tensors[slot], packer, made)
        else:
            buffer = buffers.get(key)
            if buffer is None:
                buffer = buffers[key] = pack_value(values[slot], packer, made)
        ordered.append(buffer)
    get = ordered.__getitem__
    held: list[Any] = [None] * len(program.instructions)
    for i, at in layout.held:
        held[i] = list(map(get, at))
    step.held = held
    if program.regions:
        step.regions = region_buffers(program, values, buffers, carry_tensors, made)
    events.emit("replayed", (described, held, values,
                             program.carry_in if mode else (), made))
    return step
