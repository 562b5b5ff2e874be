"""Step programs kept across `scan` calls: a loop run again (a training loop runs the same
`nn.GRU` loop every iteration) reuses the program an earlier call compiled, instead of
recording and tracing a second step and compiling anew.

Why this is exact: a later call still records and traces its step 0, and the program is reused
only when that trace is the earlier call's step 0 in everything a program depends on (the
operations and their slots, attributes, outputs and random draws; the forms, saved values and
strategies each recorded entry chose; input shapes; which slots need gradients; dtypes), runs
the same operations as the earlier step 1 the program was checked against, and uses the same
tensors from outside as both: the same objects, or equal values for constants that need no
gradient, as `same_program` requires of steps 0 and 1. Otherwise the loop runs as a first
call does (step 1 traced, a program compiled, the entry replaced). The reused program reads
the tensors this call's step 0 captured (`StepProgram.bound_to`): a parameter changed between
calls (an optimizer's step) is read as it is now, never from an array the earlier call held.

What the cache holds: no tensor. An entry keeps weak references to the tensors its traces
captured (and copies of small constants that need no gradient: Python numbers made tensors),
so a deleted model's parameters are freed and an entry over them stops matching. Entries live
per step code (held weakly), at most `PER_CODE` per code, the least recently used dropped
first; the key adds the saved-value strategy in effect and the carry's and scanned inputs'
shapes, dtypes, devices and gradient needs (not the number of steps: a program is one step). A
step made anew on every call (an `nn` layer's nested `step`) is found by its code and the
identities of what its closure holds; a clash of identities costs a comparison, never a wrong
program. Programs whose values go through a stateful strategy (one that is not a frozen value
object, e.g. a checkpointed region's stand-in packer) are not kept.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...backend import device_name
from ...saved import KeepAll, current_packer
from .step_program import Draw, Instruction, StepProgram, Trace, same_operations, same_values

PER_CODE = 8
"""Entries kept per step code (one per loop using it: layers, shapes, strategies)."""

SMALL = 256
"""Bytes up to which a constant's array is copied into its entry (larger ones are compared
while their tensor lives)."""

REUSED = "replayed (program reused from an earlier call)"
"""A loop entry's `mode` when its program came from the cache."""

_tables: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[Any, ...], _Entry]] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True, slots=True)
class _Captured:
    """A tensor a traced step captured, without holding it."""

    ref: weakref.ref[Any]
    plain: bool  # needs no gradient and has no history: equal values are as good
    data: Any  # a copy of a plain tensor's small array (None: compared while it lives)

    def matches(self, tensor: Any) -> bool:
        """Whether `tensor` may stand in for it, as `same_program` decides for two steps."""
        old = self.ref()
        if old is tensor:
            return True
        if not self.plain or tensor._requires_grad or tensor._entry is not None:
            return False
        data = self.data if self.data is not None else None if old is None else old._data
        return data is not None and same_values(data, tensor._data)


@dataclass(frozen=True, slots=True)
class _Remembered:
    """A trace as an entry keeps it: everything `program_of` compares, tensors held weakly."""

    instructions: tuple[Instruction, ...]
    outputs: tuple[tuple[int, ...], tuple[int, ...]]
    facts: tuple[tuple[bool, bool, Any, bool], ...]
    n_inputs: int
    n_slots: int
    constants: dict[int, _Captured]
    regions: tuple[Any, ...]  # its selective regions (`step_trace.TracedRegion`)


def _remember(trace: Trace) -> _Remembered:
    constants = {}
    for slot, t in trace.constants.items():
        plain = not t._requires_grad and t._entry is None
        small = plain and t._data.nbytes <= SMALL
        constants[slot] = _Captured(weakref.ref(t), plain, t._data.copy() if small else None)
    return _Remembered(tuple(trace.instructions), trace.outputs, tuple(trace.facts),
                       trace.n_inputs, trace.n_slots, constants, tuple(trace.regions))


@dataclass(frozen=True, slots=True)
class _Entry:
    first: _Remembered  # the earlier call's step 0: what a later step 0 must repeat exactly
    second: _Remembered  # its step 1, checked against step 0 when the program was made
    program: StepProgram  # unbound

    def fits(self, trace: Trace) -> bool:
        """Whether `trace` (a later call's step 0) is one program with this entry's steps."""
        first = self.first
        if trace.refused is not None or trace.n_inputs != first.n_inputs or (
            trace.n_slots != first.n_slots or tuple(trace.facts) != first.facts
        ):
            return False
        if same_operations(first, trace) is not None or same_operations(
            self.second, trace
        ) is not None:
            return False
        if not all(_same_recording(x, y) for x, y in zip(first.instructions,
                                                          trace.instructions)):
            return False
        for remembered in (first, self.second):
            if remembered.constants.keys() != trace.constants.keys() or not all(
                c.matches(trace.constants[slot]) for slot, c in remembered.constants.items()
            ):
                return False
        return True


def _same_recording(x: Instruction, y: Instruction) -> bool:
    """Whether two instructions were recorded alike: the same entry, form and saved values
    (with equal strategies), input shapes and gradient mask (`same_operations` compares the
    rest; source lines, known only while a profiler listens, are taken from this call's
    trace by `StepProgram.bound_to`)."""
    if type(x.prim) is Draw:
        return True
    try:
        same_saved = x.saved == y.saved
    except Exception:  # a strategy whose equality cannot answer: not the same
        return False
    return (same_saved and x.taped == y.taped and x.mask == y.mask and x.form is y.form
            and x.in_shapes == y.in_shapes)


