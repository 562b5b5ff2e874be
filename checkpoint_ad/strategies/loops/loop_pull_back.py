"""The pull-back of one reverse action: the adjoint of the carry after a segment (and of its
outputs) pulled back to the carry before it, its rows of `xs` and the tensors the step
captures.

A taped segment is back-propagated through its tape (`pull_back`); a replayed one through its
step program (`pull_back_replayed`), with the same roots, keys and starting sums in the same
order, so the gradients are bitwise those of the recorded steps, and both bitwise those of a
plain tape keeping every step. Owns the executor's `keys_found` and `fixed_keys` (where a
replayed pull-back's sums go, found once per backward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...autograd import (
    Capture,
    backpropagate,
    fill_retained,
    fills_grads,
    mirror_grad,
    retain_also,
    run_tensor_hooks,
)
from ...errors import BackwardError
from ...tape import edge_of
from .loop import note_retained_leaf, retained_for
from .loop_steps import ReplayedSegment, TapedSegment, discover
from .step_pull_back import pull_back_steps

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


def pull_back(
    executor: PlannedLoop,
    segment: TapedSegment | ReplayedSegment,
    adj_carry: list[Any],
    adj_ys: list[Any],
    adj_xs: list[Any],
    xs_reached: list[bool],
    adj_ext: dict[tuple[int, int], Any],
    owned: dict[int, Any],
    retain_graph: bool,
    carry_sums: list[Any] | None = None,
) -> list[Any]:
    """Back-propagate the adjoint of the carry after `segment` (and of its outputs) to the
    carry before it, its scanned inputs and the captured tensors; the carry's gradient
    adds onto `carry_sums` (the first segment's: what reached the loop's initial carry
    from after the loop)."""
    if isinstance(segment, ReplayedSegment):
        return pull_back_replayed(
            executor, segment, adj_carry, adj_ys, adj_xs, xs_reached, adj_ext, owned,
            retain_graph, carry_sums)
    flush_rows(executor, adj_ext)  # a chunk the replayed steps above left unsummed
    start, stop, carry_in = segment.start, segment.stop, segment.carry_in
    produced = segment.carry_out + [y for _, ys in segment.y_out for y in ys]
    found = discover(
        produced, carry_in + [p for _, parts in segment.x_parts for p in parts],
        segment.seq_before,
    )
    # tensors from outside that step 0's tape did not reach: captured too, and refused
    # only where a gradient reaches them (the loop's entry has no edge to hand it on). A
    # tape reaches more than the gradient does: a re-run's inner `scan` may replay where
    # step 0's (run in a trace) recorded, and its entry has an edge to every input
    unknown = [key for key in found if key not in executor.externals]
    _carry_on_hooks(executor, segment)
    _carry_on_retained(executor, segment, adj_carry)
    roots = []
    edges = segment.outside_edges
    for c, g in zip(segment.carry_out, adj_carry):
        if c is not None and g is not None and c.requires_grad:
            roots.append((edges.get(id(c)) or edge_of(c), g))
    # later outputs first, and later steps first: a plain tape's stacks of the outputs
    # were recorded last (and in that order), so it adds their adjoints in this order
    # where outputs alias one tensor
    for k in reversed(range(len(adj_ys))):
        for t, ys in reversed(segment.y_out):
            y, g = ys[k], adj_ys[k]
            if t == stop - 1 and k in executor.same:
                continue  # in adj_carry: added when the next step was reversed, or the
                # loop's last row, which reaches the entry through its final carry
            if y is not None and g is not None and y.requires_grad:
                roots.append((edges.get(id(y)) or edge_of(y), g[t]))
    keys: dict[tuple[int, int], int] = {}
    for c in carry_in:
        if c is not None and c.requires_grad:
            keys[(id(c), 0)] = len(keys)
    for _, parts in segment.x_parts:
        for p in parts:
            if p is not None and p.requires_grad:
                keys[(id(p), 0)] = len(keys)
    for key in executor.externals:
        keys.setdefault(key, len(keys))
    for key in unknown:
        keys.setdefault(key, len(keys))
    # carry on adding each captured tensor's gradient in the order a plain tape would
    initial: list[Any] = [None] * len(keys)
    if carry_sums is not None:
        for c, total in zip(carry_in, carry_sums):
            if c is not None and c.requires_grad and total is not None:
                initial[keys[(id(c), 0)]] = total
    if start > 0:
        for k in sorted(executor.same, reverse=True):
            c = carry_in[executor.same[k]]
            if c is not None and c.requires_grad and adj_ys[k] is not None:
                position = keys[(id(c), 0)]
                g = adj_ys[k][start - 1]
                initial[position] = g if initial[position] is None else initial[position] + g
    for key in executor.externals:
        initial[keys[key]] = adj_ext.pop(key, None)  # the sink's alone: see below
    sink = Capture(keys, initial=initial, owned=owned, newer_than=segment.seq_before,
                   fills_retained=fills_grads())
    del initial  # the sink holds its own list of the sums
    if roots:
        backpropagate(roots, retain_graph=retain_graph, create_graph=False, capture=sink)
    captured = sink.values
    if any(captured[keys[key]] is not None for key in unknown):
        raise BackwardError(
            f"scan: steps {start}..{stop - 1} used tensors from outside the loop that step 0 "
            "did not use; with a checkpointing strategy every step must capture the same "
            "tensors (pass values that vary by step through xs instead)"
        )
    new_adj = []
    deferred = []
    carried: list[tuple[int, list[Any]]] = []
    for k, c in enumerate(carry_in):
        keep = c is not None and c.requires_grad
        g = captured[keys[(id(c), 0)]] if keep else None
        if keep and c._hooks and start > 0:
            deferred.append((k, c._hooks))  # they see the total: the earlier segment's
        elif keep:  # step 0's: the whole gradient that reaches the loop's initial carry
            g = _step_input_hooks(c, g, "the carry of step 0")
        if keep:
            _retained_carry(executor, start, k, c, carried)
        owned.pop(id(g), None)  # handed on as a root: a rule may pass it to two inputs
        new_adj.append(g)
    if deferred:
        executor.carry_hooks[start] = deferred
    if carried:
        executor.carry_retained[start] = carried
    for t, parts in reversed(segment.x_parts):  # later steps' first, as keeping them all
        for k, p in enumerate(parts):
            if p is not None and p.requires_grad:
                g = _step_input_hooks(p, captured[keys[(id(p), 0)]], f"the row of step {t}")
                for original in retained_for(executor.retained_leaves, p):
                    fill_retained(original, g)  # a row retained_grad() was called on
                if g is not None:
                    adj_xs[k][t] = g
                    xs_reached[k] = True
    for key in executor.externals:
        if captured[keys[key]] is not None:
            adj_ext[key] = captured[keys[key]]
    return new_adj


def _carry_on_hooks(executor: PlannedLoop, segment: TapedSegment) -> None:
    """Put the hooks the later segment's re-run registered on its input carry onto this
    segment's output carry, the same value: there they see its whole gradient (what the
    later steps sent back, and what this segment's own uses of it add), as they would on
    the previous step's output keeping every step."""
    for k, hooks in executor.carry_hooks.pop(segment.stop, ()):
        c = segment.carry_out[k]
        if c is None or not c.requires_grad:
            continue
        if c._entry is None:  # the step returned its input carry: that leaf's hooks
            target = c if c._leaf_target is None else c._leaf_target
            if target._hooks is None:
                target._hooks = {}
            target._hooks.update(hooks)
        else:
            c._entry._hooks().outputs.setdefault(c._index, {}).update(hooks)


