"""Step programs: a loop step traced once into primitive calls over numbered slots, replayed on
arrays for every later step, every recompute and every step's backward.

Why: a step of an unrolled loop is the same program every time, yet recording it again costs
a Tensor, a tape entry and a saved-slot object per operation, and a checkpointing plan pays
that again for every re-run. A replay runs each primitive's forward and backward rules on
arrays directly, in the order and with the additions a recorded tape would do, so its results
are bitwise those of recording. What a replay looks up per instruction (functions, slots,
saved values, where a gradient goes) is bound once when the program is made
(`compiled_step.py`), so a replayed step costs little more than its array operations.

A trace is refused (the loop then records every step) when the step does something a replay
cannot repeat: reads a value into Python (`bool`, `item`, `float`, `numpy()`), registers a
hook, modifies a tensor in place, uses a custom `Function` or a nested planned loop. Steps 0
and 1 are both traced and must give the same program with the same constants: a step that
makes new tensors from outside data on each call (``cad.tensor(np.random.rand(3))``, a mask
drawn per call) is caught there, as it would be frozen by a replay. A loop run again may reuse
the program an earlier call made, once its step 0 is checked against it (`program_cache.py`).

Tracing is `step_trace.py`'s; this module freezes a trace into a program and replays it.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from types import MappingProxyType
from typing import Any

import numpy as np

from ... import events
from ...backend import namespace
from ...saved import KeepAll, KeptBuffer, SavedBuffer, Strategy, buffer_for, pack_value
from ...tape import edge_of
from .compiled_step import (
    PENDING,
    compile_forward,
    compile_rules,
    delivery_kinds,
)
from .step_trace import (
    Draw,
    Instruction,
    Trace,
    same_operations,
    same_program,
    same_values,
    traced_call,
)

# what other modules import from here (the tracing names are defined in step_trace.py)
__all__ = [
    "Draw", "Instruction", "ReplayedStep", "StepProgram", "Trace", "program_of",
    "same_operations", "same_values", "traced_call",
]

_MOST_ORIGIN_SETS = 8  # the source lines a cached program remembers its copies by


class StepProgram:
    """A traced step, frozen: replayed forward (`run`), forward with saved values (`tape`),
    and backward (`step_pull_back.pull_back_steps`)."""

    def __init__(self, trace: Trace, n_carry: int) -> None:
        self.n_slots = trace.n_slots
        self.n_inputs = trace.n_inputs
        self.instructions = tuple(trace.instructions)
        self.carry_in = tuple(range(n_carry))
        self.x_in = tuple(range(n_carry, trace.n_inputs))
        self.carry_out, self.y_out = trace.outputs
        self._bind(trace.constants)
        # graph facts of every slot, as the recorded step had them
        self.requires_grad = [rg for rg, _, _, _ in trace.facts]
        self.leaf = [leaf for _, leaf, _, _ in trace.facts]  # of the step: from outside it
        self.dtype = [dtype for _, _, dtype, _ in trace.facts]
        # a leaf of the graph (no entry): what recording the step would hand a profiler as a
        # leaf edge; a value captured from before the loop (heat's diffusivity) is not one
        self.graph_leaf = [leaf for _, _, _, leaf in trace.facts]
        # free each value after its last use in a forward without saving
        last: dict[int, int] = {}
        for i, ins in enumerate(self.instructions):
            for s in ins.inputs:
                last[s] = i
        kept = set(self.carry_out) | set(self.y_out) | set(self.constants)
        frees: list[list[int]] = [[] for _ in self.instructions]
        for s, i in last.items():
            if s not in kept:
                frees[i].append(s)
        self.frees = tuple(tuple(f) for f in frees)
        # the same in a forward that saves (`tape`), less what outlives the step there: the
        # values saved (the backward reads them; a profiler's buffers are made from them
        # after the step ran) and the leaves (a profiler reads those after it too). A step's
        # values all held to its end would add every unsaved intermediate to the peak of a
        # loop that tapes it (a planned backward re-tapes one step at its peak)
        saved = {ins.output if s.position < 0 else ins.inputs[s.position]
                 for ins in self.instructions if ins.taped for s in ins.saved}
        self.tape_frees = tuple(
            tuple(s for s in f if s not in saved and not trace.facts[s][1]) for f in frees)
        self.saved_slots = frozenset(saved)  # what a loop keeping every step guards
        self.backward_order = tuple(
            i for i in reversed(range(len(self.instructions))) if self.instructions[i].taped
        )
        # bound once, run every step (compiled_step.py): each instruction's forward call, the
        # primitive it announces (None: not one), and for a taped one the slots it saves when
        # every value is kept as it is (None where a packer may store it otherwise)
        self.forwards = tuple(compile_forward(ins, Draw) for ins in self.instructions)
        # whether a replay draws from the engine's generator (the caller must then say which)
        self.draws = any(type(ins.prim) is Draw for ins in self.instructions)
        announced = tuple(
            None if ins.prim is None or type(ins.prim) is Draw else ins.prim
            for ins in self.instructions)
        self.run_order = tuple(zip(self.forwards, (ins.output for ins in self.instructions),
                                   self.frees, announced))
        kept_as_is = [_kept_as_is(ins) for ins in self.instructions]
        # (index, forward, output slot, slots saved or None) per instruction, where every
        # taped one keeps its values as they are (`KeepAll`); None where some may not
        self.tape_as_is = None if any(
            ins.taped and kept is None for ins, kept in zip(self.instructions, kept_as_is)
        ) else tuple(zip(range(len(kept_as_is)), self.forwards,
                         (ins.output for ins in self.instructions),
                         [None if kept is None else _saved_getter(kept) for kept in kept_as_is],
                         self.tape_frees))
        self.backward_rules = tuple(
            (i, self.instructions[i].output, compile_rules(self.instructions[i]))
            for i in self.backward_order)
        # `_tape_kept`'s layouts, made when first needed: first step, chained to a replayed
        # step, chained to a recorded one (shared with the copies `bound_to` makes)
        self.layouts: list[KeptLayout | None] = [None, None, None]
        self.described: list[DescribedStep | None] = [None]  # `_step_begins`'s, likewise
        # source lines -> (instructions, described) of the copies `bound_to` made naming
        # those lines (shared with them): a loop that runs now profiled, now not, names them
        # now and then not, and each run would otherwise re-make and re-describe its steps
        self.by_origins: dict[tuple[Any, ...], tuple[tuple[Instruction, ...], list[Any]]] = {}
        self.delivery = delivery_kinds(self.n_slots, self.carry_in, self.x_in, self.constants,
                                       self.requires_grad, self.leaf)
        # every output that takes a gradient is made in the step: a root (the gradient of a
        # step's output) then reaches that step's own sums only, so a pull-back may take
        # each step's roots as it reaches the step (`pull_back_steps`), not all of them first
        # (keys, carry positions, external positions) of the latest pull-back: a caller
        # that hands the same keys again (a binomial plan's one-step pull-backs) reuses them
        self.positions: tuple[Any, list[Any], dict[int, Any]] | None = None
        self.roots_per_step = all(
            self.delivery[s] == PENDING for s in (*self.carry_out, *self.y_out)
            if s >= 0 and self.requires_grad[s])

    def _bind(self, constants: dict[int, Any]) -> None:
        """Read the tensors the step captured (slot -> tensor): what the program holds of them
        (their arrays, graph edges and hooks) is read here and nowhere else."""
        self.constants = {s: t._data for s, t in constants.items()}
        # every slot after the inputs (carry, then xs: slots 0, 1, ...) as a step starts:
        # the constants in place, the rest empty
        self.after_inputs = tuple(
            self.constants.get(s) for s in range(self.n_inputs, self.n_slots))
        # the tensors themselves: a value saved from one shares the buffer recorded entries
        # made of it (one stored copy, counted once), as recording every step would
        self.constant_tensors = dict(constants)
        self.external_keys: dict[int, tuple[int, int]] = {}
        self.external_edges: dict[tuple[int, int], Any] = {}  # key -> graph edge
        for slot, t in constants.items():
            edge = edge_of(t)
            if edge is not None:
                self.external_keys[slot] = (id(edge[0]), edge[1])
                self.external_edges[(id(edge[0]), edge[1])] = edge
        # captured leaves: a hook registered on one, even after the loop ran, makes the
        # backward record (a recorded pass runs leaf hooks on each segment's sum)
        self.has_hooks = [t for t in constants.values()
                          if t._entry is None and t._requires_grad]

    def bound_to(self, trace: Trace) -> StepProgram:
        """This program reading the tensors another trace of the same step captured (the same
        slots: see `program_cache.py`): a copy sharing everything compiled, whose constants
        are those tensors as they are now (a parameter an optimizer replaced is read anew),
        and whose source lines (what a profiler names) are the ones `trace` recorded from."""
        program = copy.copy(self)
        program._bind(trace.constants)
        if any(ins.origin != new.origin for ins, new in zip(self.instructions,
                                                            trace.instructions)):
            origins = tuple(new.origin for new in trace.instructions)
            known = self.by_origins.get(origins)
            if known is None:
                if len(self.by_origins) >= _MOST_ORIGIN_SETS:
                    self.by_origins.clear()
                known = self.by_origins[origins] = (tuple(
                    replace(ins, origin=origin)
                    for ins, origin in zip(self.instructions, origins)), [None])
            program.instructions, program.described = known  # described with these lines
        return program

    def unbound(self) -> StepProgram:
        """A copy that holds no captured tensor (nor their arrays or graph edges), to be kept
        beyond the loop that made it; `bound_to` gives a runnable one back."""
        program = copy.copy(self)
        program._bind({})
        return program

    def carry_aliases(self) -> dict[int, int]:
        """Outputs that are a new carry leaf itself (RNNs return h, h): output k -> leaf j."""
        return {k: j for k, y in enumerate(self.y_out) for j, c in enumerate(self.carry_out)
                if y >= 0 and y == c}

    def unreplayable_storage(self) -> str | None:
        """Why a replay could not keep the step's values as recording does, or None: a
        saved-value strategy that re-makes values itself (`Rematerializing`) learns how from
        each recorded entry, which a replay does not make."""
        for ins in self.instructions:
            for s in ins.saved:
                if type(s.packer).recorded is not Strategy.recorded:
                    return (f"its values are kept by {type(s.packer).__name__}, which re-makes "
                            "them from the recorded entries")
        return None

    # ------------------------------------------------------------- forward
    def _start(self, carry: list[Any], x: list[Any]) -> list[Any]:
        if len(carry) == len(self.carry_in) and len(x) == len(self.x_in):
            return [*carry, *x, *self.after_inputs]  # the usual case, in one go
        values: list[Any] = [None] * self.n_slots
        for s, a in zip(self.carry_in, carry):
            values[s] = a
        for s, a in zip(self.x_in, x):
            values[s] = a
        for s, a in self.constants.items():
            values[s] = a
        return values

    def run(self, carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        """One step without saving anything: (new carry arrays, output arrays)."""
        values = self._start(carry, x)
        xp = _namespace_of(values)
        emit = events.hears("apply")
        for forward, output, frees, prim in self.run_order:
            values[output] = forward(values, xp)
            if emit and prim is not None:
                events.emit("apply", prim)
            for s in frees:
                values[s] = None
        return ([None if s < 0 else values[s] for s in self.carry_out],
                [None if s < 0 else values[s] for s in self.y_out])

    def tape(self, carry: list[Any], x: list[Any],
             previous: ReplayedStep | None = None,
             carry_tensors: list[Any] | None = None) -> ReplayedStep:
        """One step keeping what its backward rules read, packed as recording would. With
        `previous` (the step before, in the same taped segment), the carry is that step's
        output: saved with the primitive's packer, not as a leaf, sharing its buffers;
        `carry_tensors` says the same of a carry made by a step recorded on the tape (these
        are its tensors, whose buffers the step shares)."""
        announce = events.hears("replayed")
        if self.tape_as_is is not None:
            if not announce:
                return self._tape_as_is(carry, x)
            if events.taken_directly():
                return self._tape_kept(carry, x, previous, carry_tensors)
        values = self._start(carry, x)
        xp = _namespace_of(values)
        saved: list[Any] = [None] * len(self.instructions)
        described = _step_begins(self) if announce else None
        chained = carry_tensors is not None or previous is not None
        buffers = self._carried(previous)
        forwards, tape_frees = self.forwards, self.tape_frees
        for i, ins in enumerate(self.instructions):
            prim = ins.prim
            values[ins.output] = forwards[i](values, xp)
            for s in tape_frees[i]:  # (never a slot this instruction saves: see `tape_frees`)
                values[s] = None
            if prim is None or type(prim) is Draw:
                continue
            if not ins.taped:
                continue
            kept = []
            for s in ins.saved:
                slot = ins.output if s.position < 0 else ins.inputs[s.position]
                packer = s.chained if chained and slot in self.carry_in else s.packer
                if type(packer) is KeepAll and not announce:
                    kept.append(values[slot])
                    continue
                constant = self.constant_tensors.get(slot)
                if constant is None and carry_tensors is not None and slot in self.carry_in:
                    constant = carry_tensors[slot]
                if constant is not None:
                    kept.append(buffer_for(constant, packer))
                    continue
                key = (slot, id(packer))
                buffer = buffers.get(key)
                if buffer is None:
                    buffer = buffers[key] = pack_value(values[slot], packer)
                kept.append(buffer)
            saved[i] = kept
        if announce:
            events.emit("replayed", (described, saved, values,
                                     self.carry_in if chained else (), None))
        return ReplayedStep(values, saved, announce, buffers)

    def tape_steps(
        self, arrays: list[Any], x_arrays: Callable[[int], list[Any]], start: int,
        stop: int | None, carry_tensors: list[Any] | None = None,
        count: Callable[[], None] | None = None,
        until: Callable[[list[Any]], bool] | None = None,
    ) -> tuple[list[tuple[int, ReplayedStep]], list[tuple[int, list[Any]]], list[Any]]:
        """Steps start..stop-1 taped from the carry `arrays`, as a taped segment of a loop
        holds them: (the steps as (t, step), their outputs as (t, arrays), the last carry's
        arrays). Each step shares the carry buffers the one before it packed, then lets go of
        its values but what its backward reads. `x_arrays(t)`: step t's scanned rows;
        `carry_tensors`: the first step's carry as a recorded step's output tensors (see
        `tape`); `count()` is called per step; `until(carry arrays)`, asked after each
        step, ends the segment early (`stop` None: only it does). The plan executor tapes
        its segments here, and a budget's dry run times the same loop."""
        steps: list[tuple[int, ReplayedStep]] = []
        y_out: list[tuple[int, list[Any]]] = []
        previous = None
        carry_out, ys_out, tape = self.carry_out, self.y_out, self.tape
        t = start
        while stop is None or t < stop:
            if count is not None:
                count()
            step = tape(arrays, x_arrays(t), previous, carry_tensors if t == start else None)
            arrays = step.output(carry_out)
            y_out.append((t, step.output(ys_out)))
            step.drop_values(carry_out)
            steps.append((t, step))
            if previous is not None and previous.buffers:
                previous.buffers = NO_BUFFERS  # shared with this step: only its slots hold them
            previous = step
            t += 1
            if until is not None and until(arrays):
                break
        if previous is not None and previous.buffers:
            previous.buffers = NO_BUFFERS
        return steps, y_out, arrays

    def _carried(self, previous: ReplayedStep | None) -> dict[tuple[int, int], Any]:
        """A step's buffers by (slot, id(packer)) as it begins: those of the new carry that
        `previous` packed, under its carry slots."""
        buffers: dict[tuple[int, int], Any] = {}
        if previous is not None:
            for k, s in enumerate(self.carry_out):
                for (slot, pid), buffer in previous.buffers.items():
                    if slot == s and s >= 0:
                        buffers[(k, pid)] = buffer
        return buffers

    def _tape_kept(self, carry: list[Any], x: list[Any], previous: ReplayedStep | None,
                   carry_tensors: list[Any] | None) -> ReplayedStep:
        """`tape` where every value is kept as it is and a profiler listens alone: the step
        runs as `_tape_as_is` (its backward reads the arrays), then makes its buffers in the
        order `tape` would (`KeptLayout`: each distinct buffer once), held per instruction
        until its backward rules ran, and hands the new ones to the profiler in its
        'replayed' event rather than one 'pack' event each. They are `tape`'s buffers, shared
        as `tape` shares them, so the profile and the order of frees are the same."""
        described = _step_begins(self)
        step = self._tape_as_is(carry, x)
        values = step.values
        mode = 2 if carry_tensors is not None else 1 if previous is not None else 0
        layout = self.layouts[mode]
        if layout is None:
            layout = self.layouts[mode] = kept_layout(self, mode)
        tensors = self.constant_tensors if carry_tensors is None else {
            **self.constant_tensors, **dict(zip(self.carry_in, carry_tensors))}
        made: list[Any] = []
        buffers = step.buffers = self._carried(previous)
        ordered = []
        for slot, key, packer in layout.sources:
            if key is None:  # a tensor's array: its buffer, shared with its recorded entries
                buffer = buffer_for(tensors[slot], packer, made)
            else:
                buffer = buffers.get(key)
                if buffer is None:
                    buffer = buffers[key] = pack_value(values[slot], packer, made)
            ordered.append(buffer)
        get = ordered.__getitem__
        held: list[Any] = [None] * len(self.instructions)
        for i, at in layout.held:
            held[i] = list(map(get, at))
        step.held = held
        events.emit("replayed", (described, held, values,
                                 self.carry_in if mode else (), made))
        return step

    def _tape_as_is(self, carry: list[Any], x: list[Any]) -> ReplayedStep:
        """`tape` where every saved value is kept as it is (`KeepAll`) and no profiler hears
        entries: the step's saved values are its arrays, nothing is packed or shared."""
        values = self._start(carry, x)
        xp = _namespace_of(values)
        saved: list[Any] = [None] * len(self.instructions)
        for i, forward, output, saved_of, frees in self.tape_as_is:
            values[output] = forward(values, xp)
            if saved_of is not None:
                saved[i] = saved_of(values)
            for s in frees:
                values[s] = None
        return ReplayedStep(values, saved, False, NO_BUFFERS, as_is=True)


