"""The backward sweep: walk recorded entries in reverse order and apply their rules.

Entries carry their recording number, so a max-heap keyed on it visits every entry after all
entries that consumed its outputs: the tape's own order, restricted to what the outputs depend
on, with no recursion (a 100,000-entry chain is fine). Saved values are released as the sweep
passes each entry unless `retain_graph` keeps them.

A loop run as one entry (a planned `scan`) stands for many steps, each of which a plain tape
would have added, use by use, onto the gradient sums of the loop's carry and captured tensors.
Adding the loop's total instead would regroup floating-point sums (a weight also used after
the loop, a `.grad` left from an earlier pass). So an op with `adds_onto(entry)` is handed
(`onto=`) the running sum of each input it names, adds its steps' gradients onto it in a plain
tape's order, and its result replaces the sum: the gradients are bitwise those of recording.
"""

from __future__ import annotations

import heapq
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import events
from .backend import namespace
from .entry import _NDARRAY, _ONE_INPUT_ONLY, _SEE_FIRST, EntryExtra
from .errors import AnomalyError, BackwardError, DeviceError, ShapeError, StepNeedsTapeError
from .grad_mode import _state, enable_grad, no_grad, refuse_trace
from .ops import astype
from .tape import Entry, Primitive, edge_of
from .tensor_base import TensorBase, as_tensor_like, make_tensor

_ONE_ZERO, _TWO_ZEROS = (0,), (0, 0)
# whether sys.getrefcount counts every holder (before 3.14, whose evaluation stack may hold
# borrowed references): `Capture.add` adds into an array nobody else holds only where it does
_EXACT_REFCOUNTS = sys.version_info < (3, 14)


def _target_meta(node: Any, index: int) -> tuple[tuple[int, ...], Any]:
    if type(node) is Entry:
        return node.out_meta[index]
    return tuple(node.shape), node.dtype


def _conform(grad: Any, node: Any, index: int, producer: Entry) -> Any:
    """Check the gradient's shape and cast it to the dtype of the value it belongs to."""
    shape, dtype = node.out_meta[index] if type(node) is Entry else _target_meta(node, index)
    if type(grad) is np.ndarray:  # the common case, checked without the generic tests
        if grad.shape == shape and grad.dtype is dtype:
            return grad
        data = grad
    else:
        if isinstance(grad, np.generic):  # numpy turns 0-d results into scalars
            grad = np.asarray(grad)
        data = grad._data if isinstance(grad, TensorBase) else grad
    if tuple(data.shape) != shape:
        raise ShapeError(
            f"{producer.describe()} produced a gradient of shape {list(data.shape)} for a value "
            f"of shape {list(shape)}; a backward rule must return one gradient per input, shaped "
            "like it"
        )
    if data.dtype != dtype:
        grad = astype(grad, dtype)
    return grad


def _accumulate_into(t: TensorBase, g: Any, create_graph: bool) -> None:
    if create_graph:
        g = g if isinstance(g, TensorBase) else make_tensor(g)
        t.grad = g if t.grad is None else t.grad + g
    else:
        g = g._data if isinstance(g, TensorBase) else g
        t.grad = make_tensor(g if t.grad is None else t.grad._data + g)


class _Grads:
    """The `.grad` a backward sweep gives each tensor (leaves, retained non-leaves), written
    into the tensors only when the sweep completes (`commit`): a sweep that fails (a rule or
    hook raising, a loop's re-run failing) leaves every `.grad` as it was, so a retry with
    `retain_graph` gives exactly the gradients of one pass.

    Each sum is made as accumulating into `.grad` would make it, in the same order (the old
    `.grad` first, then each gradient as it arrives): the same arrays, bitwise. A tensor
    whose `.grad` is None takes its first gradient by reference; one that has a `.grad`
    keeps it until the commit, beside the new sum (the one array more a transaction costs).
    """

    __slots__ = ("graph", "mirrors", "sums")

    def __init__(self, graph: bool) -> None:
        self.graph = graph  # create_graph: sums are Tensors with a history
        self.sums: dict[int, list[Any]] = {}  # id(tensor) -> [tensor, its new `.grad`]
        self.mirrors: list[tuple[TensorBase, TensorBase]] = []  # (copy, source): `mirror_grad`

    def value(self, t: TensorBase) -> Any:
        """`t`'s `.grad` as this sweep has it so far (an array, or a Tensor under
        create_graph); None where it has none."""
        item = self.sums.get(id(t))
        if item is not None:
            return item[1]
        grad = t.grad
        return grad if grad is None or self.graph else grad._data

    def put(self, t: TensorBase, value: Any) -> None:
        """Make `value` (a sum that includes `value(t)`) `t`'s new `.grad`."""
        item = self.sums.get(id(t))
        if item is None:
            self.sums[id(t)] = [t, value]
        else:
            item[1] = value

    def add(self, t: TensorBase, g: Any) -> None:
        if self.graph:
            g = g if isinstance(g, TensorBase) else make_tensor(g)
        elif isinstance(g, TensorBase):
            g = g._data
        previous = self.value(t)
        self.put(t, g if previous is None else previous + g)

    def commit(self) -> None:
        graph = self.graph
        for t, value in self.sums.values():
            t.grad = value if graph else make_tensor(value)
        self.sums.clear()
        for copy, source in self.mirrors:
            copy.grad = source.grad
        self.mirrors.clear()


