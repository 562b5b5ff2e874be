"""A planned loop's steps as its executor runs them, one or a segment at a time.

One step is recorded (`record_step`; steps 0 and 1 traced on the way, which decides whether
later steps replay from a step program), or run for its new carry and outputs alone
(`values_step`); a segment of steps is taped for a reverse action (`tape_steps`): recorded
with a tape (`TapedSegment`) or replayed keeping what its backward reads
(`ReplayedSegment`). Step 0's tape also tells which tensors from outside the loop the step
captures (`discover_from`). Owns the executor's `traces`, `program`, `mode`, `outside`,
`externals`, `same` and `step_deps`, as tracing and step 0 find them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...backend import is_floating
from ...grad_mode import _state, enable_grad, no_grad, step_scope
from ...origins import rerun_boundary, rerunning_from
from ...pytree import flatten, unflatten
from ...tape import Entry, edge_of, next_sequence
from ...tensor import Tensor
from . import step_tape
from .grad_flow import deps_of_tensors, outputs_requiring_grad
from .loop import PlannedStep, row_tensor
from .program_cache import REUSED
from .replayed_step import ReplayedStep
from .step_cuts import StepCuts
from .step_program import program_of, traced_call

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


@dataclass
class TapedSegment:
    """Steps start..stop-1 run with a tape, ready to pull an adjoint back through them."""

    start: int
    stop: int
    carry_in: list[Any]
    x_parts: list[tuple[int, list[Any]]]
    y_out: list[tuple[int, list[Any]]]
    carry_out: list[Any]
    seq_before: int
    # id -> graph edge, as the steps ran, of the outputs they returned from outside the
    # loop (a captured tensor): changed in place since (a final carry that is that
    # tensor), it has another history, and the pull-back delivers to the one they used
    outside_edges: dict[int, Any] = field(default_factory=dict)


@dataclass
class ReplayedSegment:
    """Steps start..stop-1 replayed from the step program, keeping what their backward reads."""

    start: int
    stop: int
    steps: list[tuple[int, ReplayedStep]]
    carry_in: list[Any]  # arrays
    carry_out: list[Any]  # arrays
    y_out: list[tuple[int, list[Any]]]  # arrays


def arrays_of(tensors: list[Any]) -> list[Any]:
    """The arrays of tensors (a replayed segment's outputs are arrays already)."""
    return [t._data if isinstance(t, Tensor) else t for t in tensors]


def call_step(executor: PlannedLoop, t: int, carry: list[Any], x: Any, untaped: bool = False,
              drops_hooks: bool = False, cuts: StepCuts | None = None,
              ) -> tuple[list[Any], list[Any]]:
    """Run step `t` (recorded) as a run of the loop's plan (`PlannedStep`: `untaped`,
    without a tape; `drops_hooks`, with one nobody pulls back; `cuts`: the history the
    run's carry and rows lack, where the step may take a gradient)."""
    scope = PlannedStep(executor.retained, t, executor.first_run, untaped, drops_hooks)
    scope.handles = executor.step_hooks
    scope.leaves = executor.retained_leaves
    scope.slots, scope.seq_started = executor.hook_slots, executor.seq_started
    scope.seq_run = next_sequence()
    scope.inputs = {id(v) for v in [*carry, *(flatten(x)[0] if x is not None else [])]
                    if v is not None}
    if cuts is not None:
        scope.cuts = add_rows(executor, cuts, t, x)
    if t == 0 and executor.first_run:  # step 0's carry stands for the caller's tensors
        scope.callers = {id(c): caller for c, caller in zip(carry, executor.carry_inputs)
                         if isinstance(c, Tensor) and caller is not None}
    elif t == 0:
        scope.carry_copies = {id(c) for c, caller in zip(carry, executor.carry_inputs)
                              if isinstance(c, Tensor) and caller is not None}
    with step_scope(scope):
        new, ys = record_step(executor, t, carry, x)
    if executor.first_run:
        note_carry(executor, t, carry, x, new)
    return new, ys


def note_carry(executor: PlannedLoop, t: int, carry: list[Any], x: Any, new: list[Any],
               ) -> None:
    """What recorded step t of the loop's first run did with its carry: the leaves it
    returned unchanged (a final carry every step passed on is the caller's tensor, as in a
    Python loop), the leaves it returned as one tensor, and those it returned that it did
    not make (a captured tensor: a Python loop's final carry is that tensor itself; see
    `PlannedLoop._final_carry_as_a_python_loop`)."""
    passed = [c is not None and c is m for c, m in zip(carry, new)]
    if executor.carry_passed is not None:
        passed = [a and b for a, b in zip(executor.carry_passed, passed)]
    executor.carry_passed = passed
    first = tuple(next(j for j, o in enumerate(new) if o is m) if m is not None else k
                  for k, m in enumerate(new))
    given = {id(c) for c in [*carry, *(flatten(x)[0] if x is not None else [])]
             if c is not None}
    # a leaf given to the step is the plan's copy, unless the step before returned it
    # (from outside: it passes it on, within a segment)
    known = {id(m) for m in executor.last_carry[2].values()} if (
        executor.last_carry is not None and executor.last_carry[0] == t - 1) else set()
    outside = {k: m for k, m in enumerate(new) if isinstance(m, Tensor) and (
        m._entry.seq < executor.seq_started if m._entry is not None
        else m._requires_grad and (id(m) not in given or id(m) in known))}
    executor.last_carry = (t, first, outside)


def record_step(executor: PlannedLoop, t: int, carry: list[Any], x: Any,
                ) -> tuple[list[Any], list[Any]]:
    """Run step `t` (recorded); steps 0 and 1 are traced on the way (step 0 alone when
    it fits the program an earlier call of this loop made: see `program_cache.py`)."""
    traces = executor.traces
    if traces is None or t > 1 or t in traces:
        if t == 0 and executor.outside is None and executor.program is None and (
                _state.tracer is None):  # trace=False: step 0 traced for what it reads
            new, ys, trace = traced_call(executor.loop, t, carry, x, refused=executor.mode)
            executor.outside, executor.step0_trace = trace.outside, trace
            return new, ys
        return executor.loop.call(t, carry, x)
    new, ys, traces[t] = traced_call(executor.loop, t, carry, x)
    if t == 0:
        executor.outside, executor.step0_trace = traces[0].outside, traces[0]
    place = executor.place
    if t == 0 and place is not None and place.expected:
        program = place.reuse(traces[0])
        if program is not None:
            executor.traces = None
            executor.program, executor.mode = program, REUSED
            return new, ys
    if len(traces) == 2 or executor.loop.n == 1:
        decide_replay(executor)
    return new, ys


def decide_replay(executor: PlannedLoop) -> None:
    """Replay from now on if steps 0 and 1 traced to one program; say why not otherwise."""
    traces = executor.traces
    assert traces is not None
    executor.traces = None  # decided: no more tracing, and the traced tensors are let go
    executor.program, executor.mode = program_of(traces, executor.loop.n,
                                                 len(executor.carry_meta))
    if executor.place is not None and len(traces) == 2:
        executor.place.remember(traces[0], traces[1], executor.program)


def replays_now(executor: PlannedLoop) -> bool:
    """Whether the backward may replay now: not under anomaly detection (it checks every
    entry's gradients) and no hooks on captured leaves (they run per recorded pass)."""
    program = executor.program
    return program is not None and not _state.anomaly and not any(
        t._hooks for t in program.has_hooks)


def discover_from(executor: PlannedLoop, segment: TapedSegment) -> None:
    """What step 0's tape (`segment`) tells, found once: the tensors the step captures, and
    where step 0 ran alone, its outputs' dependencies and the outputs that are the carry."""
    if executor.discovered:
        return
    executor.discovered = True
    ys = segment.y_out[0][1]
    new = segment.carry_out if segment.stop == 1 else None
    inputs = segment.carry_in + [p for _, parts in segment.x_parts for p in parts]
    produced = segment.carry_out + [y for _, ys_ in segment.y_out for y in ys_]
    executor.externals = discover(produced, inputs, segment.seq_before)
    if new is None:  # the carry step 0 made is not in hand: find aliases by position
        return
    executor.step_deps = deps_of_tensors(segment.carry_in, inputs[len(segment.carry_in):],
                                         new, ys, segment.seq_before)
    # outputs that are the new carry itself (RNNs return h, h): their adjoints are added
    # to the carry's, in the order a plain tape would add them
    executor.same = {k: j for k, y in enumerate(ys) for j, c in enumerate(new)
                     if y is not None and c is y}


def discover(outputs: list[Any], step_inputs: list[Any], seq_before: int) -> dict[Any, Any]:
    """The tensors outside the loop that a step's tape reaches (closure captures),
    including one the step returns as it is."""
    inside = {id(c) for c in step_inputs if c is not None}
    stack_ = []
    found = {}
    for o in outputs:
        if o is None or id(o) in inside:
            continue
        edge = edge_of(o)
        if edge is None:
            continue
        node, index = edge
        if type(node) is Entry and node.seq > seq_before:
            stack_.append(node)
        else:  # made outside the loop and returned untouched
            found[(id(node), index)] = edge
    seen: set[int] = set()
    while stack_:
        entry = stack_.pop()
        if id(entry) in seen:
            continue
        seen.add(id(entry))
        for edge in entry.edges:
            if edge is None:
                continue
            node, index = edge
            if type(node) is Entry:
                if node.seq > seq_before:  # recorded by the steps examined
                    stack_.append(node)
                else:
                    found[(id(node), index)] = edge
            elif id(node) not in inside:
                found[(id(node), index)] = edge
    return found


def cuts_from(executor: PlannedLoop, start: int, carry: list[Any]) -> StepCuts:
    """What the carry `carry` (tensors without history) that a run of steps from `start`
    begins with stands for: at step 0 the caller's tensors, later a carry whose history
    the plan does not keep."""
    cuts = StepCuts(start, next_sequence(), histories=executor.histories)
    if start > 0 and executor.step_deps is not None:  # (step 0 taped alone told them)
        deps = executor.step_deps
        cuts.plain_carry_rg = lambda: outputs_requiring_grad(executor.carry_rg, *deps,
                                                             start)[0]
    for k, c in enumerate(carry):
        if not isinstance(c, Tensor):
            continue
        caller = executor.carry_inputs[k] if start == 0 else None
        if caller is not None:
            cuts.stands_for[id(c)] = (f"its carry's leaf {k} at step 0 (a copy of the "
                                      "tensor the loop was given)", [caller])
            cuts.is_caller[id(c)] = caller
        else:
            cuts.stands_for[id(c)] = (f"its carry's leaf {k} at step {start} (whose history "
                                      "the plan does not keep)", None)
            cuts.carry_leaf[id(c)] = k
    return cuts


def add_rows(executor: PlannedLoop, cuts: StepCuts, t: int, x: Any) -> StepCuts:
    """`cuts`, with step t's rows of `xs` (leaves without history) standing for `xs`."""
    if x is not None:
        for j, (part, whole) in enumerate(zip(flatten(x)[0], executor.loop.xs_leaves)):
            if isinstance(part, Tensor) and whole is not None:
                cuts.stands_for[id(part)] = (f"its row of xs (leaf {j}) at step {t}", [whole])
    return cuts


def as_tensors(executor: PlannedLoop, state: list[Any], grad: bool) -> list[Any]:
    """The carry's arrays as new tensors (`grad`: requiring grad where the loop's carry may)."""
    out = []
    for array, rg in zip(state, executor.carry_rg):
        if array is None:
            out.append(None)
            continue
        t = Tensor._wrap(array)
        t._requires_grad = grad and (rg or is_floating(array.dtype))
        out.append(t)
    return out


def x_tensors(executor: PlannedLoop, t: int) -> Any:
    """Step t's rows of `xs`, as the step takes them (a pytree of new tensors, or None)."""
    loop = executor.loop
    if loop.xs_spec is None:
        return None
    parts = []
    for x in loop.xs_leaves:
        if x is None:
            parts.append(None)
            continue
        parts.append(row_tensor(x, t, x.requires_grad))
    return unflatten(loop.xs_spec, iter(parts))


def values_step(executor: PlannedLoop, t: int, arrays: list[Any]) -> tuple[list[Any], list[Any]]:
    """Step t run (recorded) from the carry `arrays` for its new carry and outputs alone
    (arrays): without a tape, or with one let go at once where the step takes a gradient
    inside it, which needs the step's graph (`StepLoop.takes_gradients`, seen in step 0,
    which runs with a tape). Hooks registered in it are dropped: the run the reverse
    pulls back registers them again."""
    if executor.loop.takes_gradients:
        with enable_grad():
            carry = as_tensors(executor, arrays, grad=True)
            new, ys = call_step(executor, t, carry, x_tensors(executor, t), drops_hooks=True,
                                cuts=cuts_from(executor, t, carry))
    else:
        with no_grad():
            new, ys = call_step(executor, t, as_tensors(executor, arrays, grad=False),
                                executor.loop.x_at(t), untaped=True)
    return arrays_of(new), arrays_of(ys)


@rerun_boundary
def tape_steps(
    executor: PlannedLoop, start: int, stop: int | None, arrays: list[Any],
    replayable: bool | None = None, until: Callable[[list[Any]], bool] | None = None,
    pulled_back: bool = True, on_outputs: Callable[[list[Any]], None] | None = None,
) -> TapedSegment | ReplayedSegment:
    """Run steps start..stop-1 from the carry `arrays` with a tape (or replayed, keeping
    what the tape would keep; `replayable` says so when the caller knows); `until(carry
    arrays)`, asked after each step, ends the segment early (`stop` None: only it does).
    `pulled_back=False`: no reverse pulls an adjoint back through the tape (hooks
    registered in the steps are dropped: see `PlannedStep`). `on_outputs(arrays)` takes a
    replayed segment's outputs step by step (its `y_out` then stays empty); a recorded
    segment keeps its output tensors in `y_out` (its pull-back starts from them)."""
    loop = executor.loop
    if replayable if replayable is not None else replays_now(executor):
        program = executor.program
        assert program is not None
        made = executor.carry_inputs if executor.carry_made and start == 0 else None
        carry_in = arrays
        steps, y_out, arrays = step_tape.tape_steps(program, arrays, loop.rows_for(program), start,
                                                    stop, made, loop.count, until,
                                                    on_outputs)
        return ReplayedSegment(start, start + len(steps), steps, carry_in, arrays, y_out)
    carry_in = as_tensors(executor, arrays, grad=True)
    carry = carry_in
    x_parts: list[tuple[int, list[Any]]] = []
    y_out: list[tuple[int, list[Any]]] = []
    cuts = cuts_from(executor, start, carry_in)
    seq_before = next_sequence()
    t = start
    with enable_grad(), rerunning_from(loop.origin):
        while stop is None or t < stop:
            x = x_tensors(executor, t)
            carry, ys = call_step(executor, t, carry, x, drops_hooks=not pulled_back,
                                  cuts=cuts)
            x_parts.append((t, flatten(x)[0] if x is not None else []))
            y_out.append((t, ys))
            t += 1
            if until is not None and until(arrays_of(carry)):
                break
    outside_edges = {id(o): (o._entry, o._index) for o in [*carry, *(
        y for _, ys in y_out for y in ys)] if o is not None and o._entry is not None and (
            o._entry.seq <= seq_before)}
    return TapedSegment(start, t, carry_in, x_parts, y_out, carry, seq_before,
                        outside_edges)