def _retained_carry(executor: PlannedLoop, start: int, k: int, leaf: Any,
                    carried: list[tuple[int, list[Any]]]) -> None:
    """The tensors a segment's input carry leaf `k` stands for, retained in its first step
    (`PlannedStep`): at step 0, copies of the caller's tensor, whose `.grad` is the
    caller's (keeping every step hands the step the caller's tensor itself); later, the
    previous step's output carry, which the earlier segment's reverse fills
    (`_carry_on_retained`: there it gets its whole gradient, after that tensor's hooks)."""
    originals = retained_for(executor.retained_leaves, leaf)
    if not originals:
        return
    if start > 0:
        carried.append((k, originals))
        return
    caller = executor.carry_inputs[k]
    for original in originals:
        if caller is not None and original is not caller:
            mirror_grad(original, caller)


def _carry_on_retained(executor: PlannedLoop, segment: TapedSegment,
                       adj_carry: list[Any]) -> None:
    """Retain the output carry of `segment` for the tensors the later segment's first step
    retained as its input carry (the same value, see `_retained_carry`), as its hooks go
    there (`_carry_on_hooks`): its gradient is then what it is keeping every step, the
    uses in this segment's last step and its hooks included. A carry this segment's step
    returned unchanged passes them on to its own input carry; one from before the loop (a
    captured tensor returned as the carry) gives them the gradient that reached it from
    the later steps."""
    for k, originals in executor.carry_retained.pop(segment.stop, ()):
        c = segment.carry_out[k]
        if c is None or not c.requires_grad:
            continue
        entry = c._entry
        if entry is None and any(c is i for i in segment.carry_in):
            for original in originals:
                note_retained_leaf(executor.retained_leaves, c, original)
        elif entry is not None and entry.seq > segment.seq_before:
            for original in originals:
                retain_also(entry, c._index, original)
        else:
            for original in originals:
                fill_retained(original, adj_carry[k])


