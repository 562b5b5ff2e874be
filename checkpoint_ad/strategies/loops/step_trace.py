"""Tracing a loop step: what one recorded run of a step did, as primitive calls over numbered
slots (`Trace`), and whether two traces are one program (`same_program`).

The engine calls the trace installed as the thread's tracer (`tracing`) on every primitive a
step records (`Trace.note`) and every random draw (`Trace.note_draw`); a step that does what
a replay cannot repeat (reads a value into Python, registers a hook, modifies a tensor in
place, calls a custom `Function` or a nested planned loop) makes the trace refuse, and the
loop then records every step. `traced_call` is the one way a step is traced. A trace is
frozen into a `StepProgram` (`step_program.py`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from ... import events
from ...backend import namespace
from ...grad_mode import _state
from ...pytree import flatten
from ...saved import KEEP, KeepAll, SavedSlot, current_packer
from ...tape import Primitive, edge_of, next_sequence


@dataclass(frozen=True, slots=True)
class Saved:
    """One value an instruction's backward rules read: by name, from an input position (-1 for
    the output), kept with `packer`; `leaf_edge`/`counted` mirror the recorded slot's graph
    edge and version counter (what the profiler reads to tell owned from aliased bytes)."""

    name: str
    position: int
    packer: Any
    chained: Any  # the packer when the value is a carry made by the previous step (not a leaf)
    leaf_edge: bool
    counted: bool


@dataclass(frozen=True, eq=False)
class Draw:
    """An array drawn from the engine's generator (`random.sample`): replays draw it again,
    from the replayed stream, with the traced step's `make`."""

    make: Any
    key: tuple[Any, ...]
    name: str = "draw"