class _Sweeps(threading.local):
    """This thread's backward sweeps now running, innermost last: each one's `_Grads`, or
    None for a sweep that fills no `.grad` (a `grad()`, a loop's own pull-back for one);
    and whether each one runs no hooks (`quiet`: see `backpropagate`)."""

    def __init__(self) -> None:
        self.grads: list[_Grads | None] = []
        self.quiet: list[bool] = []


_sweeps = _Sweeps()


def fills_grads() -> bool:
    """Whether the innermost backward sweep running in this thread fills `.grad` (a
    `backward()`, not a `grad()`): a loop entry's backward asks, so that its own pull-back
    through a re-run step fills the `.grad` of tensors retained there (`retain_grad`) as
    the sweep around it would have on a plain tape."""
    grads = _sweeps.grads
    return bool(grads) and grads[-1] is not None


class RetainedRef(weakref.ref):
    """An entry's reference to the tensor retained at one of its outputs, with more tensors
    whose `.grad` that output's gradient fills too (`retain_also`)."""

    __slots__ = ("more",)
    more: list[weakref.ref]


def retain_also(entry: Entry, index: int, tensor: TensorBase) -> None:
    """Fill `tensor.grad` with the gradient of `entry`'s output `index` in a `backward()`
    sweep, beside the tensor retained there already, if any (as `retain_grad()` fills its
    own): a planned loop's re-run makes one tensor where the caller holds several (a step's
    output carry and the next step's input carry, one tensor when every step is kept)."""
    retained = entry.retained
    if retained is None:
        retained = entry.retained = {}
    ref = retained.get(index)
    first = None if ref is None else ref()
    if first is None:
        retained[index] = weakref.ref(tensor)
        return
    if first is tensor:
        return
    if type(ref) is not RetainedRef:
        ref = retained[index] = RetainedRef(first)
        ref.more = []
    if not any(more() is tensor for more in ref.more):
        ref.more.append(weakref.ref(tensor))


def fill_retained(tensor: TensorBase, grad: Any) -> None:
    """Add `grad` to the `.grad` the innermost backward sweep gives `tensor` (a loop's
    pull-back filling a retained step input that its re-run made a leaf of its own, as
    the sweep fills a retained non-leaf); nothing in a sweep that fills no `.grad`."""
    grads = _sweeps.grads
    if grads and grads[-1] is not None and grad is not None:
        grads[-1].add(tensor, grad)


def mirror_grad(copy: TensorBase, source: TensorBase) -> None:
    """When the innermost backward sweep completes, `copy.grad` is `source.grad`: a planned
    loop's step 0 takes a copy of the caller's carry, which keeping every step hands the
    step itself, so what the caller holds as that step's input has the caller's `.grad`.
    Nothing in a sweep that fills no `.grad`."""
    grads = _sweeps.grads
    if grads and grads[-1] is not None:
        grads[-1].mirrors.append((copy, source))


def _as_tensor(grad: Any) -> Any:
    return grad if grad is None or isinstance(grad, TensorBase) else make_tensor(grad)


