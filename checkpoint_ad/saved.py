"""The saving path: every value a backward rule needs is kept through here, and only here.

A *packer* decides the stored form of a saved array (`pack`/`unpack`, the same contract as
PyTorch's saved-tensor hooks: `unpack(pack(a))` equals `a` in value, shape, dtype and device,
up to the packer's stated precision). Saving the same array twice with the same packer gives one
`SavedBuffer` shared by both slots, so a buffer used by two tape entries is stored once.
A `SavedSlot` is one entry's handle on a buffer plus the version of the tensor it came from,
so a later in-place change is caught instead of silently corrupting gradients.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import events
from .backend import is_array
from .backend import nbytes as array_nbytes
from .errors import BackwardError, SavedValueModifiedError


class Strategy:
    """How saved values are kept: the engine's side of every storage strategy.

    The contract (the same as PyTorch's saved-tensor hooks): ``unpack(pack(a))`` equals `a` in
    shape, dtype and device, and in value when `lossless` is True; `stored_nbytes` reports
    what the stored form really holds. `choose_form` picks which backward form (what a rule
    reads: inputs, output, both) a primitive records; `for_primitive` lets a per-op policy
    hand each primitive to another strategy (`for_call`, when `per_call` is True, one call of
    it, by its input shapes and attributes); `for_leaf` says how values the caller holds
    anyway (parameters, input data) are kept. Subclass it and override what differs; the
    built-ins in `checkpoint_ad.strategies` are small frozen dataclasses over it.
    """

    lossless: ClassVar[bool] = True
    # True: the engine asks `for_call` (which sees shapes) instead of `for_primitive` for each
    # call; False (nearly every strategy) keeps the recording path free of building shapes
    per_call: bool = False
    # False: every saved slot gets a buffer of its own, even for a tensor saved before
    # (a region's packers: how many values a region saves must not depend on which of its
    # tensors are the same object, which its re-run cannot reproduce)
    shares_buffers: bool = True

    def pack(self, array: Any) -> Any:
        return array

    def unpack(self, stored: Any) -> Any:
        return stored

    def stored_nbytes(self, stored: Any) -> int | None:
        """Bytes the stored form holds; None counts it as the value's own size."""
        return array_nbytes(stored) if is_array(stored) else None

    def choose_form(self, prim: Any) -> Any:
        """The backward form (a `tape.Form`) that primitive `prim` records."""
        return prim.forms[0]

    def for_primitive(self, prim: Any) -> Strategy:
        return self

    def for_call(self, prim: Any, shapes: tuple[tuple[int, ...], ...],
                 attrs: dict[str, Any]) -> Strategy:
        """`for_primitive` for one call of `prim` on inputs of `shapes` with `attrs` (asked
        only when `per_call` is True). The answer may depend on nothing else: a traced scan
        step replays it for every step with those shapes and attributes."""
        return self.for_primitive(prim)

    def for_leaf(self) -> Strategy:
        return self

    def recorded(self, prim: Any, attrs: dict[str, Any], inputs: tuple[Any, ...],
                 result: Any) -> None:
        """Called after primitive `prim` was recorded under this strategy (its values already
        packed): a strategy that recomputes values itself learns here how `result` was made.
        Nothing by default; never called under `KeepAll`."""

    def for_plan(self) -> Strategy:
        """How a checkpointing plan's snapshots are stored: their reads come in the order the
        plan announces through `prefetch`, not in reverse pack order."""
        return self

    # Storage levels (see strategies/offload.py): where a stored form's bytes live, and a hint
    # that lets a slow level read ahead of the backward sweep.
    reads_ahead: ClassVar[bool] = False  # True: prefetch hints help (a disk level)
    # True: `pack` only looks at the array, and the array itself is the stored form (a
    # region's re-run collecting its values): kept by reference, as `stores_as_is` keeps
    # them, so a parameter or an input it saves again is still known for the caller's memory;
    # `buffer_for` tells it `replacing(tensor, ref)` before a tensor's `_saved_ref` changes
    watches_only: ClassVar[bool] = False
    # True: `buffer_for` tells it `saved_tensor(tensor, stored)` after it packs a tensor's
    # array (the eviction pool: it finds the recorded result that array is from the tensor's
    # entry, rather than from a table of every result's array)
    sees_tensors: ClassVar[bool] = False

    def saved_tensor(self, tensor: Any, stored: Any) -> None:
        """`stored`, what `pack` just returned, keeps `tensor`'s array (asked only when
        `sees_tensors` is True)."""

    def stored_level(self, stored: Any) -> str:
        """Where the stored form's bytes live: 'device' (the memory the value was computed
        in), 'host' (host memory, for a device array moved off the GPU) or 'disk'."""
        return "device"

    def prefetch(self, stored: list[Any]) -> None:
        """A hint: these stored forms are unpacked next, in this order (each read once per
        listing). Nothing to do for values kept in memory."""


Packer = Strategy  # the name saved_values_hooks and use_packer have always documented


@dataclass(frozen=True)
class KeepAll(Strategy):
    """Save what each rule needs, as is: the default, and the reference every other strategy
    is compared to. The engine takes a fast path for it (no packing at all)."""


class HookPacker(Strategy):
    """A strategy made from two plain functions (see `saved_values_hooks`)."""

    def __init__(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> None:
        self.pack = pack  # type: ignore[method-assign]
        self.unpack = unpack  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"HookPacker(pack={self.pack!r}, unpack={self.unpack!r})"


KEEP = KeepAll()


class VersionCounter:
    """Counts in-place changes to one storage; views of it share the counter."""

    __slots__ = ("value",)
    scanned_row = False  # the counter of a step's row of a scan's xs (`loop.RowCounter`)

    def __init__(self, value: int = 0) -> None:
        self.value = value


_NUMPY = np.ndarray
_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple per distinct shape, shared by every buffer of that shape: a tape of many
    small saved values then holds no shape tuple of its own."""
    if len(_shapes) > 100_000:
        _shapes.clear()
    return _shapes.setdefault(shape, shape)


class SavedBuffer:
    """One stored array, shared by every slot that saved the same array with the same packer.

    `pack_value` makes either kind: a `KeptBuffer` (the array as is) or a `PackedBuffer` (a
    packer's stored form). Both answer the same questions: `packed`, `packer`, `shape`,
    `dtype`, `logical_nbytes`, `stored_nbytes`, `source` (a weak reference to the original
    array, None when `packed` is that array), `holds(array)` and `unpack()`.
    """

    __slots__ = ("__weakref__", "packed")

    packed: Any
    packer: Any
    shape: tuple[int, ...]
    dtype: Any
    logical_nbytes: int
    stored_nbytes: int
    source: Any

    def holds(self, array: Any) -> bool:
        raise NotImplementedError

    def unpack(self) -> Any:
        raise NotImplementedError

    @property
    def stored_id(self) -> int:
        """Equal for two buffers exactly when they hold the same stored bytes (a value saved
        twice is stored once)."""
        return id(self)


class KeptBuffer(SavedBuffer):
    """An array kept as is (`KeepAll`): everything else about it is the array's own, so the
    buffer holds nothing but the array (a long tape of small values pays for no copies of
    their shapes and sizes)."""

    __slots__ = ()
    source = None
    packer = KEEP

    def __init__(self, array: Any) -> None:
        self.packed = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape)

    @property
    def dtype(self) -> Any:
        return self.packed.dtype

    @property
    def logical_nbytes(self) -> int:
        return array_nbytes(self.packed)

    stored_nbytes = logical_nbytes

    def holds(self, array: Any) -> bool:
        return self.packed is array

    def unpack(self) -> Any:
        return self.packed

    @property
    def stored_id(self) -> int:
        return id(self.packed)  # the array is the stored form, whichever buffer shows it


class KeptByStrategy(KeptBuffer):
    """An array kept as is by a strategy other than `KeepAll` whose storing is the identity
    (`StoreInputs`, `StoreOutputs`: they choose which values to save, not how): stored by
    reference like a `KeptBuffer`, so a saved parameter or input row is still known for the
    caller's memory, with the strategy that chose it as its packer."""

    __slots__ = ("packer",)

    def __init__(self, array: Any, packer: Any) -> None:
        self.packed = array
        self.packer = packer


_IDENTITY_HOOKS = ("pack", "unpack", "stored_nbytes", "stored_level", "prefetch")
_stores_as_is: dict[type, bool] = {}


def stores_as_is(packer: Any) -> bool:
    """Whether `packer` stores every array as it is: neither its class nor the instance
    (a `HookPacker`'s functions) overrides any of `Strategy`'s storing hooks, so the stored
    form is the array itself, on the device."""
    kind = type(packer)
    known = _stores_as_is.get(kind)
    if known is None:
        known = _stores_as_is[kind] = isinstance(packer, Strategy) and all(
            getattr(kind, hook) is getattr(Strategy, hook) for hook in _IDENTITY_HOOKS)
    if known:
        own = getattr(packer, "__dict__", None)
        if own and any(hook in own for hook in _IDENTITY_HOOKS):
            return False
    return known


class PackedBuffer(SavedBuffer):
    """A packer's stored form of an array, with the array's shape, dtype and sizes (the
    stored form may have none of them) and a weak reference to the array it came from."""

    __slots__ = ("dtype", "logical_nbytes", "packer", "shape", "source", "stored_nbytes")

    def __init__(self, array: Any, packer: Any) -> None:
        self.packer = packer
        if type(array) is _NUMPY:
            shape = array.shape
            self.logical_nbytes = array.nbytes
        else:
            shape = tuple(array.shape)
            self.logical_nbytes = array_nbytes(array)
        shared = _shapes.get(shape)
        self.shape = shared if shared is not None else _shared_shape(shape)
        self.dtype = array.dtype
        self.packed = packer.pack(array)
        self.source = weakref.ref(array)
        measured = packer.stored_nbytes(self.packed)
        self.stored_nbytes = self.logical_nbytes if measured is None else int(measured)

    def holds(self, array: Any) -> bool:
        return self.source() is array

    def unpack(self) -> Any:
        array = self.packer.unpack(self.packed)
        if tuple(array.shape) != self.shape or array.dtype != self.dtype:
            raise BackwardError(
                f"packer {self.packer!r} broke its contract: unpack gave "
                f"{array.dtype}{list(array.shape)} for a value saved as "
                f"{self.dtype}{list(self.shape)}; unpack(pack(a)) must keep shape and dtype"
            )
        return array


def buffer_for(tensor: Any, packer: Any, made: list[Any] | None = None) -> SavedBuffer:
    """The buffer holding `tensor`'s array under `packer`, packing it on first use
    (`pack_value`, `made` passed on).

    The tensor keeps a weak reference to its latest buffer, so a value saved by several entries
    (a matmul input that is also a tanh output) is packed and stored once, and the buffer dies
    with the last entry that needs it; a packer whose `shares_buffers` is False (a region's)
    packs it again for each.
    """
    array = tensor._data
    if type(packer) is KeepAll:
        packer = KEEP  # every KeepAll keeps the array as is: one buffer serves them all
    ref = tensor._saved_ref
    if ref is not None:
        buffer = ref()
        if (buffer is not None and buffer.packer is packer and buffer.holds(array)
                and packer.shares_buffers):
            return buffer
    buffer = pack_value(array, packer, made)
    if packer.sees_tensors and type(buffer) is PackedBuffer:
        packer.saved_tensor(tensor, buffer.packed)
    if packer.watches_only:  # a region's re-run: it puts back what it replaces here
        packer.replacing(tensor, ref)
    tensor._saved_ref = weakref.ref(buffer)
    return buffer


def pack_value(array: Any, packer: Strategy, made: list[Any] | None = None) -> SavedBuffer:
    """Store `array` under `packer`: the one place a saved buffer is made (and announced).

    With `made`, the buffer is appended to it instead of announced: a replayed step heard by a
    profiler alone hands its new buffers over in bulk, in its 'replayed' event (a 'pack' event
    per value, and a 'free' watch nobody else asked for, would cost more than the step)."""
    if type(packer) is KeepAll:
        buffer: SavedBuffer = KeptBuffer(array)
    elif stores_as_is(packer):
        buffer = KeptByStrategy(array, packer)
    elif packer.watches_only:
        packer.pack(array)
        buffer = KeptByStrategy(array, packer)
    else:
        buffer = PackedBuffer(array, packer)
    if made is not None:
        made.append(buffer)
    elif events.listeners:
        events.emit("pack", buffer)
        if "free" in events.wanted and events.hears("free"):
            _watch(buffer)
    return buffer


# id(weak reference) -> (the reference, its buffer's maker thread, id(buffer)): keeps each
# reference alive until its buffer dies (a plain weakref with a callback costs half a finalize)
_watched: dict[int, tuple[weakref.ref, int, int]] = {}


def _watch(buffer: SavedBuffer) -> None:
    """Announce 'free' (to the maker thread's listeners) when `buffer` dies."""
    ref = weakref.ref(buffer, _announce_free)
    _watched[id(ref)] = (ref, threading.get_ident(), id(buffer))


def _announce_free(ref: weakref.ref) -> None:
    watched = _watched.pop(id(ref), None)
    if watched is not None:
        events.emit_to(watched[1], "free", watched[2])


def live_buffer_count() -> int:
    """How many saved buffers exist right now (slow: walks the heap; for tests and debugging)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, SavedBuffer))


def freed_error(what: str) -> BackwardError:
    """The error for reading saved values that an earlier backward already released."""
    return BackwardError(
        f"trying to backward through {what} a second time, but its saved values were already "
        "freed by the first backward; pass retain_graph=True to the first backward()/grad() "
        "call (or use a persistent GradientTape) to differentiate again"
    )


class SavedSlot:
    """One tape entry's reference to a saved value.

    `edge` is the value's place in the graph (for higher-order gradients): the entry's output
    index, a `tape.InputEdge` naming one of its inputs, an edge, or None; `counter`/`version`
    detect an in-place change after saving. A primitive's entry keeps a single saved value
    inline and hands it out as a new slot (`Entry.slots`).
    """

    __slots__ = ("buffer", "counter", "edge", "name", "version")

    def __init__(
        self, name: str, buffer: SavedBuffer, counter: VersionCounter | None, edge: Any
    ) -> None:
        self.name = name
        self.buffer: SavedBuffer | None = buffer
        self.counter = counter
        self.version = counter.value if counter is not None else 0
        self.edge = edge

    def unpack(self, describe: Callable[[], str]) -> Any:
        buffer = self.buffer
        if buffer is None:
            raise freed_error(describe())
        if self.counter is not None and self.counter.value != self.version:
            raise SavedValueModifiedError(
                f"{describe()} saved its {self.name!r} value ({buffer.dtype}"
                f"{list(buffer.shape)}) at version {self.version}, but it was modified in place "
                f"since (now version {self.counter.value}), and the backward sweep needs the "
                "original; use an out-of-place operation (y = x + 1 rather than x += 1) or "
                "modify a copy"
            )
        if "unpack" in events.wanted:
            events.emit("unpack", buffer)
        return buffer.unpack()

    def release(self) -> None:
        self.buffer = None


class _PackerStack(threading.local):
    def __init__(self) -> None:
        self.items: list[Any] = []


_stack = _PackerStack()


# one item per use_packer block open in any thread: empty means every thread keeps all
_pushed: list[Any] = []


def current_packer() -> Strategy:
    """The packer that new saved values go through right now."""
    if not _pushed:  # the common case, answered without the thread-local lookup
        return KEEP
    items = _stack.items
    return items[-1] if items else KEEP


# the checkpointed regions whose first run is running, per thread (innermost last), and one
# item per such region in any thread: empty means no operation needs telling them
_regions = _PackerStack()
_watching: list[Any] = []


def note_reads(op: Any, tensors: Sequence[Any], result: Any, view: bool) -> None:
    """Tell the checkpointed regions whose first run runs in this thread that `op` read
    `tensors` (making `result`, a view of the first when `view`): their re-runs read again
    the tensors from outside them (see `RegionPacker.note_reads`)."""
    for region in _regions.items:
        region.note_reads(op, tensors, result, view)


@contextmanager
def watching_reads(region: Any) -> Iterator[Any]:
    """Tell `region` what every operation inside the block reads (`note_reads`)."""
    _regions.items.append(region)
    _watching.append(region)
    try:
        yield region
    finally:
        _watching.pop()
        _regions.items.pop()


@contextmanager
def use_packer(packer: Any) -> Iterator[Any]:
    """Store every value saved inside the block with `packer` (innermost block wins)."""
    if not isinstance(packer, Strategy):
        raise TypeError(
            f"{packer!r} is not a packer: subclass checkpoint_ad.strategies.Strategy (alias "
            "checkpoint_ad.Packer) and override pack(array) and unpack(stored)"
        )
    _stack.items.append(packer)
    _pushed.append(packer)
    try:
        yield packer
    finally:
        _pushed.pop()  # any item: only their number matters
        _stack.items.pop()
        ended = getattr(packer, "block_ended", None)
        if ended is not None:  # a strategy that records across a block lets go at its end
            ended()


@contextmanager
def saved_values_hooks(
    pack: Callable[[Any], Any], unpack: Callable[[Any], Any]
) -> Iterator[HookPacker]:
    """Route every value saved inside the block through `pack`, and back through `unpack`.

    >>> import checkpoint_ad as cad
    >>> seen = []
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.saved_values_hooks(lambda a: seen.append(a.shape) or a, lambda a: a):
    ...     y = (x * x).sum()
    >>> seen
    [(2,)]
    """
    with use_packer(HookPacker(pack, unpack)) as packer:
        yield packer
