"""Dynamic tensor rematerialization: a saved-bytes budget for code that is not a `scan`.

Under ``use(Rematerializing(limit_bytes))`` every value a primitive saves for the backward
sweep is held by a pool. When holding a new one would pass the limit, the pool evicts held
values by the rule of Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021): drop the
value with the *lowest* ``h(t) = c(t) / (m(t) * s(t))``, where `m` is its bytes, `s` its
staleness (time since last use) and `c` the cost of bringing it back. An evicted value is
recomputed when the sweep unpacks it, by re-running the same primitives on the same input
arrays (recursively, oldest first, from the nearest values still held), so gradients are bit
for bit those of keeping everything.

Choices this module makes, where the paper leaves room:

- `c(t)` is a static estimate (elements read and written; multiply-adds for matmul) plus the
  estimates of the unsaved intermediate results its recompute needs (never in memory by the
  time they are needed) and of its evicted neighbourhood ``e*(t)``, as the paper's
  ``h_DTR-eq`` approximates it: evicted saved values are joined with their evicted
  neighbours (the saved values they read, and those that read them, at most 8 of each) into
  classes kept by union-find, each with its members' summed cost, and ``e*(t)`` is the sum
  over the distinct classes next to `t`. A value brought back leaves its class (whose cost
  drops by its own; classes are not split). Staleness counts ticks of a logical clock (one
  per recorded primitive and per unpack), not wall time, so evictions do not depend on
  timing noise.
- Choosing what to evict scores a sample of about sqrt(n) of the n evictable held values
  (as DTR's own implementation does), drawn by a generator seeded per pool, so one eviction
  costs O(sqrt n) whatever the length of the program, and a run evicts the same values
  every time. `scored` counts the values scored.
- Only values that have a recipe can be evicted: results of primitives recorded under this
  pool. Values saved by custom functions or loops, or made before the block, are held until
  their entries are freed. Leaves (parameters, input data) are saved by reference (`KEEP`):
  the caller holds them anyway, so evicting them would free nothing.
- Primitives are pure functions of their arrays and attributes: randomness enters as arrays
  with no history (dropout's mask), which recipes keep as they are, so a recompute never
  draws again. Arrays with no history that a recipe reads are kept while the recipe lives.
- Input values are checked by version: a value changed in place after it was used is
  recomputed rather than read; an input with no history changed in place cannot be, and its
  recompute raises `SavedValueModifiedError`.
- Policy at the limit: while recording, a value that cannot fit even after evicting all that
  can be evicted raises `BudgetError` (with `minimum_bytes`), early and before any gradient
  is touched. During the backward sweep the pool never raises: a recompute that cannot make
  room goes over the limit, and `peak_bytes` shows by how much.

Events: 'evict' (payload: the stored handle whose array was dropped, its bytes leave the tape)
and 'rematerialize' (one primitive re-run; payload: the handle it made resident again, its
bytes back on the tape, or None for a value no saved buffer holds). Each re-run is also an
'apply' inside ``recomputing("rematerialize")``, so profiles time it as recompute work.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ... import events
from ...backend import namespace
from ...backend import nbytes as array_nbytes
from ...entry import _NO_ATTRS, EntryExtra
from ...errors import (
    BudgetError,
    BudgetWarning,
    RecomputeError,
    SavedValueModifiedError,
    StrategyConfigError,
)
from ...origins import NO_ORIGIN
from ...saved import KEEP, Strategy, VersionCounter

__all__ = ["Rematerializing"]

_NEIGHBOURS = 8  # the most saved values a value remembers reading, and being read by
_SAMPLE_FLOOR = 8  # evictions score at least this many candidates (all, if fewer)
_SLACK = 64  # making room evicts down to 1/_SLACK of the room below what is needed


class _Value(EntryExtra):
    """How one primitive result is made again: the primitive, its attributes, its inputs
    (other `_Value`s, or `_Fixed` arrays with no recipe), and where its array is now.

    It is the result's entry's `EntryExtra` too (its line, hooks, retained outputs, and the
    attributes the recipe runs with): recorded for every primitive, one object fewer each
    for the cyclic collector to scan (see `Rematerializing.recorded`)."""

    __slots__ = ("__weakref__", "chain", "cls", "counter", "dtype", "frontier",
                 "handle", "inputs", "objects", "pool", "prim", "ref", "seq", "shape", "users",
                 "version")

    def __init__(self, pool: Rematerializing, prim: Any, extra: Any, attrs: dict[str, Any],
                 inputs: tuple[Any, ...], result: Any, cost: float) -> None:
        if isinstance(extra, EntryExtra):  # the entry's extras so far: this takes their place
            self.attrs = extra.attrs
            self.origin_frame = extra.origin_frame
            self.retained = extra.retained
            self.hooks = extra.hooks
        else:
            self.attrs = attrs or _NO_ATTRS
            self.origin_frame = NO_ORIGIN
            self.retained = None
            self.hooks = None
        self.pool = pool  # whose value: the entry keeps it, and other pools must not see it
        self.seq = pool._clock  # when it was recorded: recomputes run in the program's order
        self.prim = prim
        self.inputs = inputs
        array = result._data
        self.shape = pool._shapes.setdefault(array.shape, array.shape)
        self.dtype = array.dtype
        self.ref: Callable[[], Any] = _array_ref(array, self)
        self.counter = result._version  # the array is this value while the counter stands
        self.version = result._version.value
        self.handle: Callable[[], Any] | None = None  # weakref of the handle that saves it
        # Cost estimates see the graph of saved values only: `chain` is this primitive's cost
        # plus that of the unsaved results it reads (never in memory by the time they are
        # needed), recursively; `frontier` the saved values those read (the nearest
        # `_NEIGHBOURS`: a running sum's would otherwise grow with every step). `users`: weak
        # references to the saved values that have this one in their frontier; `cls`: this
        # value's class of evicted neighbours while it is evicted (see `_Class`).
        frontier: list[_Value] = []
        shared: tuple[_Value, ...] = ()  # an unsaved input's frontier, which may be this one's
        for source in inputs:
            if type(source) is not _Value:
                continue
            if source.handle is not None:
                if len(frontier) < _NEIGHBOURS and source not in frontier:
                    frontier.append(source)
            else:
                cost += source.chain
                if not shared:
                    shared = source.frontier
                for f in source.frontier:
                    if len(frontier) < _NEIGHBOURS and f not in frontier:
                        frontier.append(f)
        self.chain = cost
        # the same values as an input's frontier (an elementwise chain of unsaved results):
        # its tuple, not a copy (one object fewer for the cyclic collector to scan)
        if len(shared) == len(frontier) and all(f in shared for f in frontier):
            self.frontier = shared
        else:
            self.frontier = tuple(frontier)
        self.users: list[weakref.ref[_Value]] | None = None
        self.cls: _Class | None = None
        # a pool counting the process's memory counted its objects: 1 + how many of its inputs
        # are `_Fixed` (a small int, shared, where their bytes would be an int of its own)
        self.objects = 0

    def __del__(self) -> None:
        if self.objects:
            self.pool._forget(_object_bytes(self))

    def present(self) -> Any:
        """The array if it is still in memory unchanged (held, or alive in the caller's
        hands), else None."""
        array = self.ref()
        if array is None or self.counter.value != self.version:
            return None
        return array


class _ArrayRef(weakref.ref):  # type: ignore[type-arg]
    """A value's weak reference to its array, which lets go of itself and of the value's
    version counter once the array dies (`_array_died`): most results die within a step of
    being made, and their values would otherwise hold a dead reference and a counter each
    for as long as the tape lives, objects the cyclic collector scans on every full pass."""

    __slots__ = ("value",)


def _array_ref(array: Any, value: _Value) -> _ArrayRef:
    ref = _ArrayRef(array, _array_died)
    ref.value = weakref.ref(value)
    return ref


def _array_died(ref: _ArrayRef) -> None:
    value = ref.value()
    if value is not None and value.ref is ref:
        value.ref = _gone
        value.counter = _NO_COUNTER  # no tensor holds it: a recompute's array stays as made


def _gone() -> None:
    """The `_Value.ref` of a value whose array died."""
    return None


_NO_COUNTER = VersionCounter()


class _Class:
    """A class of evicted values that recompute together (DTR's equivalence classes): a
    union-find node; the root's `cost` is the summed cost of the members."""

    __slots__ = ("cost", "parent")

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.parent: _Class | None = None


def _find(node: _Class) -> _Class:
    """The root of `node`'s class (path halving: amortized near-constant time)."""
    while node.parent is not None:
        parent = node.parent
        if parent.parent is not None:
            node.parent = parent.parent
        node = parent
    return node


class _Fixed:
    """An input with no recipe, kept as is, with the version it had when it was read."""

    __slots__ = ("array", "counter", "version")

    def __init__(self, tensor: Any) -> None:
        self.array = tensor._data
        self.counter = tensor._version
        self.version = tensor._version.value


class _Handle:
    """What a saved buffer stores under the pool: the array while the pool holds it, and
    the value that makes it again once evicted (None: no recipe, never evicted)."""

    __slots__ = ("__weakref__", "array", "index", "last", "nbytes", "pool", "value")

    def __init__(self, pool: Rematerializing, array: Any, nbytes: int, now: int) -> None:
        self.pool = pool
        self.array = array
        self.nbytes = nbytes
        self.last = now
        self.value: _Value | None = None
        self.index = -1  # its place among the pool's evictable handles, -1: not there

    def __del__(self) -> None:  # the buffer died: its bytes leave the pool
        if self.array is not None:
            self.pool._let_go(self)
        if self.pool.process:
            self.pool.object_bytes -= _sizes().handle

    def __repr__(self) -> str:
        state = "held" if self.array is not None else "evicted"
        return f"<rematerializable {self.nbytes} bytes, {state}>"


class Rematerializing(Strategy):
    """Keep at most `limit_bytes` of saved values, evicting and recomputing DTR-style.

    One instance is one pool: its counters (`evictions`, `rematerializations`,
    `peak_bytes`) and the values it holds span every block it is used in; use a new instance
    for a new budget. The pool serves one thread. `Budget` delegates code outside `scan` here.

    >>> import numpy as np, checkpoint_ad as cad
    >>> w = cad.tensor(np.full((4, 4), 0.5), requires_grad=True)
    >>> pool = cad.strategies.Rematerializing(limit_bytes=256)
    >>> with cad.use(pool):
    ...     h = cad.ones(2, 4)
    ...     for _ in range(8):
    ...         h = cad.tanh(h @ w)
    ...     h.sum().backward()
    >>> pool.evictions > 0, pool.peak_bytes <= 256
    (True, True)
    """

    lossless: ClassVar[bool] = True
    sees_tensors: ClassVar[bool] = True  # `saved_tensor`: which recorded result is saved

    def __init__(self, limit_bytes: int, reserved: Callable[[], int] | None = None,
                 process: bool = False, fold: bool = False) -> None:
        """`reserved`, if given, says how many bytes of `limit_bytes` are held outside the pool
        (a budget's loops, until their backward sweep): the pool keeps to the rest.

        `process=True` (what `Budget` asks): the limit is for the program's memory as
        tracemalloc measures it, not its saved arrays alone. The pool also counts the tape's
        and its own objects for the values it records (`object_bytes`, an estimate per
        value) and keeps room for what the backward sweep makes (`gradient_bytes`: the
        gradients of the leaves its values read, two more of the largest as it is summed,
        and six of the largest value: a backward rule's gradients in and out and its
        temporaries, as tanh's ``g * (1 - y**2)`` makes, or a recompute's inputs and result
        beyond what it holds), while these take at most 7/8 of the
        limit: where they pass it (a long loop of small steps: the objects grow with the
        steps, and no evicting of arrays can hold them), it holds its arrays to the limit
        less only what fits of them, gradients first.

        `fold=True`: a periodic Python loop recorded here is folded, as it runs, into one loop
        entry that replays its steps from carry snapshots (`fold.py`): its tape then holds
        O(1) objects rather than a few KB a step; anything unusual records as before."""
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, (int, np.integer)):
            raise StrategyConfigError(
                f"Rematerializing(limit_bytes=...) takes a whole number of bytes, got "
                f"{limit_bytes!r}; e.g. Rematerializing(8 * 2**20) for 8 MiB"
            )
        if limit_bytes < 0:
            raise StrategyConfigError(
                f"Rematerializing: limit_bytes must be 0 or more, got {limit_bytes}"
            )
        self.limit_bytes = int(limit_bytes)
        self.reserved = reserved
        self.process = bool(process)
        self.object_bytes = 0  # estimated objects of the live values and handles (process)
        self.gradient_bytes = 0  # room kept for the backward sweep's gradients (process)
        self._leaves: dict[int, int] = {}  # id(leaf) -> bytes, the leaves its values read
        self._largest = 0  # bytes of the largest value recorded
        self._values = 0  # values alive whose objects are counted
        self.held_bytes = 0  # bytes of saved values the pool holds now
        self.peak_bytes = 0
        self.peak_since_mark = 0  # the most held since `mark()`
        self._warned = False  # passed the limit, for the bytes reserved, since `mark()`
        self.evictions = 0
        self.rematerializations = 0  # primitives re-run to bring values back
        self.scored = 0  # candidates scored to choose evictions (about sqrt(held) each)
        self._clock = 0
        # the held handles with a recipe, in no order: a list, so that a sample is drawn and
        # one is taken out (moving the last into its place) in constant time
        self._evictable: list[weakref.ref[_Handle]] = []
        self._random = random.Random(0)
        # id(array) -> {id(handle): handle} of the held handles that share it (a value saved
        # by two primitives): its bytes are counted once, and evicting it evicts them all
        self._holders: dict[int, dict[int, weakref.ref[_Handle]]] = {}
        self._fresh: list[weakref.ref[_Handle]] = []
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per shape
        self.fold_bytes = 0  # held by folded loops (their carry states), outside the pool
        self._folder: Any = None
        if fold:
            from .fold import Folder

            self._folder = Folder(self)

    def __repr__(self) -> str:
        return f"Rematerializing(limit_bytes={self.limit_bytes})"

    def block_ended(self) -> None:
        """A `use` block of this pool ended: a loop being folded ends there (its ring of
        recent entries would keep the whole graph alive after the caller let it go)."""
        if self._folder is not None:
            self._folder.end()

    def unseen_bytes(self) -> int:
        """Bytes of the limit a `process` pool counts besides the arrays it holds: the
        gradients' room, then the objects, while they fit in 7/8 of the limit (see
        `__init__`); 0 for a pool of saved arrays only."""
        if not self.process:
            return 0
        share = self.limit_bytes * 7 // 8
        counted = self.gradient_bytes if self.gradient_bytes <= share else 0
        if counted + self.object_bytes <= share:
            counted += self.object_bytes
        return counted

    # ------------------------------------------------------------- the Strategy contract
    def for_leaf(self) -> Strategy:
        return KEEP  # the caller's own memory: nothing to gain by evicting it

    def pack(self, array: Any) -> _Handle:
        size = array_nbytes(array)
        self._clock += 1
        adds = 0 if id(array) in self._holders else size  # held already: counted once
        if self.held_bytes + adds > (self.limit_bytes - self._reserved_bytes()
                                     - (self.unseen_bytes() if self.process else 0)):
            self._make_room(adds, locked=None, strict=True)
        handle = _Handle(self, array, size, self._clock)
        if self.process:
            self.object_bytes += _sizes().handle
        self._hold(handle)
        # maybe the output of the primitive being recorded: `recorded` will tell (or made by
        # one before: `saved_tensor` tells first)
        self._fresh.append(weakref.ref(handle))
        return handle

    def saved_tensor(self, tensor: Any, stored: _Handle) -> None:
        """`stored` keeps `tensor`'s array: if a primitive recorded here made it, its recipe
        makes it again once evicted (found from the tensor's entry: a table from every
        result's array to its recipe would cost a weak reference and a callback per
        primitive)."""
        entry = tensor._entry
        value = entry._extra if entry is not None else None
        if (type(value) is _Value and value.pool is self
                and value.present() is stored.array):  # made by a primitive before
            _attach(stored, value)


    def unpack(self, stored: _Handle) -> Any:
        self._clock += 1
        stored.last = self._clock
        if stored.array is not None:
            return stored.array
        return self._bring_back(stored)

    def stored_nbytes(self, stored: _Handle) -> int:
        return stored.nbytes

    def recorded(self, prim: Any, attrs: dict[str, Any], inputs: tuple[Any, ...],
                 result: Any) -> None:
        """Remember how `result` was made, and give the handles packed while recording it
        their recipes."""
        self._clock += 1
        sources: list[Any] = []
        fixed = 0
        for t in inputs:  # `_value_of` and `present`, inlined (this runs for every primitive)
            entry = t._entry
            value = entry._extra if entry is not None else None
            if (type(value) is not _Value or value.pool is not self or value.ref() is not t._data
                    or value.counter.value != value.version):
                value = _Fixed(t)
                fixed += 1
                if self.process and t._requires_grad and entry is None:
                    self._reads_leaf(t)
            sources.append(value)
        entry = result._entry
        value = _Value(self, prim, entry._extra, attrs, tuple(sources), result,
                       _cost(prim, inputs, result))
        entry._extra = value  # lives as long as the entry, like its values
        if self.process:
            self._count_objects(value, result, fixed)
        if self._folder is not None:
            self._folder.note(value, entry, result)
        if not self._fresh:
            return
        fresh, self._fresh = self._fresh, []
        for ref in fresh:
            handle = ref()
            if handle is None or handle.value is not None or handle.array is None:
                continue
            if handle.array is result._data:
                _attach(handle, value)

    def _reads_leaf(self, leaf: Any) -> None:
        """A leaf that will get a gradient: keep room for it in the backward sweep."""
        if id(leaf) not in self._leaves:
            self._leaves[id(leaf)] = array_nbytes(leaf._data)
            self._gradients_changed()

    def _gradients_changed(self) -> None:
        leaves = self._leaves.values()
        self.gradient_bytes = (sum(leaves) + 2 * (max(leaves) if leaves else 0)
                               + 6 * self._largest)

    def _count_objects(self, value: _Value, result: Any, fixed: int) -> None:
        """Count the tape's and the pool's objects for `value` (given back when it dies),
        and keep room for its gradient if it is the largest value yet. `fixed`: how many of
        its inputs are `_Fixed`."""
        value.objects = 1 + fixed
        self.object_bytes += _object_bytes(value)
        self._values += 1
        size = array_nbytes(result._data)
        if size > self._largest:
            self._largest = size
            self._gradients_changed()

    # ------------------------------------------------------------- holding and evicting
    def _hold(self, handle: _Handle) -> None:
        if handle.value is not None:
            self._add_evictable(handle)
        key = id(handle.array)
        holders = self._holders.get(key)
        if holders is None:
            self._holders[key] = {id(handle): weakref.ref(handle)}
            self.held_bytes += handle.nbytes
        else:
            holders[id(handle)] = weakref.ref(handle)
        if self.held_bytes > self.peak_since_mark:
            self.peak_since_mark = self.held_bytes
            if self.held_bytes > self.peak_bytes:
                self.peak_bytes = self.held_bytes

    def _reserved_bytes(self) -> int:
        """Bytes of the limit held outside the pool (see `reserved`)."""
        return (self.reserved() if self.reserved is not None else 0) + self.fold_bytes

    def mark(self) -> None:
        """Start `peak_since_mark` again from what is held now (a budget, as it plans a loop:
        how much the pool grows while that loop holds its tape)."""
        self.peak_since_mark = self.held_bytes
        self._warned = False

    def _add_evictable(self, handle: _Handle) -> None:
        if handle.index < 0:
            handle.index = len(self._evictable)
            self._evictable.append(weakref.ref(handle))

    def _drop_evictable(self, handle: _Handle) -> None:
        index = handle.index
        if index < 0:
            return
        handle.index = -1
        last = self._evictable.pop()
        if index < len(self._evictable):
            self._evictable[index] = last
            moved = last()
            if moved is not None:
                moved.index = index

    def _let_go(self, handle: _Handle) -> None:
        self._drop_evictable(handle)
        if handle.array is not None:
            key = id(handle.array)
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(id(handle), None)
                if not holders:
                    del self._holders[key]
                    self.held_bytes -= handle.nbytes
                    if not self._holders:
                        self._shrink()
        handle.array = None

    def _shrink(self) -> None:
        """Nothing is held: drop the tables' room (a dict keeps the size it grew to)."""
        self._holders = {}
        self._shapes = {}

    def _forget(self, objects: int) -> None:
        """A counted value died; with the last, the program is over: forget the leaves it
        read (the next program's gradients are its own)."""
        self.object_bytes -= objects
        self._values -= 1
        if not self._values:
            self._leaves = {}
            self._largest = 0
            self.gradient_bytes = 0

    def _victims(self, locked: _Handle | None) -> list[tuple[float, int, _Handle]]:
        """About sqrt(n) drawn of the n evictable held handles (all of them when n is small),
        as a heap of (score, draw, handle): the lowest first; empty when there is none but
        `locked`. The score is `_score`'s, inlined: this loop is most of what an eviction
        costs (cache misses on the candidates' objects, most of it)."""
        evictable = self._evictable
        n = len(evictable)
        draws = n if n <= _SAMPLE_FLOOR else max(_SAMPLE_FLOOR, math.isqrt(n) + 1)
        draw = self._random.random
        holders_of = self._holders.get
        clock = self._clock + 1
        sample: list[tuple[float, int, _Handle]] = []
        for i in range(draws):
            handle = evictable[i if draws == n else int(draw() * n)]()
            if handle is None or handle is locked:
                continue
            holders = holders_of(id(handle.array))
            if holders is not None and len(holders) > 1 and not self._frees(handle, locked):
                continue
            value = handle.value
            # c(t): its chain, plus the summed costs of the distinct classes of its evicted
            # neighbours (`_neighbourhood_cost`, inlined; most have one class, or none)
            cost = value.chain
            first = roots = None
            for source in value.frontier:
                node = source.cls
                if node is None:
                    continue
                if node.parent is not None:  # `_find`, linking the member to its root
                    root = node.parent
                    while root.parent is not None:
                        root = root.parent
                    node.parent = node = root
                if first is None:
                    first = node
                    cost += node.cost
                elif node is not first and (roots is None or node not in roots):
                    roots = [node] if roots is None else [*roots, node]
                    cost += node.cost
            for ref in value.users or ():
                user = ref()
                node = user.cls if user is not None else None
                if node is None:
                    continue
                if node.parent is not None:  # `_find`, linking the member to its root
                    root = node.parent
                    while root.parent is not None:
                        root = root.parent
                    node.parent = node = root
                if first is None:
                    first = node
                    cost += node.cost
                elif node is not first and (roots is None or node not in roots):
                    roots = [node] if roots is None else [*roots, node]
                    cost += node.cost
            sample.append((cost / ((handle.nbytes or 1) * (clock - handle.last)), i, handle))
        self.scored += draws
        if not sample and draws < n:  # drew none that frees memory: look at all
            best = next((h for h in (r() for r in evictable) if h is not None
                         and h is not locked and self._frees(h, locked)), None)
            return [(0.0, 0, best)] if best is not None else []
        heapq.heapify(sample)
        return sample

    def _frees(self, handle: _Handle, locked: _Handle | None) -> bool:
        """Whether evicting `handle` with the others that hold its array frees it: none of
        them is without a recipe, or `locked`."""
        holders = self._holders.get(id(handle.array))
        if holders is None or len(holders) == 1:
            return True
        for ref in holders.values():
            other = ref()
            if other is not None and (other.value is None or other is locked):
                return False
        return True

    def _make_room(self, size: int, locked: _Handle | None, strict: bool) -> None:
        """Evict until `size` more bytes fit (DTR: lowest cost / (bytes * staleness) first).
        `strict`: raise `BudgetError` when they cannot; else go over the limit."""
        reserved = self._reserved_bytes()
        limit = self.limit_bytes - reserved
        room = limit - self.unseen_bytes()
        # One sample serves up to sqrt(its size) evictions, while they bring the pool down
        # to `_SLACK` of the room below what `size` needs (so that the next values fit
        # without a sample of their own): the lowest-scored of the sample that is left,
        # scored again first (evicting a neighbour only raises a score, DTR's e*), so each is
        # the one a new scoring of the rest of the sample would choose.
        floor = room - room // _SLACK
        while self.held_bytes + size > room:
            sample = self._victims(locked)
            if not sample:
                break
            taken = 0
            cap = math.isqrt(len(sample))
            while sample and taken < max(cap, 1) and self.held_bytes + size > floor:
                _, i, handle = heapq.heappop(sample)
                if handle.array is None:  # went with another holder of its array
                    continue
                if taken:
                    self.scored += 1
                    now = self._score(handle)
                    if sample and now > sample[0][0]:
                        heapq.heappush(sample, (now, i, handle))
                        continue
                self._evict(handle)
                taken += 1
        if self.held_bytes + size > limit and strict and reserved and (
                self.held_bytes + size <= self.limit_bytes):
            # the budget's loops took the room: over the budget this once (the budget plans
            # its loops to leave it from the next pass on)
            if not self._warned:
                self._warned = True
                warnings.warn(BudgetWarning(
                    f"{self!r}: loops planned earlier under this budget hold {reserved} bytes "
                    f"until their backward sweep, so a saved value of {size} bytes passes the "
                    f"budget by {self.held_bytes + size - limit} bytes this once; from the "
                    "next pass on the budget plans its loops to leave room for it"), stacklevel=3)
            return
        if self.held_bytes + size > self.limit_bytes and strict:
            minimum = self.held_bytes + size
            raise BudgetError(
                f"Rematerializing(limit_bytes={self.limit_bytes}) cannot keep a new saved "
                f"value of {size} bytes: after evicting everything that can be recomputed, "
                f"{self.held_bytes} bytes remain that cannot (values saved by custom "
                "functions or loops, or made outside the block, have no recipe; a single "
                f"value must fit by itself); use a limit of at least {minimum} bytes",
                minimum,
            )

    def _score(self, handle: _Handle) -> float:
        """DTR's h(t) = c(t) / (m(t) * s(t)), with c(t) including the evicted
        neighbourhood (h_DTR-eq)."""
        value = handle.value
        assert value is not None  # only handles with a recipe are scored
        cost = value.chain + _neighbourhood_cost(value)
        staleness = self._clock - handle.last + 1
        return cost / (max(handle.nbytes, 1) * staleness)

    def _evict(self, handle: _Handle) -> None:
        holders = self._holders.get(id(handle.array))
        if holders is not None and len(holders) > 1:  # the others sharing its array go too
            for ref in list(holders.values()):
                other = ref()
                if other is not None and other is not handle:
                    self._let_go(other)
                    self._emit_evict(other)
        self._let_go(handle)
        self._emit_evict(handle)
        value = handle.value
        if value is not None and value.cls is None and value.present() is None:
            _join_evicted(value)

    def _emit_evict(self, handle: _Handle) -> None:
        self.evictions += 1
        if events.listeners:
            events.emit("evict", handle)

    # ------------------------------------------------------------- bringing values back
    def _bring_back(self, handle: _Handle) -> Any:
        """Recompute an evicted handle's value from the nearest values still in memory;
        saved values made on the way are held again (DTR), the others dropped after use."""
        value = handle.value
        assert value is not None  # a handle without a recipe is never evicted
        array = value.present()
        if array is not None:  # still in the caller's hands: read it, hold nothing more
            return array
        with events.recomputing("rematerialize"):
            return self._recompute(value, handle)

    def _recompute(self, root: _Value, target: _Handle) -> Any:
        order, have = _plan(root)
        uses: dict[int, int] = {}
        for value in order:
            for source in value.inputs:
                if type(source) is _Value:
                    uses[id(source)] = uses.get(id(source), 0) + 1
        for value in order:
            args = [_read(source, have, value) for source in value.inputs]
            for source in value.inputs:
                if type(source) is _Value:
                    uses[id(source)] -= 1
                    if not uses[id(source)] and source is not root:
                        have.pop(id(source), None)
            array = _run(value, args)
            have[id(value)] = array
            value.ref = _array_ref(array, value)
            value.version = value.counter.value  # a fresh array of the original value
            if value.cls is not None:
                _leave_evicted(value)
            self.rematerializations += 1
            if value is root:
                saver: _Handle | None = target
            else:
                saver = value.handle() if value.handle is not None else None
            if saver is not None and saver.array is None:
                self._rehold(saver, array, target)
            elif events.listeners:
                events.emit("rematerialize", None)
            if events.listeners:
                events.emit("apply", value.prim)
        return have[id(root)]

    def _rehold(self, handle: _Handle, array: Any, locked: _Handle) -> None:
        if self.held_bytes + handle.nbytes > (self.limit_bytes - self._reserved_bytes()
                                              - self.unseen_bytes()):
            self._make_room(handle.nbytes, locked=locked, strict=False)
        handle.array = array
        self._clock += 1
        handle.last = self._clock
        self._hold(handle)
        if events.listeners:
            events.emit("rematerialize", handle)