def _hook_result(new: Any, old: Any, create_graph: bool, what: str) -> Any:
    """A hook's replacement gradient, checked and in the form the sweep carries."""
    if new is None:
        return old
    if not isinstance(new, TensorBase):
        raise BackwardError(
            f"a hook on {what} returned {type(new).__name__}; return a Tensor shaped like the "
            "gradient it was given, or None to keep it"
        )
    if tuple(new.shape) != tuple(old.shape):
        raise ShapeError(
            f"a hook on {what} returned a gradient of shape {list(new.shape)} for one of shape "
            f"{list(old.shape)}; a replacement must keep the shape"
        )
    return new if create_graph else new._data


def run_tensor_hooks(hooks: dict[int, Any], grad: Any, create_graph: bool, what: str) -> Any:
    """Pass `grad` through each hook in registration order (each may replace it)."""
    for fn in list(hooks.values()):
        grad = _hook_result(fn(_as_tensor(grad)), grad, create_graph, what)
    return grad


def _run_entry_hooks(entry: Entry, grads: list[Any], create_graph: bool) -> list[Any]:
    """Apply the tensor hooks registered on `entry`'s outputs to their gradients."""
    for index, hooks in entry.hooks.outputs.items():  # type: ignore[union-attr]
        if hooks and grads[index] is not None:
            what = f"output {index} of {entry.describe()}"
            grads[index] = run_tensor_hooks(hooks, grads[index], create_graph, what)
    return grads


def _run_post_hooks(
    entry: Entry, results: list[Any], grads: list[Any], create_graph: bool
) -> list[Any]:
    """Call `Entry.register_hook` hooks with (grad_inputs, grad_outputs)."""
    for fn in list(entry.hooks.post.values()):  # type: ignore[union-attr]
        grad_inputs = tuple(_as_tensor(g) for g in results)
        new = fn(grad_inputs, tuple(_as_tensor(g) for g in grads))
        if new is None:
            continue
        if len(new) != len(results):
            raise BackwardError(
                f"a hook on {entry.describe()} returned {len(new)} gradients for its "
                f"{len(results)} inputs; return one per input (None for no gradient)"
            )
        results = [
            None if n is None else _hook_result(n, g, create_graph, entry.describe())
            for n, g in zip(new, grad_inputs)
        ]
    return results


def _check_finite(entry: Entry, results: list[Any]) -> None:
    """Raise `AnomalyError` for the first nan/inf in an entry's input gradients."""
    for i, g in enumerate(results):
        if g is None:
            continue
        data = g._data if isinstance(g, TensorBase) else g
        xp = namespace(data)
        if bool(xp.all(xp.isfinite(data))):
            continue
        bad = "nan" if bool(xp.any(xp.isnan(data))) else "inf"
        op = entry.op
        named = f" ({op.args[i]!r})" if type(op) is Primitive and not op.variadic else ""
        raise AnomalyError(
            f"backward of {entry.describe()} gave {bad} in the gradient of its input {i}"
            f"{named}, shape {list(data.shape)}; the values it saved or the gradient it "
            "received make its derivative undefined there: check the inputs of that line "
            "(e.g. log or sqrt at 0, division by 0) or guard them with where/clip"
        )


class Capture:
    """Gradients a caller takes instead of `.grad`: those reaching the nodes in `keys`
    ((id(node), output index) -> position), returned by `backpropagate` as a list.

    `initial` gives a starting value per position (gradients then add onto it in arrival
    order); `owned` (id -> array) lists sums made by the caller that nobody else sees, which
    are then added into in place, so a gradient accumulated over many passes is allocated
    once. Only entries on a path to a captured node are run; with `newer_than`, only entries
    recorded after that sequence number (a loop's own steps: what lies before them is the
    outer tape's business, and its gradients are the caller's to pass on; so are the hooks
    of captured leaves, which the sweep around runs once, on the leaf's total). With
    `fills_retained` (a loop's pull-back on behalf of a `backward()`), retained non-leaves
    reached get their `.grad` too, committed with that sweep's.
    """

    def __init__(
        self,
        keys: dict[tuple[int, int], int],
        initial: list[Any] | None = None,
        owned: dict[int, Any] | None = None,
        newer_than: int = -1,
        fills_retained: bool = False,
    ) -> None:
        self.keys = keys
        self.values: list[Any] = list(initial) if initial is not None else [None] * len(keys)
        self.owned = owned
        self.newer_than = newer_than
        self.fills_retained = fills_retained
        self.needed: set[Entry] = set()

    def add(self, position: int, grad: Any) -> None:
        previous = self.values[position]
        owned = self.owned
        if previous is None:
            self.values[position] = grad
        elif owned is not None and owned.get(id(previous)) is previous:
            previous += grad
        elif (owned is not None and _EXACT_REFCOUNTS and type(previous) is _NDARRAY
              and previous.base is None and sys.getrefcount(previous) == 3
              and type(grad) is _NDARRAY and grad.dtype == previous.dtype
              and grad.shape == previous.shape and previous.flags.writeable):
            # a rule's result that nobody else holds (this list, `previous`, the call's
            # argument: 3 references) and that owns its memory: added into in place, so the
            # first sum allocates nothing (a new sum beside the two was the peak of a
            # binomial backward: one more weight-sized array per parameter). Bitwise the
            # same sum: one ufunc, one dtype
            previous += grad
            owned[id(previous)] = previous
        else:
            total = previous + grad
            if owned is not None and isinstance(total, np.ndarray):
                owned[id(total)] = total
            self.values[position] = total


