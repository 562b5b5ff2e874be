"""A `scan` that keeps every step (no loop strategy), replayed after its first two steps (its
first step, when it reuses the program an earlier call made: see `program_cache.py`).

Steps 0 and 1 are recorded on the tape as any code is, and traced on the way (see
`step_program.py`). When they trace to one program, steps 2.. run as one tape entry: a plan
executor that tapes them all in its forward (`Periodic(n)`: nothing re-run) by replaying the
program on arrays, and pulls the adjoint back through them by the program's rules, adding
onto the running sums as the sweep hands them over (`PlannedLoop.adds_onto`). The values kept,
the profile and the gradients are those of recording every step, bit for bit; the Python cost
per operation is gone. When the trace is refused, the loop goes on recording every step, and
the result is exactly the recorded loop: nothing was done differently for steps 0 and 1.

The outputs of the parts (steps 0 and 1, the replayed rest) are put together by one entry
whose backward splits the gradient rows again, adding nothing: the executor writes the rest's
rows after those of the recorded steps into one array per output, so the join copies nothing
(`output_rows.join_rows`; rows that change shape or dtype are stacked and concatenated).
"""

from __future__ import annotations

from typing import Any

from ...function import Function
from ...grad_mode import _state, is_grad_enabled
from ...ops import concatenate, stack
from ...pytree import flatten, unflatten
from ...tensor import Tensor
from ..plans.loop_strategies import Periodic
from .loop import StepLoop, as_row, stack_outputs
from .output_rows import RecordedRows, join_rows
from .plan_executor import PlannedLoop, stops
from .program_cache import REUSED, find
from .step_program import program_of, traced_call

TRACED_STEPS = 2


