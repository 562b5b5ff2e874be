"""Primitives, tape entries, and recording one operation on the tape.

A `Primitive` is a forward function on arrays plus one or more *forms* of its vector-Jacobian
product. A form lists, per argument, the rule and the names of the values the rule needs
(argument names, or ``"out"`` for the result). Declaring the needs is what lets the saving
strategy pick a form (store inputs vs store outputs), pack the needed values, or recompute them,
without touching a rule.

An `Entry` is one recorded application: its inputs' graph edges, its saved slots, its attributes
and the user code line that ran it. Entries are numbered in execution order, so the backward
sweep visits them by descending number: no recursive graph search is needed.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import events
from .backend import broadcast_axes, namespace
from .errors import DeviceError, InplaceError, ShapeError
from .grad_mode import _state, origin_blocks
from .saved import (
    KeepAll,
    SavedBuffer,
    SavedSlot,
    Strategy,
    VersionCounter,
    buffer_for,
    current_packer,
    freed_error,
)
from .tensor_base import TensorBase, as_tensor_like, make_tensor

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class VJP:
    """One argument's backward rule and the saved values (by name) it reads."""

    needs: tuple[str, ...]
    rule: Callable[..., Any]


def vjp(needs: str, rule: Callable[..., Any]) -> VJP:
    """Shorthand for the op tables: ``vjp("a b", lambda g, a, b: ...)``."""
    return VJP(tuple(needs.split()), rule)


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


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: forms live in the tables
class Form:
    """A complete backward for a primitive: one rule per differentiable argument."""

    rules: dict[str, VJP]

    @property
    def needs(self) -> frozenset[str]:
        return frozenset(n for r in self.rules.values() for n in r.needs)

    @property
    def kind(self) -> str:
        """'none', 'inputs', 'output' or 'both': what this form saves."""
        needs = self.needs
        if not needs:
            return "none"
        if "out" not in needs:
            return "inputs"
        return "output" if needs == {"out"} else "both"


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
        nodes = entry.nodes
        if g is None:
            return [None] * len(nodes)
        values = unpack_saved(entry, create_graph)
        form = entry.form
        attrs = entry.attrs
        if self.variadic:
            rule = form.rules["xs"]
            args = (tuple(values[f"x{i}"] for i in range(len(nodes))),) if rule.needs else ()
            return [
                rule.rule(g, i, *args, **attrs) if node is not None else None
                for i, node in enumerate(nodes)
            ]
        results = []
        rules = form.rules
        broadcasts = self.broadcasts
        for i, (name, node) in enumerate(zip(self.args, nodes)):
            rule = rules.get(name) if node is not None else None
            if rule is None:
                results.append(None)
                continue
            needs = rule.needs
            if not needs:
                grad = rule.rule(g, **attrs)
            elif len(needs) == 1:
                grad = rule.rule(g, values[needs[0]], **attrs)
            else:
                grad = rule.rule(g, *[values[n] for n in needs], **attrs)
            if broadcasts and tuple(grad.shape) != entry.in_shapes[i]:
                grad = _sum_to(grad, entry.in_shapes[i])
            results.append(grad)
        return results


_sequence = itertools.count()


class _NothingFreed(tuple):
    """The saved slots of a released entry that had none: empty like `()`, yet its own object,
    so that `Entry.released` needs no field of its own on every entry."""

    __slots__ = ()


NOTHING_FREED = _NothingFreed()
_NO_ATTRS: dict[str, Any] = {}  # shared by every entry without attributes (never mutated)


class _Nodes(tuple):
    """The inputs of an entry whose every edge is (node, 0) or None, as nodes alone: the edge
    tuples are made only when someone reads `Entry.edges`, so a primitive's entry holds none."""

    __slots__ = ()


class InputEdge:
    """A saved input's place in the graph: its entry's input edge at `position`. One shared
    object per position, so a saved slot holds no edge of its own (see `input_edge`)."""

    __slots__ = ("position",)

    def __init__(self, position: int) -> None:
        self.position = position

    def __repr__(self) -> str:
        return f"InputEdge({self.position})"


_INPUT_EDGES = [InputEdge(p) for p in range(8)]


def input_edge(position: int) -> InputEdge:
    """The shared `InputEdge` for argument `position`."""
    while position >= len(_INPUT_EDGES):
        _INPUT_EDGES.append(InputEdge(len(_INPUT_EDGES)))
    return _INPUT_EDGES[position]