def _step_input_hooks(leaf: Any, grad: Any, what: str) -> Any:
    """`grad` through the hooks the step registered on one of its inputs (a carry leaf or
    a row), which a plan's re-run makes a leaf of its own: keeping every step, that input
    is the previous step's carry or a row of xs, whose hooks see its whole gradient (the
    sink's sum here) before it flows on. (A captured tensor's hooks run in the sweep
    around the loop, once on its total.)"""
    if leaf is None or grad is None or not leaf._hooks:
        return grad
    return run_tensor_hooks(leaf._hooks, grad, False, what)


def pull_back_replayed(
    executor: PlannedLoop,
    segment: ReplayedSegment,
    adj_carry: list[Any],
    adj_ys: list[Any],
    adj_xs: list[Any],
    xs_reached: list[bool],
    adj_ext: dict[tuple[int, int], Any],
    owned: dict[int, Any],
    retain_graph: bool,
    carry_sums: list[Any] | None = None,
) -> list[Any]:
    """`pull_back` for a replayed segment: the same roots, keys and starting sums, in
    the same order, so the gradients are bitwise those of the recorded steps."""
    program = executor.program
    assert program is not None
    start, stop = segment.start, segment.stop
    n_carry = len(program.carry_in)
    xs_grad = replay_keys(executor)[1]

    def requires_grad(t: int, slot: int) -> bool:
        while slot < n_carry and t > start:  # a carry the previous step made
            t, slot = t - 1, program.carry_out[slot]
        return slot >= 0 and program.requires_grad[slot]

    def roots_at(t: int) -> list[tuple[int, Any]]:
        """Step t's roots, (slot, adjoint), in the order of `roots` below."""
        found = []
        if t == stop - 1:
            for k, g in enumerate(adj_carry):
                slot = program.carry_out[k]
                if g is not None and requires_grad(t, slot):
                    found.append((slot, g))
        for k in reversed(range(len(adj_ys))):
            slot, g = program.y_out[k], adj_ys[k]
            if g is not None and not (t == stop - 1 and k in executor.same) and (
                    requires_grad(t, slot)):
                found.append((slot, g[t]))
        return found

    # every root at once, in delivery order, where a root may reach another step than
    # its own; else each step's as the pull-back reaches it (a long segment's roots are
    # a row view and two tuples a step, all held at the peak)
    roots: Any = roots_at if program.roots_per_step else []
    if not program.roots_per_step:
        for k, g in enumerate(adj_carry):
            slot = program.carry_out[k]
            if g is not None and requires_grad(stop - 1, slot):
                roots.append(((stop - 1, slot), g))
        for k in reversed(range(len(adj_ys))):
            slot, g = program.y_out[k], adj_ys[k]
            if g is None:
                continue
            for t in reversed(range(start, stop)):
                if t == stop - 1 and k in executor.same:
                    continue  # in adj_carry: added when the next step was reversed, or
                    # the loop's last row, which reaches the entry through its final carry
                if requires_grad(t, slot):
                    roots.append(((t, slot), g[t]))
    keys, external_position = segment_keys(executor, start, stop)
    initial: list[Any] = [None] * (len(keys) + len(external_position))
    if carry_sums is not None:
        for k, total in enumerate(carry_sums):
            position = keys.get(("carry", k))
            if position is not None and total is not None:
                initial[position] = total
    if start > 0:
        for k in sorted(executor.same, reverse=True):
            position = keys.get(("carry", executor.same[k]))
            if position is not None and adj_ys[k] is not None:
                g = adj_ys[k][start - 1]
                initial[position] = g if initial[position] is None else initial[position] + g
    for key, position in external_position.items():
        # taken out, not copied: a running sum the sink replaces by a new one (the first
        # time it adds onto a rule's result, which it may not change in place) is then
        # freed at once, not kept until the pull-back ends (a weight's size at the peak)
        initial[position] = adj_ext.pop(key, None)
    sink = Capture({}, initial=initial, owned=owned)
    del initial  # the sink holds its own list of the sums
    rows = executor.loop.row_source(program)
    # (a function is true: its steps may have no roots, which costs little; a chunk's
    # gradients kept from later steps are summed when the sweep passes its first step)
    if roots or (rows is not None and rows.grad_chunk >= 0):
        pull_back_steps(program, segment.steps, roots, sink, keys, retain=retain_graph,
                        rows=rows)
    captured = sink.values
    new_adj = []
    for k in range(n_carry):
        position = keys.get(("carry", k))
        g = None if position is None else captured[position]
        owned.pop(id(g), None)  # handed on as a root: a rule may pass it to two inputs
        new_adj.append(g)
    for t in range(start, stop):
        for k in xs_grad:
            position = keys[("x", t, k)]
            if captured[position] is not None:
                adj_xs[k][t] = captured[position]
                xs_reached[k] = True
    for key, position in external_position.items():
        if captured[position] is not None:
            adj_ext[key] = captured[position]
    return new_adj


