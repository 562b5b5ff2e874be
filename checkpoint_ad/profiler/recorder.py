"""`profile()`: listen to the engine's events and fill a `Profile` while a block runs.

Owned and aliased bytes: a saved value stored by reference whose memory belongs to a leaf the
caller holds anyway (a parameter, a slice of the input data) costs nothing a strategy could
save, so it is counted apart (`Profile.aliased_bytes`), not in `peak_tape_bytes`. Which one a
buffer is can only be told from the slot that saved it, so a buffer stored by reference waits
(uncounted) from its 'pack' event to the 'record' event of its entry, which follows at once in
the engine; one that no record claims before the next other event is owned.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from threading import get_ident
from time import perf_counter
from typing import Any

import numpy as np

from .. import events
from ..entry import Entry
from ..saved import KeptBuffer, SavedBuffer
from ..tensor_base import TensorBase
from .gathered import Gathered, judge_buffers
from .memory import MemoryProbe, probe_for, rss_bytes, synchronize
from .records import Profile
from .watch import Tracked, Watch


class _Recorder:
    """The event listener: keeps live saved bytes, phases and records up to date.

    `handlers` maps each event kind it hears to one method (add a kind: add a method and a
    line there). It runs inside the profiled program, so it keeps raw tuples (`Gathered`),
    turned into the profile's records and timeline when those are read, and what it knows of
    each live buffer on the weak reference that watches it (`watch.Tracked`).
    """

    def __init__(self, profile: Profile, device: str, device_memory: bool) -> None:
        self.profile = profile
        self.device = device
        self.probe = probe_for(device, device_memory)
        self.sampling = type(self.probe).sample is not MemoryProbe.sample
        # the live buffers it knows, watched for their death: one that dies in another thread
        # (the collector runs in whichever thread allocates; in a Dask worker, its event
        # loop's) is taken in at this thread's next event, so no lock guards every handler
        self.watch = Watch(self._free)
        self.tracked = self.watch.tracked  # id(buffer) -> Tracked
        self.thread = self.watch.thread
        self.foreign = self.watch.foreign  # tested before every event: frees to take in first
        self.roots: dict[int, int] = {}  # id(array) -> live owned buffers holding it
        self.pending: dict[int, Any] = {}  # id(buffer) -> buffer stored by reference, unclaimed
        # buffers packed into a new stored form since the latest other event, counted at that
        # event as if at their 'pack' (a replayed step's are counted among its instructions)
        self.packed: list[Any] = []
        self.before_step: Any = ()  # ids of the buffers waiting when a replayed step began
        # id(array) -> weakref: the arrays of the caller's leaves, and views of them seen
        self.leaf_roots: dict[int, Any] = {}
        self.counter = itertools.count()  # buffer serials (ids are reused; serials not)
        self.by_stored: dict[int, int] = {}  # id(stored form) -> id(buffer), if packed
        self.level_live: dict[str, int] = {}  # owned stored bytes off the device, per level
        self.live = 0
        self.live_aliased = 0
        self.peak = 0
        self.backward_depth = 0
        self.recompute_depth = 0
        self.phase = "forward"
        self.backward_started = 0.0
        self.recompute_started = 0.0
        # what `explain` needs: serial -> weakref of the original array, and which of those
        # serials were stored packed (a set beside the table: no pair per buffer)
        self.originals: dict[int, Any] = {}
        self.packed_originals: set[int] = set()
        self.released: set[int] = set()  # serials of owned buffers the tape let go of
        # id(base array) -> weakref of the bases of saved views, counted once each (by id
        # alone, a base made after one died would reuse its id and go uncounted)
        self.view_roots: dict[int, Any] = {}
        # owned buffers freed since the latest new peak that were alive at it (serial, bytes,
        # serial, bytes, ...: flat, no pair per free): with the live ones born before it
        # (`Tracked.born_at`), what the tape owned at its peak, in memory bounded by what is
        # alive; and buffers born owned but found the caller's later
        self.freed_since_peak: list[int] = []
        self.freed_reclassified: list[tuple[int, int, int]] = []  # (born at, serial, bytes)
        self.peak_at = 0  # timeline index of the latest new peak
        # one object per distinct shape and byte count that records name (a kept value's are
        # new objects at every read, which a long profile would hold by the thousand)
        self.shared: dict[Any, Any] = {}
        # dtype -> shape -> the `Tracked.fields` of a kept buffer of such an array (`_fields`)
        self.kept_fields: dict[Any, dict[Any, tuple[Any, ...]]] = {}
        self.gathered = Gathered()
        self.raw_records = self.gathered.records
        self.points = self.gathered.points
        self.handlers: dict[str, Callable[..., None]] = {
            events.KEPT: self._kept,
            "record": self._record,
            "replaying": self._replaying,
            "replayed": self._replayed,
            "pack": self._pack,
            "apply": self._settled(self._apply),
            "backward_begin": self._settled(self._backward_begin),
            "backward_end": self._settled(self._backward_end),
            "recompute_begin": self._settled(self._recompute_begin),
            "recompute_end": self._settled(self._recompute_end),
            "evict": self._settled(self._evict),
            "rematerialize": self._settled(self._rematerialize),
            "io_write": self._settled(self._io_write),
            "io_read": self._settled(self._io_read),
            "io_stall": self._settled(self._io_stall),
            "planned": self._settled(self._planned),
        }

    def _settled(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        """`handler`, first taking in the frees heard from other threads, counting the values
        packed since the latest event, and claiming the buffers stored by reference that no
        'record' came for (every kind but 'pack' and 'record' ends that wait)."""
        def settled(payload: Any) -> None:
            if self.foreign:
                self.watch.drain()
            if self.packed:
                self._count_packed()
            if self.pending:
                self._claim_pending()
            handler(payload)
        return settled

    # ------------------------------------------------------------- helpers
    def _set_phase(self) -> None:
        if self.recompute_depth:
            self.phase = "recompute"
        else:
            self.phase = "backward" if self.backward_depth else "forward"

    def _point(self) -> None:
        self.points.extend((perf_counter(), self.live, self.phase))

    def _sample_rss(self) -> None:
        rss = rss_bytes()
        if rss is not None and (self.profile.rss_peak_bytes or 0) < rss:
            self.profile.rss_peak_bytes = rss

    def _count(self, buffer: Any, tracked: Tracked, owned: bool, size: int | None = None,
               ) -> None:
        """Start counting a live buffer as owned (tape memory) or aliased (the caller's),
        `size` its stored bytes if known. A buffer stored by reference holding the very array a
        live owned buffer holds (a loop's restored snapshot, saved again by the step re-run
        from it) adds no bytes."""
        root_id = None
        if size is None:
            size = buffer.stored_nbytes
        if buffer.source is None:
            if owned:
                root_id = id(buffer.packed)
                roots = self.roots
                held = roots.get(root_id, 0)
                if held:
                    size = 0
                roots[root_id] = held + 1
        else:
            level = buffer.packer.stored_level(buffer.packed)
            if level != "device":  # offloaded: counted on its level, not in the tape bytes
                tracked.level, tracked.level_size = level, size
                self._add_level(level, size)
                size = 0
        tracked.counted, tracked.owned, tracked.size, tracked.root_id = True, owned, size, root_id
        if owned:
            tracked.born_at, tracked.born_size = len(self.points), size
            self.live += size
            if self.live > self.peak:
                self._new_peak()
        else:
            self._add(False, size)

    def _new_peak(self) -> None:
        self.peak = self.profile.peak_tape_bytes = self.live
        self.peak_at = len(self.points)
        if self.freed_since_peak:
            self.freed_since_peak.clear()

    def _add(self, owned: bool, size: int) -> None:
        if owned:
            self.live += size
            if self.live > self.peak:
                self._new_peak()
        else:
            self.live_aliased += size
            if self.live_aliased > (self.profile.aliased_bytes or 0):
                self.profile.aliased_bytes = self.live_aliased

    def _add_level(self, level: str, size: int) -> None:
        live = self.level_live[level] = self.level_live.get(level, 0) + size
        peaks = self.profile.level_peak_bytes
        peaks[level] = max(peaks.get(level, 0), live)

    def _count_packed(self) -> None:
        """Count the buffers packed since the latest other event, in pack order: what each
        'pack' would have counted at once (the points are the same; only their clock reads
        come later, when the event that follows arrives)."""
        packed, self.packed = self.packed, []
        tracked = self.tracked
        for buffer in packed:
            self._count(buffer, tracked[id(buffer)], owned=True)
            self._point()

    def _claim_pending(self, keys: Any = None) -> None:
        """Buffers stored by reference that no entry claimed (all, or those of `keys` still
        waiting): owned (a loop's snapshots, a checkpointed region's inputs)."""
        unrecorded = self.profile.unrecorded_bytes
        if keys is None:
            claimed = list(self.pending.items())
            self.pending.clear()  # in place: `_record` holds it
        else:
            claimed = [(key, self.pending.pop(key)) for key in keys if key in self.pending]
        for key, buffer in claimed:
            tracked = self.tracked[key]
            self._count(buffer, tracked, owned=True)
            unrecorded[str(tracked.serial)] = tracked.size
        self._point()

    def _learn_leaf(self, array: Any) -> None:
        """Remember the array of a leaf that requires grad and takes part in the forward
        computation: a parameter or input the caller holds. (Leaves a loop or a checkpointed
        region makes while re-running steps for the backward sweep are its own, not these.)"""
        known = self.leaf_roots.get(id(array))
        if known is not None and known() is array:  # the common case: a parameter seen before
            return
        root = _root(array)
        known = self.leaf_roots.get(id(root))
        if known is None or known() is not root:  # new, or its id reused
            self.leaf_roots[id(root)] = weakref.ref(root)
            self.profile.leaf_bytes += int(getattr(root, "nbytes", 0))
        if root is not array:  # a view of one (a transposed weight): known by id next time
            self.leaf_roots[id(array)] = weakref.ref(array)

    # ------------------------------------------------------------- events
    def _record(self, entry: Any) -> None:
        """One tape entry: count it, and classify and list each value it saved."""
        if self.foreign:
            self.watch.drain()
        if self.packed:
            self._count_packed()
        profile = self.profile
        profile.primitives += 1
        phase = self.phase
        if phase == "forward":
            leaf_roots = self.leaf_roots
            for node in entry.nodes:  # its leaves: learn them (most are known already)
                if node is not None and type(node) is not Entry and isinstance(node, TensorBase):
                    array = node._data
                    known = leaf_roots.get(id(array))
                    if known is None or known() is not array:
                        self._learn_leaf(array)
        elif phase == "recompute":
            profile.recomputed_primitives += 1
        slots = entry._saved
        if isinstance(slots, SavedBuffer):  # one value kept inline: its slot's facts, unmade
            role, position = entry.inline_key()
            self._saved(entry.op.name, role, entry.origin_frame, phase, slots,
                        position >= 0 and entry.nodes[position] is None)
            slots = None
        elif type(slots) is np.ndarray:
            slots = entry.slots
        if slots:
            op, frame, saved = entry.op.name, entry.origin_frame, self._saved
            for slot in slots:
                buffer = slot.buffer
                if buffer is not None:
                    saved(op, slot.name, frame, phase, buffer,
                          slot.edge is None and slot.counter is not None)
        if self.pending:  # saved by reference but held by no slot of this entry
            self._claim_pending()
        else:
            self.points.extend((perf_counter(), self.live, phase))

    def _kept(self, entry: Any, buffer: Any, fresh: bool, role: str | None, unedged: bool,
              frame: Any) -> None:
        """An entry of `record`'s fast path (`events.kept_record`), with its single saved
        value's `buffer` (`fresh`: made for it) or None (its slots were announced by 'pack'
        events, or it saved nothing): what its 'pack' and 'record' events would have done,
        without the events or the entry's slot objects. A fresh buffer, the usual case, is
        tracked and counted here at once (`_pack` then `_saved`, inline, less the wait in
        `pending` that only tells the two events apart)."""
        if buffer is None:
            if entry._saved or self.foreign or self.packed or self.pending:
                self._record(entry)  # slots, counted there
                return
            phase = self._kept_primitive(entry)  # `_record` of an entry that saved nothing
            self.points.extend((perf_counter(), self.live, phase))
            return
        if not fresh or self.foreign or self.packed or self.pending or self.sampling:
            if fresh:  # the events' order of things
                self._pack(buffer)
            self._kept_record(entry, buffer, role, unedged, frame)
            return
        phase = self._kept_primitive(entry)
        array = buffer.packed
        key = id(buffer)
        serial = next(self.counter)
        tracked = Tracked(buffer, self._free)  # `_pack`'s, inline
        tracked.key, tracked.serial, tracked.born_at = key, serial, None
        tracked.level, tracked.stored_id, tracked.evicted = None, None, None
        self.tracked[key] = tracked
        if phase == "forward":
            try:  # noqa: SIM105 (see `_pack`)
                self.originals[serial] = weakref.ref(array)
            except TypeError:
                pass
        # `_saved`'s, inline, for a buffer stored by reference that its record claims
        root, owned = self._claimed(array, unedged)
        fields = self._fields(buffer, array)
        size = fields[3]
        root_id = None
        if owned:
            root_id = id(array)
            roots = self.roots
            held = roots.get(root_id, 0)
            if held:
                size = 0
            roots[root_id] = held + 1
        tracked.counted, tracked.owned, tracked.size, tracked.root_id = True, owned, size, root_id
        tracked.fields = fields
        points = self.points
        if owned:
            tracked.born_at, tracked.born_size = len(points), size
            live = self.live = self.live + size
            if live > self.peak:
                self._new_peak()
            if root is not array:
                self._note_view(buffer, serial, root)
        else:
            self._add(False, size)
        self.raw_records.extend((
            entry.op.name, role, fields[0], fields[1], fields[2], fields[3], frame, serial,
            phase, owned, "device", fields[4]))
        points.extend((perf_counter(), self.live, phase))

    def _fields(self, buffer: Any, array: Any) -> tuple[Any, ...]:
        """(shape, dtype, logical bytes, stored bytes, strategy) of a buffer stored by
        reference, its `array`: for a `KeptBuffer`, one tuple per distinct shape and dtype,
        shared by the buffers' `Tracked.fields` (its shape and size are made anew at each
        read: a long profile holds one of each per distinct value)."""
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

    def _kept_primitive(self, entry: Any) -> str:
        """`_record`'s count of a fast-path entry (and its leaves, in the forward); the phase."""
        profile = self.profile
        profile.primitives += 1
        phase = self.phase
        if phase == "forward":
            self._kept_leaves(entry)
        elif phase == "recompute":
            profile.recomputed_primitives += 1
        return phase

    def _claimed(self, array: Any, unedged: bool) -> tuple[Any, bool]:
        """(root, owned) of a saved value stored by reference: the tape owns it unless its
        root is a leaf's array, or it is a view of data the record has no edge to."""
        root = array if getattr(array, "base", None) is None else _root(array)
        known = self.leaf_roots.get(id(root))
        return root, not ((known is not None and known() is root) or (
            unedged and root is not array))

    def _kept_leaves(self, entry: Any) -> None:
        """`_record`'s leaves, for an entry of one or two inputs (`Entry._in`, `_in2`)."""
        leaf_roots = self.leaf_roots
        for node in (entry._in, entry._in2):
            if node is not None and type(node) is not Entry and isinstance(node, TensorBase):
                array = node._data
                known = leaf_roots.get(id(array))
                if known is None or known() is not array:
                    self._learn_leaf(array)

    def _kept_record(self, entry: Any, buffer: Any, role: str | None, unedged: bool,
                     frame: Any) -> None:
        """`_record` of an entry with one saved value, its slot's facts given."""
        if self.foreign:
            self.watch.drain()
        if self.packed:
            self._count_packed()
        phase = self._kept_primitive(entry)
        self._saved(entry.op.name, role, frame, phase, buffer, unedged)  # type: ignore[arg-type]
        if self.pending:
            self._claim_pending()
        else:
            self.points.extend((perf_counter(), self.live, phase))

    def _replaying(self, _: Any) -> None:
        """A replayed step begins: the values packed before it are counted now, so that those
        packed until its 'replayed' event are its own. (Buffers stored by reference wait on:
        the step's first instruction may claim them, as its first 'record' would.)"""
        if self.foreign:
            self.watch.drain()
        if self.packed:
            self._count_packed()
        self.before_step = list(self.pending) if self.pending else ()

    def _replayed(self, payload: tuple[Any, list[Any], list[Any], tuple[int, ...],
                                      list[Any] | None]) -> None:
        """A replayed loop step, counted as `_record` would count the entries that recording
        it would have made, instruction by instruction, in their order (`DescribedStep`, in
        step_program.py, says what each would hold, the same for every step; the event brings
        this step's saved buffers and values, `made`: the carry slots the previous step
        made, graph values rather than leaves, and `fresh`: the buffers it made, in order,
        when their 'pack' events were not sent). The values it packed are counted in order
        with them: each instruction's before its record, as their 'pack' events were."""
        step, saved, values, made, fresh = payload
        if self.foreign:
            self.watch.drain()
        if fresh:
            self._adopt(fresh)
        profile, phase, points = self.profile, self.phase, self.points
        recomputing = phase == "recompute"
        packed, self.packed = self.packed, []
        n_packed, at = len(packed), 0
        before, self.before_step = self.before_step, ()
        profile.primitives += step.primitives
        if recomputing:
            profile.recomputed_primitives += step.primitives
        forward = phase == "forward"
        # one clock reading for the step's points (read again after a point of its own): a
        # step's instructions are announced at once, at its end
        now = perf_counter()
        for described, kept in zip(step.instructions, saved):
            if described is None:
                continue
            if forward and described.leaves:
                self._replayed_leaves(described.leaves, values, made)
            if kept:
                if at < n_packed:
                    for buffer in kept:
                        if at < n_packed and packed[at] is buffer:
                            self._count(buffer, self.tracked[id(buffer)], owned=True)
                            points.extend((perf_counter(), self.live, phase))
                            at += 1
                    now = perf_counter()
                self._replayed_values(described, kept, phase, made)
            # the step's own buffers stored by reference wait for their instructions; those
            # from before it that its first one did not claim are claimed now, as its first
            # 'record' would have
            if before and any(key in self.pending for key in before):
                self._claim_pending(before)
                now = perf_counter()
            else:
                points.extend((now, self.live, phase))
            before = ()
        if at < n_packed:  # packed by none of its instructions (not expected): as at an event
            self.packed = packed[at:] + self.packed
            self._count_packed()

    def _adopt(self, fresh: list[Any]) -> None:
        """What the 'pack' events of a replayed step's new buffers would have done, in the
        order it made them (`_pack`'s, in one loop: they are all kept as they are, stored by
        reference, so each waits in `pending` for its first record)."""
        if self.sampling:
            for buffer in fresh:
                self._pack(buffer)
            return
        tracked_of, counter, pending, free = self.tracked, self.counter, self.pending, self._free
        originals = self.originals if self.phase == "forward" else None
        for buffer in fresh:
            key = id(buffer)
            serial = next(counter)
            tracked = tracked_of[key] = Tracked(buffer, free)
            tracked.key, tracked.serial, tracked.counted, tracked.born_at = key, serial, False, None
            tracked.level, tracked.stored_id, tracked.evicted, tracked.fields = (
                None, None, None, None)
            if originals is not None:
                try:  # noqa: SIM105 (see `_pack`)
                    originals[serial] = weakref.ref(buffer.packed)
                except TypeError:
                    pass
            pending[key] = buffer

    def _replayed_leaves(self, leaves: tuple[int, ...], values: list[Any],
                         made: tuple[int, ...]) -> None:
        """`_record`'s leaves, for a replayed instruction's leaf slots."""
        leaf_roots = self.leaf_roots
        for slot in leaves:
            if slot not in made:  # a carry the previous step made is no leaf
                array = values[slot]
                known = leaf_roots.get(id(array))
                if known is None or known() is not array:  # else: known already
                    self._learn_leaf(array)

    def _replayed_values(self, described: Any, kept: list[Any], phase: str,
                         made: tuple[int, ...]) -> None:
        """`_saved` for each value one replayed instruction saved. Most are arrays of the
        step's own, kept as they are: neither a view nor a leaf's array, so owned whatever
        their edge (`_claimed`), listed here with the fields their first record found;
        the others go through `_saved`."""
        op, frame = described.op, described.origin
        tracked_of, leaf_roots, records = self.tracked.get, self.leaf_roots, self.raw_records
        for (role, slot, unedged), buffer in zip(described.saved, kept):
            tracked = tracked_of(id(buffer))
            if tracked is not None and type(buffer) is KeptBuffer:
                array = buffer.packed
                known = leaf_roots.get(id(array))
                if getattr(array, "base", None) is None and (
                        known is None or known() is not array):
                    if not tracked.counted and self.pending.pop(tracked.key, None) is not None:
                        # its first record
                        self._count_by_reference(tracked, array, True, self._fields(buffer, array))
                    fields = tracked.fields
                    if tracked.counted and tracked.owned and fields is not None:
                        records.extend((
                            op, role, fields[0], fields[1], fields[2], fields[3], frame,
                            tracked.serial, phase, True, tracked.level or "device", fields[4]))
                        continue
            self._saved(op, role, frame, phase, buffer, unedged and slot not in made)

    def _count_by_reference(self, tracked: Tracked, array: Any, owned: bool,
                            fields: tuple[Any, ...]) -> None:
        """`_count` of a buffer stored by reference (`array`), at its first record, which
        found its `fields` and whether it is `owned` (inline in `_saved` and `_kept`, whose
        every saved value would pay for the call)."""
        root_id = None
        size = fields[3]
        if owned:
            root_id = id(array)
            roots = self.roots
            held = roots.get(root_id, 0)
            if held:
                size = 0
            roots[root_id] = held + 1
        tracked.counted, tracked.owned, tracked.size, tracked.root_id = (
            True, owned, size, root_id)
        tracked.fields = fields
        if owned:
            tracked.born_at, tracked.born_size = len(self.points), size
            self.live += size
            if self.live > self.peak:
                self._new_peak()
        else:
            self._add(False, size)

    def _saved(self, op: str, role: str, frame: Any, phase: str, buffer: Any,
               unedged: bool) -> None:
        """One value an entry saved: classify its buffer (owned, or the caller's memory saved
        by reference), count it if new, and list its record. `unedged`: its tensor is outside
        the graph (no gradient), so a view of another array there is a slice of the caller's
        data (an input's row).

        A buffer saved again (a parameter, by every step) lists the fields its first record
        found (`Tracked.fields`: a buffer's shape, sizes and strategy do not change), and one
        counted as the caller's stays the caller's: nothing is classified again."""
        key = id(buffer)
        tracked = self.tracked.get(key)
        if tracked is not None and tracked.counted and tracked.fields is not None:
            fields = tracked.fields
            if not tracked.owned:
                self.raw_records.extend((
                    op, role, fields[0], fields[1], fields[2], fields[3], frame,
                    tracked.serial, phase, False, tracked.level or "device", fields[4]))
                return
            # owned, stored by reference: listed as such unless this record shows it the
            # caller's (then classified again below)
            array = buffer.packed
            root, owned = self._claimed(array, unedged)
            if owned:
                if root is not array:
                    self._note_view(buffer, tracked.serial, root)
                self.raw_records.extend((
                    op, role, fields[0], fields[1], fields[2], fields[3], frame,
                    tracked.serial, phase, True, tracked.level or "device", fields[4]))
                return
        if buffer.source is None:  # stored as is: the caller's memory, or the tape's?
            array = buffer.packed
            root, owned = self._claimed(array, unedged)
            if tracked is not None and tracked.fields is not None:
                shape, dtype, logical, stored, strategy = tracked.fields
            else:
                shape, dtype, logical, stored, strategy = self._fields(buffer, array)
            if tracked is not None and self.pending.pop(key, None) is not None:
                # `_count_by_reference`, inline (most saved values, one call fewer each)
                root_id = None
                size = stored
                if owned:
                    root_id = id(array)
                    roots = self.roots
                    held = roots.get(root_id, 0)
                    if held:
                        size = 0
                    roots[root_id] = held + 1
                tracked.counted, tracked.owned, tracked.size, tracked.root_id = (
                    True, owned, size, root_id)
                tracked.fields = (shape, dtype, logical, stored, strategy)
                if owned:
                    tracked.born_at, tracked.born_size = len(self.points), size
                    self.live += size
                    if self.live > self.peak:
                        self._new_peak()
                    if root is not array:
                        self._note_view(buffer, tracked.serial, root)
                else:
                    self._add(False, size)
                self.raw_records.extend((
                    op, role, shape, dtype, logical, stored, frame, tracked.serial, phase,
                    owned, "device", strategy))
                return
        else:  # packed: the stored form is a new array
            owned, root = True, None
            shape, dtype = buffer.shape, buffer.dtype
            logical, stored = buffer.logical_nbytes, buffer.stored_nbytes
            strategy = type(buffer.packer).__name__
        if tracked is None:  # saved before profiling began: known from now on
            tracked = self.watch.track(buffer, key, next(self.counter))
        elif self.pending.pop(key, None) is not None:
            self._count(buffer, tracked, owned, stored)
        elif tracked.counted:  # one buffer, one classification...
            if tracked.owned and not owned:  # ...but claimed as owned before its entry
                self.live -= tracked.size
                tracked.owned = False
                self._add(False, tracked.size)
            owned = tracked.owned
        if tracked.counted and root is not None:  # stored by reference: see above
            tracked.fields = (shape, dtype, logical, stored, strategy)
        if owned and root is not None and root is not array:
            self._note_view(buffer, tracked.serial, root)
        self.raw_records.extend((
            op, role, shape, dtype, logical, stored, frame, tracked.serial, phase, owned,
            tracked.level or "device", strategy,
        ))

    def _note_view(self, buffer: Any, serial: int, root: Any) -> None:
        """A saved view keeps its whole base (`root`) alive: note the bytes beyond the view's
        own (once per base, and not if the base is itself a saved value the tape owns)."""
        key = id(root)
        known = self.view_roots.get(key)
        if (known is not None and (known is _BY_ID or known() is root)) or self.roots.get(key):
            return
        try:
            self.view_roots[key] = weakref.ref(root)
        except TypeError:  # no weak references: known by id (a later base may reuse it)
            self.view_roots[key] = _BY_ID
        extra = int(getattr(root, "nbytes", 0)) - buffer.stored_nbytes
        if extra > 0:
            self.profile.view_base_bytes[str(serial)] = extra

    def _apply(self, _: Any) -> None:
        self.profile.primitives += 1
        if self.recompute_depth:
            self.profile.recomputed_primitives += 1

    def _pack(self, buffer: Any) -> None:
        if self.foreign:
            self.watch.drain()
        key = id(buffer)
        serial = next(self.counter)
        # `Watch.track`, inline (one call fewer per saved value)
        tracked = Tracked(buffer, self._free)
        tracked.key, tracked.serial, tracked.counted, tracked.born_at = key, serial, False, None
        tracked.level, tracked.stored_id, tracked.evicted, tracked.fields = None, None, None, None
        self.tracked[key] = tracked
        source = buffer.source
        if self.phase != "forward":  # re-run values: the tape's own
            pass
        elif source is None or source() is buffer.packed:  # stored as is
            try:  # noqa: SIM105 (not contextlib.suppress: a context manager per value)
                self.originals[serial] = weakref.ref(buffer.packed)
            except TypeError:  # no weak references: not judged
                pass
        else:
            self.originals[serial] = source
            self.packed_originals.add(serial)
        if self.sampling:
            self.probe.sample()
        if source is None:  # stored by reference: its record says whose memory it is
            self.pending[key] = buffer
            return
        tracked.stored_id = id(buffer.packed)
        self.by_stored[tracked.stored_id] = key
        self.packed.append(buffer)  # counted at the next other event (`_count_packed`)

    def _free(self, tracked: Tracked, drained: bool = False) -> None:
        """A tracked buffer died: its weak reference's callback (`drained`: the death was
        heard in another thread, and is counted now, in this one; see `Watch`)."""
        if not drained:  # the protocol `Watch` describes, inline: one call per death
            if self.tracked.pop(tracked.key, None) is None:  # closed meanwhile
                return
            if get_ident() != self.thread:
                self.foreign.append(tracked)
                return
            if self.foreign:  # those died first
                self.watch.drain()
        if self.packed:  # as `_settled` does
            self._count_packed()
        if self.pending:  # (a buffer dying unclaimed was owned)
            self._claim_pending()
        if tracked.stored_id is not None:
            self.by_stored.pop(tracked.stored_id, None)
        if tracked.level is not None:
            self._add_level(tracked.level, -tracked.level_size)
        if not tracked.counted:
            return
        size = tracked.size
        if tracked.owned:
            self.live -= size
            serial = tracked.serial
            if serial in self.originals:
                self.released.add(serial)
            born_at = tracked.born_at
            if born_at is not None and born_at <= self.peak_at:
                self.freed_since_peak.extend((serial, tracked.born_size))
        else:
            self.live_aliased -= size
            if tracked.born_at is not None:  # owned when counted: listed at the peak as such
                self.freed_reclassified.append((tracked.born_at, tracked.serial,
                                                tracked.born_size))
        root_id = tracked.root_id
        if root_id is not None:
            roots = self.roots
            if roots[root_id] == 1:
                del roots[root_id]
            else:
                roots[root_id] -= 1
        if self.sampling:
            self.probe.sample()
        self.points.extend((perf_counter(), self.live, self.phase))

    def _tracked_stored(self, stored: Any) -> Tracked | None:
        """The counted buffer whose stored form is `stored`, if any."""
        key = self.by_stored.get(id(stored)) if stored is not None else None
        tracked = self.tracked.get(key) if key is not None else None
        return tracked if tracked is not None and tracked.counted else None

    def _evict(self, stored: Any) -> None:
        """A pool dropped the array of a saved value (it is recomputed when needed): its
        bytes leave the tape until it is rematerialized or freed."""
        self.profile.evictions += 1
        tracked = self._tracked_stored(stored)
        if tracked is None or tracked.evicted is not None:
            return
        size = tracked.evicted = tracked.size
        tracked.size = 0
        self._add(tracked.owned, -size)
        self._point()

    def _rematerialize(self, stored: Any) -> None:
        """One primitive re-run to bring an evicted value back; a saved value's bytes return."""
        self.profile.rematerializations += 1
        tracked = self._tracked_stored(stored)
        if tracked is None or tracked.evicted is None:
            return
        size, tracked.evicted = tracked.evicted, None
        tracked.size = size
        self._add(tracked.owned, size)
        self._point()

    def _io_write(self, nbytes: int) -> None:
        self.profile.io_bytes_written += nbytes

    def _io_read(self, nbytes: int) -> None:
        self.profile.io_bytes_read += nbytes

    def _io_stall(self, seconds: float) -> None:
        self.profile.io_stall_seconds += seconds

    def _planned(self, payload: tuple[float, int]) -> None:
        """A dry run ended (unheard while it ran): its seconds are planning, taken out of the
        phase it ran within (a scan planned inside a backward sweep or a recompute)."""
        seconds, held = payload
        profile = self.profile
        profile.plan_seconds += seconds
        profile.plans += 1
        profile.plan_tape_bytes = max(profile.plan_tape_bytes, held)
        if self.backward_depth:
            self.backward_started += seconds
        if self.recompute_depth:
            self.recompute_started += seconds

    def _backward_begin(self, _: Any) -> None:
        if self.backward_depth == 0 and self.recompute_depth == 0:
            synchronize(self.device)
            self._sample_rss()
            self.backward_started = time.perf_counter()
        self.backward_depth += 1
        self._set_phase()

    def _backward_end(self, _: Any) -> None:
        self.backward_depth -= 1
        self._set_phase()
        if self.backward_depth == 0 and self.recompute_depth == 0:
            synchronize(self.device)
            self.profile.backward_seconds += time.perf_counter() - self.backward_started
            self._sample_rss()

    def _recompute_begin(self, _: Any) -> None:
        if self.recompute_depth == 0:
            synchronize(self.device)
            self.recompute_started = time.perf_counter()
        self.recompute_depth += 1
        self._set_phase()

    def _recompute_end(self, _: Any) -> None:
        self.recompute_depth -= 1
        self._set_phase()
        if self.recompute_depth == 0:
            synchronize(self.device)
            self.profile.recompute_seconds += time.perf_counter() - self.recompute_started

    # ------------------------------------------------------------- lifetime
    def start(self) -> None:
        self._sample_rss()
        self.profile.rss_start_bytes = self.profile.rss_peak_bytes
        self.probe.start()
        self.profile.memory_source = self.probe.source
        synchronize(self.device)
        self.started = self.gathered.started = time.perf_counter()
        self._point()
        self.profile.__dict__["_fill"] = self.gathered

    def stop(self) -> None:
        self.watch.drain()  # frees heard from other threads
        if self.packed:
            self._count_packed()
        if self.pending:
            self._claim_pending()
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        self._point()
        self.profile.forward_seconds = max(
            elapsed - self.profile.backward_seconds - self.profile.plan_seconds, 0.0)
        self.profile.device_peak_bytes = self.probe.stop()
        self._sample_rss()
        self.profile.level_peak_bytes["device"] = self.profile.peak_tape_bytes
        freed = self.freed_since_peak
        at_peak = list(zip(freed[0::2], freed[1::2])) + [
            (t.serial, t.born_size) for t in self.tracked.values()
            if t.born_at is not None and t.born_at <= self.peak_at] + [
            (serial, size) for born, serial, size in self.freed_reclassified
            if born <= self.peak_at]
        self.watch.close()
        self.gathered.judge = partial(judge_buffers, self.originals, self.packed_originals,
                                      self.released, at_peak)
        self.gathered.ended = True