class _LeafGrad:
    """A leaf's `.grad`, as the sweep has it so far, seen as a one-item container (for
    `_running_sums`)."""

    __slots__ = ("grads", "leaf")

    def __init__(self, leaf: TensorBase, grads: _Grads) -> None:
        self.leaf = leaf
        self.grads = grads

    def __getitem__(self, _: int) -> Any:
        return self.grads.value(self.leaf)

    def __setitem__(self, _: int, value: Any) -> None:
        self.grads.put(self.leaf, value)


def _running_sums(
    entry: Entry, wanted: Sequence[bool], sum_at: Any
) -> tuple[list[Any], list[Any]] | None:
    """What each input of `entry` that its op adds onto (`wanted`) has summed so far in this
    sweep, and where that sum is kept (a (container, key) place from `sum_at`, to replace it);
    None for both where nothing has arrived or the sum is not a plain running sum; None
    when no input has a sum. An input reached by two edges gets none: both would add it."""
    edges = entry.edges
    counts: dict[tuple[int, int], int] = {}
    for edge in edges:
        if edge is not None:
            key = (id(edge[0]), edge[1])
            counts[key] = counts.get(key, 0) + 1
    sums: list[Any] = [None] * len(edges)
    places: list[Any] = [None] * len(edges)
    for i, (edge, want) in enumerate(zip(edges, wanted)):
        if not want or edge is None or counts[(id(edge[0]), edge[1])] > 1:
            continue
        place = sum_at(edge[0], edge[1])
        if place is not None:
            total = place[0][place[1]]
            if total is not None:
                sums[i], places[i] = total, place
    return (sums, places) if any(p is not None for p in places) else None


def _needed_entries(
    roots: list[Any], wanted: dict[tuple[int, int], int], newer_than: int
) -> set[Entry]:
    """Entries recorded after `newer_than` whose backward leads to a wanted leaf or non-leaf
    output (for `grad`)."""
    order: list[Entry] = []
    seen: set[int] = set()
    stack = [node for node, _ in roots if type(node) is Entry]
    while stack:
        entry = stack.pop()
        if id(entry) in seen or entry.seq <= newer_than:
            continue
        seen.add(id(entry))
        order.append(entry)
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)
    order.sort(key=lambda e: e.seq)
    needed: set[Entry] = set()
    for entry in order:
        for edge in entry.edges:
            if edge is None:
                continue
            node, index = edge
            if (id(node), index) in wanted or (type(node) is Entry and node in needed):
                needed.add(entry)
                break
    return needed