def flush_rows(executor: PlannedLoop, adj_ext: dict[tuple[int, int], Any]) -> None:
    """A chunk of stacked rows (`hoisted_rows.RowSource`) that replayed steps left before
    the sweep reached its first step, summed into the captured tensors' gradients now: the
    steps below are recorded (anomaly detection) and pull back row by row, or the backward
    ended."""
    rows = executor.loop.rows
    if executor.program is None or rows is None or rows[1] is None or rows[1].grad_chunk < 0:
        return

    def add(key: tuple[int, int], grad: Any) -> None:
        previous = adj_ext.get(key)
        adj_ext[key] = grad if previous is None else previous + grad

    rows[1].flush(add, dict(replay_keys(executor)[2]))


def segment_keys(
    executor: PlannedLoop, start: int, stop: int
) -> tuple[dict[tuple[Any, ...], int], dict[tuple[int, int], int]]:
    """(keys, external positions) of a replayed pull-back of steps start..stop-1: where
    each sum it hands out goes. Without scanned inputs that take a gradient they are the
    same for every segment, so made once per backward (a binomial plan pulls back one
    step at a time: made per step, they cost about a tenth of a small step)."""
    carry_grad, xs_grad, ext_slots = replay_keys(executor)
    if not xs_grad and executor.fixed_keys is not None:
        return executor.fixed_keys
    keys: dict[tuple[Any, ...], int] = {("carry", k): i for i, k in enumerate(carry_grad)}
    for t in range(start, stop):
        for k in xs_grad:
            keys[("x", t, k)] = len(keys)
    external_position = {key: len(keys) + i for i, key in enumerate(executor.externals)}
    for slot, key in ext_slots:
        keys[("ext", slot)] = external_position[key]
    if not xs_grad:
        executor.fixed_keys = (keys, external_position)
    return keys, external_position


def replay_keys(
    executor: PlannedLoop,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, Any], ...]]:
    """What every replayed pull-back of a backward keys its sums by, found once: the carry
    leaves that take a gradient, the xs leaves that do, and (slot, key) of each captured
    tensor the program reads."""
    found = executor.keys_found
    if found is None:
        program = executor.program
        assert program is not None
        found = executor.keys_found = (
            tuple(k for k in range(len(program.carry_in)) if program.requires_grad[k]),
            tuple(k for k, x in enumerate(executor.loop.xs_leaves)
                  if x is not None and x.requires_grad),
            tuple((slot, key) for slot, key in program.external_keys.items()
                  if key in executor.externals),
        )
    return found