NO_BUFFERS: Mapping[tuple[int, int], Any] = MappingProxyType({})
"""The buffers of a step that shares none with the next: one read-only mapping for all (a
dict of its own per taped step was 64 bytes of every step of a long loop)."""


class ReplayedStep:
    """One replayed step's values and what its backward rules read."""

    __slots__ = ("announced", "as_is", "buffers", "held", "saved", "values")

    def __init__(self, values: list[Any], saved: list[Any], announced: bool,
                 buffers: Mapping[tuple[int, int], Any], as_is: bool = False) -> None:
        self.values: Sequence[Any] = values
        self.saved = saved
        # with `as_is`, the buffers a profiler watches of the arrays in `saved`, per
        # instruction (`_tape_kept`): freed when its rules ran, as `release` frees (None: none)
        self.held: list[Any] | None = None
        # a profiler heard of its entries: each one's saved values are released one by one in
        # slot order, as a recorded entry's are, so it sees them freed in the same order
        self.announced = announced
        self.buffers = buffers  # (slot, id(packer)) -> packed buffer, shared with the next step
        # every saved value is the array itself (no buffer to unpack) and no entry announced
        self.as_is = as_is

    def packed_ids(self) -> set[int]:
        """Ids of the buffers this step keeps that must be unpacked (not kept as is)."""
        return {id(v) for kept in self.saved if kept for v in kept
                if type(v) is not KeptBuffer and isinstance(v, SavedBuffer)}

    def unpack(self, i: int, later: dict[int, tuple[Any, Any]],
               here: dict[int, tuple[Any, Any]], shared: set[int] | None) -> list[Any]:
        """Instruction i's saved values as arrays. A buffer that the step after this one
        unpacked (`later`), or this one already (`here`), gives that array again; one this
        step shares with the step before (its id in `shared`, that step's `packed_ids`) is
        remembered in `here`. Why: a carry kept packed (quantized, offloaded) is read by two
        steps' rules, the one that made it and the one that took it in; unpacking it once
        takes 4.5% off an int8 RNN's instructions."""
        arrays = []
        for v in self.saved[i]:
            if type(v) is KeptBuffer:  # kept as is, in a buffer: its array, without a call
                arrays.append(v.packed)
            elif isinstance(v, SavedBuffer):
                key = id(v)
                found = later.get(key) or here.get(key)
                if found is not None and found[0]() is v:
                    arrays.append(found[1])
                    continue
                array = v.unpack()
                if shared is not None and key in shared:
                    here[key] = (weakref.ref(v), array)
                arrays.append(array)
            else:
                arrays.append(v)
        return arrays

    def release(self, i: int) -> None:
        kept = self.saved[i]
        self.saved[i] = None
        if self.announced and kept:  # (a list dropped at once frees its last item first)
            kept.reverse()
            kept.clear()

    def output(self, slots: tuple[int, ...]) -> list[Any]:
        return [None if s < 0 else self.values[s] for s in slots]

    def drop_values(self, keep: tuple[int, ...]) -> None:
        """Forget every value (the saved ones stay in `saved`): the step's outputs are in the
        caller's hands, and a full-precision copy kept here would undo a compressing strategy.
        Buffers of the `keep` slots (the new carry) stay, for the next step to share."""
        self.values = ()  # (shared: a taped step holds no empty list of its own)
        if self.buffers:
            self.buffers = {k: b for k, b in self.buffers.items() if k[0] in keep} or NO_BUFFERS


