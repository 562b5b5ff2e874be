"""Folding a periodic Python loop recorded under an eviction pool into one loop record.

Why: under ``use(Budget(...))`` a Python loop's steps are recorded one primitive at a time;
the pool holds their saved arrays within the budget, but every step leaves its entries and
recipes on the tape (several KB a step), so a long loop of small steps passes any budget on
objects alone. No per-step record can fit 20,000 steps in 2 MiB; folding can: once the
newest entries repeat a period, the periods recorded are replaced by one loop entry (a
`StepProgram` made from one period's recipes, plus the carry snapshots an online plan keeps)
whose backward replays steps as a `scan`'s does, so the gradients are bitwise those of
keeping every entry.

How (`Folder.note`, called by the pool for every primitive it records):
- the pool's recipes (`dtr._Value`) name every input of a primitive, constants included, so
  they are a complete forward program; the newest ones are kept in a short ring;
- a period p (at most `MAX_PERIOD` primitives) holds when each of the newest 2p recipes runs
  the primitive of the one p before, with the same attributes, shapes, dtypes and backward
  form, and reads either the same outside array or value (same version: a parameter, a
  weight computed before the loop) or the value p after the one that one read, made in the
  same period or the one before (the carry). A new loop folds once its code repeated over
  `_MIN_ITEMS` primitives (a few equal operations in a row are no loop);
- a period is folded two periods after it was recorded (the user's variables of a step are
  reassigned by then), and only if none of its tensors is alive, nothing but the ring's
  entries holds its entries (reference counts: a custom Function's or another strategy's
  entry that read one), none has hooks or retained gradients or was released, and no input
  changed in place. Recording under a listener (profiler), a `GradientTape`, a trace, a
  planned loop's step, anomaly mode, no_grad or a checkpointed region's first run folds
  nothing. Any failed check ends the loop record: what follows is recorded as before.
Folding a period moves the edges and recipes of the period after it from the folded values
to the loop entry's outputs (the carry), and lets the period's entries, recipes and saved
values die. The loop entry is numbered as the first folded entry, so the backward sweep
reaches it after everything that read its carry. Its carry states are held outside the
pool's values and counted as reserved (`Rematerializing.fold_bytes`): half the limit at most.
Under create_graph the loop is taped again from its first state and differentiated like a
plain loop (first-order gradients bitwise, second-order to rounding, as a `scan`'s).
Not folded (recorded as before): a loop that reads a new outside array every step (rows of a
tensor, `xs[t]`; random draws), multi-output or variadic primitives.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from typing import Any

import numpy as np

from ... import events
from ...autograd import Capture
from ...errors import BackwardError, SavedValueModifiedError
from ...forms import needed_values
from ...grad_mode import _state, enable_grad
from ...saved import KEEP, PackedBuffer, VersionCounter, _watching, freed_error, use_packer
from ...tape import Entry, Primitive, edge_of, graph_tensor, tape_blocks
from ..loops.loop_backward import pull_back_with_graph
from ..loops.step_program import StepProgram
from ..loops.step_pull_back import pull_back_steps
from ..loops.step_tape import tape_steps
from ..loops.step_trace import Instruction, Saved, Trace, same_values
from ..plans.online import OnlinePlanner
from ..plans.revolve import _ADVANCE, _FREE, _RESTORE, _REVERSE, _SNAPSHOT, split_code
from .dtr import _Fixed, _Value

MAX_PERIOD = 64  # the longest loop body (in primitives) looked for
_LAG = 2  # periods recorded after one before it is folded
_MIN_ITEMS = 2 * MAX_PERIOD  # primitives a new loop repeats before its first fold
_MOST_SNAPSHOTS = 1024


class _Item:
    """One recorded primitive in the ring: its recipe, entry and a weak reference to its
    result tensor."""

    __slots__ = ("entry", "ref", "value")

    def __init__(self, value: Any, entry: Entry, ref: Any) -> None:
        self.value = value
        self.entry = entry
        self.ref = ref


def quiet_now() -> bool:
    """Whether nothing that a fold would hide is watching the recording."""
    return not (events.listeners or tape_blocks or _state.tracer is not None or _watching
                or _state.step_scope is not None or _state.anomaly
                or not _state.grad_enabled)


class Folder:
    """A pool's folding of periodic code (see the module's doc)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.items: list[_Item] = []
        self.base = 0  # the absolute number of items[0]
        self.where: dict[int, int] = {}  # id(recipe) -> absolute number
        self.period = 0
        self.start = 0  # absolute number of the oldest unfolded period's first item
        self.anchor = 0  # where the period was first seen
        self.loop: FoldedLoop | None = None
        self.folds = 0  # periods folded, all loops
        self.stopped: str | None = None  # why the last loop record ended

    # ------------------------------------------------------------- the ring
    def note(self, value: Any, entry: Entry, result: Any) -> None:
        """The pool recorded `value` (the recipe of `result`, made by `entry`)."""
        if self.loop is not None and (self.loop.consumed or self.loop.finished):
            self._reset("its backward ran")
        if not quiet_now() or entry.op.variadic or len(entry.out_meta) != 1:
            if self.items:
                self._reset("unusual recording")
            return
        number = self.base + len(self.items)
        self.items.append(_Item(value, entry, weakref.ref(result)))
        self.where[id(value)] = number
        if self.period:
            if self._matches(number, self.period, self.start - self.period):
                self._maybe_fold(number)
                return
            if self.loop is not None:
                self._reset("the code stopped repeating")
                return
            self.period = 0  # a shorter repeat inside a longer body: look again
        self._detect(number)
        if not self.period and len(self.items) > 4 * MAX_PERIOD:
            self._drop_items(len(self.items) - 3 * MAX_PERIOD)

    def _detect(self, number: int) -> None:
        items = self.items
        n = len(items)
        newest = items[-1].value.prim
        for p in range(1, min(MAX_PERIOD, n // 3) + 1):
            if items[-1 - p].value.prim is not newest:
                continue
            anchor = number + 1 - 3 * p
            if all(self._matches(i, p, anchor) for i in range(number, number - 2 * p, -1)):
                self.period = p
                self.anchor = anchor
                self.start = anchor + p  # the first period to fold; the one before: carry
                return

    def _matches(self, i: int, p: int, anchor: int) -> bool:
        """Whether item i repeats item i - p (see the module's doc); `anchor`: the absolute
        number where some period begins (its phase)."""
        a = self.items[i - self.base]
        b = self.items[i - p - self.base]
        va, vb = a.value, b.value
        if va.prim is not vb.prim:
            return False
        ma, mb = a.entry._meta, b.entry._meta
        if ma is not mb and ma != mb:
            return False
        if va.attrs is not vb.attrs and not same_values(va.attrs, vb.attrs):
            return False
        first = i - (i - anchor) % p - p  # the first item of the period before i's
        na, nb = a.entry.nodes, b.entry.nodes
        if len(va.inputs) != len(vb.inputs):
            return False
        where = self.where
        for sa, sb, xa, xb in zip(va.inputs, vb.inputs, na, nb):
            if type(sa) is not type(sb):
                return False
            if type(sa) is _Value:
                ia = where.get(id(sa), -1)
                if sa is sb and xa is xb and ia < first - p:
                    continue  # made before the loop, read by every step (a captured weight)
                ib = where.get(id(sb), -1)
                if ia < 0 or ib < 0 or ia - ib != p or ia < first or ia >= i:
                    return False
            elif sa.array is not sb.array or sa.counter is not sb.counter or (
                    sa.version != sb.version or xa is not xb):
                return False
        return a.entry.indices == b.entry.indices

    def _drop_items(self, count: int) -> None:
        for item in self.items[:count]:
            self.where.pop(id(item.value), None)
        del self.items[:count]
        self.base += count

    def end(self) -> None:
        """The recording block ended: no loop goes on past it, and the ring lets go of its
        entries (the newest holds the whole graph through its edges)."""
        if self.items or self.loop is not None:
            self._reset("the block ended")

    def _reset(self, why: str) -> None:
        if self.loop is not None:
            self.stopped = why
        self.loop = None
        self.period = 0
        self.where = {}
        self.base += len(self.items)
        self.items = []

    # ------------------------------------------------------------- folding
    def _maybe_fold(self, number: int) -> None:
        """At the end of a period: fold every period recorded `_LAG` periods ago or more
        (a new loop only once its code has repeated over `_MIN_ITEMS` primitives: four
        `sin`s in a row are no loop worth a program)."""
        p = self.period
        if (number + 1 - self.start) % p or (
                self.loop is None and number + 1 - self.anchor < _MIN_ITEMS):
            return
        while number + 1 - self.start >= (1 + _LAG) * p:
            first = self.start - self.base
            period = self.items[first:first + p]
            why = _unsafe(period, self.items)
            if why is not None:
                self._reset(why)
                return
            if self.loop is None:
                self.loop = FoldedLoop.begin(self.pool, self.items[first - p:first], period)
                if self.loop is None:
                    self._reset("the budget has no room for two of its carry states")
                    return
            self.loop.fold(period, self.items[first + p:first + 2 * p])
            _forget_values(period, self.items[first + p:])
            self.folds += 1
            self.start += p
            self._drop_items(self.start - self.base)  # the folded period, and any before it


def _forget_values(period: list[_Item], later: list[_Item]) -> None:
    """The recipes recorded after `period` no longer name its values as neighbours (a
    value's `frontier` may reach back through unsaved results, past the period before it):
    they would keep the folded recipes, and through theirs every one before, alive."""
    made = {id(item.value) for item in period}
    for item in later:
        value = item.value
        frontier = value.frontier
        if any(id(f) in made for f in frontier):
            value.frontier = tuple(f for f in frontier if id(f) not in made)


def _unsafe(period: list[_Item], ring: list[_Item]) -> str | None:
    """Why folding `period` could change what someone sees (None: it cannot). Its entries
    may be held only by the ring and by the ring's entries (a custom function's or another
    strategy's entry that read one would see it orphaned): counted by reference counts,
    which can only over-count (then nothing is folded)."""
    readers = Counter(id(node) for item in ring for node in item.entry.nodes)
    for item in period:
        # the ring's item, the call's argument, the ring's entries that read it
        if sys.getrefcount(item.entry) > 2 + readers[id(item.entry)]:
            return "an entry of the loop is held from outside it"
        if item.ref() is not None:
            return "a value of the loop is still held"
        value, entry = item.value, item.entry
        if entry._extra is not value or value.hooks is not None or value.retained:
            return "a hook or retain_grad on a value of the loop"
        if entry.released or type(entry.op) is not Primitive:
            return "an entry already released"
        for source in value.inputs:
            if type(source) is _Fixed and source.counter.value != source.version:
                return "an input changed in place"
    return None


class FoldedLoop:
    """The loop entry's op: the folded periods as a step program, their carry states kept by
    an online plan, and the backward that replays them."""

    name = "folded_loop"

    def __init__(self) -> None:
        self.program: StepProgram
        # the loop's entry until its first fold gives it readers: then the entries that read
        # the carry hold it, and it holds this op; holding it here too would make a cycle,
        # leaving both (and the carry states) to the cyclic collector once the graph is let go
        self._first: Any = None
        self.positions: tuple[int, ...] = ()  # carry k: its place in a period
        self.externals: list[int] = []  # program slots of the captured tensors with a gradient
        self.guards: list[tuple[Any, int]] = []  # (counter, version) of every constant
        self.planner: OnlinePlanner
        self.snapshots: dict[int, list[Any]] = {}
        self.last_in: list[Any] = []  # carry-in of the newest folded step
        self.current: list[Any] = []  # its carry-out: the carry-in of what follows
        self.n = 0
        self.finished = False  # a backward ran: no more steps
        self.consumed = False
        self.keys: dict[tuple[Any, ...], int] = {}
        self.held = 0  # bytes of snapshots and states, reserved in the pool
        self.pool: Any = None
        self.carry_bytes = 0

    def __del__(self) -> None:  # a graph let go without a backward: its states leave too
        if self.held and self.pool is not None:
            self.pool.fold_bytes -= self.held

    @classmethod
    def begin(cls, pool: Any, before: list[_Item], period: list[_Item]) -> FoldedLoop | None:
        """The loop of `period`'s program, whose carry is what it reads of `before`; None
        where what is left of half the pool's limit does not hold four carry states (two
        snapshots, the newest state and the one before)."""
        loop = cls()
        loop.pool = pool
        index_before = {id(item.value): q for q, item in enumerate(before)}
        carry: list[int] = sorted({index_before[id(s)] for item in period
                                   for s in item.value.inputs if id(s) in index_before})
        loop.positions = tuple(carry)
        n_carry = len(carry)
        own = {id(item.value): q for q, item in enumerate(period)}
        constants: dict[tuple[int, int, int], int] = {}
        tensors: list[Any] = []
        slot_of_const: list[tuple[Any, Any]] = []
        arrays: dict[int, Any] = {}  # id(source) -> its array
        for item in period:
            nodes, indices = item.entry.nodes, item.entry.indices
            for source, node, index in zip(item.value.inputs, nodes, indices):
                if id(source) in own or id(source) in index_before:
                    continue
                array = arrays.get(id(source))
                if array is None:
                    array = arrays[id(source)] = (_materialize(pool, source)
                                                  if type(source) is _Value else source.array)
                key = (id(array), id(node), index)
                if key not in constants:
                    constants[key] = n_carry + len(tensors)
                    edge = None if node is None else (node, index)
                    tensors.append(graph_tensor(array, edge))
                    slot_of_const.append((source.counter, source.version))
        first = n_carry + len(tensors)
        instructions = []
        for q, item in enumerate(period):
            value, entry = item.value, item.entry
            inputs = []
            for source, node, index in zip(value.inputs, entry.nodes, entry.indices):
                if id(source) in own:
                    inputs.append(first + own[id(source)])
                elif id(source) in index_before:
                    inputs.append(carry.index(index_before[id(source)]))
                else:
                    inputs.append(constants[(id(arrays[id(source)]), id(node), index)])
            mask = tuple(node is not None for node in entry.nodes)
            prim = value.prim
            saved = tuple(Saved(name, position, KEEP, KEEP, True, True)
                          for name, position in needed_values(entry.form, prim.args, mask))
            instructions.append(Instruction(prim, tuple(inputs), dict(value.attrs), first + q,
                                            True, mask, entry.form, saved, entry.in_shapes,
                                            (None, 0)))
        trace = Trace(n_carry, 0)
        trace.instructions = instructions
        trace.constants = {n_carry + j: t for j, t in enumerate(tensors)}
        carry_out = tuple(first + q for q in carry)
        trace.outputs = (carry_out, ())
        metas = [before[q].entry.out_meta[0] for q in carry]
        metas += [(tuple(t.shape), t.dtype) for t in tensors]
        metas += [item.entry.out_meta[0] for item in period]
        trace.facts = ([(True, True, dtype, False) for _, dtype in metas[:n_carry]]
                       + [(t._requires_grad, True, t.dtype, t._entry is None) for t in tensors]
                       + [(True, False, dtype, False) for _, dtype in metas[first:]])
        trace.shapes = [shape for shape, _ in metas]
        trace.n_slots = len(metas)
        loop.program = StepProgram(trace, n_carry)
        loop.externals = [slot for slot, t in trace.constants.items() if edge_of(t) is not None]
        loop.guards = slot_of_const
        loop.keys = {("carry", k): k for k in range(n_carry)}
        loop.keys.update({("ext", slot): n_carry + j for j, slot in enumerate(loop.externals)})
        edges = [(before[q].entry, 0) for q in carry]
        edges += [edge_of(trace.constants[slot]) for slot in loop.externals]
        entry = Entry(loop, edges, {})
        entry.seq = period[0].entry.seq  # before everything that reads its carry
        entry.out_meta = tuple(metas[:n_carry])
        loop._first = entry  # held until the first fold gives it readers (`fold`)
        carry_bytes = sum(_nbytes(shape, dtype) for shape, dtype in metas[:n_carry]) or 1
        loop.carry_bytes = carry_bytes
        # half the limit for the states of every loop folded and not yet differentiated
        # (an inner loop run again by an outer one is a new loop each time): what is left
        s = min(_MOST_SNAPSHOTS, (pool.limit_bytes // 2 - pool.fold_bytes) // carry_bytes - 2)
        if s < 2:
            return None
        loop.planner = OnlinePlanner(s, keep_plan=False)
        loop.current = [_materialize(pool, before[q].value) for q in carry]
        return loop

    def fold(self, period: list[_Item], after: list[_Item]) -> None:
        """Fold `period` as the loop's next step; `after` (the period that follows) reads
        its carry from the loop entry from now on."""
        t = self.n
        actions = self.planner.advance()  # about state t - 1 (see `OnlinePlanner`)
        for action in actions:
            name = type(action).__name__
            if name == "Snapshot":
                self.snapshots[action.step] = self.last_in
            elif name == "Free":
                del self.snapshots[action.step]
        self.last_in = self.current
        self.current = [_materialize(self.pool, period[q].value) for q in self.positions]
        self.n = t + 1
        entry = self._first
        if entry is None:  # the period folded now reads its carry from the loop's entry
            entry = next(e[0] for item in period for e in item.entry.edges
                         if e is not None and e[0].op is self)
        self._retarget(period, after, entry)
        self._first = None  # the entries after it read the loop's entry now
        self._count()

    def _count(self) -> None:
        """The loop's states (the snapshots, the newest state and the one before it),
        reserved in the pool: what it holds outside the pool's values."""
        held = (len(self.snapshots) + 2) * self.carry_bytes
        self.pool.fold_bytes += held - self.held
        self.held = held

    def _retarget(self, period: list[_Item], after: list[_Item], loop_entry: Entry) -> None:
        made = {id(item.value): q for q, item in enumerate(period)}
        entries = {id(item.entry): q for q, item in enumerate(period)}
        carry_of = {q: k for k, q in enumerate(self.positions)}
        fixed = []
        for array in self.current:
            f = object.__new__(_Fixed)
            f.array, f.counter, f.version = array, VersionCounter(), 0
            fixed.append(f)
        pool = self.pool
        for item in after:
            value, entry = item.value, item.entry
            if any(id(s) in made for s in value.inputs):
                value.inputs = tuple(fixed[carry_of[made[id(s)]]] if id(s) in made else s
                                     for s in value.inputs)
            edges = entry.edges
            if any(e is not None and id(e[0]) in entries for e in edges):
                entry.edges = [(loop_entry, carry_of[entries[id(e[0])]])
                               if e is not None and id(e[0]) in entries else e for e in edges]
            for buffer in _buffers(entry):
                handle = buffer.packed
                if buffer.packer is pool and handle.value is not None and (
                        id(handle.value) in made):
                    q = made[id(handle.value)]
                    handle.value = None  # the carry: held, no longer made again
                    pool._drop_evictable(handle)
                    if handle.array is None:
                        pool._rehold(handle, self.current[carry_of[q]], None)

    # ------------------------------------------------------------- the entry's op
    def adds_onto(self, entry: Entry) -> list[bool]:
        """The carry and the captured tensors: each step adds onto their sums (as
        `PlannedLoop.adds_onto`)."""
        return [True] * len(entry.edges)

    def backward(self, entry: Entry, grads: list[Any], create_graph: bool,
                 retain_graph: bool = False, onto: list[Any] | None = None) -> list[Any]:
        """The carry's and captured tensors' gradients, each step's added in a plain tape's
        order onto the sums `onto` hands (bitwise those of keeping every entry)."""
        if self.consumed:
            raise freed_error(entry.describe())
        for counter, version in self.guards:
            if counter.value != version:
                raise SavedValueModifiedError(
                    f"{entry.describe()}: a tensor the folded loop reads was modified in place "
                    "after the loop ran; modify a copy instead")
        if create_graph:
            results = self._backward_with_graph(entry, grads, onto)
            if not retain_graph:
                self._let_go()
            return results
        self.finished = True
        program = self.program
        n_carry = len(self.positions)
        snapshots = dict(self.snapshots) if retain_graph else self.snapshots
        adj = list(grads[:n_carry])
        sums = list(onto) if onto is not None else [None] * len(entry.edges)
        start_sums, ext = sums[:n_carry], sums[n_carry:]
        arrays = self.last_in
        no_x = _no_rows
        for kind, step, stop in _actions(self.planner.reversal(self.n)):
            if kind == _ADVANCE:
                for _ in range(step, stop):
                    arrays, _ys = program.run(arrays, [])
            elif kind == _SNAPSHOT:
                snapshots[step] = arrays
            elif kind == _RESTORE:
                arrays = snapshots[step]
            elif kind == _FREE:
                del snapshots[step]
            elif kind == _REVERSE:
                steps, _, _ = tape_steps(program, list(arrays), no_x, step, step + 1)
                roots = [((step, program.carry_out[k]), g) for k, g in enumerate(adj)
                         if g is not None]
                begin = start_sums if step == 0 else [None] * n_carry
                sink = Capture({}, initial=[*begin, *ext])
                pull_back_steps(program, steps, roots, sink, self.keys)
                adj, ext = sink.values[:n_carry], sink.values[n_carry:]
            else:  # the online planner takes no other action
                raise BackwardError(f"{entry.describe()}: unexpected plan action {kind}")
        if not retain_graph:
            self._let_go()
        return [*adj, *ext]

    def _let_go(self) -> None:
        """The backward ran without retain_graph: the states go, and their reserved bytes."""
        self.consumed = True
        self.snapshots = {}
        self.last_in = self.current = []
        self.pool.fold_bytes -= self.held
        self.held = 0


    def _backward_with_graph(self, entry: Entry, grads: list[Any],
                             onto: list[Any] | None) -> list[Any]:
        """create_graph=True: every step recorded again from the first carry state (kept by
        every online plan) with a tape, under `KeepAll`, and the gradients pulled back
        through that tape with create_graph, as `scan` does (`loop_backward`)."""
        state = self.snapshots.get(0, self.last_in if self.n == 1 else None)
        if state is None:
            raise BackwardError(f"{entry.describe()}: the loop's first state is gone")
        program = self.program
        n_carry = len(self.positions)
        with use_packer(KEEP), enable_grad():
            carry = [graph_tensor(a, e) for a, e in zip(state, entry.edges[:n_carry])]
            constants = program.constant_tensors
            for _ in range(self.n):
                values: dict[int, Any] = dict(constants)
                values.update(zip(program.carry_in, carry))
                for ins in program.instructions:
                    values[ins.output] = ins.prim(*[values[s] for s in ins.inputs],
                                                  **ins.attrs)
                carry = [values[s] for s in program.carry_out]
        return pull_back_with_graph(entry, carry, grads, onto)


def _actions(parts: Any) -> Any:
    """(kind, step, stop) of each packed action, one segment's codes at a time."""
    for part in parts:
        for code in part:
            yield split_code(code)


def _no_rows(t: int) -> list[Any]:
    return []


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _buffers(entry: Entry) -> list[Any]:
    saved = entry._saved
    if isinstance(saved, PackedBuffer):
        return [saved]
    if type(saved) is tuple:
        return [s.buffer for s in saved if isinstance(s.buffer, PackedBuffer)]
    return []


def _materialize(pool: Any, value: Any) -> Any:
    """`value`'s array: in memory, or made again from its recipe."""
    array = value.present()
    if array is None:
        array = pool._recompute(value, None)
    return array