class _Sizes:
    """Bytes of the objects recording one value makes (`sys.getsizeof` of each kind, measured
    once): the tape's entry, the value (its extras too), its tuples, weak references, version
    counter and class (once evicted); per input a tuple slot, per input with no recipe a
    `_Fixed`; per saved handle the handle, the saved buffer and slot, their weak references,
    the list of the values that read it, and its place in the table of holders."""

    def __init__(self) -> None:
        from ...entry import Entry
        from ...saved import PackedBuffer, SavedSlot

        ref = sys.getsizeof(weakref.ref(self))
        array_ref = sys.getsizeof(_ArrayRef(self))
        slots = ((*_Value.__slots__, *EntryExtra.__slots__), _Handle.__slots__,
                 Entry.__slots__, _Fixed.__slots__,
                 (*PackedBuffer.__slots__, "packed", "__weakref__"), SavedSlot.__slots__)
        sizes = [_slotted(names) for names in slots]
        value, handle, entry, fixed, buffer, slot = sizes
        tuple_, counter, cls = 40, 40, 64  # an empty tuple, a version counter, a `_Class`
        self.value = value + entry + array_ref + ref + 2 * tuple_ + counter + cls
        self.per_input = 8
        self.per_fixed = fixed
        listed = 56 + ref  # a list of users and a weak reference in it
        held = 232 + ref  # a dict of the handles holding its array, and one in it
        self.handle = handle + buffer + slot + 3 * ref + listed + held


