"""Primitives, tape entries, and recording one operation on the tape.

A `Primitive` is a forward function on arrays plus one or more *forms* of its vector-Jacobian
product. A form lists, per argument, the rule and the names of the values the rule needs
(argument names, or ``"out"`` for the result). Declaring the needs is what lets the saving
strategy pick a form (store inputs vs store outputs), pack the needed values, or recompute them,
without touching a rule.

An `Entry` (`entry.py`) is one recorded application: its inputs' graph edges, its saved slots,
its attributes and the user code line that ran it (`origins.py`, when someone asked). Entries
are numbered in execution order, so the backward sweep visits them by descending number: no
recursive graph search is needed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from threading import get_ident
from typing import Any, ClassVar

import numpy as np

from . import events
from .backend import broadcast_axes, namespace
from .entry import (
    _NDARRAY,
    _NO_ATTRS,
    _ONE_INPUT_ONLY,
    _SEE_FIRST,
    Entry,
    EntryExtra,
    InputEdge,
    _sequence,
    compact_edges,
    input_edge,
    shared_meta,
)
from .errors import DeviceError, InplaceError, ShapeError
from .forms import VJP, Form, needed_values
from .forms import vjp as vjp  # re-exported: the op tables and custom primitives use it
from .grad_mode import _state, origin_blocks
from .origins import _MAX_ORIGINS, NO_ORIGIN, _user_frame
from .saved import (
    KEEP,
    KeepAll,
    KeptBuffer,
    SavedBuffer,
    SavedSlot,
    Strategy,
    _pushed,
    _watching,
    buffer_for,
    current_packer,
    freed_error,
    note_reads,
)
from .tensor_base import TensorBase, as_tensor_like, make_tensor


def define(
    name: str,
    forward: Callable[..., Any],
    args: str = "x",
    forms: Sequence[dict[str, VJP]] = (),
    **options: Any,
) -> Primitive:
    """Build a primitive from the op tables' compact notation (argument names as one string,
    each form as a dict from argument name to its `vjp`)."""
    return Primitive(
        name, forward, tuple(args.split()), tuple(Form(dict(f)) for f in forms), **options
    )


@dataclass(frozen=True, eq=False)
class Primitive:
    """A differentiable operation: forward on arrays and its backward forms.

    `forward(xp, *arrays, **attrs)` computes with the array namespace `xp`. `forms` lists the
    backward forms, preferred first. `broadcasts` makes the engine sum each argument's gradient
    back to that argument's shape. `view` marks results that may share memory with the first
    argument (they share its version counter). `variadic` primitives take one sequence of
    arrays; their single rule is called as ``rule(g, i, inputs, **attrs)`` for argument `i`.
    """

    name: str
    forward: Callable[..., Any]
    args: tuple[str, ...] = ("x",)
    forms: tuple[Form, ...] = ()
    broadcasts: bool = False
    view: bool = False
    variadic: bool = False
    differentiable: bool = True
    doc: str = field(default="", repr=False)
    # an entry's op sits in its shared `_meta` tuple (see `entry.shared_meta`): primitives are
    # few and long-lived, so every entry of one primitive and shape shares that tuple
    shares_meta: ClassVar[bool] = True

    def __post_init__(self) -> None:
        # What the recording and sweep fast paths read, worked out once per primitive: per
        # form, each argument's rule by position; for a primitive recorded under `KeepAll`
        # (its first form), the values to save per requires-grad mask (bit i: argument i).
        by_position = {f: tuple(f.rules.get(name) for name in self.args) for f in self.forms}
        object.__setattr__(self, "_rules_by_position", by_position)
        keep = None
        if self.forms and self.differentiable and not (self.variadic or self.view) and (
            len(self.args) <= 3
        ):
            keep = tuple(
                needed_values(self.forms[0], self.args,
                              tuple(bool(m >> i & 1) for i in range(len(self.args))))
                for m in range(1 << len(self.args))
            )
        object.__setattr__(self, "_keep_needs", keep)

    def __repr__(self) -> str:
        return f"Primitive({self.name!r})"

    def form(self, kind: str) -> Form | None:
        """The form that saves `kind` ('inputs', 'output', ...) if this primitive has one."""
        return next((f for f in self.forms if f.kind == kind), None)

    def __call__(self, *args: Any, **attrs: Any) -> Any:
        """Apply to Tensors (recorded) or to raw arrays (just computed, as rules need)."""
        if self.variadic:
            items = args[0]
            if not any(isinstance(a, TensorBase) for a in items):
                return self.forward(namespace(items[0]), items, **attrs)
            return record(self, tuple(items), attrs)
        for a in args:
            if isinstance(a, TensorBase):
                return record(self, args, attrs)
        first = args[0]
        return self.forward(np if type(first) is np.ndarray else namespace(first), *args, **attrs)

    def backward(
        self, entry: Entry, grads: list[Any], create_graph: bool, retain_graph: bool = False
    ) -> list[Any]:
        """Apply the recorded form's rules to the output gradient (one per argument)."""
        g = grads[0]
        second = entry._in2
        if second is _ONE_INPUT_ONLY:
            nodes: tuple[Any, ...] = (entry._in,)
        elif second is _SEE_FIRST:
            nodes = entry.nodes
        else:
            nodes = (entry._in, second)
        if g is None:
            return [None] * len(nodes)
        saved = entry._saved
        if type(saved) is _NDARRAY and not create_graph and "unpack" not in events.wanted and (
            entry._counter.value == entry._version  # type: ignore[union-attr]
        ):
            values = None  # the one saved value, `saved`, is every rule's need: read as is
        elif type(saved) is KeptBuffer and not create_graph and "unpack" not in events.wanted and (
            entry._counter.value == entry._version  # type: ignore[union-attr]
        ):
            saved = saved.packed  # the same, kept in a buffer (a profiler listens): its array
            values = None
        elif type(saved) is tuple and not saved:
            values = None  # nothing saved: no rule reads a value
        else:
            values = unpack_saved(entry, create_graph)
        attrs = entry._extra  # `entry.attrs`, written out
        if attrs is None:
            attrs = _NO_ATTRS
        elif isinstance(attrs, EntryExtra):
            attrs = attrs.attrs
        _, in_shapes, form, _ = entry._meta
        if second is _ONE_INPUT_ONLY and values is None and not self.variadic:
            rule = self._rules_by_position[form][0]  # type: ignore[attr-defined]
            if rule is None or entry._in is None:  # the loop below, for one argument
                return [None]
            if rule.needs:
                grad = rule.rule(g, saved, **attrs) if attrs else rule.rule(g, saved)
            else:
                grad = rule.rule(g, **attrs) if attrs else rule.rule(g)
            if self.broadcasts and grad.shape != in_shapes[0]:
                grad = _sum_to(grad, in_shapes[0])
            return [grad]
        if self.variadic:
            rule = form.rules["xs"]
            args = (tuple([values[f"x{i}"] for i in range(len(nodes))]),) if rule.needs else ()
            return [
                rule.rule(g, i, *args, **attrs) if node is not None else None
                for i, node in enumerate(nodes)
            ]
        results = []
        broadcasts = self.broadcasts
        for i, rule in enumerate(self._rules_by_position[form]):  # type: ignore[attr-defined]
            if rule is None or nodes[i] is None:
                results.append(None)
                continue
            needs = rule.needs
            if not needs:
                grad = rule.rule(g, **attrs) if attrs else rule.rule(g)
            elif values is None:
                grad = rule.rule(g, saved, **attrs) if attrs else rule.rule(g, saved)
            elif len(needs) == 1:
                grad = rule.rule(g, values[needs[0]], **attrs)
            else:
                grad = rule.rule(g, *[values[n] for n in needs], **attrs)
            if broadcasts and grad.shape != in_shapes[i]:
                grad = _sum_to(grad, in_shapes[i])
            results.append(grad)
        return results


