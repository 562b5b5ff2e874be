"""A step program's instructions turned, once, into the calls a replay makes per step.

Why: a replay runs every instruction of every step, forward and backward, so whatever it
looks up per call (which function, which slots, which saved value a rule reads, where a
gradient goes) is paid thousands of times. Here each instruction is bound once, when its
`StepProgram` is made, to a small closure over its forward function, input slots and
attributes, and each backward rule to the positions of the saved values it reads; every slot
gets a delivery kind saying where a gradient arriving at it goes. The calls are the same
functions with the same arguments in the same order as before, so results stay bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from ... import random
from ...backend import broadcast_axes, namespace
from ...saved import KeepAll

# where a gradient arriving at a slot goes (see `step_pull_back.pull_back_steps`)
DROP = 0  # no gradient wanted: a leaf that does not require one, or a leaf made in the step
PENDING = 1  # a value made in the step: summed until the instruction that made it runs
CARRY = 2  # the step's carry: the previous step's new carry, or the sink for the first step
XS = 3  # a scanned input: the sink, at this step's row
EXTERNAL = 4  # a tensor captured from outside the loop: the sink

Forward = Callable[[list[Any], Any], Any]
Rule = Callable[[Any, list[Any]], Any]
SumBack = Callable[[Any], Any]
# (index, forward, output slot, the getter of the slots it saves or None, slots freed after)
AsIsRow = tuple[int, Forward, int, Callable[[list[Any]], Sequence[Any]] | None, tuple[int, ...]]


def namespace_of(values: list[Any]) -> Any:
    """The array namespace a step's forwards take (`xp`), from its values (one device: the
    engine checks it per op)."""
    for v in values:
        if v is not None:
            return namespace(v)
    return np


def compile_forward(ins: Any, draw_type: type) -> Forward:
    """`(values, xp) -> output` of one instruction: its input's array (detach), a new draw
    from the engine's generator, or the primitive's forward on the input slots' values."""
    prim = ins.prim
    slots = ins.inputs
    if prim is None:
        (source,) = slots
        return lambda values, xp: values[source]
    if type(prim) is draw_type:
        make = prim.make
        return lambda values, xp: make(random.generator())
    forward = prim.forward
    attrs = ins.attrs
    # numpy gives a scalar for a 0-d result; a slot holds an array (checked inline: a call
    # more per instruction would cost as much as the check)
    scalar = np.generic
    asarray = np.asarray
    if prim.variadic:
        def call(values: list[Any], xp: Any) -> Any:
            out = forward(xp, [values[s] for s in slots], **attrs)
            return asarray(out) if isinstance(out, scalar) else out
    elif attrs:
        def call(values: list[Any], xp: Any) -> Any:
            out = forward(xp, *[values[s] for s in slots], **attrs)
            return asarray(out) if isinstance(out, scalar) else out
    elif len(slots) == 1:
        (a,) = slots

        def call(values: list[Any], xp: Any) -> Any:
            out = forward(xp, values[a])
            return asarray(out) if isinstance(out, scalar) else out
    elif len(slots) == 2:
        a, b = slots

        def call(values: list[Any], xp: Any) -> Any:
            out = forward(xp, values[a], values[b])
            return asarray(out) if isinstance(out, scalar) else out
    else:
        def call(values: list[Any], xp: Any) -> Any:
            out = forward(xp, *[values[s] for s in slots])
            return asarray(out) if isinstance(out, scalar) else out
    return call


# how a compiled rule is called (see `compile_rules`)
GRAD_ONLY = 0  # fn(g)
ONE_SAVED = 1  # fn(g, saved[k])
BOUND = 2  # fn(g, saved): a closure binding what else the rule takes
HOIST = 3  # no call: a batched product's gradient, kept for its chunk (`hoisted_rows.py`)


def compile_rules(ins: Any) -> tuple[tuple[int, Callable[..., Any], int, Any, Any, int], ...]:
    """The backward of one taped instruction: per input that takes a gradient, in input
    order, (call kind, function, saved index, the input's shape where the primitive
    broadcasts else None, what sums a gradient back to that shape, input slot). The call
    kind says how the function is called with the output's gradient `g` and the
    instruction's saved values (in `ins.saved` order); it returns that input's gradient,
    as `Primitive.backward` computes it."""
    prim = ins.prim
    names = [s.name for s in ins.saved]
    attrs = ins.attrs
    out = []
    if prim.variadic:
        rule = ins.form.rules["xs"]
        everything = tuple(names.index(f"x{i}") for i in range(len(ins.inputs))) \
            if rule.needs else None
        for i, needed in enumerate(ins.mask):
            if needed:
                out.append((BOUND, _variadic_rule(rule.rule, i, everything, attrs), 0, None,
                            None, ins.inputs[i]))
        return tuple(out)
    for i, (name, needed) in enumerate(zip(prim.args, ins.mask)):
        rule = ins.form.rules.get(name) if needed else None
        if rule is None:
            continue
        shape = ins.in_shapes[i] if prim.broadcasts else None
        back = sum_back(shape) if shape is not None else None
        needs = tuple(names.index(n) for n in rule.needs)
        if not attrs and not needs:
            call = (GRAD_ONLY, rule.rule, 0)
        elif not attrs and len(needs) == 1:
            call = (ONE_SAVED, rule.rule, needs[0])
        else:
            call = (BOUND, _rule(rule.rule, needs, attrs), 0)
        out.append((*call, shape, back, ins.inputs[i]))
    return tuple(out)