def _saved_getter(slots: tuple[int, ...]) -> Callable[[list[Any]], Sequence[Any]]:
    """The values at `slots`, as one call without a frame, in a sequence made at its exact
    size. Why not `tuple(map(...))`: that sizes its tuple by a guess and shrinks it, and the
    shrunk tuple, once freed, joins the interpreter's free list instead of returning its
    memory; one per taped step, so the process held (and tracemalloc counted) memory that
    grew with the loop's steps, up to the free list's bound."""
    if len(slots) >= 2:
        return itemgetter(*slots)
    return itemgetter(slice(slots[0], slots[0] + 1) if slots else slice(0, 0))


def _kept_as_is(ins: Instruction) -> tuple[int, ...] | None:
    """The slots a taped instruction saves, when every one is kept as it is (`KeepAll`,
    chained or not); None otherwise, or for an instruction that saves nothing taped."""
    if not ins.taped or not all(
        type(s.packer) is KeepAll and type(s.chained) is KeepAll for s in ins.saved
    ):
        return None
    return tuple(ins.output if s.position < 0 else ins.inputs[s.position] for s in ins.saved)


@dataclass(frozen=True, slots=True)
class KeptLayout:
    """Where a step's buffers come from when every value is kept as it is, the same for every
    step of one kind (`StepProgram.layouts`): each distinct buffer once, in the order `tape`
    packs them, as (slot, key, packer) (key None: the buffer of a tensor's array, a constant
    or a recorded step's carry; else its key in the step's buffers), and per instruction the
    positions of the buffers it saves in that order."""

    sources: tuple[tuple[int, tuple[int, int] | None, Any], ...]
    held: tuple[tuple[int, tuple[int, ...]], ...]  # (instruction, positions) where it saves