@dataclass(frozen=True, slots=True)
class Instruction:
    """One primitive call: its input slots, attributes, output slot and, when it recorded an
    entry, the form and saved values of that entry."""

    prim: Any  # a Primitive, a Draw, or None for detach (the input's array, no gradient)
    inputs: tuple[int, ...]
    attrs: dict[str, Any]
    output: int
    taped: bool
    mask: tuple[bool, ...]  # which inputs had a graph edge (require grad)
    form: Any
    saved: tuple[Saved, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    origin: tuple[Any, int]


@dataclass(frozen=True, slots=True)
class TracedRegion:
    """A selective region a step opened: its instructions `start`..`stop`-1 and the slots they
    read from before it (`inputs`, constants aside). A replay keeps the inputs, not what the
    region's instructions save, and re-runs them in the backward (`step_pull_back`)."""

    start: int
    stop: int
    inputs: tuple[int, ...]
    name: str  # what a profiler hears of its re-run (`events.recomputing`), as `checkpoint`'s


@dataclass
class Trace:
    """What tracing one step found; `program()` freezes it."""

    n_inputs: int
    seq_before: int
    slot_of: dict[int, int] = field(default_factory=dict)
    tensors: list[Any] = field(default_factory=list)  # every slot's tensor (kept: ids stay)
    versions: list[int] = field(default_factory=list)
    constants: dict[int, Any] = field(default_factory=dict)  # slot -> tensor from outside
    instructions: list[Instruction] = field(default_factory=list)
    refused: str | None = None
    outputs: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    drawn: dict[int, tuple[int, Any]] = field(default_factory=dict)  # id(array) -> (slot, array)
    shapes: list[Any] = field(default_factory=list)  # every slot's shape (None: no tensor)
    # per slot, once finished: (requires grad, a leaf of the step, dtype, a leaf of the graph)
    facts: list[tuple[bool, bool, Any, bool]] = field(default_factory=list)
    n_slots: int = 0
    # the version counters of every tensor from outside the step that a primitive read, found
    # also after a refusal (the loop then records, and a plan re-running its steps must still
    # catch such a tensor changed in place before its backward): id -> (counter, dtype, shape)
    outside: dict[int, tuple[Any, Any, tuple[int, ...]]] = field(default_factory=dict)
    input_ids: frozenset[int] = frozenset()
    # once finished: the inputs (by slot: carry leaves, then xs leaves) the step changed in
    # place, and the versions of `outside`'s counters as the step left them (a plan that
    # re-runs steps must not re-run one that changes what it reads: see `PlannedLoop`)
    changed_inputs: tuple[int, ...] = ()
    input_written: tuple[int, ...] = ()  # rows changed through rows of theirs (`RowCounter`)
    outside_versions: dict[int, int] = field(default_factory=dict)
    # tensors the step did not make that it changed in place (`note_write`), by counter:
    # (weak reference, counter); those still alive once the step's own are gone belong to
    # someone else (a captured tensor), which a re-run of the step would change again
    written: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    # the selective regions the step opened (`selective.region`), each a `TracedRegion`;
    # `region_open`: the step is inside one
    regions: list[TracedRegion] = field(default_factory=list)
    region_open: bool = False
    region_pending: bool = False  # the region's `checkpoint` has not begun: it refuses nothing

    # ------------------------------------------------------------- called by the engine
    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def note(self, prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any],
             result: Any) -> None:
        """`tape.record` ran `prim` on `tensors` giving `result`."""
        for t in tensors:
            entry = t._entry
            if (entry is None or entry.seq <= self.seq_before) and id(t) not in self.input_ids:
                self.outside.setdefault(id(t._version), (t._version, t.dtype, t.shape))
        if self.refused is not None:
            return
        inputs = tuple(self._slot(t) for t in tensors)
        entry = result._entry
        taped = entry is not None and entry.op is prim and entry.seq > self.seq_before
        saved: tuple[Saved, ...] = ()
        form = None
        in_shapes: tuple[tuple[int, ...], ...] = ()
        if taped:
            form = entry.form
            in_shapes = entry.in_shapes
            chained = current_packer()
            if self.region_open:  # a replay keeps none of a region's saved values (their
                chained = KEEP  # recorded packer is one run's `checkpoint`): said as kept
            elif type(chained) is not KeepAll:
                chained = (chained.for_call(prim, tuple([t.shape for t in tensors]), attrs)
                           if chained.per_call else chained.for_primitive(prim))
            saved = tuple(self._saved(prim, slot, chained, self.region_open)
                          for slot in entry.slots or ())
        mask = tuple(edge_of(t) is not None for t in tensors)
        output = self._new_slot(result)
        origin = entry.origin_frame if taped else (None, 0)
        self.instructions.append(Instruction(
            prim, inputs, dict(attrs), output, taped, mask, form, saved, in_shapes, origin))

    def note_write(self, tensor: Any) -> None:
        """`tensor` is about to be changed in place (`_state.inplace_watch`)."""
        if id(tensor) in self.input_ids:  # the step's carry or row: `changed_inputs`
            return
        target = tensor._base if tensor._base is not None else tensor
        entry = target._entry
        if id(target) in self.input_ids or (entry is not None and entry.seq > self.seq_before):
            return  # its input, or a tensor the step computed
        counter = target._version
        if id(counter) not in self.written:
            try:
                ref = weakref.ref(target)
            except TypeError:
                return
            self.written[id(counter)] = (ref, counter)

    def note_draw(self, make: Any, key: tuple[Any, ...], array: Any) -> None:
        """`random.sample` drew `array` from the engine's generator."""
        if self.refused is not None:
            return
        slot = len(self.tensors)
        self.tensors.append(None)
        self.versions.append(0)
        self.drawn[id(array)] = (slot, array)
        self.instructions.append(Instruction(
            Draw(make, key), (), {}, slot, False, (), None, (), (), (None, 0)))

    def open_region(self) -> int:
        """A selective region begins: where its instructions will start."""
        self.region_open = self.region_pending = True
        return len(self.instructions)

    def close_region(self, start: int, name: str) -> None:
        """The region begun at instruction `start` returned: note its instructions and the
        slots they read from before it (its inputs: what a replay keeps of it)."""
        self.region_open = self.region_pending = False
        if self.refused is not None:
            return
        stop = len(self.instructions)
        made: set[int] = set()
        inputs: list[int] = []
        for ins in self.instructions[start:stop]:
            if type(ins.prim) is Draw:
                self.refuse("draws random numbers inside a selective region (a replay would "
                            "draw others when it re-runs the region)")
                return
            for s in ins.inputs:
                if s not in made and s not in self.constants and s not in inputs:
                    inputs.append(s)
            made.add(ins.output)
        if stop > start:
            self.regions.append(TracedRegion(start, stop, tuple(inputs), name))

    # ------------------------------------------------------------- helpers
    def _saved(self, prim: Primitive, slot: SavedSlot, chained: Any, in_region: bool,
               ) -> Saved:
        name = slot.name
        if name == "out":
            position = -1
        elif prim.variadic:
            position = int(name[1:])
        else:
            position = prim.args.index(name)
        packer = KEEP if in_region else slot.buffer.packer
        return Saved(name, position, packer, chained, slot.edge is not None,
                     slot.counter is not None)

    def _new_slot(self, tensor: Any) -> int:
        slot = len(self.tensors)
        self.tensors.append(tensor)
        if tensor is None:  # an absent carry or xs leaf: a slot that stays None
            self.versions.append(0)
            return slot
        self.versions.append(tensor._version.value)
        self.slot_of[id(tensor)] = slot
        return slot

    def _slot(self, tensor: Any) -> int:
        slot = self.slot_of.get(id(tensor))
        if slot is not None:
            return slot
        entry = tensor._entry
        if entry is not None and entry.seq > self.seq_before:
            self.refuse(
                f"uses an operation that is not a primitive ({type(entry.op).__name__}: a "
                "custom Function or a nested loop)"
            )
        drawn = self.drawn.get(id(tensor._data))
        if drawn is not None and drawn[1] is tensor._data:  # a random draw, now a tensor
            slot = drawn[0]
            if tensor._requires_grad:
                self.refuse("draws a random tensor that requires grad")
            self.tensors[slot] = tensor
            self.versions[slot] = tensor._version.value
            self.slot_of[id(tensor)] = slot
            return slot
        for known, other in enumerate(self.tensors):  # detach(): same array, no gradient
            if other is not None and other._data is tensor._data and entry is None \
                    and not tensor._requires_grad:
                slot = self._new_slot(tensor)
                self.instructions.append(Instruction(
                    None, (known,), {}, slot, False, (False,), None, (), (), (None, 0)))
                return slot
        slot = self._new_slot(tensor)
        self.constants[slot] = tensor
        return slot

    def add_inputs(self, tensors: list[Any]) -> None:
        """The step's carry leaves, then its scanned inputs' leaves: slots 0, 1, ..."""
        for t in tensors:
            self._new_slot(t)
        self.input_ids = frozenset(id(t) for t in tensors if t is not None)
        self.input_written = tuple(_written(t) for t in tensors)

    def finish(self, outputs: list[Any], ys: list[Any]) -> None:
        """The step returned: note its outputs, and refuse if it changed a tensor in place."""
        for k, t in enumerate(self.tensors):
            if t is None:
                continue
            if t._version.value != self.versions[k] or (
                    k < self.n_inputs and _written(t) != self.input_written[k]):
                self.refuse("modifies a tensor in place")
                if k < self.n_inputs:
                    self.changed_inputs += (k,)
        self.outside_versions = {key: found[0].value for key, found in self.outside.items()}
        for t in (*outputs, *ys):  # the step's outputs are its own (a leaf it made, returned)
            if t is not None:
                self.written.pop(id(t._version), None)
        if self.refused is None:
            carry = tuple(-1 if t is None else self._slot(t) for t in outputs)
            y = tuple(-1 if t is None else self._slot(t) for t in ys)
            self.outputs = (carry, y)
        if events.listeners:  # a profile: the values the step made, held until now
            events.emit("traced_step", [t for k, t in enumerate(self.tensors)
                                        if k >= self.n_inputs and t is not None
                                        and k not in self.constants])
        # what a program needs of each slot, kept; the step's tensors let go now (they would
        # keep its tape, and the buffers the profiler counts, alive until the next step)
        self.facts = [
            (t is not None and t._requires_grad,
             t is None or t._entry is None or t._entry.seq <= self.seq_before,
             None if t is None else t.dtype,
             t is None or t._entry is None)
            for t in self.tensors
        ]
        self.shapes = [None if t is None else tuple(t.shape) for t in self.tensors]
        self.n_slots = len(self.tensors)
        self.tensors = []
        self.slot_of = {}
        self.drawn = {}