def backpropagate(
    roots: Sequence[tuple[Any, Any]],
    *,
    retain_graph: bool,
    create_graph: bool,
    capture: Capture | None = None,
    quiet: bool = False,
) -> None:
    """Propagate seed gradients from `roots` ((edge, gradient) pairs) down the tape.

    Entries are visited newest first; each one's op turns its output gradients into input
    gradients (`op.backward`). Without `capture`, gradients accumulate into leaf `.grad` (and
    retained non-leaves), written when the sweep completes (see `_Grads`); with it, into
    `capture.values`. A `quiet` sweep (a `backward()` in a checkpointed region's re-run,
    whose results are dropped) runs no hooks, nor do the loop pull-backs within it, and
    writes no `.grad`: the region's first run fired and wrote them, as the plain function
    does once.
    """
    # a scan step computing a gradient (grad(), backward(), vjp...): a replay of the step's
    # primitives would not compute it again (its values would be frozen as the first steps'
    # constants, its create_graph graph unknown to the trace): the loop records every step
    refuse_trace("computes a gradient (grad(), backward() or a functional transform), which a "
                 "replay of its operations would not compute again")
    pending: dict[Entry, list[Any]] = {}
    heap: list[tuple[int, int, Entry]] = []
    keys = capture.keys if capture is not None else None
    if capture is not None:
        capture.needed = _needed_entries(
            [edge for edge, _ in roots], capture.keys, capture.newer_than
        )
    anomaly = _state.anomaly
    plain = capture is None and not anomaly  # the sweep's common case: see the loop
    heappop, heappush = heapq.heappop, heapq.heappush
    held: dict[int, list[Any]] = {}  # leaves with hooks: [leaf, summed grad, capture position]
    # the `.grad` this sweep gives: its own, or (a loop's pull-back for a `backward()`) the
    # enclosing sweep's, for the tensors retained in the loop's steps; None: fills none
    if capture is None:
        made: _Grads | None = _Grads(create_graph)
    elif capture.fills_retained and _sweeps.grads:
        made = _sweeps.grads[-1]
    else:
        made = None
    # a loop's pull-back hands its leaves' gradients to the sweep around it, which runs their
    # hooks once on the total (run here too, they would fire once per reversed segment)
    leaf_hooks = capture is None or capture.newer_than < 0
    if capture is not None and not leaf_hooks and _sweeps.quiet:
        quiet = quiet or _sweeps.quiet[-1]  # (a loop's pull-back within a quiet sweep)

    def hold(leaf: TensorBase, grad: Any, position: int | None) -> None:
        """Sum a hooked leaf's gradient over the pass: its hooks see the total, once."""
        item = held.get(id(leaf))
        if item is None:
            held[id(leaf)] = [leaf, grad, position]
        else:
            item[1] = item[1] + grad

    def deliver(node: Any, index: int, grad: Any) -> None:
        if capture is not None:
            position = keys.get((id(node), index))  # type: ignore[union-attr]
            if type(node) is not Entry or (node not in capture.needed and position is None):
                if position is not None:
                    if type(node) is not Entry and node._hooks and leaf_hooks:
                        hold(node, grad, position)
                    else:
                        capture.add(position, grad)
                return
            if position is not None and capture.values[position] is not None:
                # a captured non-leaf with a starting value: add onto it in arrival order
                grads = _pending(node)
                grads[index] = capture.values[position] if grads[index] is None else grads[index]
                capture.values[position] = None
        elif type(node) is not Entry:
            if node._hooks:
                hold(node, grad, None)
            else:
                made.add(node, grad)  # type: ignore[union-attr]
            return
        grads = _pending(node)
        grads[index] = grad if grads[index] is None else grads[index] + grad

    def sum_at(node: Any, index: int) -> tuple[Any, Any]:
        """Where `deliver` would add a gradient for (node, index): (container, key) whose
        item is the running sum (None there: nothing arrived yet), or None where `deliver`
        does more than add (it drops the gradient, or moves a captured starting value)."""
        if capture is not None:
            position = keys.get((id(node), index))  # type: ignore[union-attr]
            if type(node) is not Entry or (node not in capture.needed and position is None):
                if position is None:
                    return None
                if type(node) is not Entry and node._hooks and leaf_hooks:
                    item = held.get(id(node))
                    return None if item is None else (item, 1)
                return capture.values, position
            if position is not None and capture.values[position] is not None:
                return None
        elif type(node) is not Entry:
            if node._hooks:
                item = held.get(id(node))
                return None if item is None else (item, 1)
            return _LeafGrad(node, made), 0  # type: ignore[arg-type]
        grads = pending.get(node)
        return None if grads is None else (grads, index)

    def _pending(node: Entry) -> list[Any]:
        grads = pending.get(node)
        if grads is None:
            grads = pending[node] = [None] * len(node.out_meta)
            heapq.heappush(heap, (-node.seq, id(node), node))
        return grads

    _sweeps.grads.append(made)
    _sweeps.quiet.append(quiet)
    if events.listeners:
        events.emit("backward_begin", None)
    try:
        for (node, index), grad in roots:
            deliver(node, index, grad)
        with enable_grad() if create_graph else no_grad():
            while heap:
                entry = heappop(heap)[2]
                grads = pending.pop(entry)
                op = entry._meta[3]  # `entry.op`
                extra = entry._extra
                if plain and type(op) is Primitive and (not isinstance(extra, EntryExtra) or (
                        extra.hooks is None and extra.retained is None)):  # (a line's origin)
                    results = op.backward(entry, grads, create_graph, retain_graph)
                    if not retain_graph:
                        if type(entry._saved) is _NDARRAY and "release" not in events.wanted:
                            entry._saved = entry._counter = None  # `entry.release()`, written out
                        else:
                            entry.release()
                else:  # hooks, retained outputs, captures, anomaly checks, loops
                    if not isinstance(extra, EntryExtra):  # hooks, retained outputs: few entries
                        extra = None  # (None or the attributes' dict: see `Entry.attrs`)
                    hooks = None if extra is None else extra.hooks
                    if quiet:
                        hooks = None
                    if hooks is not None and hooks.outputs and (
                            capture is None or entry.seq > capture.newer_than):
                        # (not a tensor from before a loop, reached by the loop's pull-back
                        # with part of its gradient: the sweep around runs its hooks once,
                        # on the total, as it runs a captured leaf's)
                        grads = _run_entry_hooks(entry, grads, create_graph)
                    if capture is not None:
                        for index, grad in enumerate(grads):
                            position = keys.get((id(entry), index))  # type: ignore[union-attr]
                            if position is not None and grad is not None:
                                previous = capture.values[position]
                                capture.values[position] = (
                                    grad if previous is None else previous + grad
                                )
                    if made is not None and extra is not None and extra.retained and (
                            capture is None or entry.seq > capture.newer_than):
                        # (a loop's pull-back reaches a retained tensor from before the loop,
                        # c of ``c.retain_grad()``, with the sum so far: the sweep around
                        # fills its .grad once, on the total)
                        for index, ref in extra.retained.items():
                            t = ref()
                            if t is not None and grads[index] is not None:
                                made.add(t, grads[index])
                            if type(ref) is RetainedRef and grads[index] is not None:
                                for more in ref.more:  # (see `retain_also`)
                                    t = more()
                                    if t is not None:
                                        made.add(t, grads[index])
                    if capture is not None and entry not in capture.needed:
                        continue
                    running = None
                    adds_onto = None if type(op) is Primitive else getattr(op, "adds_onto", None)
                    if adds_onto is not None and not anomaly and (
                        hooks is None or not hooks.post
                    ):
                        running = _running_sums(entry, adds_onto(entry), sum_at)
                    if running is not None:
                        results = op.backward(entry, grads, create_graph, retain_graph,
                                              onto=running[0])
                    else:
                        results = op.backward(entry, grads, create_graph, retain_graph)
                    if hooks is not None and hooks.post:
                        results = _run_post_hooks(entry, results, grads, create_graph)
                    if anomaly:
                        _check_finite(entry, results)
                    if not retain_graph:
                        entry.release()
                    if running is not None:  # sums that already hold what arrived before
                        for edge, grad, place in zip(entry.edges, results, running[1]):
                            if edge is not None and grad is not None:
                                grad = _conform(grad, edge[0], edge[1], entry)
                                if place is None:
                                    deliver(edge[0], edge[1], grad)
                                else:  # the op's result includes the sum it was handed
                                    place[0][place[1]] = grad
                        continue
                second = entry._in2  # `entry.nodes` and `entry.indices`, written out
                if second is _ONE_INPUT_ONLY:
                    nodes, indices = (entry._in,), _ONE_ZERO
                elif second is _SEE_FIRST:
                    nodes, indices = entry.nodes, entry.indices
                else:
                    nodes, indices = (entry._in, second), _TWO_ZEROS
                for node, index, grad in zip(nodes, indices, results):
                    if node is None or grad is None:
                        continue
                    if type(node) is not Entry or capture is not None:
                        deliver(node, index, _conform(grad, node, index, entry))
                        continue
                    # an entry's output, no capture: `deliver` inlined, the sweep's hot path
                    out_meta = node._meta[0]  # `node.out_meta`
                    shape, dtype = out_meta[index]
                    if type(grad) is not np.ndarray or grad.shape != shape or (
                        grad.dtype is not dtype
                    ):
                        grad = _conform(grad, node, index, entry)
                    grads = pending.get(node)
                    if grads is None:
                        grads = pending[node] = [None] * len(out_meta)
                        heappush(heap, (-node.seq, id(node), node))
                    previous = grads[index]
                    grads[index] = grad if previous is None else previous + grad
            for leaf, grad, position in held.values():
                if not quiet:
                    grad = run_tensor_hooks(leaf._hooks, grad, create_graph, "a leaf tensor")
                if position is not None:
                    capture.add(position, grad)  # type: ignore[union-attr]
                else:
                    made.add(leaf, grad)  # type: ignore[union-attr]
        # the sweep completed: its `.grad` are written now; not in a quiet sweep (a region's
        # re-run, whose first run wrote them: the re-run added the same gradients again,
        # silently). The sweep still runs, so the re-run takes the first run's path and
        # saves the same values.
        if capture is None and not quiet:
            made.commit()  # type: ignore[union-attr]
    finally:
        _sweeps.grads.pop()
        _sweeps.quiet.pop()
        if events.listeners:
            events.emit("backward_end", None)


