"""`profile()`: listen to the engine's events and fill a `Profile` while a block runs.

Owned and aliased bytes: a saved value stored by reference whose memory belongs to a leaf the
caller holds anyway (a parameter, a slice of the input data) costs nothing a strategy could
save, so it is counted apart (`Profile.aliased_bytes`), not in `peak_tape_bytes`. Which one a
buffer is can only be told from the slot that saved it, so a buffer stored by reference waits
(uncounted) from its 'pack' event to the 'record' event of its entry, which follows at once in
the engine; one that no record claims before the next other event is owned.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from .. import events
from ..tensor_base import TensorBase
from .gathered import Gathered, judge_buffers
from .memory import MemoryProbe, probe_for, rss_bytes, synchronize
from .records import Profile


class _Recorder:
    """The event listener: keeps live saved bytes, phases and records up to date.

    `handlers` maps each event kind it hears to one method (add a kind: add a method and a
    line there). It runs inside the profiled program, so it keeps raw tuples (`Gathered`),
    turned into the profile's records and timeline when those are read.
    """

    def __init__(self, profile: Profile, device: str, device_memory: bool) -> None:
        self.profile = profile
        self.device = device
        self.probe = probe_for(device, device_memory)
        self.sampling = type(self.probe).sample is not MemoryProbe.sample
        self.serials: dict[int, int] = {}  # id(buffer) -> serial (ids are reused; serials not)
        # id(buffer) -> (owned, bytes counted, id of its array if owned and by reference)
        self.counted: dict[int, tuple[bool, int, int | None]] = {}
        self.roots: dict[int, int] = {}  # id(array) -> live owned buffers holding it
        self.pending: dict[int, Any] = {}  # id(buffer) -> buffer stored by reference, unclaimed
        self.leaf_roots: dict[int, Any] = {}  # id(root array) -> weakref of a caller's leaf's
        self.counter = itertools.count()
        # packed buffers by their stored form, for events about a stored form (an eviction)
        self.by_stored: dict[int, int] = {}  # id(stored form) -> id(buffer)
        self.stored_of: dict[int, int] = {}  # id(buffer) -> id(stored form)
        self.evicted: dict[int, int] = {}  # id(buffer) -> bytes an eviction took off
        self.level_live: dict[str, int] = {}  # owned stored bytes off the device, per level
        self.levels: dict[int, tuple[str, int]] = {}  # id(buffer) -> (level, bytes) if off it
        # a saved buffer that dies in a reference cycle is freed by whichever thread's
        # allocation triggers the collector (in a Dask worker, its event loop's): its 'free'
        # must not interleave with this thread's handlers, or a count is lost; reentrant, as
        # the collector may also run inside one of this thread's own handlers
        self.lock = threading.RLock()
        self.live = 0
        self.live_aliased = 0
        self.peak = 0
        self.backward_depth = 0
        self.recompute_depth = 0
        self.phase = "forward"
        self.backward_started = 0.0
        self.recompute_started = 0.0
        # what `explain` needs: serial -> (weakref of the original array, stored packed?)
        self.originals: dict[int, tuple[Any, bool]] = {}
        self.released: set[int] = set()  # serials of owned buffers the tape let go of
        self.view_roots: set[int] = set()  # id(base array) of saved views, counted once
        # live owned buffers: serial -> (timeline index when counted, bytes counted), and
        # those freed since the latest new peak that were alive at it: together, what the
        # tape owned at its peak, in memory bounded by what is alive
        self.born: dict[int, tuple[int, int]] = {}
        self.freed_since_peak: list[tuple[int, int]] = []
        self.peak_at = 0  # timeline index of the latest new peak
        self.gathered = Gathered()
        self.raw_records = self.gathered.records
        self.points = self.gathered.points
        self.handlers: dict[str, Callable[[Any], None]] = {
            "record": self._record,
            "pack": self._pack,
            "apply": self._settled(self._apply),
            "free": self._free,  # settles pending buffers itself: the most frequent kind
            "backward_begin": self._settled(self._backward_begin),
            "backward_end": self._settled(self._backward_end),
            "recompute_begin": self._settled(self._recompute_begin),
            "recompute_end": self._settled(self._recompute_end),
            "evict": self._settled(self._evict),
            "rematerialize": self._settled(self._rematerialize),
            "io_write": self._settled(self._io_write),
            "io_read": self._settled(self._io_read),
            "io_stall": self._settled(self._io_stall),
        }
        self.handlers = {kind: self._locked(h) for kind, h in self.handlers.items()}

    def _locked(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        lock = self.lock

        def locked(payload: Any) -> None:
            with lock:
                handler(payload)
        return locked

    def _settled(self, handler: Callable[[Any], None]) -> Callable[[Any], None]:
        """`handler`, first claiming the buffers stored by reference that no 'record' came
        for: every kind but 'pack' and 'record' ends that wait."""
        def settled(payload: Any) -> None:
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
        self.points.append((time.perf_counter() - self.started, self.live, self.phase))

    def _sample_rss(self) -> None:
        rss = rss_bytes()
        if rss is not None and (self.profile.rss_peak_bytes or 0) < rss:
            self.profile.rss_peak_bytes = rss

    def _count(self, buffer: Any, owned: bool) -> None:
        """Start counting a live buffer as owned (tape memory) or aliased (the caller's). A
        buffer stored by reference holding the very array a live owned buffer holds (a loop's
        restored snapshot, saved again by the step re-run from it) adds no bytes."""
        key, size, root_id = id(buffer), buffer.stored_nbytes, None
        if buffer.source is None and owned:
            root_id = id(buffer.packed)
            if self.roots.get(root_id):
                size = 0
            self.roots[root_id] = self.roots.get(root_id, 0) + 1
        if buffer.source is not None:
            level = buffer.packer.stored_level(buffer.packed)
            if level != "device":  # offloaded: counted on its level, not in the tape bytes
                self.levels[key] = (level, size)
                self._add_level(level, size)
                size = 0
        self.counted[key] = (owned, size, root_id)
        if owned:
            serial = self.serials.get(key)
            if serial is not None:
                self.born[serial] = (len(self.points), size)
        self._add(owned, size)

    def _add(self, owned: bool, size: int) -> None:
        if owned:
            self.live += size
            if self.live > self.peak:
                self.peak = self.profile.peak_tape_bytes = self.live
                self.peak_at = len(self.points)
                if self.freed_since_peak:
                    self.freed_since_peak.clear()
        else:
            self.live_aliased += size
            if self.live_aliased > (self.profile.aliased_bytes or 0):
                self.profile.aliased_bytes = self.live_aliased

    def _add_level(self, level: str, size: int) -> None:
        live = self.level_live[level] = self.level_live.get(level, 0) + size
        peaks = self.profile.level_peak_bytes
        peaks[level] = max(peaks.get(level, 0), live)

    def _claim_pending(self) -> None:
        """Buffers stored by reference that no entry claimed: owned (a loop's snapshots, a
        checkpointed region's inputs)."""
        unrecorded = self.profile.unrecorded_bytes
        for key, buffer in self.pending.items():
            self._count(buffer, owned=True)
            unrecorded[str(self.serials[key])] = self.counted[key][1]
        self.pending.clear()
        self._point()

    def _learn_leaves(self, entry: Any) -> None:
        """Remember the arrays of leaves that require grad and take part in the forward
        computation: parameters and inputs the caller holds. (Leaves a loop or a checkpointed
        region makes while re-running steps for the backward sweep are its own, not these.)"""
        leaf_roots = self.leaf_roots
        for edge in entry.edges:
            if edge is not None and isinstance(edge[0], TensorBase):
                root = _root(edge[0]._data)
                known = leaf_roots.get(id(root))
                if known is None or known() is not root:  # new, or its id reused
                    leaf_roots[id(root)] = weakref.ref(root)
                    self.profile.leaf_bytes += int(getattr(root, "nbytes", 0))

    def _is_alias(self, slot: Any, buffer: Any) -> bool:
        """Whether `slot` holds, by reference, memory the caller keeps anyway: an array of a
        leaf that requires grad (or a view of one), or a view (a slice of input data) saved
        for a value with no history. An array of its own with no history (a dropout mask, an
        initial state made inside the model) may be kept alive by the tape alone: owned."""
        if buffer.source is not None:  # packed: the stored form is a new array
            return False
        array = buffer.packed
        root = _root(array)
        known = self.leaf_roots.get(id(root))
        if known is not None and known() is root:
            return True
        return slot.edge is None and slot.counter is not None and root is not array

    # ------------------------------------------------------------- events
    def _record(self, entry: Any) -> None:
        self.profile.primitives += 1
        if self.backward_depth or self.recompute_depth:
            if self.recompute_depth:
                self.profile.recomputed_primitives += 1
        else:
            self._learn_leaves(entry)
        slots = entry.slots
        if slots:
            op, frame, phase = entry.op.name, entry.origin_frame, self.phase
            pending, counted, serials = self.pending, self.counted, self.serials
            for slot in slots:
                buffer = slot.buffer
                if buffer is None:
                    continue
                key = id(buffer)
                owned = buffer.source is not None or not self._is_alias(slot, buffer)
                if key in pending:
                    self._count(pending.pop(key), owned)
                elif key in counted:  # one buffer, one classification...
                    was_owned, size, root_id = counted[key]
                    if was_owned and not owned:  # ...but claimed as owned before its entry
                        self.live -= size
                        counted[key] = (False, size, root_id)
                        self._add(False, size)
                    owned = counted[key][0]
                serial = serials.get(key)
                if serial is None:  # saved before profiling began: known from now on
                    serial = serials[key] = next(self.counter)
                if owned and buffer.source is None:
                    self._note_view(buffer, serial)
                self.raw_records.append((
                    op, slot.name, buffer.shape, buffer.dtype, buffer.logical_nbytes,
                    buffer.stored_nbytes, frame, serial, phase, owned,
                    self.levels[key][0] if key in self.levels else "device",
                    type(buffer.packer).__name__,
                ))
        if self.pending:  # saved by reference but held by no slot of this entry
            self._claim_pending()
        else:
            self.points.append((time.perf_counter() - self.started, self.live, self.phase))

    def _note_view(self, buffer: Any, serial: int) -> None:
        """A saved view keeps its whole base alive: note the bytes beyond the view's own
        (once per base, and not if the base is itself a saved value the tape owns)."""
        array = buffer.packed
        root = _root(array)
        if root is array or id(root) in self.view_roots or self.roots.get(id(root)):
            return
        self.view_roots.add(id(root))
        extra = int(getattr(root, "nbytes", 0)) - buffer.stored_nbytes
        if extra > 0:
            self.profile.view_base_bytes[str(serial)] = extra

    def _apply(self, _: Any) -> None:
        self.profile.primitives += 1
        if self.recompute_depth:
            self.profile.recomputed_primitives += 1

    def _pack(self, buffer: Any) -> None:
        serial = self.serials[id(buffer)] = next(self.counter)
        if self.backward_depth or self.recompute_depth:  # re-run values: the tape's own
            pass
        elif buffer.source is None or buffer.source() is buffer.packed:  # stored as is
            with contextlib.suppress(TypeError):  # no weak references: not judged
                self.originals[serial] = (weakref.ref(buffer.packed), False)
        else:
            self.originals[serial] = (buffer.source, True)
        if self.sampling:
            self.probe.sample()
        if buffer.source is None:  # stored by reference: its record says whose memory it is
            self.pending[id(buffer)] = buffer
            return
        self.by_stored[id(buffer.packed)] = id(buffer)
        self.stored_of[id(buffer)] = id(buffer.packed)
        self._count(buffer, owned=True)
        self._point()

    def _free(self, key: int) -> None:
        if self.pending:  # as `_settled` does (a buffer dying unclaimed was owned)
            self._claim_pending()
        stored = self.stored_of.pop(key, None)
        if stored is not None:
            self.by_stored.pop(stored, None)
            self.evicted.pop(key, None)
        level = self.levels.pop(key, None)
        if level is not None:
            self._add_level(level[0], -level[1])
        counted = self.counted.pop(key, None)
        if counted is None:
            return
        owned, size, root_id = counted
        if owned:
            self.live -= size
            serial = self.serials.get(key)
            if serial is not None:
                if serial in self.originals:
                    self.released.add(serial)
                born = self.born.pop(serial, None)
                if born is not None and born[0] <= self.peak_at:
                    self.freed_since_peak.append((serial, born[1]))
        else:
            self.live_aliased -= size
        if root_id is not None:
            self.roots[root_id] -= 1
            if not self.roots[root_id]:
                del self.roots[root_id]
        self.serials.pop(key, None)
        if self.sampling:
            self.probe.sample()
        self._point()

    def _evict(self, stored: Any) -> None:
        """A pool dropped the array of a saved value (it is recomputed when needed): its
        bytes leave the tape until it is rematerialized or freed."""
        self.profile.evictions += 1
        key = self.by_stored.get(id(stored))
        counted = self.counted.get(key) if key is not None else None
        if counted is None or key in self.evicted:
            return
        owned, size, root_id = counted
        self.evicted[key] = size
        self.counted[key] = (owned, 0, root_id)
        self._add(owned, -size)
        self._point()

    def _rematerialize(self, stored: Any) -> None:
        """One primitive re-run to bring an evicted value back; a saved value's bytes return."""
        self.profile.rematerializations += 1
        key = self.by_stored.get(id(stored)) if stored is not None else None
        size = self.evicted.pop(key, None) if key is not None else None
        if size is None:
            return
        owned, _, root_id = self.counted[key]
        self.counted[key] = (owned, size, root_id)
        self._add(owned, size)
        self._point()

    def _io_write(self, nbytes: int) -> None:
        self.profile.io_bytes_written += nbytes

    def _io_read(self, nbytes: int) -> None:
        self.profile.io_bytes_read += nbytes

    def _io_stall(self, seconds: float) -> None:
        self.profile.io_stall_seconds += seconds

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
        self.started = time.perf_counter()
        self._point()
        self.profile.__dict__["_fill"] = self.gathered

    def stop(self) -> None:
        if self.pending:
            self._claim_pending()
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        self._point()
        self.profile.forward_seconds = max(elapsed - self.profile.backward_seconds, 0.0)
        self.profile.device_peak_bytes = self.probe.stop()
        self._sample_rss()
        self.profile.level_peak_bytes["device"] = self.profile.peak_tape_bytes
        at_peak = self.freed_since_peak + [
            (serial, size) for serial, (born, size) in self.born.items() if born <= self.peak_at]
        self.gathered.judge = partial(judge_buffers, self.originals, self.released, at_peak)
        self.gathered.ended = True


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
