"""A `scan` run without gradients (under `no_grad` or inference mode), replayed after its
first two steps.

Why: a loop evaluated for inference (a validation pass, a rollout, the forward of an
evaluation metric) recorded nothing, yet still paid the engine's Python cost per operation:
every op made a tensor and went through the general recording path. Steps 0 and 1 are traced
as a taped loop traces them (`traced_call`); when they trace to one program, steps 2.. run it
on arrays (`StepProgram.run`) and their outputs are written into one array per output as they
come (`OutputRows`). The results are bitwise those of running every step: the same array
calls on the same arrays, in the same order, and randomness drawn through the engine's
generator is drawn in the same order. A refused trace (the step reads a value, makes tensors
from outside data, changes shapes, ...) runs the rest step by step, as before. A loop with
`until` (and `while_loop`) asks it after every step, replayed or not, and stops where the
recorded loop stops; its rows are gathered in chunks, the length being unknown.

A later call of the same loop reuses the program an earlier one made when its step 0
traces to it exactly (`program_cache.py`), so only step 0 runs op by op. Such programs are
kept apart from those of loops that take gradients (traced without gradients, none of their
instructions is taped): a loop run with gradients on never reuses one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...pytree import unflatten
from ...tensor_base import make_tensor
from .loop import StepLoop, stack_outputs
from .output_rows import OutputRows
from .plan_executor import stops
from .program_cache import REUSED, find
from .step_program import program_of, traced_call


def run_untaped(loop: StepLoop, carry_leaves: list[Any],
                until: Callable[[Any], Any] | None = None,
                limit: int | None = None) -> tuple[Any, Any]:
    """Every step of `loop` without a tape; with `until`, up to the first step after which it
    says stop (at most `limit` steps; None: no bound but `until`). (carry, ys)."""
    most = loop.most_steps(until, limit)
    place = find(loop.step, "untaped", carry_leaves, loop.xs_leaves)
    carry, ys, first = traced_call(loop, 0, carry_leaves, loop.x_at(0))
    per_step = [ys]
    if _ended(loop, until, carry, 1, most):
        loop.mode = "recorded: `until` stopped it after step 0"
        return _recorded_result(loop, carry, per_step)
    program = place.reuse(first) if place.expected else None
    if program is not None:
        loop.mode = REUSED
    else:
        carry, ys, second = traced_call(loop, 1, carry, loop.x_at(1))
        per_step.append(ys)
        program, loop.mode = program_of({0: first, 1: second}, max(most or 3, 3), len(carry),
                                        template=1)
        place.remember(first, second, program)
        del second
        if _ended(loop, until, carry, 2, most):
            loop.mode = "recorded: `until` stopped it after step 1"
            return _recorded_result(loop, carry, per_step)
    del first  # what the steps made, as tensors: let go of it before the rest runs
    t = len(per_step)
    if program is None:  # `until` asked once per step, as the recorded loop asks it
        while True:
            carry, ys = loop.call(t, carry, loop.x_at(t))
            per_step.append(ys)
            t += 1
            if _ended(loop, until, carry, t, most):
                return _recorded_result(loop, carry, per_step)
    done = t
    lead = [[None if y is None else y._data for y in ys] for ys in per_step]
    rows = OutputRows(None if until is not None else loop.n - done,
                      lead=lead if until is None else ())
    arrays = [None if c is None else c._data for c in carry]
    x_rows = loop.rows_for(program)
    while True:
        loop.count()
        arrays, ys = program.run(arrays, x_rows(t))
        rows.append(ys)
        t += 1
        if until is not None and stops(until, loop.carry_spec, _tensors(arrays)):
            break
        if t == most:
            break
    loop.n = t
    loop.release_rows()
    carry = _tensors(arrays)
    full = rows.full() if until is None else None
    if full is not None and rows.lead == len(lead):
        ys_leaves = _tensors(full)
    else:  # rows written apart from the first steps', or unlike each other: stacked
        rest = rows.stacked({})
        per_step += [[None if a is None else make_tensor(a[i]) for a in rest]
                     for i in range(t - done)]
        ys_leaves = stack_outputs(per_step)
    return unflatten(loop.carry_spec, iter(carry)), unflatten(loop.y_spec, iter(ys_leaves))


def _ended(loop: StepLoop, until: Callable[[Any], Any] | None, carry: list[Any], t: int,
           most: int | None) -> bool:
    """Whether the loop ends after its first `t` steps (their carry: `carry`); `until` is
    asked after every step, the last one too, as the recorded loop asks it."""
    if until is not None and stops(until, loop.carry_spec, carry):
        return True
    return t == most


def _recorded_result(loop: StepLoop, carry: list[Any], per_step: list[list[Any]],
                     ) -> tuple[Any, Any]:
    loop.n = len(per_step)
    return (unflatten(loop.carry_spec, iter(carry)),
            unflatten(loop.y_spec, iter(stack_outputs(per_step))))


def _tensors(arrays: list[Any]) -> list[Any]:
    return [None if a is None else make_tensor(a) for a in arrays]
