"""One loop, step by step: calling the user's step function over pytrees of tensors, checking
that it keeps its structure, and splitting and stacking the scanned inputs and outputs.

Both the plain (keep-every-step) loop and the plan executor run steps through `StepLoop`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import events
from ...autograd import retain_also
from ...backend import is_floating
from ...errors import ShapeError, StepNeedsTapeError
from ...function import Function
from ...grad_mode import (
    DRY_RUN,
    StepScope,
    _state,
    enable_grad,
    is_grad_enabled,
    no_grad,
    step_scope,
)
from ...ops import stack
from ...ops.shape import GETITEM
from ...pytree import flatten, unflatten
from ...saved import VersionCounter
from ...tensor import Tensor
from .hoisted_rows import RowSource, choose_chunk
from .step_cuts import StepCuts


class RowCounter(VersionCounter):
    """The version counter of rows split off a scanned input: it moves when the row is
    changed in place (alone: its sibling rows keep theirs) and whenever the input it was split
    from is. So a value a step saved from its row is caught as modified when the caller changes
    `xs` in place before the backward (as PyTorch catches it through a view's shared counter),
    while a step that changes its own row in place leaves the other steps' saved rows valid.
    `written` counts changes made through rows split off this row in turn (a `scan` in a
    step, over its x): the step changed its row all the same (`Trace.finish`)."""

    __slots__ = ("own", "parent", "written")
    scanned_row = True  # an in-place op on the row while recording raises (`Tensor._inplace`)

    def __init__(self, parent: VersionCounter) -> None:
        self.parent = parent
        self.own = 0
        self.written = 0

    @property  # type: ignore[override]
    def value(self) -> int:
        return self.own + self.parent.value

    @value.setter
    def value(self, value: int) -> None:
        self.own = value - self.parent.value
        parent = self.parent
        while type(parent) is RowCounter:
            parent.written += 1
            parent = parent.parent


def as_row(part: Tensor, x: Tensor, index: Any) -> Tensor:
    """`part`, row(s) `index` of the scanned input `x`, made to behave as PyTorch's view of
    it: its version follows `x`'s (`RowCounter`), and where `x` is a leaf that requires grad,
    an in-place op on it raises `InplaceError` as on any view of such a leaf (it would change
    the caller's `xs`), as a planned loop's rows do."""
    part._version = RowCounter(x._version)
    base, chain = x, ()
    if x._base is not None:  # (`reverse=True` scans a reversed view of the caller's xs)
        base, chain = x._base, x._view[0]  # type: ignore[index]
    if base._entry is None and base._requires_grad:
        part._base = base
        part._view = ((*chain, (GETITEM, {"index": index, "source": tuple(x.shape)})), None)
    return part


def row_tensor(x: Tensor, t: int, requires_grad: bool = False) -> Tensor:
    """Row t of the scanned input `x` as a leaf (a plan's re-run reads it so), its version
    following `x`'s (`RowCounter`): an in-place op on it while recording raises, as on the
    rows every other mode gives a step."""
    part = Tensor._wrap(x._data[t], counter=RowCounter(x._version))
    part._requires_grad = requires_grad
    return part


class _Unstack(Function):
    """Split a tensor along its first axis; the backward stacks the pieces' gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(Tensor._wrap(x._data[t]) for t in range(x.shape[0]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tensor:
        return stack(list(grads), axis=0)


@dataclass
class StepLoop:
    step: Callable[[Any, Any], Any]
    carry_spec: Any
    xs_leaves: list[Any]
    xs_spec: Any
    n: int
    y_spec: Any = None
    evaluations: int = 0
    mode: str = ""
    """How the loop ran, once it has ("replayed", "recorded: <why>"): what `loops()` lists."""
    origin: tuple[Any, int] | None = None
    """The user line that ran the loop, when someone asked for origins as it began (a
    profiler): what entries of its steps taped again for the backward sweep name, where the
    step is this package's code (`origins.rerun_boundary`)."""
    planned_by_budget: bool = False
    """Its plan was priced by a loop planner (`Budget`) from its steps' whole tape: a `scan`
    inside its step keeps every step rather than plan again (see `inside_planned_step`)."""
    holders: list[Any] | None = None
    """Given by a budget that planned the loop: the executors holding its tape add weak
    references to themselves here, so the budget knows when they let go of it (their
    backward sweep, or the graph dropped) and counts their bytes until then."""
    takes_gradients: bool = False
    """A call of the step took a gradient inside it (`grad`, `backward`: a step that
    descends an energy), which needs the step's graph: a plan then runs with a tape (let go
    at once) the steps it runs for their values alone."""
    batch_rows: bool = False
    """Whether replayed steps take their carry-independent products batched over chunks of
    rows, and sum captured tensors' gradients per chunk (`hoisted_rows.py`;
    `scan(..., batch_rows=True)` turns it on)."""
    row_offset: int = 0
    """The index in the whole scan of this loop's step 0 (a loop keeping every step replays
    the steps after the traced ones as a loop of its own): what aligns the chunks."""
    rows: Any = field(default=None, init=False, repr=False)
    """(program, `RowSource`) of the latest `rows_for`."""

    def most_steps(self, until: Any, limit: int | None) -> int | None:
        """The most steps the loop may run: its length, or with `until`, `limit` (None:
        `until` alone ends the loop)."""
        return self.n if until is None else limit

    def x_at(self, t: int) -> Any:
        """The scanned input of step t, without history (for re-runs under a plan)."""
        if self.xs_spec is None:
            return None
        parts = [None if x is None else row_tensor(x, t) for x in self.xs_leaves]
        return unflatten(self.xs_spec, iter(parts))

    def rows_for(self, program: Any) -> Callable[[int], list[Any]]:
        """`x_arrays`, or where `program` batches products over chunks of rows (and this
        loop lets it), its `hoisted_rows.RowSource.at`: what a replayed step takes."""
        source = self.row_source(program)
        return self.x_arrays if source is None else source.at

    def row_source(self, program: Any) -> Any:
        """The `hoisted_rows.RowSource` the replays of `program` in this loop read (one per
        program: the chunk it holds is the loop's), or None where rows are not batched."""
        if (not self.batch_rows or not (program.hoisted or program.summed)
                or self.xs_spec is None):
            return None
        held = self.rows
        if held is not None and held[0] is program:
            return held[1]  # (None: the loop is too short, or its rows too large)
        xs = [None if x is None else x._data for x in self.xs_leaves]
        length = min((x.shape[0] for x in xs if x is not None), default=0)
        chunk = choose_chunk(program.row_bytes, length + self.row_offset)
        source = RowSource(program, xs, self.row_offset, chunk) if chunk else None
        self.rows = (program, source)
        return source

    def release_rows(self) -> None:
        """Let go of the chunk of products held (a run or a backward ended)."""
        if self.rows is not None and self.rows[1] is not None:
            self.rows[1].release()

    def x_arrays(self, t: int) -> list[Any]:
        """Step t's rows of the scanned arrays (a replayed step's inputs), one per xs leaf."""
        return [None if x is None else row(x._data, t) for x in self.xs_leaves]

    def all_x(self) -> list[Any]:
        """Every step's input, split off xs by one differentiable operation per leaf (so the
        backward stacks the step gradients once instead of scattering into xs at every step)."""
        if self.xs_spec is None:
            return [None] * self.n
        per_leaf: list[list[Any]] = []
        for x in self.xs_leaves:
            if x is None:
                per_leaf.append([None] * self.n)
            elif x.requires_grad and is_grad_enabled():
                per_leaf.append([as_row(part, x, t) for t, part in enumerate(_Unstack.apply(x))])
            else:
                per_leaf.append([as_row(Tensor._wrap(x._data[t]), x, t) for t in range(self.n)])
        rows = zip(*per_leaf)  # a loop stopped by `until` may end before xs does
        return [unflatten(self.xs_spec, iter(row)) for _, row in zip(range(self.n), rows)]

    def count(self) -> None:
        """One more step evaluation (recorded or replayed), announced as a 'step' event (a
        progress bar's tick) when anyone listens."""
        self.evaluations += 1
        if events.listeners:
            events.emit("step", self.evaluations)

    def call(self, t: int, carry_leaves: list[Any], x: Any) -> tuple[list[Any], list[Any]]:
        """Run step `t` on a carry (its leaves) and scanned input; (new carry leaves, y leaves)."""
        self.count()
        carry_in = unflatten(self.carry_spec, iter(carry_leaves))
        taken = _state.gradients_taken
        if self.planned_by_budget:
            _planned_steps.depth = getattr(_planned_steps, "depth", 0) + 1
            try:
                result = self.step(carry_in, x)
            finally:
                _planned_steps.depth -= 1
        else:
            result = self.step(carry_in, x)
        if _state.gradients_taken != taken:
            self.takes_gradients = True
        carry, y = self._checked(result, t)
        new_leaves, spec = flatten(carry)
        if spec != self.carry_spec:
            raise ShapeError(
                f"scan: step {t} returned a carry structured as {spec}, but the initial carry "
                f"is {self.carry_spec}; the carry must keep its structure"
            )
        for k, (old, new) in enumerate(zip(carry_leaves, new_leaves)):
            if old is not None and new is not None and (
                old.shape != new.shape or old.dtype != new.dtype
            ):
                raise ShapeError(
                    f"scan: step {t} changed carry leaf {k} from {old.dtype}{list(old.shape)} "
                    f"to {new.dtype}{list(new.shape)}; a carry must keep its shape and dtype "
                    "(cast or reshape inside the step, e.g. .astype(carry.dtype))"
                )
        y_leaves, y_spec = flatten(y)
        if self.y_spec is None:
            self.y_spec = y_spec
        elif y_spec != self.y_spec:
            raise ShapeError(f"scan: step {t} returned outputs structured as {y_spec}, "
                             f"step 0 as {self.y_spec}; every step must return the same structure")
        return new_leaves, y_leaves

    def call_for_values(self, t: int, carry_leaves: list[Any], x: Any,
                        ) -> tuple[list[Any], list[Any]]:
        """Step t run for its values alone, no tape kept (a budget's dry run, a disk level's
        timing), from a carry and scanned input without history: without a tape, or with one
        let go where the step takes a gradient inside it (`takes_gradients`; learned here if
        an untaped run finds it, and the step run again). Hooks and retain_grad() in it are
        dropped."""
        if not self.takes_gradients:
            try:
                with no_grad(), step_scope(PlannedStep(None, t, first=False, untaped=True)):
                    return self.call(t, carry_leaves, x)
            except StepNeedsTapeError:
                self.takes_gradients = True
        leaves, spec = flatten(x)
        with enable_grad(), step_scope(PlannedStep(None, t, first=False, drops_hooks=True)):
            return self.call(t, _with_graph(carry_leaves), unflatten(spec, _with_graph(leaves)))

    @staticmethod
    def _checked(result: Any, t: int) -> tuple[Any, Any]:
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(f"scan: step must return (carry, y); step {t} returned {result!r:.80}")
        return result


class PlannedStep(StepScope):
    """One run of step `t` of a loop under a plan (see `grad_mode.StepScope`). The plan runs
    a step for its values alone (`untaped`, or with a tape let go: `drops_hooks`) and, in
    each backward, once with the tape its reverse pulls back, where hooks registered in the
    step fire. `retain_grad()` in the step's first run (`first`: the loop's forward, whose
    tensors the caller may keep) notes the tensor in `retained` (step -> tensors, in call
    order); in a later run, the tensor made by the same call hands its gradient to the
    noted one, so `.grad` fills on the tensor the caller holds, as keeping every step would
    (PyTorch's non-reentrant checkpoint fills it the same way). Step 0's input carry, in
    the first run a copy of the caller's (`callers`: id -> the caller's tensor), retains
    the caller's tensor, which keeping every step hands the step itself. A retained
    tensor that is a leaf in a run pulled back (its input carry or row, which the plan
    makes new leaves) is noted in `leaves` (id -> (the leaf, the tensors it stands for),
    weakly): the pull-back hands them its gradient (`loop_pull_back._retained_carry`)."""

    __slots__ = ("callers", "calls", "carry_copies", "cuts", "drops_hooks", "dry", "first",
                 "handles", "inputs", "leaves", "outer", "retained", "seq_run",
                 "seq_started", "slot_calls", "slots", "t", "untaped")

    def __init__(self, retained: dict[int, list[Any]] | None, t: int, first: bool,
                 untaped: bool = False, drops_hooks: bool = False) -> None:
        self.retained = retained
        self.t = t
        self.first = first
        self.untaped = untaped
        outer = _state.step_scope  # a dry run's drops every hook of the steps within
        self.outer = outer  # the scope the loop runs in (an outer loop's step, or None)
        self.drops_hooks = untaped or drops_hooks or (outer is not None and outer.drops_hooks)
        # within a budget's dry run (values measured, then dropped): nothing to refuse
        self.dry = outer is DRY_RUN or getattr(outer, "dry", False)
        self.calls = 0
        self.callers: dict[int, Any] | None = None
        # a later run's step 0 carry: copies of the caller's tensors, which hold its hooks
        self.carry_copies: set[int] | None = None
        # the hooks this run registered, where its tape may be let go (`run_growing_plan`)
        self.handles: list[Any] | None = None
        self.cuts: StepCuts | None = None  # the history this run cuts (`step_cuts.py`)
        self.leaves: dict[int, Any] | None = None  # retained leaves (see the class's doc)
        # the loop's `HookSlot`s by (step, call), where its tensors begin, this run's inputs
        self.slots: dict[tuple[int, int], HookSlot] | None = None
        self.seq_started = 0
        self.inputs: set[int] = set()
        self.slot_calls = 0
        self.seq_run: int | None = None  # the tape's sequence where this run began

    def note_hook(self, handle: Any) -> None:
        if self.handles is not None:
            self.handles.append(handle)

    def slot_hook(self, tensor: Any, hook: Any) -> Any:
        """A hook on a tensor from before the loop (a captured `w * 1.0`), which outlives
        the runs of the step: its k-th registration in step t is one `HookSlot` there,
        registered by the loop's forward (in a Python loop's order), filled by the run
        pulled back (in each backward, again: not one more hook per re-run)."""
        if self.slots is None or self.dry or not self.from_before(tensor):
            return None
        key = (self.t, self.slot_calls)
        self.slot_calls += 1
        slot = self.slots.get(key)
        if slot is None:
            if not self.first:
                return None  # (not met by the loop's forward: registered as usual)
            slot = self.slots[key] = HookSlot()
            slot.tensor = weakref.ref(tensor)
            _state.step_scope = self.outer  # registered as outside the loop
            try:
                slot.handle = tensor.register_hook(slot)
            finally:
                _state.step_scope = self
        elif slot.tensor() is not tensor:
            return None  # a leaf the step makes (a new one in each run): registered as usual
        if not self.drops_hooks:
            slot.fn = hook
        return slot.handle

    def from_before(self, tensor: Any) -> bool:
        """Whether `tensor` comes from before the loop: not made by this run of the step
        (nor given to it)."""
        entry = tensor._entry
        if entry is not None:
            return entry.seq < self.seq_started
        return tensor._requires_grad and id(tensor) not in self.inputs

    def hook_target(self, tensor: Any) -> Any:
        """Step 0's carry stands for the caller's tensor, which keeping every step hands the
        step itself: its first run registers the hook there (it fires once on the caller's
        whole gradient, in the sweep around the loop, as a Python loop's would), and later
        runs drop it."""
        if self.dry:
            return None
        caller = self.callers.get(id(tensor)) if self.callers else None
        if caller is not None:
            return caller
        if self.carry_copies is not None and id(tensor) in self.carry_copies:
            return None
        if self.drops_hooks and self.made_here(tensor) and self.fills_grads():
            # a tensor this run makes, whose tape is let go: the hook fires only in a
            # `backward()` this run takes, which fills `.grad` here (the loop's forward), as
            # it fires in each step of a Python loop (the run pulled back, which takes none,
            # registers it again for the backward around the loop)
            return tensor
        return None if self.drops_hooks else tensor

    def made_here(self, tensor: Any) -> bool:
        """Whether this run of the step made `tensor` (after it began)."""
        entry = tensor._entry
        return entry is not None and self.seq_run is not None and entry.seq >= self.seq_run

    def check_gradient(self, roots: list[Any], inputs: list[Any] | None) -> None:
        if self.cuts is not None and not self.dry:
            self.cuts.check(roots, inputs)

    def fills_grads(self) -> bool:
        """Only in the loop's first run (its forward), as a Python loop's step fills them
        once; in an outer loop's step, where that one fills them too."""
        outer = self.outer
        return self.first and not self.dry and self.retained is not None and (
            outer is None or outer.fills_grads())

    def retain(self, tensor: Any) -> bool:
        k = self.calls
        self.calls += 1
        retained = self.retained
        if retained is None:
            return self.drops_hooks
        if self.first:
            caller = self.callers.get(id(tensor)) if self.callers else None
            if caller is not None:
                retained.setdefault(self.t, []).append(weakref.ref(tensor))
                _state.step_scope = self.outer  # as outside the loop, refusals included
                try:
                    caller.retain_grad()
                finally:
                    _state.step_scope = self
                self.note_leaf(tensor, tensor)  # (its `.grad` mirrors the caller's)
                return True
            original = self.stand_in_of_outer(tensor)
            retained.setdefault(self.t, []).append(weakref.ref(original))
            if original is tensor:
                if not self.drops_hooks and tensor._entry is None:
                    self.note_leaf(tensor, tensor)
                return self.drops_hooks  # a run pulled back retains it as usual
        else:
            noted = retained.get(self.t, ())
            original = noted[k]() if k < len(noted) else None
        if self.drops_hooks:
            return True
        if tensor._entry is None:  # (no graph in a run pulled back: refused as usual)
            if original is not None:
                self.note_leaf(tensor, original)
            return False
        if original is None or original is tensor:
            return False
        # (beside another the output stands for: a step's output carry, retained, which
        # the next step retains as its input carry, as one tensor is kept every step)
        retain_also(tensor._entry, tensor._index, original)
        return True

    def stand_in_of_outer(self, tensor: Any) -> Any:
        """The tensor the caller holds for `tensor`, retained in this loop's first run:
        `tensor` itself, or, where this loop runs in a re-run of an outer loop's step, the
        tensor that step's first run retained at the same call (there, this loop may have
        run otherwise: without gradients, keeping every step)."""
        outer = self.outer
        if type(outer) is not PlannedStep or outer.retained is None:
            return tensor
        k = outer.calls
        outer.calls += 1
        if outer.first:
            original = outer.stand_in_of_outer(tensor)
            outer.retained.setdefault(outer.t, []).append(weakref.ref(original))
            return original
        noted = outer.retained.get(outer.t, ())
        original = noted[k]() if k < len(noted) else None
        return tensor if original is None else original

    def note_leaf(self, leaf: Any, original: Any) -> None:
        """`leaf` (an input this run's plan made a leaf) stands for `original`, retained."""
        if self.leaves is not None and leaf._requires_grad:
            note_retained_leaf(self.leaves, leaf, original)


class HookSlot:
    """One registration of a hook by a planned loop's step on a tensor from before the
    loop (`PlannedStep.slot_hook`): registered there once, by the loop's forward, it calls
    the hook the latest run of that step pulled back gave it (none yet: the gradient
    passes unchanged)."""

    __slots__ = ("fn", "handle", "tensor")

    def __init__(self) -> None:
        self.fn: Any = None
        self.handle: Any = None
        self.tensor: Any = None  # (a weak reference to the tensor it is registered on)

    def __call__(self, grad: Any) -> Any:
        fn = self.fn
        return None if fn is None else fn(grad)


def note_retained_leaf(leaves: dict[int, Any], leaf: Any, original: Any) -> None:
    """Note in `leaves` that `leaf`'s gradient is also `original`'s (see `PlannedStep`)."""
    item = leaves.get(id(leaf))
    if item is None or item[0]() is not leaf:
        item = leaves[id(leaf)] = (weakref.ref(leaf), [])
    if not any(ref() is original for ref in item[1]):
        item[1].append(weakref.ref(original))


def retained_for(leaves: dict[int, Any], leaf: Any) -> list[Any]:
    """The tensors `leaf` stands for (see `PlannedStep`): those alive."""
    item = leaves.get(id(leaf))
    if item is None or item[0]() is not leaf:
        return []
    return [t for t in (ref() for ref in item[1]) if t is not None]


_planned_steps = threading.local()  # .depth: steps of budget-planned loops running now


def inside_planned_step() -> bool:
    """Whether this thread is running a step of a loop a budget planned: a budget prices
    such a loop from its steps' whole tape, a nested loop's included, so a `scan` in it
    keeps every step (planning it again, with the whole budget, would spend it twice)."""
    return getattr(_planned_steps, "depth", 0) > 0


def _with_graph(leaves: list[Any]) -> list[Any]:
    """The leaves (tensors or None) as leaves of a graph: floating ones require grad."""
    out = []
    for leaf in leaves:
        if leaf is not None:
            leaf = Tensor._wrap(leaf._data)
            leaf._requires_grad = is_floating(leaf.dtype)
        out.append(leaf)
    return out


def row(array: Any, t: int) -> Any:
    """Row t of a scanned array, as an array (numpy gives a scalar for a 1-d array's row)."""
    value = array[t]
    return np.asarray(value) if isinstance(value, np.generic) else value


def stack_outputs(per_step: list[list[Any]]) -> list[Any]:
    """Each output leaf stacked over the steps (None leaves stay None)."""
    return [None if c[0] is None else stack(c, axis=0) for c in columns(per_step)]


def columns(per_step: list[list[Any]]) -> list[list[Any]]:
    if not per_step:
        return []
    return [[ys[k] for ys in per_step] for k in range(len(per_step[0]))]


def loop_length(xs_leaves: list[Any], length: int | None, open_ended: bool = False) -> int | None:
    """The number of steps xs and `length` give (the most steps when the loop is
    `open_ended`, i.e. stopped by `until`: None when neither is given)."""
    sizes = {x.shape[0] for x in xs_leaves if x is not None and x.ndim > 0}
    if len(sizes) > 1:
        raise ShapeError(f"scan: xs leaves have different leading lengths {sorted(sizes)}")
    if length is not None:
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"scan: length must be a non-negative int, got {length!r}")
        if sizes and sizes != {length}:
            raise ShapeError(f"scan: length={length} but xs has leading length {sizes.pop()}")
        return length
    if not sizes:
        if open_ended:
            return None
        raise ValueError(
            "scan needs xs with a leading axis to scan over, length=, or until= (a predicate "
            "on the carry that ends the loop)"
        )
    return sizes.pop()