class _Tapes(threading.local):
    """The explicit tapes (`GradientTape`) recording in this thread."""

    def __init__(self) -> None:
        self.items: list[Any] = []


_tapes = _Tapes()


# one item per GradientTape recording in any thread: while it is empty (the common case)
# `record` asks no thread-local question about tapes
tape_blocks: list[Any] = []


def active_tapes() -> list[Any]:
    """The `GradientTape`s recording in the calling thread (innermost last)."""
    return _tapes.items


def start_tape(tape: Any) -> None:
    """Record every new entry of the calling thread into `tape` too, until `stop_tape`."""
    _tapes.items.append(tape)
    tape_blocks.append(tape)


def stop_tape(tape: Any) -> None:
    _tapes.items.remove(tape)
    tape_blocks.pop()  # any item: only their number matters


def edge_of(tensor: Any) -> Any:
    """Where gradients for `tensor` go: (entry, output index), (leaf tensor, 0), or None."""
    entry = tensor._entry
    if entry is not None:
        return (entry, tensor._index)
    if tensor._requires_grad:
        target = tensor._leaf_target
        return (tensor if target is None else target, 0)
    return None


def _describe_inputs(tensors: Sequence[Any]) -> str:
    return ", ".join(f"{t.dtype}{list(t.shape)} on {t.device}" for t in tensors)


