"""A planned loop's guards: the version checks that catch a value its backward reads again
modified in place since the loop ran (`SavedValueModifiedError`), as recording every step
would catch it.

A guard is (version counter, version, description, dtype, shape). Those the backward always
reads (`guards`: what the steps saved, the final carry where its last step's backward reads
it) are checked by every backward; those only a re-run of the steps reads (`input_guards`:
the initial carry, the rows of `xs`, every tensor the step captures) are checked where the
backward re-runs steps (`reruns`), or rebuilds its state, or runs with a graph. Owns the
executor's `guards`, `input_guards` and `reruns`.
"""

from __future__ import annotations

import gc
import types
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InplaceError, SavedValueModifiedError
from ...tape import Entry
from ..plans.revolve import _ADVANCE, _KIND_MASK, _REVERSE, _REVERSE_SEGMENT, plan_codes
from .loop_steps import ReplayedSegment, TapedSegment

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


def find_guards(executor: PlannedLoop, carry_leaves: list[Any]) -> tuple[list[Any], list[Any]]:
    """(version counter, version, description, dtype, shape) of every value the backward
    reads from outside the loop, as (those it reads, those only a re-run of the steps
    reads): a plan that keeps every step reads only what its steps saved, and so is
    guarded where recording every step is; one that re-runs steps (or a backward with a
    graph, which re-runs them all) reads the initial carry, `xs` and every tensor the step
    captured (leaf or not, needing a gradient or not) again. The description is finished
    only for an error (a dtype's name costs more than a short loop's bookkeeping)."""
    program = executor.program
    executor.reruns = backward_reruns(executor)
    saved = program.saved_slots if program is not None and not executor.reruns else None
    named: list[tuple[Any, str, bool]] = []  # (tensor or counter, what, read by backward)
    for k, t in enumerate(carry_leaves):
        named.append((t, f"the initial carry's leaf {k}",
                      saved is None or program.carry_in[k] in saved))  # type: ignore[union-attr]
    for k, x in enumerate(executor.loop.xs_leaves):
        named.append((x, f"xs leaf {k}",
                      saved is None or program.x_in[k] in saved))  # type: ignore[union-attr]
    captured = "a tensor the step captures"
    if program is not None:
        for slot, t in program.constant_tensors.items():
            named.append((t, captured, saved is None or slot in saved))
    else:
        named += [(node, captured, True) for node, _ in executor.externals.values()
                  if type(node) is not Entry]
        named += [(found, captured, True) for found in (executor.outside or {}).values()]
    guards: list[Any] = []
    rerun: list[Any] = []
    seen: set[int] = set()
    for t, what, read in named:
        if t is None:
            continue
        counter, dtype, shape = (t if type(t) is tuple else (t._version, t.dtype, t.shape))
        if id(counter) in seen:
            continue
        seen.add(id(counter))
        (guards if read else rerun).append((counter, counter.value, what, dtype, shape))
    return guards, rerun


def find_changes(executor: PlannedLoop) -> str | None:
    """What the steps change in place that a re-run of them reads again (None: nothing),
    found by step 0's trace: its own row of xs or its carry, changed by step 0 itself,
    a tensor from outside the loop that step 0 read, changed by a later step (a
    ``counter.add_(1)`` on a captured tensor), or one step 0 changed itself (a step that
    changes it only then, or a loop of one step). A re-run would run on the changed values
    and differentiate another loop, so a backward that re-runs steps refuses
    (`refuse_changes`); one that keeps every step reads only what the steps saved."""
    trace = executor.step0_trace
    executor.step0_trace = None
    if trace is None:
        return None
    n_carry = len(executor.carry_meta)
    for slot in trace.changed_inputs:
        if slot >= n_carry:
            return f"the step changes its row of xs leaf {slot - n_carry} in place"
        return f"the step changes its carry's leaf {slot} in place"
    for key, version in trace.outside_versions.items():
        counter, dtype, shape = trace.outside[key]
        if counter.value != version:
            return (f"the step changes a tensor it captures ({dtype}{list(shape)}) in "
                    "place")
    program = executor.program
    changed = _captured(trace.written, [trace.constants, *(
        [program.constant_tensors] if program is not None else [])])
    if changed is not None:  # by step 0 itself (a step changing it only then, or one step)
        return (f"the step changes a tensor it captures ({changed.dtype}"
                f"{list(changed.shape)}) in place")
    return None


