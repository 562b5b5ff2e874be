"""The backward of a step program: an adjoint pulled back through replayed steps.

`pull_back_steps` runs each taped instruction's backward rules (bound once:
`compiled_step.compile_rules`) from the last step to the first, delivering each gradient where
a recorded tape would deliver it (a sum within the step, the step before's new carry, a row of
`xs`, a captured tensor: `compiled_step.delivery_kinds`) and adding in the order a recorded tape
adds, so the sums are bitwise the same. Saved values are unpacked as the rules need them and
freed as soon as they ran, as a recorded entry's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import events
from ...errors import BackwardError
from ...ops import astype
from ...saved import KEEP, KeptBuffer, SavedBuffer, pack_value
from .compiled_step import (
    CARRY,
    EXTERNAL,
    GRAD_ONLY,
    HOIST,
    ONE_SAVED,
    PENDING,
    XS,
    namespace_of,
)

if TYPE_CHECKING:
    from .hoisted_rows import RowSource
    from .replayed_step import ReplayedStep
    from .step_program import StepProgram


def pull_back_steps(
    program: StepProgram,
    steps: list[tuple[int, ReplayedStep]],
    roots: list[tuple[tuple[int, int], Any]] | Callable[[int], list[tuple[int, Any]]],
    sink: Any,
    keys: dict[tuple[Any, ...], int],
    retain: bool = False,
    rows: RowSource | None = None,
) -> None:
    """Back-propagate `roots` ((step, slot) -> adjoint, in delivery order) through the
    replayed `steps` (first to last), adding what reaches a leaf into `sink` (a `Capture`)
    at ``keys[leaf key]``: ("carry", k) for the first step's carry, ("x", t, k) for step
    t's scanned inputs, ("ext", slot) for a captured tensor. Additions happen in the order
    a recorded tape would make them, so the sums are bitwise the same.

    Where the program's outputs are all made in the step (`roots_per_step`), `roots` may
    be a function of a step giving its roots as (slot, adjoint), in delivery order: each
    step's are taken when its sums begin (before anything else reaches them, as when all
    are delivered first), so a long segment holds one or two steps' sums and roots at a
    time, not every step's.

    `rows`: where the steps took their rows (`hoisted_rows.RowSource`); a step whose
    captured tensors' gradients are summed per chunk (a batched product's matrix, a
    product's right operand, a bias: `hoisted_rows.find_summed`) gives it the gradients
    reaching those instructions and their saved values, and it adds each tensor's gradient
    over a chunk when the sweep finishes the chunk's first step."""
    first = steps[0][0]
    # per step, the gradient summed so far at each slot (made in that step, not yet run
    # back through the instruction that made it)
    pending: dict[int, list[Any]] = {}
    n_slots = program.n_slots
    roots_at = None if isinstance(roots, list) else roots
    assert roots_at is None or program.roots_per_step

    def begin(t: int) -> list[Any]:
        """Step t's sums, begun with its roots (each a slot made in the step)."""
        grads = pending[t] = [None] * n_slots
        if roots_at is not None:
            for slot, grad in roots_at(t):
                previous = grads[slot]
                grads[slot] = grad if previous is None else previous + grad
        return grads
    kinds = program.delivery
    carry_out = program.carry_out
    n_carry = len(program.carry_in)
    positions = program.positions
    if positions is None or positions[0] is not keys:  # the caller's keys, made anew
        positions = program.positions = (
            keys, [keys.get(("carry", k)) for k in range(n_carry)],
            {slot: keys.get(("ext", slot)) for slot in program.constants})
    carry_position, external_position = positions[1], positions[2]
    add = sink.add

    def deliver(t: int, slot: int, grad: Any) -> None:
        while True:
            kind = kinds[slot]
            if kind == PENDING:
                grads = pending.get(t)
                if grads is None:
                    grads = begin(t)
                previous = grads[slot]
                grads[slot] = grad if previous is None else previous + grad
                return
            if kind == CARRY:
                if t == first:
                    position = carry_position[slot]
                    if position is not None:
                        add(position, grad)
                    return
                t, slot = t - 1, carry_out[slot]  # the previous step's new carry
                continue
            if kind == XS:
                position = keys.get(("x", t, slot - n_carry))
            elif kind == EXTERNAL:
                position = external_position[slot]
            else:
                return
            if position is not None:
                add(position, grad)
            return

    if roots_at is None:
        for (t, slot), grad in roots:  # type: ignore[union-attr]
            deliver(t, slot, grad)
    if events.listeners:
        events.emit("backward_begin", None)
    dtypes = program.dtype
    region_of = program.region_of
    # arrays unpacked from buffers shared with the step before (id -> (weak reference
    # to the buffer, array)): made by a step, read again by the next one run back
    # (its carry's producer), then dropped; each shared value is unpacked once
    unpacked_later: dict[int, tuple[Any, Any]] = {}
    unpacked_here: dict[int, tuple[Any, Any]] = {}
    try:
        for index in range(len(steps) - 1, -1, -1):
            t, step = steps[index]
            if unpacked_later or unpacked_here:
                unpacked_later, unpacked_here = unpacked_here, {}
            core = rows is not None and rows.core(t)
            grads = pending.get(t)
            if grads is None:
                if roots_at is None:  # nothing reached this step
                    if core:
                        rows.step_done(t, add, external_position)  # type: ignore[union-attr]
                    continue
                grads = begin(t)
            kept = step.saved
            as_is = step.as_is
            shared = steps[index - 1][1].packed_ids() if index and not as_is else None
            held = step.held
            frees = held is not None or not as_is  # its instructions free saved values
            for i, output, rules in (program.core_backward_rules if core
                                     else program.backward_rules):
                g = grads[output]
                if g is None:
                    continue
                grads[output] = None
                if region_of[i] >= 0 and kept[i] is None:  # a selective region's: re-run
                    rerun_region(program, region_of[i], step, retain)
                    held = step.held
                    frees = held is not None or not as_is
                saved = kept[i] if as_is else step.unpack(i, unpacked_later,
                                                          unpacked_here, shared)
                if as_is and not retain:
                    kept[i] = None
                # each input's gradient delivered as soon as it is made: the rules read
                # only g and the saved values, which no delivery changes, so the sums are
                # made in the same order as computing them all first would make them
                for call, fn, k, shape, back, slot in rules:
                    if call == ONE_SAVED:
                        grad = fn(g, saved[k])
                    elif call == GRAD_ONLY:
                        grad = fn(g)
                    elif call == HOIST:  # a captured tensor's, summed over its chunk
                        rows.keep(t, k, g, saved)  # type: ignore[union-attr]
                        continue
                    else:
                        grad = fn(g, saved)
                    if grad is None:
                        continue
                    if shape is not None and grad.shape != shape:
                        grad = back(grad)
                    if isinstance(grad, np.generic):
                        grad = np.asarray(grad)
                    dtype = dtypes[slot]
                    if grad.dtype is not dtype and grad.dtype != dtype:
                        grad = astype(grad, dtype)
                    kind = kinds[slot]
                    if kind == PENDING:  # deliver()'s cases within the step, inline
                        previous = grads[slot]
                        grads[slot] = grad if previous is None else previous + grad
                    elif kind == EXTERNAL:
                        position = external_position[slot]
                        if position is not None:
                            add(position, grad)
                    else:
                        deliver(t, slot, grad)
                    # delivered: let go, so that the next rule's result is not made while
                    # this one is still held (a weight's gradient each: the peak's size)
                    grad = previous = None
                if frees and not retain:  # an announced entry is freed after its
                    if held is None:  # rules ran, as the recorded tape frees it
                        step.release(i)
                    else:  # `release`'s, for buffers held beside the arrays
                        buffers = held[i]
                        if buffers:
                            held[i] = None
                            buffers.reverse()
                            buffers.clear()
            del pending[t]
            if core:
                rows.step_done(t, add, external_position)  # type: ignore[union-attr]
    finally:
        if events.listeners:
            events.emit("backward_end", None)