def kept_layout(program: StepProgram, mode: int) -> KeptLayout:
    """`tape`'s choice of buffer for every saved value, made once: `mode` 0 for a step whose
    carry comes from arrays, 1 for one chained to a replayed step, 2 to a recorded one."""
    chained, tensors = mode > 0, set(program.constant_tensors)
    if mode == 2:
        tensors |= set(program.carry_in)
    sources: list[tuple[int, tuple[int, int] | None, Any]] = []
    position: dict[Any, int] = {}
    held: list[tuple[int, tuple[int, ...]]] = []
    for i, ins in enumerate(program.instructions):
        if ins.prim is None or type(ins.prim) is Draw or not ins.taped or not ins.saved:
            continue
        at = []
        for s in ins.saved:
            slot = ins.output if s.position < 0 else ins.inputs[s.position]
            packer = s.chained if chained and slot in program.carry_in else s.packer
            key = None if slot in tensors else (slot, id(packer))
            found = ("tensor", slot) if key is None else key
            if found not in position:
                position[found] = len(sources)
                sources.append((slot, key, packer))
            at.append(position[found])
        held.append((i, tuple(at)))
    return KeptLayout(tuple(sources), tuple(held))


def _namespace_of(values: list[Any]) -> Any:
    """The array namespace of a step's values (one device: the engine checks it per op)."""
    for v in values:
        if v is not None:
            return namespace(v)
    return np