class _Arity:
    """What an entry's second input field holds when it is not a second input's node."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


_ONE_INPUT_ONLY = _Arity("one input")
_ZEROS = ((), (0,), (0, 0))
_SEE_FIRST = _Arity("inputs in the first field")


def compact_edges(edges: Sequence[Any]) -> tuple[Any, Any]:
    """How an entry stores its input edges, as its (`_in`, `_in2`) fields: the nodes of one
    or two inputs whose edges are (node, 0) or None, one of them `_ONE_INPUT_ONLY`; else
    `_SEE_FIRST` and, in the first, `_Nodes` when every index is 0 or the edges themselves."""
    count = len(edges)
    if all(edge is None or edge[1] == 0 for edge in edges):
        nodes = [None if edge is None else edge[0] for edge in edges]
        if count == 1:
            return nodes[0], _ONE_INPUT_ONLY
        if count == 2:
            return nodes[0], nodes[1]
        if count:
            return _Nodes(nodes), _SEE_FIRST
    return tuple(edges), _SEE_FIRST


class EntryExtra:
    """What few entries carry: the recording line (when someone asked), retained non-leaf
    outputs and hooks. Kept apart so that an ordinary entry pays one field for all three."""

    __slots__ = ("hooks", "origin_frame", "retained")

    def __init__(self) -> None:
        self.origin_frame: tuple[Any, int] = NO_ORIGIN
        self.retained: dict[int, Any] | None = None
        self.hooks: EntryHooks | None = None


class Entry:
    """One operation recorded on the tape.

    A long tape is mostly entries, so one entry is one object: its inputs as nodes (`_in`,
    `_in2`, see `compact_edges`; read them as `edges`), a primitive's single saved value
    inline (`_saved` its buffer, `_key` its (name, argument position or -1), `_counter` and
    `_version` what catches an in-place change; read them as `slots`), and the rarely set
    fields in one `EntryExtra`. `_saved` otherwise holds the tuple of slots; None once
    released."""

    __slots__ = (
        "__weakref__",  # the rematerializing strategy (dtr.py) keys what it knows by entry
        "_counter",
        "_extra",
        "_in",
        "_in2",
        "_key",
        "_saved",
        "_version",
        "attrs",
        "form",
        "in_shapes",
        "op",
        "out_meta",
        "seq",
    )

    def __init__(self, op: Any, edges: Sequence[Any], attrs: dict[str, Any],
                 origin_frame: tuple[Any, int] | None = None) -> None:
        self.op = op
        self.seq = next(_sequence)
        self._in, self._in2 = compact_edges(edges)
        self.attrs = attrs
        self._saved: Any = ()
        self._key: tuple[str, int] | None = None
        self._counter: VersionCounter | None = None
        self._version = 0
        self.form: Form | None = None
        self.in_shapes: tuple[tuple[int, ...], ...] = ()
        self.out_meta: tuple[tuple[tuple[int, ...], Any], ...] = ()
        self._extra: EntryExtra | None = None
        # the user's line, where someone will read it: the stack walk costs more than a small
        # op (a replayed step's entry knows its line already)
        if origin_frame is not None:
            self.origin_frame = origin_frame
        elif events.listeners or (origin_blocks and _state.origins):
            self.origin_frame = _user_frame()

    # ------------------------------------------------------------- inputs
    @property
    def edges(self) -> tuple[Any, ...]:
        """Per input: (entry, output index), (leaf tensor, 0), or None (no gradient)."""
        first, second = self._in, self._in2
        if second is _ONE_INPUT_ONLY:
            return (None if first is None else (first, 0),)
        if second is _SEE_FIRST:
            if type(first) is tuple:
                return first
            return tuple([None if node is None else (node, 0) for node in first])
        return (None if first is None else (first, 0), None if second is None else (second, 0))

    @edges.setter
    def edges(self, edges: Sequence[Any]) -> None:
        self._in, self._in2 = compact_edges(edges)

    @property
    def nodes(self) -> tuple[Any, ...]:
        """Per input: the node its edge leads to (an entry or a leaf), or None; for the
        sweep, which needs the output index only where it is not 0 (see `edges`)."""
        first, second = self._in, self._in2
        if second is _ONE_INPUT_ONLY:
            return (first,)
        if second is _SEE_FIRST:
            if type(first) is _Nodes:
                return first
            return tuple([None if edge is None else edge[0] for edge in first])
        return (first, second)

    @property
    def indices(self) -> tuple[int, ...]:
        """Per input: the output index of its node that the edge leads to (0 for a leaf or
        where there is no edge); with `nodes`, the edges without their tuples."""
        second = self._in2
        if second is _ONE_INPUT_ONLY:
            return _ZEROS[1]
        if second is not _SEE_FIRST:
            return _ZEROS[2]
        first = self._in
        if type(first) is _Nodes:
            return (0,) * len(first)
        return tuple([0 if edge is None else edge[1] for edge in first])

    # ------------------------------------------------------------- saved values
    @property
    def slots(self) -> tuple[SavedSlot, ...]:
        """The saved slots; None once released (`NOTHING_FREED` if there were none). A
        value kept inline is handed out as a new `SavedSlot` over the same buffer."""
        saved = self._saved
        if isinstance(saved, SavedBuffer):
            name, position = self._key  # type: ignore[misc]
            slot = SavedSlot(name, saved, None, self._inline_edge(position))
            slot.counter, slot.version = self._counter, self._version
            return (slot,)
        return saved

    @slots.setter
    def slots(self, slots: tuple[SavedSlot, ...] | None) -> None:
        self._saved = slots
        self._key = self._counter = None

    def _inline_edge(self, position: int) -> Any:
        """The `SavedSlot.edge` of the inline saved value: see `save_tensor`."""
        if position < 0:
            return 0
        return None if self.nodes[position] is None else input_edge(position)

    # ------------------------------------------------------------- rare fields
    def _extras(self) -> EntryExtra:
        extra = self._extra
        if extra is None:
            extra = self._extra = EntryExtra()
        return extra

    @property
    def origin_frame(self) -> tuple[Any, int]:
        """(code, line) of the user code that recorded this entry; `NO_ORIGIN` when no one
        asked."""
        extra = self._extra
        return NO_ORIGIN if extra is None else extra.origin_frame

    @origin_frame.setter
    def origin_frame(self, frame: tuple[Any, int]) -> None:
        if frame[0] is not None or self._extra is not None:
            self._extras().origin_frame = frame

    @property
    def retained(self) -> dict[int, Any] | None:
        """Output index -> weak reference to a non-leaf output that called retain_grad()."""
        extra = self._extra
        return None if extra is None else extra.retained

    @retained.setter
    def retained(self, retained: dict[int, Any] | None) -> None:
        self._extras().retained = retained

    @property
    def hooks(self) -> EntryHooks | None:
        extra = self._extra
        return None if extra is None else extra.hooks

    @hooks.setter
    def hooks(self, hooks: EntryHooks | None) -> None:
        self._extras().hooks = hooks

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def origin(self) -> str:
        """'file:line' of the user code that recorded this entry, or '<unknown>' where no one
        asked for it (see `record_origins`)."""
        return origin_text(self.origin_frame)

    def describe(self) -> str:
        if self.origin_frame[0] is None:
            return f"tape entry #{self.seq} {self.name!r} (record under cad.record_origins() " \
                "to see its line)"
        return f"tape entry #{self.seq} {self.name!r} (recorded at {self.origin})"

    def saved_nbytes(self) -> int:
        """Stored bytes of this entry's saved values (shared buffers counted in full)."""
        return sum(s.buffer.stored_nbytes for s in self.slots or () if s.buffer is not None)

    @property
    def released(self) -> bool:
        """Whether a backward sweep has released this entry (freed its saved values)."""
        saved = self._saved
        return saved is None or saved is NOTHING_FREED

    def release(self) -> None:
        """Drop the saved values; the entry stays so a second sweep can say it was freed."""
        saved = self._saved
        if isinstance(saved, SavedBuffer):
            self._saved = self._counter = None  # None: had saved values, now freed
        elif saved:
            for slot in saved:
                slot.release()
            self._saved = None
        elif saved is not None:
            self._saved = NOTHING_FREED  # nothing to free: a second sweep may run it again
        if "release" in events.wanted:
            events.emit("release", self)

    def register_hook(self, fn: Callable[[tuple[Any, ...], tuple[Any, ...]], Any]) -> Any:
        """Call ``fn(grad_inputs, grad_outputs)`` after this entry's backward runs.

        Both are tuples of Tensors (None where there is no gradient); `fn` may return a
        replacement for `grad_inputs`. Like PyTorch's ``grad_fn.register_hook``.

        >>> import checkpoint_ad as cad
        >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
        >>> y = x * 3
        >>> handle = y.grad_fn.register_hook(lambda gi, go: (gi[0] * 0, gi[1]))
        >>> y.sum().backward()
        >>> x.grad.tolist()
        [0.0, 0.0]
        >>> handle.remove()
        """
        return add_hook(self._hooks().post, fn)

    def _hooks(self) -> EntryHooks:
        if self.hooks is None:
            self.hooks = EntryHooks()
        return self.hooks

    def __repr__(self) -> str:
        shapes = ", ".join(str(list(s)) for s, _ in self.out_meta)
        return f"<Entry #{self.seq} {self.name} -> {shapes} at {self.origin}>"


