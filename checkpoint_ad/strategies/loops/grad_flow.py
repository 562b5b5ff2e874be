"""Which outputs of a loop's entry require grad: those that depend, through the steps run,
on something that does.

Why: a loop's entry is one tape entry, and an entry's outputs all require grad; but recording
every step gives a carry leaf that never meets a tensor requiring grad (``h * 2`` beside
``y = h * w``) a tensor without history, which `np.asarray` or `.numpy()` accept. A step is
read once (its program, or its tape for step 0) as a map from the carry leaves it reads to
those it makes, plus what depends on `xs` or a captured tensor that requires grad; the map is
then iterated over the loop's steps, which repeats after at most 2**(carry leaves) of them,
so the cost does not grow with the loop's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...tape import Entry, edge_of
from .step_program import Draw

Deps = tuple[frozenset[int], bool]
"""What a value depends on: the step's carry leaves (by index), and whether anything else that
requires grad (a scanned input, a captured tensor)."""

_NOTHING: Deps = (frozenset(), False)


def deps_of_program(program: Any, xs_rg: Sequence[bool]) -> tuple[list[Deps], list[Deps]]:
    """(each new carry leaf's, each output's) dependencies in one replayed step of `program`
    (a `StepProgram`), where the scanned inputs that require grad are `xs_rg`."""
    deps: list[Deps] = [_NOTHING] * program.n_slots
    for k, slot in enumerate(program.carry_in):
        deps[slot] = (frozenset((k,)), False)
    for k, slot in enumerate(program.x_in):
        deps[slot] = (frozenset(), bool(xs_rg[k]) if k < len(xs_rg) else False)
    for slot in program.constant_tensors:
        deps[slot] = (frozenset(), bool(program.requires_grad[slot]))
    for ins in program.instructions:
        if ins.prim is None or type(ins.prim) is Draw:  # detach, or a random draw
            continue
        if not ins.taped and any(ins.mask):  # no gradient flows through it (e.g. argmax)
            continue
        carry: frozenset[int] = frozenset()
        other = False
        for slot in ins.inputs:
            c, o = deps[slot]
            carry, other = carry | c, other or o
        deps[ins.output] = (carry, other)
    return ([_NOTHING if s < 0 else deps[s] for s in program.carry_out],
            [_NOTHING if s < 0 else deps[s] for s in program.y_out])


def deps_of_tensors(carry_in: Sequence[Any], x_parts: Sequence[Any], carry_out: Sequence[Any],
                    ys: Sequence[Any], seq_before: int) -> tuple[list[Deps], list[Deps]]:
    """The same for a step recorded on the tape from the tensors `carry_in` and `x_parts`
    (entries newer than `seq_before` are the step's own)."""
    carry_ids = {id(t): k for k, t in enumerate(carry_in) if t is not None}
    x_ids = {id(t): t.requires_grad for t in x_parts if t is not None}

    def deps(t: Any) -> Deps:
        if t is None:
            return _NOTHING
        if id(t) in carry_ids:
            return frozenset((carry_ids[id(t)],)), False
        edge = edge_of(t)
        if edge is None:
            return _NOTHING
        found: set[int] = set()
        other = False
        stack = [edge]
        seen: set[int] = set()
        while stack:
            node, _ = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if type(node) is Entry and node.seq > seq_before:
                stack.extend(e for e in node.edges if e is not None)
            elif id(node) in carry_ids:
                found.add(carry_ids[id(node)])
            elif id(node) in x_ids:
                other = other or x_ids[id(node)]
            else:  # a captured tensor (or an entry made before the step) that requires grad
                other = True
        return frozenset(found), other

    return [deps(t) for t in carry_out], [deps(t) for t in ys]


def outputs_requiring_grad(carry_rg: Sequence[bool], carry_deps: list[Deps],
                           y_deps: list[Deps], steps: int) -> tuple[list[bool], list[bool]]:
    """(whether each final carry leaf, whether each stacked output) requires grad after
    `steps` steps from an initial carry whose leaves require grad as `carry_rg` says."""
    def after(state: tuple[bool, ...], of: list[Deps]) -> tuple[bool, ...]:
        return tuple(other or any(state[k] for k in carry) for carry, other in of)

    state = tuple(bool(r) for r in carry_rg)
    ys = [False] * len(y_deps)
    seen: dict[tuple[bool, ...], int] = {}
    t = 0
    while t < steps:
        if state in seen:  # the states repeat from here: skip whole cycles
            cycle = t - seen[state]
            t += (steps - t) // cycle * cycle
            seen = {}
            if t >= steps:
                break
        seen[state] = t
        ys = [y or now for y, now in zip(ys, after(state, y_deps))]
        state = after(state, carry_deps)
        t += 1
    return list(state), ys