_BY_ID: Any = object()  # a base known by its id alone (`_note_view`)


def _root(array: Any) -> Any:
    """The array that owns `array`'s memory (numpy and cupy views keep it as `.base`)."""
    base = getattr(array, "base", None)
    while base is not None and hasattr(base, "shape"):  # not a bytes or mmap owner
        array, base = base, getattr(base, "base", None)
    return array


@contextmanager
def profile(
    device: str = "cpu", device_memory: bool | None = None, **meta: Any
) -> Iterator[Profile]:
    """Profile the tape of everything run inside the block.

    Yields the `Profile`, which is complete when the block exits. Nothing is measured, and
    nothing costs, outside such a block. `device_memory` also measures the device's peak
    allocation (`Profile.device_peak_bytes`; `Profile.memory_source` says how): cupy's pool
    on a GPU, which costs little and is on by default there; tracemalloc on the CPU, which
    traces every allocation and slows numpy-heavy code several times over, so it is off
    unless asked for (the sweeps ask for it, and time their runs apart).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.profile(model="demo") as prof:
    ...     cad.tanh(x).sum().backward()
    >>> prof.peak_tape_bytes, prof.records[0].op
    (8, 'tanh')
    """
    result = Profile(device=device, meta=dict(meta))
    if device_memory is None:
        device_memory = device.startswith("cuda")
    recorder = _Recorder(result, device, bool(device_memory))
    recorder.start()
    unsubscribe = events.subscribe_handlers(recorder.handlers)
    try:
        yield result
    finally:
        unsubscribe()
        recorder.stop()