class EntryHooks:
    """Hooks of one entry: on the gradient of each output (tensor hooks of non-leaf tensors,
    by output index) and after its backward (`Entry.register_hook`)."""

    __slots__ = ("outputs", "post")

    def __init__(self) -> None:
        self.outputs: dict[int, dict[int, Callable[[Any], Any]]] = {}
        self.post: dict[int, Callable[..., Any]] = {}


class RemovableHandle:
    """What `register_hook` returns: `remove()` unregisters the hook (a second call is a
    no-op)."""

    __slots__ = ("_key", "_table")

    def __init__(self, table: dict[int, Any], key: int) -> None:
        self._table = table
        self._key = key

    def remove(self) -> None:
        self._table.pop(self._key, None)

    def __repr__(self) -> str:
        state = "active" if self._key in self._table else "removed"
        return f"<RemovableHandle #{self._key} {state}>"


_hook_ids = itertools.count()


def add_hook(table: dict[int, Any], fn: Callable[..., Any]) -> RemovableHandle:
    """Put `fn` last in `table` (hooks run in registration order) and return its handle."""
    if not callable(fn):
        raise TypeError(f"register_hook takes a callable, got {type(fn).__name__}")
    key = next(_hook_ids)
    table[key] = fn
    return RemovableHandle(table, key)