def sum_back(shape: tuple[int, ...]) -> SumBack:
    """`grad` summed back to `shape` where broadcasting made it larger (the sum `_sum_to` of
    the tape makes), the axes found once per gradient shape rather than on every call. The
    caller checks the shapes first: most gradients need no sum."""
    axes_for: dict[tuple[int, ...], tuple[int, ...]] = {}
    reduce = np.add.reduce  # what `ndarray.sum` calls, without its Python layer

    def back(grad: Any) -> Any:
        got = tuple(grad.shape)
        if got == shape:
            return grad
        axes = axes_for.get(got)
        if axes is None:
            axes = axes_for[got] = broadcast_axes(shape, got)
        if type(grad) is np.ndarray:
            return reduce(grad, axes, None, None, True).reshape(shape)
        return grad.sum(axis=axes, keepdims=True).reshape(shape)

    return back


def _rule(fn: Callable[..., Any], needs: tuple[int, ...], attrs: dict[str, Any]) -> Rule:
    return lambda g, saved: fn(g, *[saved[k] for k in needs], **attrs)


def _variadic_rule(fn: Callable[..., Any], i: int, everything: tuple[int, ...] | None,
                   attrs: dict[str, Any]) -> Rule:
    if everything is None:
        return lambda g, saved: fn(g, i, **attrs)
    return lambda g, saved: fn(g, i, tuple([saved[k] for k in everything]), **attrs)


def delivery_kinds(n_slots: int, carry_in: tuple[int, ...], x_in: tuple[int, ...],
                   constants: dict[int, Any], requires_grad: list[bool],
                   leaf: list[bool]) -> list[int]:
    """Per slot, where a gradient arriving at it goes (`DROP`, `PENDING`, ...)."""
    kinds = []
    for slot in range(n_slots):
        if slot in constants:
            kinds.append(EXTERNAL)
        elif slot in x_in:
            kinds.append(XS)
        elif slot in carry_in:
            kinds.append(CARRY)
        elif requires_grad[slot] and not leaf[slot]:
            kinds.append(PENDING)
        else:
            kinds.append(DROP)
    return kinds


def compile_tape_as_is(instructions: tuple[Any, ...], forwards: tuple[Forward, ...],
                      tape_frees: tuple[tuple[int, ...], ...],
                      region_of: tuple[int, ...]) -> tuple[AsIsRow, ...] | None:
    """The rows of a taped replay where every taped instruction keeps its values as they are
    (`KeepAll`: `step_tape.tape_as_is`), one per instruction: (index, forward, output slot,
    the getter of the slots it saves or None, the slots freed after it); None where some
    taped instruction may store its values otherwise. An instruction of a selective region
    (`region_of` >= 0) keeps nothing: the backward re-runs it."""
    kept_as_is = [None if r >= 0 else _kept_as_is(ins)
                  for ins, r in zip(instructions, region_of)]
    if any(ins.taped and kept is None and r < 0
           for ins, kept, r in zip(instructions, kept_as_is, region_of)):
        return None
    return tuple(zip(range(len(kept_as_is)), forwards, (ins.output for ins in instructions),
                     [None if kept is None else _saved_getter(kept) for kept in kept_as_is],
                     tape_frees))


def _saved_getter(slots: tuple[int, ...]) -> Callable[[list[Any]], Sequence[Any]]:
    """The values at `slots`, as one call without a frame, in a sequence made at its exact
    size. Why not `tuple(map(...))`: that sizes its tuple by a guess and shrinks it, and the
    shrunk tuple, once freed, joins the interpreter's free list instead of returning its
    memory; one per taped step, so the process held (and tracemalloc counted) memory that
    grew with the loop's steps, up to the free list's bound."""
    if len(slots) >= 2:
        return itemgetter(*slots)
    return itemgetter(slice(slots[0], slots[0] + 1) if slots else slice(0, 0))


def _kept_as_is(ins: Any) -> tuple[int, ...] | None:
    """The slots a taped instruction saves, when every one is kept as it is (`KeepAll`,
    chained or not); None otherwise, or for an instruction that saves nothing taped."""
    if not ins.taped or not all(
        type(s.packer) is KeepAll and type(s.chained) is KeepAll for s in ins.saved
    ):
        return None
    return tuple(ins.output if s.position < 0 else ins.inputs[s.position] for s in ins.saved)