_out_metas: dict[tuple[tuple[int, ...], Any], tuple[tuple[tuple[int, ...], Any]]] = {}


def _shared_meta(key: tuple[tuple[int, ...], Any]) -> tuple[tuple[tuple[int, ...], Any]]:
    """The `out_meta` of a single (shape, dtype) output, one tuple shared by every entry with
    such an output: a long tape of same-shaped results then holds no metadata of its own."""
    if len(_out_metas) > _MAX_ORIGINS:
        _out_metas.clear()
    shape, dtype = key
    return _out_metas.setdefault(key, ((tuple(shape), dtype),))


def add_entry(
    op: Any,
    edges: Sequence[Any],
    outputs: Sequence[Any],
    attrs: dict[str, Any] = _NO_ATTRS,
    save: Callable[..., tuple[SavedSlot, ...]] | None = None,
    counter: Any = None,
    save_args: tuple[Any, ...] = (),
) -> list[Any]:
    """Append one entry to the tape and return its output tensors: the way entries are made,
    by primitives, custom functions and loops alike. (`record`'s fast path, `_record_kept`,
    writes the same entry out directly, only while nobody listens (or a profiler alone, which
    `_record_heard` hands it to) and no `GradientTape` records: the two things this path
    adds.)

    `op` has ``backward(entry, grads, create_graph, retain_graph)`` (input gradients from
    output gradients; `retain_graph` says whether the entry must answer again) and a ``name``;
    `edges` are the inputs' `edge_of`; `outputs` the result arrays (None for an absent
    output); `save(entry, results, *save_args)` returns the entry's saved slots (or None where
    it stored them in the entry itself); `counter` is the version counter a view shares.
    """
    return _append(Entry(op, edges, attrs), outputs, save, counter, save_args)


def _append(
    entry: Entry,
    outputs: Sequence[Any],
    save: Callable[..., tuple[SavedSlot, ...]] | None,
    counter: Any,
    save_args: tuple[Any, ...],
) -> list[Any]:
    """`add_entry` once the entry is made (`record` makes its own, from nodes)."""
    if len(outputs) == 1 and outputs[0] is not None:  # most entries: skip the generic loops
        out = outputs[0]
        key = (out.shape, out.dtype)
        meta = _out_metas.get(key)
        if meta is None:
            meta = _shared_meta(key)
        entry.out_meta = meta
        results = [make_tensor(out, entry, 0, counter)]
    else:
        entry.out_meta = tuple([  # from a list: see `backend.broadcast_axes`
            ((), None) if a is None else (tuple(a.shape), a.dtype) for a in outputs
        ])
        results = [
            None if a is None else make_tensor(a, entry, i, counter)
            for i, a in enumerate(outputs)
        ]
    if save is not None:
        saved = save(entry, results, *save_args)
        if saved is not None:
            entry._saved = saved
    tapes = _tapes.items
    if tapes:
        for tape in tapes:
            tape._entries.append(entry)
    if events.listeners:
        events.emit("record", entry)
    return results