def rerun_region(program: StepProgram, r: int, step: ReplayedStep, retain: bool) -> None:
    """Selective region `r` of a taped `step` re-run from the inputs the step kept, as a
    recorded `checkpoint` re-runs it when its first saved value is read: the same forwards
    on the same arrays, so the saved values, and the gradients, are bitwise the recorded
    ones (its instructions whose outputs no saved value needs are left out:
    `StepProgram.region_runs`). Each taped instruction of the region gets its saved
    values; the inputs are let
    go (kept with `retain`, for a second sweep). A profiler hears it as a recorded region's
    re-run: a recompute phase, its primitives, and its saved values packed (freed as each
    instruction's rules ran)."""
    inputs = step.regions[r] if step.regions is not None else None
    if inputs is None:
        raise BackwardError(
            "backward through a replayed loop step a second time: its selective region's "
            "inputs were freed when the first backward re-ran it; pass retain_graph=True to "
            "the first backward to keep them")
    region = program.regions[r]
    values: list[Any] = [None] * program.n_slots
    for slot, kept in zip(region.inputs, inputs):
        values[slot] = (kept.packed if type(kept) is KeptBuffer
                        else kept.unpack() if isinstance(kept, SavedBuffer) else kept)
    for slot, array in program.constants.items():
        values[slot] = array
    xp = namespace_of([values[s] for s in region.inputs] or list(program.constants.values()))
    forwards, instructions = program.forwards, program.instructions
    saved = step.saved
    with events.recomputing(region.name):
        emit = events.hears("apply")
        for i in program.region_runs[r]:
            ins = instructions[i]
            values[ins.output] = forwards[i](values, xp)
            if emit and ins.prim is not None:
                events.emit("apply", ins.prim)
        heard = bool(events.listeners)
        if heard and step.as_is and step.held is None:
            step.held = [None] * len(instructions)
        for i, get in program.region_saved[r]:
            arrays = list(get(values))
            if not heard:
                saved[i] = arrays
            elif step.as_is:  # the rules read the arrays; the buffers are the profiler's
                saved[i] = arrays
                step.held[i] = [pack_value(a, KEEP) for a in arrays]
            else:
                saved[i] = [pack_value(a, KEEP) for a in arrays]
    if not retain:
        step.regions[r] = None