def _seed(output: TensorBase, gradient: Any, position: str) -> Any:
    if gradient is None:
        if output._element_count() != 1:
            raise BackwardError(
                f"{position} has shape {list(output.shape)}: an implicit gradient of 1 is only "
                "defined for single-element outputs; pass gradient= (grad_outputs= for grad()) "
                "with the same shape, or reduce the output first (e.g. .sum())"
            )
        return namespace(output._data).ones_like(output._data)
    seed = as_tensor_like(gradient, like=(output,))
    if seed.shape != output.shape:
        raise ShapeError(
            f"the gradient given for {position} has shape {list(seed.shape)}, but the output has "
            f"shape {list(output.shape)}; they must match"
        )
    if type(seed._data) is not type(output._data):
        raise DeviceError(
            f"the gradient given for {position} is on {seed.device}, the output on "
            f"{output.device}; move it with .to()"
        )
    return seed


def _root_edge(output: TensorBase, position: str) -> Any:
    if not isinstance(output, TensorBase):
        raise TypeError(f"{position} must be a Tensor, got {type(output).__name__}")
    edge = edge_of(output._current())
    if edge is None:
        _refuse_untaped_step()
        raise BackwardError(
            f"{position} does not require grad: it was computed only from tensors with "
            "requires_grad=False, or under no_grad(); set requires_grad=True on the inputs you "
            "want gradients for"
        )
    return edge