def _primitive_entry(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any],
                     saves: frozenset[str]) -> Entry:
    """A primitive's entry, its inputs' nodes taken from the tensors as `compact_edges`
    stores them: the recording hot path, which makes no edge tuples. Its user line is found
    when asked for every entry (`record_origins`, anomaly mode), and for a listener (the
    profiler) only when its form `saves` values: the lines a profile shows are its saved
    values', and the stack walk is most of what profiling costs per entry."""
    entry = object.__new__(Entry)
    entry.seq = next(_sequence)
    if len(tensors) == 1:
        t = tensors[0]
        node = t._entry
        if node is None:
            entry._in, entry._in2 = _leaf_node(t), _ONE_INPUT_ONLY
        elif t._index == 0:
            entry._in, entry._in2 = node, _ONE_INPUT_ONLY
        else:  # an output of a multi-output entry: the general form
            entry._in, entry._in2 = ((node, t._index),), _SEE_FIRST
    elif len(tensors) == 2 and tensors[0]._index == 0 and tensors[1]._index == 0:
        a, b = tensors
        entry._in = a._entry if a._entry is not None else _leaf_node(a)
        entry._in2 = b._entry if b._entry is not None else _leaf_node(b)
    else:
        entry._in, entry._in2 = compact_edges([edge_of(t) for t in tensors])
    entry._extra = attrs or None  # `entry.attrs = attrs`, written out
    entry._saved = ()
    entry._counter = None
    entry._version = 0
    entry._meta = shared_meta((), (), None, prim)  # `entry.op = prim`
    if (saves and events.listeners) or (origin_blocks and _state.origins):
        entry.origin_frame = _user_frame()
    return entry


def record(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
    """Run `prim` on tensors and, when gradients are needed, append an entry to the tape.

    This runs once per operation of every user's loop: the common case (numpy arrays, no
    views, gradients on, values kept as they are, nobody listening) takes `_record_kept`,
    which makes only the result, its entry and its version counter; under a profiler alone,
    `_record_heard` (the same, handed to the profiler); everything else takes `_record_any`.
    """
    for t in tensors:
        if not isinstance(t, TensorBase):
            tensors = _with_operands(tensors)
            break
    keep = prim._keep_needs  # type: ignore[attr-defined]
    if keep is not None and not (_pushed or origin_blocks or tape_blocks):
        if not events.listeners:
            result = _record_kept(prim, tensors, attrs, keep)
            if result is not None:
                return result
        elif events.kept_record is not None:
            result = _record_heard(prim, tensors, attrs, keep)
            if result is not None:
                return result
    return _record_any(prim, tensors, attrs)


def _record_heard(
    prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any],
    keep: tuple[tuple[tuple[str, int], ...], ...],
) -> Any:
    """`_record_kept` under the one listener that takes entries directly (the profiler, see
    `events.kept_record`; else None, before anything ran): the entry the general path would
    make (a single saved value in a buffer shared through the tensor, its user line), handed
    to the listener with that value, rather than announced by 'pack' and 'record' events
    that the listener would take apart again."""
    heard = events.kept_record
    if heard is None or heard[0] != get_ident():
        return None
    result = _record_kept(prim, tensors, attrs, keep)
    if result is None:
        return None
    entry = result._entry
    frame = _user_frame() if prim.forms[0].needs else NO_ORIGIN
    if frame[0] is not None:  # `Entry.origin_frame`'s setter, on an entry with no extras yet
        extra = entry._extra = EntryExtra(entry._extra or _NO_ATTRS)  # it may hold attributes
        extra.origin_frame = frame
    array = entry._saved
    if type(array) is not _NDARRAY:  # slots (their 'pack' events sent) or nothing saved
        heard[1](entry, None, False, None, False, frame)
        return result
    first = tensors[0]
    mask = 1 if len(tensors) == 1 else first._requires_grad + 2 * tensors[1]._requires_grad
    role, position = keep[mask][0]
    tensor = result if position < 0 else tensors[position]
    # `buffer_for` without its 'pack' event: the listener counts a fresh buffer itself
    ref = tensor._saved_ref
    buffer = ref() if ref is not None else None
    fresh = type(buffer) is not KeptBuffer or buffer.packed is not array  # (None: not one)
    if fresh:
        buffer = KeptBuffer(array)
        tensor._saved_ref = weakref.ref(buffer)
    entry._saved = buffer
    heard[1](entry, buffer, fresh, role, position >= 0 and not tensor._requires_grad, frame)
    return result


