"""Whose memory a saved value is, told from the live objects while the program runs.

The recorder (recorder.py) describes each value an entry saves as its log lists it: the
buffer's serial, the fields its record names (shape, dtype, bytes, strategy), whether the tape
owns the memory or it is the caller's (a leaf's array, a parameter or input the caller holds
anyway, or a view of data outside the graph), and what base a saved view keeps alive. Only the
live arrays can say which: this class, the recorder's base, learns the leaves' arrays as
entries name them, remembers the bases of saved views, and at the block's end counts the
parameters' and gradients' bytes. What it answers is remembered per buffer (`Tracked.seen`)
and per shape, so a parameter saved by every step costs a lookup.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np

from ..entry import Entry
from ..saved import KeptBuffer
from ..tensor_base import TensorBase
from .accountant import TRACK
from .records import Profile
from .watch import Tracked


class SavedFacts:
    """The facts of saved values and the leaves' memory; the base of the recorder, which
    watches the buffers (`tracked`, `_tracked`: it logs each) and holds the `profile`."""

    profile: Profile
    tracked: dict[int, Tracked]  # id(buffer) -> its reference, while alive

    def __init__(self) -> None:
        # id(array) -> weakref: the arrays of the caller's leaves, and views of them seen
        self.leaf_roots: dict[int, Any] = {}
        # id(base array) -> (weakref or None, serial) of the bases of saved views: a serial
        # per base object (by id alone, a base made after one died would reuse its id)
        self.view_bases: dict[int, tuple[Any, int]] = {}
        self.base_counter = itertools.count()
        # one object per distinct shape and byte count that records name (a kept value's are
        # new objects at every read, which a long profile would hold by the thousand)
        self.shared: dict[Any, Any] = {}
        # dtype -> shape -> the facts of a kept buffer of such an array (`_fields`)
        self.kept_fields: dict[Any, dict[Any, tuple[Any, ...]]] = {}
        self.leaf_kinds: dict[type, bool] = {}  # type of an entry's input node -> a leaf's?
        self.leaves_learned = 0  # leaf arrays learned so far (`_describe`'s remembered answers)
        # id(root array) -> (weakref, bytes) of each leaf's memory, and id(tensor) -> weakref
        # of the leaf tensors seen: parameters and gradients are those still alive at the end
        # (a planned loop's re-run steps make leaves of their own, which die with the loop)
        self.leaf_root_bytes: dict[int, tuple[Any, int]] = {}
        self.leaf_tensors: dict[int, Any] = {}
        # ids of leaf arrays read by more than one entry: their gradient is summed (a running
        # sum, and a partial beside it), not made once
        self.reused: set[int] = set()

    def _tracked(self, buffer: Any, opcode: int) -> Tracked:
        """Start watching a live buffer and log it: the recorder's (it holds the log)."""
        raise NotImplementedError

    def _fields(self, buffer: Any, array: Any) -> tuple[Any, ...]:
        """(shape, dtype, logical bytes, stored bytes, strategy) of a buffer stored by
        reference, its `array`: for a `KeptBuffer`, one tuple per distinct shape and dtype."""
        kept = type(buffer) is KeptBuffer
        if kept:
            by_shape = self.kept_fields.get(array.dtype)
            if by_shape is None:
                by_shape = self.kept_fields[array.dtype] = {}
            fields = by_shape.get(array.shape)
            if fields is not None:
                return fields
        shared = self.shared
        shape = shared.setdefault(array.shape, array.shape)
        size = array.nbytes if type(array) is np.ndarray else buffer.stored_nbytes
        size = shared.setdefault(size, size)
        kind = type(buffer.packer)
        strategy = shared.get(kind)
        if strategy is None:
            strategy = shared[kind] = kind.__name__
        fields = (shape, array.dtype, size, size, strategy)
        if kept:
            by_shape[array.shape] = fields
        return fields

    def _describe(self, buffer: Any, role: str, unedged: bool) -> tuple[Any, ...]:
        """(serial, role, owned, view, facts) of one value an entry saved, as the log lists it.
        Stored by reference, it is the tape's unless its root is a leaf's array, or it is a
        view of data the entry has no edge to (`unedged`: an input's row); `view` says what
        base a view keeps alive. A buffer saved before the block began is known from now on.
        A buffer saved again (a parameter, by every step) is described as it was the last time
        (`Tracked.seen`) unless a leaf was learned since: nothing else changes the answer."""
        t = self.tracked.get(id(buffer))
        if t is None:
            t = self._tracked(buffer, TRACK)
        if t.stored_id is not None:  # packed: the tape's
            return t.serial, role, True, None, t.facts
        seen = t.seen
        if seen is not None and seen[0] == self.leaves_learned and seen[1] == unedged:
            return t.serial, role, seen[2], seen[3], t.facts
        array = buffer.packed
        root = array if getattr(array, "base", None) is None else _root(array)
        known = self.leaf_roots.get(id(root))
        owned = not ((known is not None and known() is root) or (
            unedged and root is not array))
        facts = t.facts
        if facts is None:
            facts = t.facts = self._fields(buffer, array)
        view = None
        if root is not array:  # the caller's view: its root names the array, counted once
            view = self._view(buffer, root) if owned else (-1, id(root), 0)
        t.seen = (self.leaves_learned, unedged, owned, view)
        return t.serial, role, owned, view, facts

    def _view(self, buffer: Any, root: Any) -> tuple[int, int, int]:
        """(serial, id, bytes beyond the view's own) of the base a saved view keeps alive."""
        key = id(root)
        known = self.view_bases.get(key)
        if known is None or (known[0] is not None and known[0]() is not root):
            try:
                ref = weakref.ref(root)
            except TypeError:  # no weak references: known by id (a later base may reuse it)
                ref = None
            known = self.view_bases[key] = (ref, next(self.base_counter))
        return known[1], key, int(getattr(root, "nbytes", 0)) - buffer.stored_nbytes

    def _learn_leaf(self, array: Any) -> None:
        """Remember the array of a leaf that requires grad and takes part in the forward
        computation: a parameter or input the caller holds. (Leaves a loop or a checkpointed
        region makes while re-running steps for the backward sweep are its own, not these.)"""
        known = self.leaf_roots.get(id(array))
        if known is not None and known() is array:  # the common case: a parameter seen before
            self.reused.add(id(array))
            return
        root = _root(array)
        known = self.leaf_roots.get(id(root))
        if known is None or known() is not root:  # new, or its id reused
            ref = self.leaf_roots[id(root)] = weakref.ref(root)
            self.leaf_root_bytes[id(root)] = (ref, int(getattr(root, "nbytes", 0)))
            self.leaves_learned += 1
        else:  # a new view of one seen before (a transposed weight)
            self.reused.add(id(root))
        if root is not array:  # a view of one (a transposed weight): known by id next time
            self.leaf_roots[id(array)] = weakref.ref(array)

    def _learn_leaves(self, nodes: Any) -> None:
        """The leaves among an entry's input nodes, learned (a leaf seen before, the usual
        case, costs a lookup here rather than a call)."""
        kinds, leaf_roots = self.leaf_kinds, self.leaf_roots
        for node in nodes:
            kind = kinds.get(type(node))
            if kind or (kind is None and self._is_leaf_kind(node)):
                array = node._data
                known = leaf_roots.get(id(array))
                if known is None or known() is not array:
                    self._learn_leaf(array)
                    self.leaf_tensors[id(node)] = weakref.ref(node)
                else:
                    self.reused.add(id(array))

    def _is_leaf_kind(self, node: Any) -> bool:
        """Whether an entry's input node of this type is a leaf tensor (remembered per type:
        `leaf_kinds`)."""
        kind = self.leaf_kinds[type(node)] = (
            node is not None and type(node) is not Entry and isinstance(node, TensorBase))
        return kind

    def _replayed_leaves(self, leaves: tuple[int, ...], values: list[Any],
                         made: tuple[int, ...]) -> None:
        """The leaves of a replayed instruction's leaf slots, learned."""
        for slot in leaves:
            if slot not in made:  # a carry the previous step made is no leaf
                self._learn_leaf(values[slot])


    def _count_leaves(self) -> None:
        """Parameters: the bytes of the leaves' arrays still alive as the block ends, each
        counted once (not the leaves a loop made to re-run its steps from snapshots, which
        die with it); gradients: the distinct `.grad` arrays of the leaf tensors still alive,
        and the largest of those of leaves read more than once (summed in the backward)."""
        profile = self.profile
        profile.leaf_bytes = sum(size for ref, size in self.leaf_root_bytes.values()
                                 if ref() is not None)
        grads: dict[int, int] = {}
        summed = 0  # the largest gradient of a leaf read more than once
        reused = self.reused
        for ref in self.leaf_tensors.values():
            leaf = ref()
            grad = getattr(leaf, "grad", None) if leaf is not None else None
            if grad is not None:
                array = _root(getattr(grad, "_data", grad))
                size = grads[id(array)] = int(getattr(array, "nbytes", 0))
                data = leaf._data
                if id(data) in reused or id(_root(data)) in reused:
                    summed = max(summed, size)
        profile.gradient_bytes = sum(grads.values())
        profile.largest_gradient_bytes = summed


def _root(array: Any) -> Any:
    """The array that owns `array`'s memory (numpy and cupy views keep it as `.base`)."""
    base = getattr(array, "base", None)
    while base is not None and hasattr(base, "shape"):  # not a bytes or mmap owner
        array, base = base, getattr(base, "base", None)
    return array