def _object_bytes(value: _Value) -> int:
    """The bytes of objects counted for `value` (see `Rematerializing._count_objects`)."""
    sizes = _SIZES[0] if _SIZES else _sizes()
    return (sizes.value + sizes.per_input * len(value.inputs)
            + sizes.per_fixed * (value.objects - 1))


def _slotted(names: tuple[str, ...]) -> int:
    """`sys.getsizeof` of an instance of a class with these `__slots__` (and the collector's
    header, which it counts)."""
    return 16 + 16 + 8 * len([n for n in names if n != "__weakref__"]) + 8 * (
        "__weakref__" in names)


_SIZES: list[_Sizes] = []


def _sizes() -> _Sizes:
    if not _SIZES:
        _SIZES.append(_Sizes())
    return _SIZES[0]


def _attach(handle: _Handle, value: _Value) -> None:
    """`handle` saves `value`: it can be evicted, and a recompute of `value` holds it again."""
    handle.value = value
    if handle.array is not None:
        value.pool._add_evictable(handle)
    if value.handle is None:  # saved for the first time: its saved inputs learn of it
        ref = weakref.ref(value)
        for source in value.frontier:
            if source.users is None:
                source.users = [ref]
            elif len(source.users) < _NEIGHBOURS:
                source.users.append(ref)
    if value.handle is None or value.handle() is None:
        value.handle = weakref.ref(handle)