def _record_kept(
    prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any],
    keep: tuple[tuple[tuple[str, int], ...], ...],
) -> Any:
    """`record` for one or two numpy tensors, at least one requiring grad, with gradients on
    and nothing tracing (else None, before anything ran): the general path's result and
    entry, written out. A single saved value is kept in the entry as the array itself
    (`KeepAll` needs no buffer: the array is the stored form). A view takes it too (an RNN's
    ``xs[t] @ U``: its saved value shares the base's version counter, as on the general path)
    unless its base changed in place since it was made: `_record_any` re-derives its
    history first (`refresh_view`)."""
    if len(tensors) == 1:
        a = tensors[0]
        b = None
        if not a._requires_grad or a._index or type(a._data) is not _NDARRAY or (
            a._base is not None and a._view[1] is not a._base._entry
        ):
            return None
        mask = 1
    elif len(tensors) == 2:
        a, b = tensors
        if a._index or b._index or (
            type(a._data) is not _NDARRAY or type(b._data) is not _NDARRAY
        ) or (a._base is not None and a._view[1] is not a._base._entry) or (
            b._base is not None and b._view[1] is not b._base._entry
        ):
            return None
        mask = a._requires_grad + 2 * b._requires_grad
        if not mask:
            return None
    else:
        return None
    if not _state.plain:  # gradients off, inference mode or a tracer
        return None
    try:
        if b is None:
            out = prim.forward(np, a._data, **attrs) if attrs else prim.forward(np, a._data)
        else:
            out = prim.forward(np, a._data, b._data, **attrs) if attrs else prim.forward(
                np, a._data, b._data)
    except (ValueError, TypeError, IndexError) as exc:
        raise _forward_error(prim, tensors, attrs, exc) from exc
    if type(out) is not _NDARRAY and isinstance(out, np.generic):  # numpy's 0-d results
        out = np.asarray(out)
    entry = object.__new__(Entry)
    entry.seq = next(_sequence)
    node = a._entry
    if node is None and a._requires_grad:
        node = a if a._leaf_target is None else a._leaf_target
    entry._in = node
    if b is None:
        entry._in2 = _ONE_INPUT_ONLY
        key: tuple[Any, ...] = (prim, out.shape, out.dtype)
    else:
        node = b._entry
        if node is None and b._requires_grad:
            node = b if b._leaf_target is None else b._leaf_target
        entry._in2 = node
        if prim.broadcasts:
            key = (prim, out.shape, out.dtype, a._data.shape, b._data.shape)
        else:
            key = (prim, out.shape, out.dtype)
    meta = _kept_metas.get(key)
    entry._meta = meta if meta is not None else _kept_meta(key)
    entry._extra = attrs or None  # `entry.attrs = attrs`, written out
    result = make_tensor(out, entry)
    needed = keep[mask]
    if len(needed) == 1:
        name, position = needed[0]
        saved = result if position < 0 else tensors[position]
        if saved._inference:
            _buffer(saved, name, KEEP, entry)  # raises the general path's error
        entry._saved = saved._data
        counter = entry._counter = saved._version
        entry._version = counter.value
    else:
        entry._counter = None
        entry._version = 0
        entry._saved = () if not needed else tuple([
            save_tensor(result, name, KEEP, entry, 0) if position < 0
            else save_tensor(tensors[position], name, KEEP, entry,
                             _edge_at(tensors[position], position))
            for name, position in needed
        ])
    return result