class _SplitHead(Function):
    """The first `heads` rows of a tensor, and the rest as one tensor; the backward puts them
    back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, heads: int) -> tuple[Tensor, ...]:
        ctx.heads = heads
        return _head_and_rest(x, heads)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:
        heads = ctx.heads
        return concatenate([stack(list(grads[:heads]), axis=0), grads[heads]], axis=0), None


def replays(loop: StepLoop, trace: bool, until: Any = None, limit: int | None = None) -> bool:
    """Whether a loop keeping every step is worth tracing: grad on, tracing allowed, more
    steps than are traced (with `until`, when it may run more than two: at most `limit`),
    and not itself inside a step being traced (an outer loop replays this one's operations
    as its own)."""
    steps = loop.most_steps(until, limit)
    return (trace and is_grad_enabled() and _state.tracer is None
            and (steps is None or steps > TRACED_STEPS))


def replays_untaped(loop: StepLoop, trace: bool, until: Any = None,
                    limit: int | None = None) -> bool:
    """Whether a loop run without gradients is worth tracing (see `untaped_loop.py`): as
    `replays`, with gradients off (with `until`, when it may run more than two steps)."""
    steps = loop.most_steps(until, limit)
    return (trace and not is_grad_enabled() and _state.tracer is None
            and (steps is None or steps > TRACED_STEPS))


def recorded_because(loop: StepLoop, trace: bool, until: Any = None,
                     limit: int | None = None) -> str:
    """Why a loop records every step, when neither `replays` nor `replays_untaped` says
    yes: the mode `cad.inspect.loops()` lists for it."""
    if not trace:
        return "recorded: trace=False"
    if _state.tracer is not None:
        return "recorded: run inside a step being traced (the outer loop replays it)"
    steps = loop.most_steps(until, limit)
    return f"recorded: a loop of {steps} steps has none to replay beyond the {TRACED_STEPS} traced"


def keep_every_step(loop: StepLoop, carry_leaves: list[Any], until: Any = None,
                    limit: int | None = None) -> tuple[Any, Any]:
    """Run `loop` keeping every step; (carry, ys). How it ran is the loop entry's `mode`
    (no entry: recorded). With `until` (asked after each step), the loop runs until it
    says so, at most `limit` steps (None: no bound): `loop.n` is then the steps run."""
    if until is not None:
        loop.n = limit or 0  # all of xs is split, if there is one
    place = find(loop.step, "kept", carry_leaves, loop.xs_leaves)
    # an earlier call left a program: step 0 alone is recorded if it fits (see
    # `program_cache.py`); else, as on a first call, steps 0 and 1
    heads, rest = _split_xs(loop.xs_leaves, loop, 1 if place.expected else TRACED_STEPS)
    carry, ys, first = traced_call(loop, 0, carry_leaves, _row(loop, heads, 0))
    per_step = [ys]
    program = place.reuse(first) if place.expected else None
    mode = REUSED
    ended = _stops(loop, until, carry)
    if program is None and not ended:
        if place.expected and heads is not None:  # it did not fit: split row 1 off the
            more, rest = _split_xs(rest or [], loop, 1)  # rest as well
            heads += more or []
        carry, ys, second = traced_call(loop, 1, carry, _row(loop, heads, 1))
        per_step.append(ys)
        # step 1's trace: its carry is a step's output, as the carry of every step replayed
        program, mode = program_of({0: first, 1: second}, loop.n or TRACED_STEPS + 1,
                                   len(carry), template=1)
        place.remember(first, second, program)
        ended = _stops(loop, until, carry)
    done = len(per_step)
    loop.mode = mode
    if ended:  # `until` ended the loop within the steps recorded
        loop.n = done
        if program is not None or done == 1:  # (else the trace's refusal says why)
            loop.mode = f"recorded: `until` ended the loop after {done} traced step(s)"
        return _recorded_outputs(loop, carry, per_step)
    bound = loop.n if until is None or limit else None  # None: until alone ends the loop
    if program is None:  # record the rest as the steps so far were
        return record_steps(loop, carry, per_step, _rows(loop, rest, done) if loop.n else None,
                            bound, until)
    most = None if bound is None else bound - done
    rest_loop = StepLoop(loop.step, loop.carry_spec, rest or [], loop.xs_spec,
                         most or 0, y_spec=loop.y_spec, origin=loop.origin,
                         planned_by_budget=loop.planned_by_budget, holders=loop.holders,
                         batch_rows=loop.batch_rows, row_offset=done)
    lead = [[None if y is None else y._data for y in ys] for ys in per_step]
    executor = PlannedLoop(rest_loop, Periodic(most or 1), until, most, program=program,
                           name="scan[keep-all]", lead_rows=lead, mode=mode,
                           keeps_every_step=until is not None)
    carry_out, ys_rest = executor.run(list(carry))
    loop.evaluations += rest_loop.evaluations
    loop.rows = rest_loop.rows  # (what a profile counts of its chunk: `scan._loop_arrays`)
    loop.n = done + rest_loop.n
    whole, executor.full_outputs = executor.full_outputs, None  # the entry keeps no outputs
    from_rest = [None] * len(per_step[0]) if ys_rest is None else flatten(ys_rest)[0]
    if whole is None:  # rows kept (unlike rows): joined by copying
        whole = [None] * len(from_rest)
    ys_leaves = [
        None if lead_ys[0] is None
        else join_rows([*lead_ys, r], full) if full is not None
        else concatenate([stack(list(lead_ys), axis=0), r], axis=0)
        for lead_ys, r, full in zip(zip(*per_step), from_rest, whole)
    ]
    return carry_out, unflatten(loop.y_spec, iter(ys_leaves))


def record_steps(loop: StepLoop, carry: list[Any], per_step: list[list[Any]],
                 rows: list[Any] | None, bound: int | None, until: Any) -> tuple[Any, Any]:
    """Record steps ``len(per_step)``.. on the tape one by one (`per_step`: the outputs of
    those run so far; `rows[i]`: the scanned input of the i-th step recorded here, None
    without xs) until the loop has run `bound` steps (None: no bound) or `until` says so
    after one; (carry, ys) of the whole loop, whose `n` is then the steps run."""
    done = t = len(per_step)
    # each step's outputs written into their place as it ends (`RecordedRows`): the step's
    # tensors, once used, are let go; a loop `until` ends writes into growing chunks
    written = RecordedRows(bound if until is None else None)
    for ys in per_step:
        written.append(ys)
    del per_step[:]
    while bound is None or t < bound:
        carry, ys = loop.call(t, carry, None if rows is None else rows[t - done])
        written.append(ys)
        del ys
        t += 1
        if _stops(loop, until, carry):
            break
    loop.n = t
    return (unflatten(loop.carry_spec, iter(carry)),
            unflatten(loop.y_spec, iter(written.stacked())))


def _recorded_outputs(loop: StepLoop, carry: list[Any], per_step: list[list[Any]],
                      ) -> tuple[Any, Any]:
    ys_leaves = stack_outputs(per_step)
    return unflatten(loop.carry_spec, iter(carry)), unflatten(loop.y_spec, iter(ys_leaves))


def _stops(loop: StepLoop, until: Any, carry: list[Any]) -> bool:
    """Whether `until` (if any) ends the loop at `carry` (its leaves)."""
    return until is not None and stops(until, loop.carry_spec, carry)


def _row(loop: StepLoop, heads: list[list[Any]] | None, t: int) -> Any:
    return None if heads is None else unflatten(loop.xs_spec, iter(heads[t]))


def _split_xs(leaves: list[Any], loop: StepLoop, count: int,
              ) -> tuple[list[list[Any]] | None, list[Any] | None]:
    """The first `count` rows of every xs leaf (per step: a list of leaves), and the rest of
    each leaf as one tensor; a leaf that needs a gradient is split by one differentiable
    operation. The parts behave as views of the leaf (`as_row`)."""
    if loop.xs_spec is None:
        return None, None
    heads: list[list[Any]] = [[] for _ in range(count)]
    rest: list[Any] = []
    for x in leaves:
        if x is None:
            parts: tuple[Any, ...] = (None,) * (count + 1)
        elif x.requires_grad:
            parts = _SplitHead.apply(x, count)
        else:
            parts = _head_and_rest(x, count)
        for t in range(count):
            heads[t].append(as_row(parts[t], x, t))
        rest.append(as_row(parts[count], x, slice(count, None)))
    return heads, rest


def _head_and_rest(x: Tensor, count: int) -> tuple[Tensor, ...]:
    """The first `count` rows of `x`, and the rest, as tensors without history (views of
    its array)."""
    data = x._data
    return (*(Tensor._wrap(data[t]) for t in range(count)), Tensor._wrap(data[count:]))


def _rows(loop: StepLoop, rest: list[Any] | None, done: int) -> list[Any]:
    """The scanned inputs of the steps after the first `done` (split off `rest` as a plain
    loop splits xs)."""
    n = loop.n - done
    if rest is None:
        return [None] * n
    rest_loop = StepLoop(loop.step, loop.carry_spec, rest, loop.xs_spec, n)
    return rest_loop.all_x()