def _evicted_neighbours(value: _Value) -> list[_Class]:
    """The distinct classes of `value`'s evicted neighbours (at most 2 x `_NEIGHBOURS`)."""
    roots: list[_Class] = []
    for source in value.frontier:
        if source.cls is not None:
            root = _find(source.cls)
            if root not in roots:
                roots.append(root)
    for ref in value.users or ():
        user = ref()
        if user is not None and user.cls is not None:
            root = _find(user.cls)
            if root not in roots:
                roots.append(root)
    return roots


def _neighbourhood_cost(value: _Value) -> float:
    """Estimated cost of the evicted values a recompute of `value` (or of what reads it)
    would also run: the summed costs of the classes next to it (`_evicted_neighbours`,
    without building the list where no neighbour is evicted, the common case)."""
    first: _Class | None = None
    roots: list[_Class] | None = None
    total = 0.0
    for source in value.frontier:
        node = source.cls
        if node is None:
            continue
        if node.parent is not None:
            node = _find(node)
        if first is None:
            first, total = node, node.cost
        elif node is not first and (roots is None or node not in roots):
            if roots is None:
                roots = [node]
            else:
                roots.append(node)
            total += node.cost
    for ref in value.users or ():
        user = ref()
        if user is None or user.cls is None:
            continue
        node = user.cls
        if node.parent is not None:
            node = _find(node)
        if first is None:
            first, total = node, node.cost
        elif node is not first and (roots is None or node not in roots):
            if roots is None:
                roots = [node]
            else:
                roots.append(node)
            total += node.cost
    return total