_kept_metas: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _kept_meta(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The `Entry._meta` of `_record_kept`'s entries with this (primitive, output shape and
    dtype[, input shapes]) `key`."""
    if len(_kept_metas) > _MAX_ORIGINS:
        _kept_metas.clear()
    prim, shape, dtype, *shapes = key
    out_meta = _out_metas.get((shape, dtype)) or _shared_meta((shape, dtype))
    in_shapes = tuple(tuple(s) for s in shapes)
    return _kept_metas.setdefault(key, shared_meta(out_meta, in_shapes, prim.forms[0], prim))


def _forward_error(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any],
                   exc: Exception) -> ShapeError:
    return ShapeError(
        f"{prim.name!r} cannot run on inputs {_describe_inputs(tensors)} "
        f"with {attrs or 'no attributes'}: {exc}"
    )


def _record_any(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
    """`record` for every case: views, strategies, explicit tapes, listeners, tracers."""
    first = tensors[0]._data
    kind = type(first)
    requires_grad = False
    datas = []
    for t in tensors:
        if t._base is not None and t._view[1] is not t._base._entry:  # type: ignore[index]
            refresh_view(t)
        if t._requires_grad:
            requires_grad = True
        data = t._data
        if type(data) is not kind:
            raise DeviceError(
                f"{prim.name!r} got tensors on different devices or array libraries "
                f"({_describe_inputs(tensors)}); move them to one device first, e.g. with .to()"
            )
        datas.append(data)
    try:
        xp = np if kind is np.ndarray else namespace(first)
        if prim.variadic:
            out = prim.forward(xp, datas, **attrs)
        else:
            out = prim.forward(xp, *datas, **attrs)
    except (ValueError, TypeError, IndexError) as exc:
        raise _forward_error(prim, tensors, attrs, exc) from exc
    if type(out) is not kind and isinstance(out, np.generic):  # numpy's 0-d results
        out = np.asarray(out)
    view = prim.view
    counter = tensors[0]._version if view else None
    if not (requires_grad and prim.differentiable and _state.grad_enabled):
        result = make_tensor(out, counter=counter)
        if events.listeners:
            events.emit("apply", prim)
    else:
        packer = current_packer()
        if type(packer) is KeepAll:
            form = prim.forms[0]
        else:
            packer = (packer.for_call(prim, tuple([d.shape for d in datas]), attrs)
                      if packer.per_call else packer.for_primitive(prim))
            form = prim.forms[0] if type(packer) is KeepAll else packer.choose_form(prim)
        (result,) = _append(
            _primitive_entry(prim, tensors, attrs or _NO_ATTRS, form.needs), (out,),
            _save_primitive_values, counter, (prim, form, packer, tensors, datas),
        )
        if type(packer) is not KeepAll:
            packer.recorded(prim, attrs, tensors, result)
    if view:
        _link_view(result, tensors[0], prim, attrs)
    if _watching:  # a checkpointed region's first run: what it reads from outside
        note_reads(prim, tensors, result, view)
    tracer = _state.tracer
    if tracer is not None:
        tracer.note(prim, tensors, attrs, result)
    return result


def _leaf_node(t: Any) -> Any:
    """Where a leaf's gradient goes (its edge's node), or None for a constant."""
    if not t._requires_grad:
        return None
    target = t._leaf_target
    return t if target is None else target


def _with_operands(items: tuple[Any, ...]) -> tuple[Any, ...]:
    """`items` with Python scalars and arrays made tensors like the first tensor among them
    (`x * 2` keeps x's float32)."""
    if len(items) == 2:  # `x * 1.01` and `1.01 * x` on numpy: one shared constant
        a, b = items
        if isinstance(a, TensorBase):
            if type(a._data) is np.ndarray:
                constant = _constant(b, a._data.dtype)
                if constant is not None:
                    return (a, constant)
        elif isinstance(b, TensorBase) and type(b._data) is np.ndarray:
            constant = _constant(a, b._data.dtype)
            if constant is not None:
                return (constant, b)
    ref = None
    for item in items:
        if isinstance(item, TensorBase):
            ref = item._data
            break
    if type(ref) is not np.ndarray:
        return tuple(t if isinstance(t, TensorBase) else as_tensor_like(t, items) for t in items)
    made = []
    for t in items:
        if not isinstance(t, TensorBase):
            constant = _constant(t, ref.dtype)
            t = as_tensor_like(t, items) if constant is None else constant
        made.append(t)
    return tuple(made)


class _Constants(threading.local):
    """Each thread's constants: a tensor keeps its latest saved buffer, so a constant shared
    by threads would share that buffer, which one thread's profile then never sees packed and
    sees die only when the other thread's tape lets it go."""

    def __init__(self) -> None:
        self.table: dict[tuple[type, Any, Any], Any] = {}


_constants = _Constants()


def _constant(value: Any, dtype: Any) -> Any:
    """A shared read-only tensor for the Python float or int `value` in numpy's `dtype`, or
    None where sharing is not exact (bools, zeros with their sign, nan, int dtypes).

    `y * 1.01` in a loop then makes no tensor, array or saved buffer per step: every entry
    saves the one constant (stored once, like any value saved twice). Read-only, so a rule
    that hands it on unchanged cannot let anyone modify it in place. One per thread (see
    `_Constants`).
    """
    kind = type(value)
    if kind is not float and kind is not int:
        return None
    key = (kind, value, dtype)
    constants = _constants.table
    constant = constants.get(key)  # only exact ones are ever stored
    if constant is None:
        if dtype.kind != "f" or not value or value != value:
            return None
        if len(constants) > 1024:  # a loop over many distinct scalars: keep the cache small
            constants.clear()
        array = np.asarray(value, dtype=dtype)
        array.flags.writeable = False
        constant = constants[key] = make_tensor(array)
        constant._inference = False  # shared: one made under inference_mode serves all code
    return constant


def _link_view(result: Any, parent: Any, prim: Primitive, attrs: dict[str, Any]) -> None:
    """Remember how `result` is made from the storage it shares (for `refresh_view`)."""
    base = parent._base
    if base is None:
        result._base = parent
        result._view = (((prim, attrs),), parent._entry)
    else:
        result._base = base
        result._view = (parent._view[0] + ((prim, attrs),), base._entry)  # type: ignore[index]


def refresh_view(view: Any) -> Any:
    """Re-derive `view`'s history from its base after the base was changed in place (PyTorch
    regenerates a view's grad_fn the same way): the view primitives are recorded again on
    the base's current history; the view keeps its storage. Returns `view`."""
    base = view._base
    chain = view._view[0]
    enabled = _state.grad_enabled
    _state.grad_enabled = True  # the history exists whatever the current mode
    try:
        current = base
        for prim, attrs in chain:
            current = record(prim, (current,), attrs)
    finally:
        _state.grad_enabled = enabled
    view._entry = current._entry
    view._index = current._index
    view._requires_grad = current._requires_grad
    view._view = (chain, base._entry)
    return view



_shapes_cache: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}


