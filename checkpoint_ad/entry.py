"""`Entry`: one operation recorded on the tape, stored compactly (a long tape is mostly
entries), with the hooks an entry may carry."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import events
from .forms import Form, needed_values
from .grad_mode import _state, origin_blocks
from .origins import _MAX_ORIGINS, NO_ORIGIN, _user_frame, origin_text
from .saved import KeptBuffer, SavedBuffer, SavedSlot, VersionCounter

_sequence = itertools.count()
_NDARRAY = np.ndarray  # an inline saved value kept as is (see `Entry`)


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


_metas: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def shared_meta(
    out_meta: tuple[tuple[tuple[int, ...], Any], ...],
    in_shapes: tuple[tuple[int, ...], ...],
    form: Form | None,
    op: Any = None,
) -> tuple[Any, ...]:
    """An entry's (out_meta, in_shapes, form, op), one tuple shared by every entry with the
    same: a long tape of same-shaped results holds no metadata of its own (see `Entry._meta`).
    Only ops whose class says `shares_meta` (primitives: few, long-lived) are shared; an op
    made for one entry (a custom function's) gets a tuple of its own, which the table would
    otherwise keep alive with everything the op holds."""
    key = (out_meta, in_shapes, form, op)
    if op is not None and not getattr(type(op), "shares_meta", False):
        return key
    meta = _metas.get(key)
    if meta is None:
        if len(_metas) > _MAX_ORIGINS:
            _metas.clear()
        meta = _metas[key] = key
    return meta


class EntryExtra:
    """What few entries carry: the recording line (when someone asked), retained non-leaf
    outputs and hooks. Kept apart so that an ordinary entry pays one field for all.
    An entry with attributes and none of these holds its attributes' dict in that field
    instead (see `Entry.attrs`); one that has both keeps them here. The rematerializing
    strategy's recipe for the result is a subclass (strategies/budget/dtr.py `_Value`), which
    takes this place on the entries it records: one object an entry rather than two (the
    cyclic collector scans each), and no weak-keyed table, so an entry needs no
    `__weakref__` field. Test for one with `isinstance`."""

    __slots__ = ("attrs", "hooks", "origin_frame", "retained")

    def __init__(self, attrs: dict[str, Any] = _NO_ATTRS) -> None:
        self.attrs = attrs
        self.origin_frame: tuple[Any, int] = NO_ORIGIN
        self.retained: dict[int, Any] | None = None
        self.hooks: EntryHooks | None = None


class Entry:
    """One operation recorded on the tape.

    A long tape is mostly entries, so one entry is one object: its inputs as nodes (`_in`,
    `_in2`, see `compact_edges`; read them as `edges`), its output shapes and dtypes, input
    shapes, form and op in one shared tuple (`_meta`, see `shared_meta`; read them as
    `out_meta`, `in_shapes`, `form`, `op`), a primitive's single saved value
    inline (`_saved` its buffer, or under `KeepAll` the numpy array itself: it is its own
    stored form; `inline_key` its name and argument, `_counter` and `_version` what catches
    an in-place change; read them as `slots`), and the rarely set fields in one
    `EntryExtra`, or in its place the attributes' dict (`_extra`: None when there are neither,
    the usual case; read them as `attrs`, `hooks`, ...). `_saved` otherwise holds the tuple of
    slots; None once released."""

    __slots__ = (  # no "__weakref__": 8 bytes an entry, and nothing refers to one weakly
        "_counter",
        "_extra",
        "_in",
        "_in2",
        "_meta",
        "_saved",
        "_version",
        "seq",
    )

    def __init__(self, op: Any, edges: Sequence[Any], attrs: dict[str, Any],
                 origin_frame: tuple[Any, int] | None = None) -> None:
        self.seq = next(_sequence)
        self._in, self._in2 = compact_edges(edges)
        self._saved: Any = ()
        self._counter: VersionCounter | None = None
        self._version = 0
        self._meta = shared_meta((), (), None, op)
        self._extra: Any = None
        self.attrs = attrs
        # the user's line, where someone will read it: the stack walk costs more than a small
        # op (a replayed step's entry knows its line already)
        if origin_frame is not None:
            self.origin_frame = origin_frame
        elif events.listeners or (origin_blocks and _state.origins):
            self.origin_frame = _user_frame()

    # ------------------------------------------------------------- metadata
    @property
    def out_meta(self) -> tuple[tuple[tuple[int, ...], Any], ...]:
        """Per output: (shape, dtype)."""
        return self._meta[0]

    @out_meta.setter
    def out_meta(self, out_meta: tuple[tuple[tuple[int, ...], Any], ...]) -> None:
        meta = self._meta
        self._meta = shared_meta(out_meta, meta[1], meta[2], meta[3])

    @property
    def in_shapes(self) -> tuple[tuple[int, ...], ...]:
        """A broadcasting primitive's input shapes (its rules' gradients are summed back to
        them); () for others."""
        return self._meta[1]

    @in_shapes.setter
    def in_shapes(self, in_shapes: tuple[tuple[int, ...], ...]) -> None:
        meta = self._meta
        self._meta = shared_meta(meta[0], in_shapes, meta[2], meta[3])

    @property
    def form(self) -> Form | None:
        """The backward form a primitive recorded (None for other ops)."""
        return self._meta[2]

    @form.setter
    def form(self, form: Form | None) -> None:
        meta = self._meta
        self._meta = shared_meta(meta[0], meta[1], form, meta[3])

    @property
    def op(self) -> Any:
        """What runs this entry's backward: a `Primitive`, a custom function's op, a loop."""
        return self._meta[3]

    @op.setter
    def op(self, op: Any) -> None:
        meta = self._meta
        self._meta = shared_meta(meta[0], meta[1], meta[2], op)

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
        if type(saved) is _NDARRAY or isinstance(saved, SavedBuffer):
            name, position = self.inline_key()
            buffer = saved if type(saved) is not _NDARRAY else KeptBuffer(saved)
            slot = SavedSlot(name, buffer, None, self._inline_edge(position))
            slot.counter, slot.version = self._counter, self._version
            return (slot,)
        return saved

    @slots.setter
    def slots(self, slots: tuple[SavedSlot, ...] | None) -> None:
        self._saved = slots
        self._counter = None

    def inline_key(self) -> tuple[str, int]:
        """(name, argument position or -1 for the output) of the value a primitive's entry
        keeps inline: the one value its form needs for the inputs that need a gradient."""
        mask = tuple([node is not None for node in self.nodes])
        return needed_values(self.form, self.op.args, mask)[0]  # type: ignore[arg-type]

    def _inline_edge(self, position: int) -> Any:
        """The `SavedSlot.edge` of the inline saved value: see `save_tensor`."""
        if position < 0:
            return 0
        return None if self.nodes[position] is None else input_edge(position)

    # ------------------------------------------------------------- rare fields
    @property
    def attrs(self) -> dict[str, Any]:
        """The op's attributes (keyword arguments), the empty `_NO_ATTRS` for most entries.
        Kept in `_extra` (see the class): most entries have none, and one that has some
        rarely has hooks or a line too, so the dict takes the place of an `EntryExtra`."""
        extra = self._extra
        if extra is None:
            return _NO_ATTRS
        return extra.attrs if isinstance(extra, EntryExtra) else extra

    @attrs.setter
    def attrs(self, attrs: dict[str, Any]) -> None:
        extra = self._extra
        if isinstance(extra, EntryExtra):
            extra.attrs = attrs
        else:
            self._extra = attrs or None

    def _extras(self) -> EntryExtra:
        """The entry's `EntryExtra`, made (holding its attributes) the first time it's asked."""
        extra = self._extra
        if not isinstance(extra, EntryExtra):
            extra = self._extra = EntryExtra(extra or _NO_ATTRS)
        return extra

    @property
    def origin_frame(self) -> tuple[Any, int]:
        """(code, line) of the user code that recorded this entry; `NO_ORIGIN` when no one
        asked."""
        extra = self._extra
        return extra.origin_frame if isinstance(extra, EntryExtra) else NO_ORIGIN

    @origin_frame.setter
    def origin_frame(self, frame: tuple[Any, int]) -> None:
        if frame[0] is not None or isinstance(self._extra, EntryExtra):
            self._extras().origin_frame = frame

    @property
    def retained(self) -> dict[int, Any] | None:
        """Output index -> weak reference to a non-leaf output that called retain_grad()."""
        extra = self._extra
        return extra.retained if isinstance(extra, EntryExtra) else None

    @retained.setter
    def retained(self, retained: dict[int, Any] | None) -> None:
        self._extras().retained = retained

    @property
    def hooks(self) -> EntryHooks | None:
        extra = self._extra
        return extra.hooks if isinstance(extra, EntryExtra) else None

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
        if type(saved) is _NDARRAY or isinstance(saved, SavedBuffer):
            self._saved = self._counter = None  # None: had saved values, now freed
            if "release" in events.wanted:
                events.emit("release", self)
            return
        if saved:
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