def _join_evicted(value: _Value) -> None:
    """`value` is no longer in memory: it joins the classes of its evicted neighbours, under
    the root of the costliest (a class of many members keeps its root, so that their finds
    stay short: in a long chain of evictions each new member would otherwise become the
    root above all the others)."""
    node = value.cls = _Class(value.chain)
    roots = _evicted_neighbours(value)
    if not roots:
        return
    top = max(roots, key=_class_cost)
    for root in roots:
        if root is not top:
            root.parent = top
            top.cost += root.cost
    node.parent = top
    top.cost += node.cost


def _class_cost(node: _Class) -> float:
    return node.cost


def _leave_evicted(value: _Value) -> None:
    """`value` is in memory again: its class no longer counts its cost (the class is not
    split, as in h_DTR-eq)."""
    root = _find(value.cls)
    root.cost = max(root.cost - value.chain, 0.0)
    value.cls = None


def _plan(root: _Value) -> tuple[list[_Value], dict[int, Any]]:
    """The values to recompute for `root`, in the order the program made them (found by an
    iterative walk that stops at values still in memory), and the arrays of those it
    stopped at. In that order each result is made just before the program used it: a walk's
    own order makes a chain's side inputs first (an RNN's ``x_t @ U`` of every step, held
    until their step is reached: 5 MiB over 81 steps, outside any count)."""
    order: list[_Value] = []
    have: dict[int, Any] = {}
    seen: set[int] = set()
    stack: list[tuple[_Value, bool]] = [(root, False)]
    while stack:
        value, expanded = stack.pop()
        if expanded:
            order.append(value)
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        array = value.present() if value is not root else None
        if array is not None:
            have[id(value)] = array
            continue
        stack.append((value, True))
        for source in value.inputs:
            if type(source) is _Value and id(source) not in seen:
                stack.append((source, False))
    order.sort(key=_recorded_at)
    return order, have