def _captured(written: dict[int, tuple[Any, Any]], ours: list[Any]) -> Any:
    """A tensor step 0 changed in place that someone else holds now that the step's own
    tensors are gone (None: none), which a re-run of the step would change again: still
    alive, and referred to by more than the loop's own tables of the step's tensors (`ours`,
    where a tensor the step made and changed may linger as a traced constant). Rare (a step
    changing in place a tensor without history), and costly then: the referrers are looked
    up."""
    if not any(ref() is not None for ref, _ in written.values()):
        return None
    gc.collect()  # the step's own tensors caught in reference cycles go first
    mine = {id(table) for table in ours}
    for ref, _ in written.values():
        tensor = ref()
        if tensor is not None and any(
                id(r) not in mine and not isinstance(r, types.FrameType)
                for r in gc.get_referrers(tensor)):
            return tensor
    return None


def refuse_changes(executor: PlannedLoop, entry: Entry) -> None:
    """Raise: the backward would re-run steps that change what they read (`find_changes`)."""
    raise InplaceError(
        f"{entry.describe()} re-runs steps in its backward, but {executor.changes}: a re-run "
        "would read the changed values and give a wrong gradient. Use an out-of-place "
        "op (x = x * 2), carry a value that changes from step to step (return it in the "
        "carry), or keep every step (strategy=None), which runs each step once")


def backward_reruns(executor: PlannedLoop) -> bool:
    """Whether the backward runs steps again: not when the plan's first reverse action
    (taped in the forward) is its only one and nothing is advanced (`Periodic(n)`, a loop
    keeping every step), whose backward reads only what the steps saved."""
    state = executor.state
    if state is None or state.kept is None:
        return True
    kinds = np.frombuffer(plan_codes(executor.plan), dtype=np.int64)[state.cursor + 1:]
    kinds = kinds & _KIND_MASK
    return bool(((kinds == _ADVANCE) | (kinds == _REVERSE)
                 | (kinds == _REVERSE_SEGMENT)).any())


def guard_final_carry(executor: PlannedLoop, carry: list[Any]) -> None:
    """Guard the loop's final carry where its last step's backward reads it (as recording
    would: a loss on `tanh`'s output, changed in place after the loop, is caught): a
    recorded last step shares its tensors' version counters with the entry's outputs, so
    its own saved values catch the change; a replayed one is guarded by the entry."""
    kept = executor.state.kept if executor.state is not None else None
    if isinstance(kept, TapedSegment):
        for tensor, made in zip(carry, kept.carry_out):
            if tensor is not None and made is not None:
                tensor._version = made._version
    elif isinstance(kept, ReplayedSegment) and executor.program is not None:
        saved = executor.program.saved_slots
        for k, (tensor, slot) in enumerate(zip(carry, executor.program.carry_out)):
            if tensor is not None and slot in saved:
                executor.guards.append((tensor._version, tensor._version.value,
                                        f"its final carry's leaf {k}", tensor.dtype,
                                        tensor.shape))


def check_versions(entry: Entry, guards: list[Any]) -> None:
    """Raise where a guarded value's version moved since the loop ran."""
    for counter, version, what, dtype, shape in guards:
        if counter.value != version:
            raise SavedValueModifiedError(
                f"{entry.describe()} re-reads {what} ({dtype}{list(shape)}) in its "
                "backward, but it was modified "
                f"in place since the loop ran (version {version}, now {counter.value}); "
                "use out-of-place operations on tensors a loop uses, or modify a copy"
            )