def _refuse_untaped_step() -> None:
    """Raise `StepNeedsTapeError` where a checkpointed loop runs a step without a tape:
    a gradient the step takes finds no graph there."""
    scope = _state.step_scope
    if scope is not None and scope.untaped:
        raise StepNeedsTapeError(
            "a step of a checkpointed loop takes a gradient inside it (grad/backward), but "
            "this run of the step has no tape: the loop runs its steps with one where step 0 "
            "took a gradient, so take it in every step (as step 0), or run the loop keeping "
            "every step (strategy=None)"
        )


def _seed_value(seed: Any, create_graph: bool) -> Any:
    if isinstance(seed, TensorBase):
        return seed if create_graph else seed._data
    return make_tensor(seed) if create_graph else seed


def backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """Accumulate the gradients of `tensors` (one or several, summed in one pass) into `.grad`.

    `grad_tensors` gives each output's seed (None: 1 for single-element outputs); `inputs`
    limits accumulation to those tensors (leaves or not), as PyTorch's ``inputs=``.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor(2.0, requires_grad=True)
    >>> w = cad.tensor(5.0, requires_grad=True)
    >>> cad.backward([x * x, x * w], inputs=[x])
    >>> x.grad.item(), w.grad
    (9.0, None)
    """
    _state.gradients_taken += 1
    outs, single = _as_list(tensors)
    if not outs:
        raise ValueError("backward() needs at least one output tensor")
    seeds = _seeds_for(outs, grad_tensors, "grad_tensors")
    roots = []
    for i, (out, seed) in enumerate(zip(outs, seeds)):
        name = "the tensor backward() was called on" if single else f"tensors[{i}]"
        roots.append((_root_edge(out, name), _seed_value(_seed(out, seed, name), create_graph)))
    retain = create_graph if retain_graph is None else retain_graph
    scope = _state.step_scope  # (a step of a checkpointed loop: see `StepScope`)
    # a checkpointed region's re-run: its first run filled `.grad` and fired the hooks
    quiet = _state.rerun_floor is not None
    if inputs is None:
        if scope is not None:
            scope.check_gradient([edge for edge, _ in roots], None)
            if not scope.fills_grads():
                return  # the step's run in the loop's forward filled them, once
        backpropagate(roots, retain_graph=retain, create_graph=create_graph, quiet=quiet)
        return
    ins, _ = _as_list(inputs)
    if not ins:
        raise ValueError("backward(inputs=...) was given no tensors; leave inputs out instead")
    keys = _capture_keys(ins, "inputs")
    if scope is not None:
        scope.check_gradient([edge for edge, _ in roots], ins)
        if not scope.fills_grads():
            return
    captured = Capture(keys)
    backpropagate(roots, retain_graph=retain, create_graph=create_graph, capture=captured,
                  quiet=quiet)
    if quiet:
        return
    done: set[tuple[int, int]] = set()
    for t in ins:
        edge = edge_of(t)
        key = (id(edge[0]), edge[1])
        value = captured.values[keys[key]]
        if value is not None and key not in done:
            done.add(key)
            _accumulate_into(t, value, create_graph)