def _written(t: Any) -> int:
    """Changes made to a scanned row through rows split off it (`loop.RowCounter`)."""
    return 0 if t is None else getattr(t._version, "written", 0)


def same_program(a: Trace, b: Trace) -> str | None:
    """Why two traces of consecutive steps are not one program (None when they are)."""
    if a.refused or b.refused:
        return a.refused or b.refused
    reason = same_operations(a, b)
    if reason is not None:
        return reason
    if a.constants.keys() != b.constants.keys():
        return "uses different tensors from outside on different steps"
    for slot, t in a.constants.items():
        u = b.constants[slot]
        if t is u:
            continue
        if t._requires_grad or u._requires_grad or t._entry is not None or not same_values(
            t._data, u._data
        ):
            return ("makes a tensor from outside data whose values change from step to step "
                    "(a replay would freeze the first step's values)")
    return None


def same_operations(a: Any, b: Any) -> str | None:
    """Why two traces (or what a cache remembers of one) do not run the same operations on
    the same slots, with the same attributes, outputs and random draws (None when they do)."""
    if len(a.instructions) != len(b.instructions) or a.outputs != b.outputs:
        return "runs different operations on different steps"
    if tuple(a.regions) != tuple(b.regions):
        return "opens its selective regions differently on different steps"
    for x, y in zip(a.instructions, b.instructions):
        if type(x.prim) is Draw and type(y.prim) is Draw:
            if not same_values(x.prim.key, y.prim.key) or x.output != y.output:
                return "draws random numbers differently on different steps"
            continue
        if x.prim is not y.prim or x.inputs != y.inputs or not same_values(x.attrs, y.attrs):
            name = x.prim.name if x.prim is not None else "detach"
            return f"runs {name!r} differently on different steps"
    return None