# id(code) -> defined inside this package? Keyed by id because hashing a code object hashes
# its bytecode and constants, per frame of every recorded op; `_codes_seen` keeps each code
# object alive so that its id stays its own while listed.
_code_kinds: dict[int, bool] = {}
_codes_seen: list[Any] = []
# (id(code), line) -> (code, line): one shared pair per user code line
_origins: dict[tuple[int, int], tuple[Any, int]] = {}
_MAX_ORIGINS = 100_000
NO_ORIGIN: tuple[Any, int] = (None, 0)  # the origin of an entry recorded where no one asked


def _is_internal(code: Any) -> bool:
    internal = _code_kinds.get(id(code))
    if internal is None:
        if len(_codes_seen) > _MAX_ORIGINS:  # code made on the fly (exec) would pile up
            _code_kinds.clear()
            _codes_seen.clear()
        _codes_seen.append(code)
        internal = _code_kinds[id(code)] = code.co_filename.startswith(_PACKAGE_DIR)
    return internal


def origin_text(frame: tuple[Any, int]) -> str:
    """'file:line' of an entry's `origin_frame` (code object, line number)."""
    code, line = frame
    return f"{code.co_filename}:{line}" if code is not None else "<unknown>"


def _user_frame() -> tuple[Any, int]:
    """(code, line) of the nearest caller outside this package; formatted only when asked.

    Every entry asks, so the walk looks each frame's code up by id, and the pair is shared by
    every entry recorded on the same line (a loop's entries hold no pair of their own)."""
    frame = sys._getframe(3)  # past Entry.__init__ and add_entry: entries come from there
    kinds = _code_kinds
    while frame is not None:
        code = frame.f_code
        internal = kinds.get(id(code))
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            line = frame.f_lineno
            pair = _origins.get((id(code), line))
            if pair is None:
                if len(_origins) > _MAX_ORIGINS:
                    _origins.clear()
                pair = _origins[(id(code), line)] = (code, line)
            return pair
        frame = frame.f_back
    return NO_ORIGIN


class _Tapes(threading.local):
    """The explicit tapes (`GradientTape`) recording in this thread."""

    def __init__(self) -> None:
        self.items: list[Any] = []


_tapes = _Tapes()