def _seeds_for(outs: list[Any], given: Any, name: str) -> list[Any]:
    if given is None:
        return [None] * len(outs)
    seeds = [given] if isinstance(given, TensorBase) else list(given)
    if len(seeds) != len(outs):
        raise ValueError(f"{name} has {len(seeds)} entries for {len(outs)} outputs; give one each")
    return seeds


def _capture_keys(ins: list[Any], name: str) -> dict[tuple[int, int], int]:
    """(graph node id, output index) -> position for each tensor in `ins`."""
    keys: dict[tuple[int, int], int] = {}
    for i, t in enumerate(ins):
        if not isinstance(t, TensorBase):
            raise TypeError(f"{name}[{i}] must be a Tensor, got {type(t).__name__}")
        edge = edge_of(t._current())
        if edge is None:
            _refuse_untaped_step()
            raise BackwardError(
                f"{name}[{i}] ({t.dtype}{list(t.shape)}) does not require grad, so it has no "
                "gradient; set requires_grad=True on it before computing the outputs"
            )
        keys.setdefault((id(edge[0]), edge[1]), i)
    return keys


def _as_list(value: Any) -> tuple[list[Any], bool]:
    if isinstance(value, TensorBase):
        return [value], True
    return list(value), False


def grad(
    outputs: Any,
    inputs: Any,
    grad_outputs: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[Any, ...]:
    """Gradients of `outputs` with respect to `inputs`, returned as a tuple with one entry per
    input, also when `inputs` is a single tensor, as ``torch.autograd.grad`` (no `.grad` is
    filled).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor(3.0, requires_grad=True)
    >>> (dx,) = cad.grad(x * x, x)
    >>> dx.item()
    6.0
    """
    _state.gradients_taken += 1
    outs, _ = _as_list(outputs)
    ins, _ = _as_list(inputs)
    if not ins or not outs:
        raise ValueError("grad() needs at least one output and one input tensor")
    seeds = _seeds_for(outs, grad_outputs, "grad_outputs")
    capture = _capture_keys(ins, "inputs")
    roots = []
    for i, (out, seed) in enumerate(zip(outs, seeds)):
        name = f"outputs[{i}]"
        roots.append((_root_edge(out, name), _seed_value(_seed(out, seed, name), create_graph)))
    if _state.step_scope is not None:
        _state.step_scope.check_gradient([edge for edge, _ in roots], ins)
    retain = create_graph if retain_graph is None else retain_graph
    captured = Capture(capture)
    backpropagate(roots, retain_graph=retain, create_graph=create_graph, capture=captured)
    results: list[Any] = []
    for i, t in enumerate(ins):
        edge = edge_of(t)
        value = captured.values[capture[(id(edge[0]), edge[1])]]
        if value is None:
            if not allow_unused:
                raise BackwardError(
                    f"inputs[{i}] ({t.dtype}{list(t.shape)}) was not used to compute the "
                    "outputs; pass allow_unused=True to get None for it"
                )
            results.append(None)
            continue
        if isinstance(value, TensorBase):
            results.append(value)
        else:
            results.append(make_tensor(value))
    return tuple(results)