def _save_primitive_values(
    entry: Entry,
    results: list[Any],
    prim: Primitive,
    form: Form,
    packer: Strategy,
    tensors: tuple[Any, ...],
    datas: list[Any],
) -> tuple[SavedSlot, ...] | None:
    """The saved slots of a primitive's entry: what `form`'s rules read, for the arguments
    that need a gradient. A single value is kept in the entry itself (None returned)."""
    in_shapes = entry.in_shapes
    if prim.broadcasts:
        shapes = tuple([d.shape for d in datas])
        in_shapes = _shapes_cache.get(shapes) or _shared_shapes(shapes)
    entry._meta = shared_meta(entry.out_meta, in_shapes, form, prim)
    if prim.variadic:
        if not form.rules["xs"].needs:
            return ()
        return tuple(
            save_tensor(t, f"x{i}", packer, entry, _edge_at(t, i)) for i, t in enumerate(tensors)
        )
    if len(tensors) == 1:
        mask: tuple[bool, ...] = _ONE_INPUT  # recorded, so its one input requires grad
    else:
        mask = tuple([t._requires_grad for t in tensors])
    needed = needed_values(form, prim.args, mask)
    if len(needed) == 1:
        key = needed[0]
        position = key[1]
        tensor = results[0] if position < 0 else tensors[position]
        entry._saved = _buffer(tensor, key[0], packer, entry)
        counter = entry._counter = tensor._version
        entry._version = counter.value
        return None
    return tuple([
        save_tensor(results[0], name, packer, entry, 0)
        if position < 0
        else save_tensor(tensors[position], name, packer, entry,
                         _edge_at(tensors[position], position))
        for name, position in needed
    ])


_ONE_INPUT = (True,)


def _edge_at(tensor: Any, position: int) -> InputEdge | None:
    """A saved input's edge: the entry's input at `position`, None for a constant."""
    if tensor._entry is None and not tensor._requires_grad:
        return None
    return input_edge(position)