@dataclass(frozen=True, slots=True)
class Described:
    """What a profiler counts of the entry that recording one instruction would make, the same
    for every replayed step: its op's name and origin, per saved value (role, slot, whether
    its recorded slot has a version counter but no graph edge), and the input slots that
    would be its leaf edges."""

    op: str
    origin: tuple[Any, int]
    saved: tuple[tuple[str, int, bool], ...]
    leaves: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DescribedStep:
    """A profiler's view of a replayed step, the same for every step: per instruction, what
    its entry would record (None where it records none), and how many primitives it runs
    (recorded or not: each a 'record' or an 'apply' when recorded)."""

    instructions: tuple[Described | None, ...]
    primitives: int


def _step_begins(program: StepProgram) -> DescribedStep:
    """A profiler listens: say a replayed step begins (the values it packs until its
    'replayed' event are its own) and give the program's description.

    Replayed steps are announced one event per step, not per instruction: the event carries
    the description and the step's saved buffers and values, and the profiler lists from them
    what recording the step would have listed, in the same order; no entry, saved slot or
    leaf tensor is made just to be announced."""
    described = program.described[0]  # made when a profiler first hears one of its steps
    if described is None:
        described = program.described[0] = DescribedStep(
            tuple(_describe(program, ins) if ins.taped else None
                  for ins in program.instructions),
            sum(1 for ins in program.instructions
                if ins.prim is not None and type(ins.prim) is not Draw))
    events.emit("replaying", None)
    return described


def _describe(program: StepProgram, ins: Instruction) -> Described:
    return Described(
        ins.prim.name, ins.origin,
        tuple((s.name, ins.output if s.position < 0 else ins.inputs[s.position],
               s.counted and not s.leaf_edge) for s in ins.saved),
        tuple(slot for slot, needed in zip(ins.inputs, ins.mask)
              if needed and program.leaf[slot] and program.graph_leaf[slot]),
    )


def program_of(traces: dict[int, Trace], n_steps: int, n_carry: int, template: int = 0,
               ) -> tuple[StepProgram | None, str]:
    """The program steps 0 and 1 traced to, and how the loop runs: ("replayed"), or no
    program and "recorded: <why>". The program is made from trace `template`: step 1's
    where step 0's carry came from the caller (which need not require grad) and the steps
    to replay take a step's output as their carry."""
    if n_steps == 1:
        return None, "recorded: a loop of one step has nothing to replay"
    reason = same_program(traces[0], traces[1])
    if reason is not None:
        return None, f"recorded: the step {reason}"
    program = StepProgram(traces[template], n_carry)
    reason = program.unreplayable_storage()
    if reason is not None:
        return None, f"recorded: {reason}"
    return program, "replayed"