def active_tapes() -> list[Any]:
    """The `GradientTape`s recording in the calling thread (innermost last)."""
    return _tapes.items


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
    """Append one entry to the tape and return its output tensors: the only way entries are
    made, by primitives, custom functions and loops alike.

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
        entry.out_meta = tuple(
            ((), None) if a is None else (tuple(a.shape), a.dtype) for a in outputs
        )
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


def _primitive_entry(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any]) -> Entry:
    """A primitive's entry, its inputs' nodes taken from the tensors as `compact_edges`
    stores them: the recording hot path, which makes no edge tuples."""
    entry = object.__new__(Entry)
    entry.op = prim
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
    entry.attrs = attrs
    entry._saved = ()
    entry._key = entry._counter = None
    entry._version = 0
    entry.in_shapes = ()
    entry._extra = None
    if events.listeners or (origin_blocks and _state.origins):
        entry.origin_frame = _user_frame()
    return entry


def record(prim: Primitive, tensors: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
    """Run `prim` on tensors and, when gradients are needed, append an entry to the tape.

    This runs once per operation of every user's loop, so it reads each attribute once and
    leaves the generic helpers (views, strategies, explicit tapes, listeners) to the cases
    that need them.
    """
    for t in tensors:
        if not isinstance(t, TensorBase):
            tensors = _with_operands(tensors)
            break
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
        raise ShapeError(
            f"{prim.name!r} cannot run on inputs {_describe_inputs(tensors)} "
            f"with {attrs or 'no attributes'}: {exc}"
        ) from exc
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
            packer = packer.for_primitive(prim)
            form = prim.forms[0] if type(packer) is KeepAll else packer.choose_form(prim)
        (result,) = _append(
            _primitive_entry(prim, tensors, attrs or _NO_ATTRS), (out,),
            _save_primitive_values, counter, (prim, form, packer, tensors, datas),
        )
        if type(packer) is not KeepAll:
            packer.recorded(prim, attrs, tensors, result)
    if view:
        _link_view(result, tensors[0], prim, attrs)
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


_constants: dict[tuple[type, Any, Any], Any] = {}


def _constant(value: Any, dtype: Any) -> Any:
    """A shared read-only tensor for the Python float or int `value` in numpy's `dtype`, or
    None where sharing is not exact (bools, zeros with their sign, nan, int dtypes).

    `y * 1.01` in a loop then makes no tensor, array or saved buffer per step: every entry
    saves the one constant (stored once, like any value saved twice). Read-only, so a rule
    that hands it on unchanged cannot let anyone modify it in place.
    """
    kind = type(value)
    if (kind is not float and kind is not int) or dtype.kind != "f" or not value or (
        value != value
    ):
        return None
    key = (kind, value, dtype)
    constant = _constants.get(key)
    if constant is None:
        if len(_constants) > 1024:  # a loop over many distinct scalars: keep the cache small
            _constants.clear()
        array = np.asarray(value, dtype=dtype)
        array.flags.writeable = False
        constant = _constants[key] = make_tensor(array)
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



_needs_cache: dict[tuple[Form, tuple[bool, ...]], tuple[tuple[str, int], ...]] = {}
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
    entry.form = form
    if prim.broadcasts:
        shapes = tuple([d.shape for d in datas])
        entry.in_shapes = _shapes_cache.get(shapes) or _shared_shapes(shapes)
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
    needed = _needs_cache.get((form, mask))
    if needed is None:
        needed = _needs_cache[(form, mask)] = _needed_values(prim, form, mask)
    if len(needed) == 1:
        key = needed[0]
        position = key[1]
        tensor = results[0] if position < 0 else tensors[position]
        entry._saved = _buffer(tensor, key[0], packer, entry)
        entry._key = key
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


def _needed_values(
    prim: Primitive, form: Form, mask: tuple[bool, ...]
) -> tuple[tuple[str, int], ...]:
    """(name, argument position or -1 for the output) of every value `form` needs when the
    arguments flagged in `mask` require grad; sorted, so slots come in a stable order."""
    names: set[str] = set()
    for name, requires_grad in zip(prim.args, mask):
        rule = form.rules.get(name)
        if requires_grad and rule is not None:
            names.update(rule.needs)
    return tuple((n, -1 if n == "out" else prim.args.index(n)) for n in sorted(names))


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
    if isinstance(slots, SavedBuffer):  # one value, kept in the entry
        if (
            slots.source is None and "unpack" not in events.wanted and not create_graph
            and entry._counter.value == entry._version  # type: ignore[union-attr]
        ):
            return {entry._key[0]: slots.packed}  # type: ignore[index]
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