def _shared_shapes(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """`in_shapes` shared by every entry whose inputs have these shapes."""
    if len(_shapes_cache) > _MAX_ORIGINS:
        _shapes_cache.clear()
    return _shapes_cache.setdefault(shapes, tuple(tuple(s) for s in shapes))


def save_tensor(tensor: Any, name: str, packer: Strategy, entry: Entry, edge: Any) -> SavedSlot:
    """Keep `tensor`'s value for `entry`'s backward through `packer`. `edge` is the value's
    place in the graph: an int for one of the entry's own outputs (its output index), an
    `InputEdge` for one of its inputs (shared rather than a copy of the edge), or an edge."""
    return SavedSlot(name, _buffer(tensor, name, packer, entry), tensor._version, edge)


def _buffer(tensor: Any, name: str, packer: Strategy, entry: Entry) -> SavedBuffer:
    """The buffer keeping `tensor`'s value, saved as `name` by `entry`."""
    if tensor._inference:
        raise InplaceError(
            f"{entry.describe()} needs to save its {name!r} value, an inference tensor "
            f"({tensor.dtype}"
            f"{list(tensor.shape)}) for backward; tensors made under inference_mode() cannot be "
            "saved: compute it under no_grad() instead, or .clone() it outside inference_mode()"
        )
    if tensor._entry is None and type(packer) is not KeepAll:
        packer = packer.for_leaf()  # a parameter or input: the caller keeps it anyway
    return buffer_for(tensor, packer)


def graph_tensor(array: Any, edge: Any) -> Any:
    """A tensor holding an unpacked saved value, attached where the original sat in the graph
    (so a rule run under create_graph is itself differentiated)."""
    if edge is None:
        return make_tensor(array)
    node, index = edge
    if type(node) is Entry:
        return make_tensor(array, entry=node, index=index)
    t = make_tensor(array)
    t._requires_grad = True
    t._leaf_target = node
    return t


def slot_edge(entry: Entry, slot: SavedSlot) -> Any:
    """The graph edge of `slot`'s value (see `save_tensor`), or None."""
    edge = slot.edge
    if type(edge) is InputEdge:
        return entry.edges[edge.position]
    return (entry, edge) if isinstance(edge, int) else edge


def unpack_saved(entry: Entry, create_graph: bool) -> dict[str, Any]:
    """Every saved value of `entry`, as arrays (or graph-attached tensors under create_graph)."""
    slots = entry._saved
    if slots is None:
        raise freed_error(entry.describe())
    if type(slots) is _NDARRAY:  # one value kept as is in the entry
        if "unpack" not in events.wanted and not create_graph and (
            entry._counter.value == entry._version  # type: ignore[union-attr]
        ):
            return {entry.inline_key()[0]: slots}
        slots = entry.slots
    elif isinstance(slots, SavedBuffer):  # one value, kept in the entry
        if (
            slots.source is None and "unpack" not in events.wanted and not create_graph
            and entry._counter.value == entry._version  # type: ignore[union-attr]
        ):
            return {entry.inline_key()[0]: slots.packed}
        slots = entry.slots
    values = {}
    for slot in slots:
        buffer = slot.buffer
        counter = slot.counter
        if (
            buffer is not None and buffer.source is None and "unpack" not in events.wanted
            and (counter is None or counter.value == slot.version)
        ):
            array = buffer.packed  # kept as is and unchanged: nothing to check or announce
        else:
            array = slot.unpack(entry.describe)
        if create_graph:
            array = graph_tensor(array, slot_edge(entry, slot))
        values[slot.name] = array
    return values


def _sum_to(grad: Any, shape: tuple[int, ...]) -> Any:
    """Undo broadcasting in a gradient: arrays, or tensors under create_graph."""
    axes = broadcast_axes(shape, tuple(grad.shape))
    if isinstance(grad, TensorBase):
        return grad.sum(axis=axes, keepdims=True).reshape(shape)  # type: ignore[attr-defined]
    xp = namespace(grad)
    return xp.reshape(xp.sum(grad, axis=axes, keepdims=True), shape)


def next_sequence() -> int:
    """A number greater than every entry's recorded so far (entries made later are greater)."""
    return next(_sequence)
