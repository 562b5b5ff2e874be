"""A planned loop's backward: the rest of its plan, from where the forward stopped.

Each action runs in turn: restore a snapshot, advance (steps replayed or recorded without a
tape), take or free a snapshot, and reverse a segment: tape its steps (or take the taped end
the forward kept) and pull the adjoint back through them (`loop_pull_back`), so at most the
plan's snapshots and one segment's tape are held at once (`run_backward`). Under
`create_graph` the loop is run again once with a tape from its real inputs and differentiated
like a plain loop (`backward_with_graph`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ... import events, random
from ...autograd import Capture, backpropagate, fills_grads
from ...backend import namespace
from ...grad_mode import enable_grad, no_grad, step_scope
from ...ops import stack
from ...origins import rerun_boundary, rerunning_from
from ...pytree import flatten
from ...saved import use_packer
from ...tape import Entry, edge_of
from ...tensor import Tensor
from ..plans.revolve import (
    _ADVANCE,
    _DISK_RESTORE,
    _DISK_SNAPSHOT,
    _FREE,
    _RESTORE,
    _REVERSE,
    _SNAPSHOT,
    plan_codes,
    split_code,
)
from .loop import PlannedStep, columns
from .loop_forward import take_back_kept_hooks
from .loop_pull_back import flush_rows, pull_back
from .loop_snapshots import read_ahead, restore_snapshot, take_snapshot
from .loop_steps import replays_now, tape_steps, values_step

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


def run_backward(
    executor: PlannedLoop, entry: Entry, grads: list[Any], retain_graph: bool,
    onto: list[Any] | None,
) -> list[Any]:
    """The plan's actions from the forward's cursor to its end: the loop's input gradients
    (see `PlannedLoop.backward`, which checks the guards and cleans up on an error)."""
    loop = executor.loop
    forward = executor.state
    assert forward is not None
    executor.keys_found = None  # found again per backward: xs may take a gradient now
    executor.fixed_keys = None  # (`loop_pull_back.segment_keys`)
    executor.carry_hooks = {}
    executor.carry_retained = {}
    leaves = executor.retained_leaves  # (those of runs gone: let go)
    for key in [key for key, (leaf, _) in leaves.items() if leaf() is None]:
        del leaves[key]
    if retain_graph:  # work on copies: the forward's state must answer again
        snapshots = dict(forward.snapshots)
    else:
        snapshots = forward.snapshots
        entry.slots = ()  # the plan frees snapshots as it goes: the entry must not keep them
    n_carry = len(executor.carry_meta)
    adj_carry = list(grads[:n_carry])
    adj_ys = grads[n_carry:]
    # each scanned input's gradient, one array written row by row (not a list of rows
    # stacked at the end: that would hold it twice); None where no gradient reached it
    adj_xs: list[Any] = [
        namespace(x._data).zeros(x.shape, dtype=x.dtype)
        if x is not None and x.requires_grad else None
        for x in loop.xs_leaves
    ]
    xs_reached = [False] * len(adj_xs)
    adj_ext: dict[tuple[int, int], Any] = {}
    carry_sums: list[Any] = [None] * n_carry  # what the carry's gradient adds onto
    if onto is not None:
        carry_sums = list(onto[:n_carry])
        for k, passed in enumerate(executor.final_passed):
            if passed and carry_sums[k] is not None:  # the final carry is the initial
                # one: what reached it from after the loop starts the last step's sum, as
                # on a plain tape (the entry's own output for it is handed to no one)
                moved, carry_sums[k] = carry_sums[k], None
                adj_carry[k] = moved if adj_carry[k] is None else moved + adj_carry[k]
        for key, start in zip(executor.externals, onto[executor.n_inputs:]):
            if start is not None:
                adj_ext[key] = start
    owned: dict[int, Any] = {}  # gradient sums made here, safe to add into in place
    arrays = forward.current
    stream = random.restored(executor.initial_engine_state)  # rewound before any step re-runs
    if forward.current_engine_state is not None:
        if forward.current_numpy_state is not None:
            np.random.set_state(forward.current_numpy_state)
        random.rewind(stream, forward.current_engine_state)
    read_ahead(executor, snapshots, forward.cursor - 1)
    program = executor.program
    # a replay that draws nothing, with nobody listening, needs none of the blocks a
    # re-run enters (no generator to switch, no tape, no recompute events): run bare;
    # a taped one too when it packs nothing (a storage's pack might draw)
    bare = program is not None and not program.draws and not events.listeners
    bare_reverse = bare and program.tape_as_is is not None and replays_now(executor)
    codes = plan_codes(executor.plan)  # read packed: building each action costs more
    if forward.kept_hooks and not _reverses_kept(codes, forward.cursor):
        take_back_kept_hooks(forward)  # its steps run again: they register them again
    for index in range(forward.cursor, len(codes)):
        kind, step, stop = split_code(codes[index])
        if kind == _ADVANCE:
            if bare:
                arrays = advance_replayed(executor, step, stop, arrays)
                continue
            with events.recomputing(executor.name), no_grad(), random.using(stream):
                if program is not None:
                    arrays = advance_replayed(executor, step, stop, arrays)
                else:
                    for t in range(step, stop):
                        arrays, _ = values_step(executor, t, arrays)
        elif kind == _SNAPSHOT:
            with random.using(stream):
                snapshots[step] = take_snapshot(executor, arrays)
        elif kind == _DISK_SNAPSHOT:
            with random.using(stream):
                snapshots[step] = take_snapshot(executor, arrays, executor.disk_storage)
        elif kind in (_RESTORE, _DISK_RESTORE):
            arrays = restore_snapshot(executor, snapshots[step], stream)
            read_ahead(executor, snapshots, index)
        elif kind == _FREE:
            del snapshots[step]
        else:
            start = step  # (a one-step action repeats its step in the second field)
            stop = step + 1 if kind == _REVERSE else stop
            kept = forward.kept if index == forward.cursor else None
            if kept is None and bare_reverse:
                segment = tape_steps(executor, start, stop, arrays, replayable=True,
                                     on_outputs=_dropped)
            elif kept is None:
                with events.recomputing(executor.name), random.using(stream), use_packer(
                    executor.step_packer
                ):
                    segment = tape_steps(executor, start, stop, arrays, on_outputs=_dropped)
            else:
                segment = kept
                if not retain_graph:
                    forward.kept = None
            adj_carry = pull_back(
                executor, segment, adj_carry, adj_ys, adj_xs, xs_reached, adj_ext, owned,
                retain_graph=retain_graph and kept is not None,
                carry_sums=carry_sums if start == 0 else None,
            )
            # let go of the reversed segment's steps now, not when the next segment is
            # taped (the name would hold them while it is: two segments at the peak)
            arrays = segment = kept = None
    if not retain_graph:
        executor.state = None
        executor.consumed = True
    flush_rows(executor, adj_ext)
    executor.loop.release_rows()
    results = list(adj_carry)
    results.extend(g if reached else None for g, reached in zip(adj_xs, xs_reached))
    for key in executor.externals:
        results.append(adj_ext.get(key))
    return results


def advance_replayed(executor: PlannedLoop, start: int, stop: int, arrays: list[Any]) -> list[Any]:
    """Steps start..stop-1 replayed from the carry `arrays` without a tape: the new
    carry's arrays (each step counted as an evaluation)."""
    loop, program = executor.loop, executor.program
    assert program is not None
    rows = loop.rows_for(program)
    for t in range(start, stop):
        loop.count()
        arrays, _ = program.run(arrays, rows(t))
    return arrays