def _recorded_at(value: _Value) -> int:
    return value.seq


def _read(source: Any, have: dict[int, Any], user: _Value) -> Any:
    if type(source) is _Value:
        return have[id(source)]
    if source.counter.value != source.version:
        raise SavedValueModifiedError(
            f"recomputing an evicted result of {user.prim.name!r} ({user.dtype}"
            f"{list(user.shape)}) needs its input {source.array.dtype}"
            f"{list(source.array.shape)} as it was at version {source.version}, but it was "
            f"modified in place since (now version {source.counter.value}); modify a copy "
            "instead, or raise the budget so the result is not evicted"
        )
    return source.array


def _run(value: _Value, args: list[Any]) -> Any:
    """The primitive's forward on `args`, checked against what the first run made."""
    prim = value.prim
    xp = namespace(args[0])
    out = prim.forward(xp, args, **value.attrs) if prim.variadic else prim.forward(
        xp, *args, **value.attrs)
    if isinstance(out, np.generic):  # numpy reduces 0-d results to scalars
        out = np.asarray(out)
    if tuple(out.shape) != value.shape or out.dtype != value.dtype:
        raise RecomputeError(
            f"recomputing an evicted result of {prim.name!r} gave {out.dtype}"
            f"{list(out.shape)}, but the first run made {value.dtype}{list(value.shape)}; "
            "a primitive's forward must depend only on its arrays and attributes"
        )
    return out


def _cost(prim: Any, inputs: tuple[Any, ...], result: Any) -> float:
    """A static estimate of a primitive's run time: elements read and written, or
    multiply-adds for a matmul (whose time grows with the shared axis)."""
    out = result._data
    if prim.name == "matmul" and inputs[0]._data.ndim:
        return float(out.size * inputs[0]._data.shape[-1])
    return float(out.size + sum(t._data.size for t in inputs))