_PLAIN = frozenset({int, float, bool, str, type(None), type(Ellipsis)})


def same_values(a: Any, b: Any) -> bool:
    """Whether two attributes, keys or arrays are equal (arrays: in shape, dtype and every
    value)."""
    if a is b:
        return True
    if type(a) in _PLAIN:  # most attributes: answered without looking for a shape
        return type(a) is type(b) and a == b
    if isinstance(a, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same_values(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_values(a[k], b[k]) for k in a))
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return (hasattr(b, "shape") and a.shape == b.shape and a.dtype == b.dtype
                and bool(namespace(a).all(a == b)))
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def traced_call(loop: Any, t: int, carry: list[Any], x: Any, refused: str | None = None,
                ) -> tuple[list[Any], list[Any], Trace]:
    """Run step `t` of `loop` (a `StepLoop`) recorded, tracing it: (new carry, outputs, trace).
    The one way a step is traced, by the executor and by a budget's dry run alike. A trace
    `refused` from the start makes no program: it only finds the tensors from outside the
    step that it reads (`Trace.outside`)."""
    trace = Trace(len(carry) + len(loop.xs_leaves), next_sequence())
    if refused is not None:
        trace.refuse(refused)
    trace.add_inputs(list(carry) + (flatten(x)[0] if x is not None else []))
    previous = tracing(trace)
    watch = _state.inplace_watch

    def note_write(tensor: Any) -> None:
        trace.note_write(tensor)
        if watch is not None:
            watch(tensor)

    _state.inplace_watch = note_write
    try:
        new, ys = loop.call(t, carry, x)
    finally:
        _state.inplace_watch = watch
        stop_tracing(previous)
    trace.finish(new, ys)
    return new, ys, trace


def tracing(trace: Trace) -> Any:
    """Install `trace` as the calling thread's tracer; returns the one it replaced."""
    previous = _state.tracer
    _state.tracer = trace
    return previous


def stop_tracing(previous: Any) -> None:
    _state.tracer = previous