@rerun_boundary
def backward_with_graph(
    executor: PlannedLoop, entry: Entry, grads: list[Any], onto: list[Any] | None = None
) -> list[Any]:
    """Differentiate the loop with a graph of its own gradient (create_graph=True): re-run
    every step with a tape from the loop's real inputs, like a plain loop, and pull the
    gradients back through that tape with create_graph."""
    loop = executor.loop
    np.random.set_state(executor.initial_numpy_state)
    with events.recomputing(executor.name), enable_grad(), random.replaying(
        executor.initial_engine_state
    ), use_packer(executor.step_packer), rerunning_from(loop.origin):
        carry = list(executor.carry_inputs)
        per_step = []
        for t, x in enumerate(loop.all_x()):
            scope = PlannedStep(executor.retained, t, first=False)
            scope.slots, scope.seq_started = executor.hook_slots, executor.seq_started
            scope.inputs = {id(v) for v in [*carry, *(flatten(x)[0] if x is not None else [])]
                            if v is not None}
            with step_scope(scope):
                carry, ys = loop.call(t, carry, x)
            per_step.append(ys)
        outputs = carry + [
            None if rows is None else stack(rows, axis=0)
            for rows in output_rows_of(executor, per_step)
        ]
    return pull_back_with_graph(entry, outputs, grads, onto, fills_retained=fills_grads())


def pull_back_with_graph(entry: Entry, outputs: list[Any], grads: list[Any],
                         onto: list[Any] | None, fills_retained: bool = False) -> list[Any]:
    """The gradients at `entry`'s edges of `grads` pulled back, with create_graph, from the
    re-recorded `outputs` (tensors; None where absent) through to the entry's inputs, each
    begun from its running sum in `onto`: the last half of a loop entry's create_graph
    backward (a planned `scan`'s, a folded Python loop's)."""
    roots = []
    for out, g in zip(outputs, grads):
        if out is not None and g is not None and out.requires_grad:
            roots.append((edge_of(out), g if isinstance(g, Tensor) else Tensor._wrap(g)))
    keys: dict[tuple[int, int], int] = {}
    for edge in entry.edges:
        if edge is not None:
            keys.setdefault((id(edge[0]), edge[1]), len(keys))
    initial: list[Any] = [None] * len(keys)
    for edge, total in zip(entry.edges, onto or ()):
        if edge is not None and total is not None:
            initial[keys[(id(edge[0]), edge[1])]] = total
    sink = Capture(keys, initial=initial, newer_than=entry.seq, fills_retained=fills_retained)
    backpropagate(roots, retain_graph=True, create_graph=True, capture=sink)
    return [
        None if edge is None else sink.values[keys[(id(edge[0]), edge[1])]]
        for edge in entry.edges
    ]


def output_rows_of(executor: PlannedLoop, per_step: list[list[Any]]) -> list[list[Any] | None]:
    """The rows each of the entry's stacked outputs holds: every step's, except the last
    of an output that is the carry itself (joined on after the entry, see
    `PlannedLoop._last_rows_from_carry`); None for an absent output or one left with no rows."""
    out: list[list[Any] | None] = []
    for k, column in enumerate(columns(per_step)):
        rows = column[:-1] if k in executor.same else column
        out.append(None if column[0] is None or not rows else rows)
    return out


def _reverses_kept(codes: Any, cursor: int) -> bool:
    """Whether the backward's first action reverses the forward's kept tape (else it runs
    those steps again)."""
    if cursor >= len(codes):
        return False
    return split_code(codes[cursor])[0] not in (
        _ADVANCE, _SNAPSHOT, _DISK_SNAPSHOT, _RESTORE, _DISK_RESTORE, _FREE)


def _dropped(ys: list[Any]) -> None:
    """A re-taped segment's outputs, let go as each step ends: the forward handed them over
    already, and its pull-back reads only the saved values (a segment holding them all would
    keep every step's outputs at full precision under a compressing strategy)."""