class Place:
    """One loop's place in the cache, found before its step 0 runs: `expected` says whether
    an earlier call left a program, `reuse` checks step 0's trace against it, `remember`
    keeps what a first call made."""

    __slots__ = ("entry", "key", "table")

    def __init__(self, table: OrderedDict[tuple[Any, ...], _Entry] | None,
                 key: tuple[Any, ...]) -> None:
        self.table = table
        self.key = key
        self.entry = None if table is None else table.get(key)

    @property
    def expected(self) -> bool:
        """Whether an earlier call left a program to check step 0 against."""
        return self.entry is not None

    def reuse(self, trace: Trace) -> StepProgram | None:
        """The earlier call's program reading this call's tensors, if `trace` (this call's
        step 0) fits it; None otherwise."""
        entry = self.entry
        if entry is None or not entry.fits(trace):
            return None
        if self.table is not None and self.key in self.table:
            self.table.move_to_end(self.key)
        return entry.program.bound_to(trace)

    def remember(self, first: Trace, second: Trace, program: StepProgram | None) -> None:
        """Keep `program`, made from steps 0 and 1 traced as `first` and `second`, for later
        calls (no program, or one that cannot be kept: forget the stale entry)."""
        table = self.table
        if table is None:
            return
        if program is None or not _keepable(program):
            table.pop(self.key, None)
            return
        table[self.key] = _Entry(_remember(first), _remember(second), program.unbound())
        table.move_to_end(self.key)
        while len(table) > PER_CODE:
            table.popitem(last=False)


def find(step: Callable[..., Any], kind: str, carry_leaves: list[Any],
         xs_leaves: list[Any]) -> Place:
    """The place of a loop running `step` from `carry_leaves` over `xs_leaves` under the
    saved-value strategy in effect; `kind` names how the loop traces its steps (a program
    made from step 1 by `kept_loop` is not one made from step 0 by the plan executor)."""
    owner, identities = step_identity(step)
    key = (kind, identities, _packer_key(current_packer()),
           tuple(_meta(t) for t in carry_leaves), tuple(_meta(t, row=True) for t in xs_leaves))
    try:
        table = _tables.get(owner)
        if table is None:
            table = _tables[owner] = OrderedDict()
    except TypeError:  # neither code nor an object a weak reference can name: not kept
        return Place(None, key)
    return Place(table, key)


def _packer_key(packer: Any) -> Any:
    """A value strategy names itself (an equal one finds its programs); any other, or one
    that cannot be hashed, its identity (held by no key)."""
    if _is_value(packer):
        try:
            hash(packer)
        except TypeError:
            return id(packer)
        return packer
    return id(packer)


def _meta(t: Any, row: bool = False) -> tuple[Any, ...] | None:
    if t is None:
        return None
    shape = t.shape[1:] if row else t.shape
    return shape, t.dtype, device_name(t._data), t.requires_grad


def step_identity(step: Any, held: list[Any] | None = None) -> tuple[Any, tuple[Any, ...]]:
    """(owner, identities): what stays the same when one loop runs again. A step defined
    inside the function that calls `scan` is a new function object per call: its code and
    the identities of what it closes over (and of its defaults, a method's object, a
    partial's arguments) name it instead. `held`, if given, receives the objects whose ids
    the identities hold (so a caller can tell, by weak reference, when one has died and its
    id may name another)."""
    ids: list[Any] = []
    while True:
        if isinstance(step, functools.partial):
            ids.extend(map(id, step.args))
            ids.extend(id(v) for v in step.keywords.values())
            ids.append(tuple(step.keywords))
            if held is not None:
                held.extend((*step.args, *step.keywords.values()))
            step = step.func
        elif isinstance(step, types.MethodType):
            ids.append(id(step.__self__))
            if held is not None:
                held.append(step.__self__)
            step = step.__func__
        else:
            break
    if not isinstance(step, types.FunctionType):
        return step, tuple(ids)  # a callable object names itself
    return step.__code__, (*ids, *_captured_identities(step, NESTED, held))


NESTED = 3
"""Levels of functions made anew per call (a step calling a cell defined beside it) named by
their code and captures rather than their identity."""


def _captured_identities(fn: types.FunctionType, depth: int,
                         held: list[Any] | None = None) -> tuple[Any, ...]:
    ids: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            ids.append(None)
            continue
        if depth and isinstance(value, types.FunctionType):
            ids.append((value.__code__, _captured_identities(value, depth - 1, held)))
        elif isinstance(value, types.MethodType):  # made anew by each attribute lookup
            ids.append((id(value.__self__), value.__func__))
            if held is not None:
                held.append(value.__self__)
        else:
            ids.append(id(value))
            if held is not None:
                held.append(value)
    defaults = (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
    ids.extend(map(id, defaults))
    if held is not None:
        held.extend(defaults)
    return tuple(ids)


def _keepable(program: StepProgram) -> bool:
    """Whether every strategy the program packs values with is a value object (keeping
    every value, or a frozen dataclass): one that equals it later behaves alike, and keeping
    it holds nothing of a loop's run."""
    return all(_is_value(p) for ins in program.instructions for s in ins.saved
               for p in (s.packer, s.chained))


def _is_value(packer: Any) -> bool:
    if type(packer) is KeepAll:
        return True
    params = getattr(type(packer), "__dataclass_params__", None)
    return dataclasses.is_dataclass(packer) and params is not None and params.frozen


def clear() -> None:
    """Forget every kept program: the next call of each loop traces two steps again."""
    _tables.clear()
