"""`profile()`: hear the engine's events while a block runs, and log what they say.

The recorder runs inside the profiled program, so what it spends there the profile would
measure. It does only what needs the live objects: which buffer is which (a weak reference
each, `watch.Tracked`, that also hears it die), whether a saved array is the caller's (a leaf's
array, or a slice of data outside the graph) or a view keeping a larger base alive (those
answers are its base class's, `saved_facts.SavedFacts`), the forward's originals that
`explain` judges, what each entry saved. It logs those facts, with a clock reading, in one
flat list; live and peak bytes, records and timeline are counted from that log by the
accountant (accountant.py) when the profile is first read.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from threading import get_ident
from time import perf_counter
from typing import Any

import numpy as np

from .. import events
from ..origins import origin_text
from ..saved import KeptBuffer, SavedBuffer
from .accountant import (
    APPLY,
    BY_REFERENCE,
    END,
    EVICT,
    FREE,
    KEPT,
    NOTHING,
    ORIGINAL,
    PACKED,
    PHASE,
    POINT,
    QUIET,
    RECORD,
    REMATERIALIZE,
    REPLAYED,
    REPLAYING,
    SETTLE,
    TRACK,
    make_accountant,
)
from .cycles import collect_cycles
from .memory import MemoryProbe, TracemallocProbe, probe_for, rss_bytes, synchronize
from .records import Profile
from .saved_facts import SavedFacts, _root
from .watch import Tracked


class _Recorder(SavedFacts):
    """The event listener: snapshots what each event says into `log`. How each saved value is
    described (its fields, whose memory it is) is its base's, `SavedFacts`.

    `handlers` maps each event kind it hears to one method (add a kind: add a method, a line
    there, and its log entry's opcode and reading in accountant.py). Every log entry is
    written by one `extend` call, once its handler has read everything it needs: a buffer
    dying meanwhile (the collector runs at any allocation, in any thread) logs its death
    whole, before or after it, never inside it.
    """

    def __init__(self, profile: Profile, device: str, device_memory: bool) -> None:
        super().__init__()
        self.profile = profile
        self.device = device
        self.probe = probe_for(device, device_memory)
        self.sampling = type(self.probe).sample is not MemoryProbe.sample
        # the probe counts this process's own allocations, the log's among them (tracemalloc;
        # cupy's pool does not): the log is accounted for as it grows (see `_sample`)
        self.bounded = type(self.probe) is TracemallocProbe
        self.measuring = self.sampling or self.bounded
        self.log: list[Any] = []
        self.thread = get_ident()  # the one whose events it hears
        self.tracked: dict[int, Tracked] = {}  # id(buffer) -> its reference, while alive
        self.by_stored: dict[int, Tracked] = {}  # id(stored form) -> a packed buffer's
        self.counter = itertools.count()  # buffer serials (ids are reused; serials not)
        self.backward_depth = 0
        self.recompute_depth = 0
        self.phase = "forward"
        self.forward = True  # the phase is the forward
        # entries and applied primitives saving nothing, not logged one by one: counted, and
        # logged as one number at the next phase change or read (`_flush_quiet`)
        self.quiet = 0
        # a buffer was logged since the latest entry: the next entry, saving or not, is
        # logged, since it settles that buffer (counts it, or claims it as the tape's)
        self.unsettled = False
        self.step_plans: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # id(step) -> `_plan`
        self.backward_started = 0.0
        self.recompute_started = 0.0
        self.handlers: dict[str, Callable[..., None]] = {
            events.KEPT: self._kept,
            "record": self._record,
            "replaying": self._replaying,
            "replayed": self._replayed,
            "pack": self._pack,
            "apply": self._apply,
            "backward_begin": self._backward_begin,
            "backward_end": self._backward_end,
            "recompute_begin": self._recompute_begin,
            "recompute_end": self._recompute_end,
            "evict": self._evict,
            "rematerialize": self._rematerialize,
            "io_write": self._io_write,
            "io_read": self._io_read,
            "io_stall": self._io_stall,
            "loop_arrays": self._loop_arrays,
            "planned": self._planned,
            "traced_step": self._traced_step,
        }

    # ------------------------------------------------------------- buffers
    def _tracked(self, buffer: Any, opcode: int) -> Tracked:
        """Start watching a live buffer, and log it under `opcode` (BY_REFERENCE or PACKED,
        as it is stored; or TRACK): its serial, stored bytes, and the id of the array it holds
        by reference, or the storage level of its packed form."""
        key = id(buffer)
        t = Tracked(buffer, self._free)
        t.key, t.serial, t.seen = key, next(self.counter), None
        packed = buffer.packed
        stored = buffer.stored_nbytes
        if buffer.source is None:  # stored as is: its records say whose memory it is
            t.facts, t.stored_id = None, None
            if opcode != TRACK:
                opcode = BY_REFERENCE
            self.log.extend((opcode, t.serial, True, stored, id(packed)))
        else:
            t.facts = (buffer.shape, buffer.dtype, buffer.logical_nbytes, stored,
                       type(buffer.packer).__name__)
            t.stored_id = id(packed)
            self.by_stored[t.stored_id] = t
            if opcode != TRACK:
                opcode = PACKED
            self.log.extend((opcode, t.serial, False, stored,
                             buffer.packer.stored_level(packed)))
        self.tracked[key] = t
        return t

    # ------------------------------------------------------------- events
    def _kept(self, entry: Any, buffer: Any, fresh: bool, role: str | None, unedged: bool,
              frame: Any) -> None:
        """An entry of `record`'s fast path (`events.kept_record`), with its single saved
        value's `buffer` (`fresh`: made for it) or None (its slots were announced by 'pack'
        events, or it saved nothing): what its 'pack' and 'record' events would have logged,
        without the events or the entry's slot objects. An entry that saved nothing is only
        counted, unless a buffer waits to be settled (see `unsettled`)."""
        if self.forward:  # its one or two inputs' leaves
            self._learn_leaves((entry._in, entry._in2))
        if buffer is None:
            if entry._saved:
                self._record(entry, leaves=False)
            elif self.unsettled:
                self.unsettled = False
                self.log.extend((NOTHING, perf_counter()))
            else:
                self.quiet += 1
            return
        self.unsettled = False
        if not fresh:
            self.log.extend((RECORD, entry.op.name, frame,
                             self._describe(buffer, role, unedged), perf_counter()))
            return
        array = buffer.packed
        key = id(buffer)
        t = Tracked(buffer, self._free)  # `_tracked`'s, inline: logged with its entry below
        t.key, t.serial, t.stored_id, t.facts, t.seen = key, next(self.counter), None, None, None
        self.tracked[key] = t
        original = _original(array) if self.forward else None
        if self.measuring:
            self._sample()
        serial, role, owned, view, fields = self._describe(buffer, role, unedged)
        self.log.extend((KEPT, serial, id(array), original, fields, entry.op.name, frame, role,
                         owned, view, perf_counter()))

    def _record(self, entry: Any, leaves: bool = True) -> None:
        """One tape entry: its leaves learned (unless `_kept` did), each value it saved
        described."""
        self.unsettled = False
        if leaves and self.forward:
            self._learn_leaves(entry.nodes)
        saved: Any = ()
        slots = entry._saved
        if isinstance(slots, SavedBuffer):  # one value kept inline: its slot's facts, unmade
            role, position = entry.inline_key()
            saved = self._describe(slots, role, position >= 0 and entry.nodes[position] is None)
            slots = None
        elif type(slots) is np.ndarray:
            slots = entry.slots
        if slots:
            saved = []
            describe = self._describe
            for slot in slots:
                buffer = slot.buffer
                if buffer is not None:
                    saved.extend(describe(buffer, slot.name,
                                          slot.edge is None and slot.counter is not None))
        self.log.extend((RECORD, entry.op.name, entry.origin_frame, saved, perf_counter()))

    def _sample(self) -> None:
        """Sample the device's memory at a new buffer, when measuring it, and account for the
        log so far once it is long: the allocator would otherwise count the log's growth as
        the program's."""
        if self.sampling:
            self.probe.sample()
        if self.bounded and len(self.log) > _LOG_UNDER_PROBE:
            self.account(self.profile)

    def _pack(self, buffer: Any) -> None:
        t = self._tracked(buffer, PACKED)
        self.unsettled = True
        if self.forward:  # (re-run values are the tape's own)
            source = buffer.source
            if source is None or source() is buffer.packed:  # stored as is
                original = _original(buffer.packed)
                if original is not None:
                    self.log.extend((ORIGINAL, t.serial, original, False))
            else:
                self.log.extend((ORIGINAL, t.serial, source, True))
        if self.measuring:
            self._sample()

    def _replaying(self, _: Any) -> None:
        self.log.extend((REPLAYING, perf_counter()))

    def _replayed(self, payload: tuple[Any, list[Any], list[Any], tuple[int, ...],
                                      list[Any] | None]) -> None:
        """A replayed loop step (`DescribedStep`, in step_profiled.py, says what each of its
        instructions would record, the same for every step; the event brings this step's
        saved buffers per instruction and its values, `made`: the carry slots the previous
        step made, graph values rather than leaves, and `fresh`: the buffers it made, in
        order, when their 'pack' events were not sent): each saved value described, in
        order, as recording it would have (an instruction saves one buffer per value its
        description lists)."""
        step, saved, values, made, fresh = payload
        plan = self.step_plans.get(id(step))
        if plan is None or plan[0] is not step:
            plan = self.step_plans[id(step)] = (step, _plan(step))
        adopted = self._adopt(fresh) if fresh else ()
        forward = self.forward
        tracked_of, leaf_roots, describe = self.tracked.get, self.leaf_roots, self._describe
        flat: list[Any] = []
        for i, leaves, described_saved in plan[1]:
            if forward and leaves:
                self._replayed_leaves(leaves, values, made)
            kept = saved[i]
            if not kept:
                continue
            for (role, slot, unedged), buffer in zip(described_saved, kept):
                # most are arrays of the step's own, kept as they are: neither a view nor a
                # leaf's array, so owned whatever their edge (`_describe`, inline)
                t = tracked_of(id(buffer))
                if t is not None and type(buffer) is KeptBuffer:
                    array = buffer.packed
                    if array.base is None:
                        known = leaf_roots.get(id(array))
                        if known is None or known() is not array:
                            facts = t.facts
                            if facts is None:
                                facts = t.facts = self._fields(buffer, array)
                            flat.extend((t.serial, role, True, None, facts))
                            continue
                flat.extend(describe(buffer, role, unedged and slot not in made))
        self.unsettled = False
        self.log.extend((REPLAYED, step, adopted, flat, perf_counter()))

    def _adopt(self, fresh: list[Any]) -> list[Any]:
        """A replayed step's new buffers watched, in the order it made them (all kept as they
        are, stored by reference: `_tracked`'s, in one loop): (serial, stored bytes, id of
        the array) of each, flat."""
        tracked_of, counter, free, measuring = (
            self.tracked, self.counter, self._free, self.measuring)
        forward = self.forward
        adopted: list[Any] = []
        for buffer in fresh:
            key = id(buffer)
            t = tracked_of[key] = Tracked(buffer, free)
            array = buffer.packed
            serial = next(counter)
            t.key, t.serial, t.facts, t.stored_id, t.seen = key, serial, None, None, None
            if measuring:
                self._sample()
            adopted.extend((serial, array.nbytes if type(array) is np.ndarray
                            else buffer.stored_nbytes, id(array),
                            _original(array) if forward else None))
        return adopted

    def _free(self, t: Tracked) -> None:
        """A watched buffer died (its reference's callback, in whichever thread the collector
        ran: one `extend` of the log, which needs no lock)."""
        if self.tracked.pop(t.key, None) is None:  # the block ended meanwhile
            return
        if t.stored_id is not None:
            self.by_stored.pop(t.stored_id, None)
        if self.sampling:
            self.probe.sample()
        self.log.extend((FREE, t.serial, perf_counter()))

    def _apply(self, _: Any) -> None:
        if self.unsettled:
            self.unsettled = False
            self.log.extend((APPLY, perf_counter()))
        else:
            self.quiet += 1

    def _evict(self, stored: Any) -> None:
        """A pool dropped the array of a saved value (it is recomputed when needed)."""
        t = self.by_stored.get(id(stored)) if stored is not None else None
        self.log.extend((EVICT, None if t is None else t.serial, perf_counter()))

    def _rematerialize(self, stored: Any) -> None:
        """One primitive re-run to bring an evicted value back."""
        t = self.by_stored.get(id(stored)) if stored is not None else None
        self.log.extend((REMATERIALIZE, None if t is None else t.serial, perf_counter()))

    def _io_write(self, nbytes: int) -> None:
        self.profile.io_bytes_written += nbytes
        self.log.extend((SETTLE, perf_counter()))

    def _io_read(self, nbytes: int) -> None:
        self.profile.io_bytes_read += nbytes
        self.log.extend((SETTLE, perf_counter()))

    def _io_stall(self, seconds: float) -> None:
        self.profile.io_stall_seconds += seconds
        self.log.extend((SETTLE, perf_counter()))

    def _loop_arrays(self, payload: tuple[int, int, Any]) -> None:
        """A `scan` ended: its stacked outputs and the input gradient its backward fills,
        arrays no saved value is (see `profiler.process`)."""
        stacked, filled, origin = payload
        line = origin_text(origin) if origin is not None else "<unknown>"
        arrays = self.profile.loop_arrays
        arrays[line] = arrays.get(line, 0) + stacked + filled

    def _traced_step(self, tensors: list[Any]) -> None:
        """A loop step traced for its step program returned: every value it made was held
        while it ran (the trace keeps them). Logged for the step holding the most with the
        owned tape beside it: the bytes of its values that no saved buffer holds and no leaf
        is, which the tape does not show, and the owned tape then."""
        saved: set[int] = set()
        tape: dict[int, int] = {}
        for t in list(self.tracked.values()):
            buffer = t()
            if buffer is not None:
                root = _root(buffer.packed)
                saved.add(id(root))
                if t.seen is None or t.seen[2]:  # owned (not the caller's, by reference)
                    tape[id(root)] = int(buffer.stored_nbytes)
        leaves = self.leaf_roots
        made: dict[int, int] = {}
        for tensor in tensors:
            array = _root(getattr(tensor, "_data", None))
            if array is not None and id(array) not in saved and id(array) not in leaves:
                made[id(array)] = int(getattr(array, "nbytes", 0))
        profile, unsaved, owned = self.profile, sum(made.values()), sum(tape.values())
        if unsaved + owned > profile.traced_step_bytes + profile.traced_tape_bytes:
            profile.traced_step_bytes, profile.traced_tape_bytes = unsaved, owned

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
        self.log.extend((SETTLE, perf_counter()))

    # ------------------------------------------------------------- phases
    def _set_phase(self) -> None:
        self._flush_quiet()  # counted in the phase they ran in
        if self.recompute_depth:
            self.phase = "recompute"
        else:
            self.phase = "backward" if self.backward_depth else "forward"
        self.forward = self.phase == "forward"
        self.log.extend((PHASE, self.phase, perf_counter()))

    def _flush_quiet(self) -> None:
        """Log the entries counted but not logged since the last call (`quiet`)."""
        if self.quiet:
            quiet, self.quiet = self.quiet, 0
            self.log.extend((QUIET, quiet))

    def _before_reading(self) -> None:
        """The profile is read during the block: what `quiet` counted is logged first, unless
        it is read from another thread (`quiet` is this thread's to change: such a read counts
        the entries logged up to the latest phase change)."""
        if get_ident() == self.thread:
            self._flush_quiet()

    def _sample_rss(self) -> None:
        rss = rss_bytes()
        if rss is not None and (self.profile.rss_peak_bytes or 0) < rss:
            self.profile.rss_peak_bytes = rss

    def _backward_begin(self, _: Any) -> None:
        if self.backward_depth:  # a loop's or a region's pull-back, within the sweep
            self.profile.nested_sweeps += 1
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
        self.log.extend((POINT, self.started))
        self.account = make_accountant(self.profile, self.log, self.started,
                                       self._before_reading)

    def stop(self) -> None:
        synchronize(self.device)
        ended = time.perf_counter()
        self._flush_quiet()
        self.log.extend((END, ended))
        self.tracked.clear()  # deaths from now on are not this profile's
        self.by_stored.clear()
        profile = self.profile
        profile.forward_seconds = max(
            ended - self.started - profile.backward_seconds - profile.plan_seconds, 0.0)
        if self.bounded:  # tracemalloc: cycles' arrays can be traced to their lines
            profile.cycle_bytes, profile.cycle_lines = collect_cycles()
        profile.device_peak_bytes = self.probe.stop()
        self._sample_rss()
        self._count_leaves()


def _plan(step: Any) -> tuple[tuple[int, tuple[int, ...], tuple[Any, ...]], ...]:
    """What `_replayed` reads of a replayed step's description, made once per description:
    (index, leaf slots, saved values' (role, slot, unedged)) of each instruction that records
    an entry with leaves or saved values."""
    return tuple((i, d.leaves, d.saved) for i, d in enumerate(step.instructions)
                 if d is not None and (d.leaves or d.saved))


# log items at which a recorder measuring device memory accounts for its log (a few kB: the
# accountant's records and timeline, which grow as the program runs, are smaller)
_LOG_UNDER_PROBE = 1024


def _original(array: Any) -> Any:
    """A weak reference to a forward value's array, for `explain` (None if it takes none)."""
    try:
        return weakref.ref(array)
    except TypeError:
        return None


@contextmanager
def profile(
    device: str = "cpu", device_memory: bool | None = None, **meta: Any
) -> Iterator[Profile]:
    """Profile the tape of everything run inside the block.

    Yields the `Profile`, which is complete when the block exits. Nothing is measured, and
    nothing costs, outside such a block. Inside it, the program pays only for a log of what
    the engine did; live and peak bytes, records and the timeline are counted from that log
    the first time one of them is read (during the block or after it), outside the run.

    `device_memory` also measures the device's peak allocation (`Profile.device_peak_bytes`;
    `Profile.memory_source` says how): cupy's pool on a GPU, which costs little and is on by
    default there; tracemalloc on the CPU, which traces every allocation and slows
    numpy-heavy code several times over, so it is off unless asked for (the sweeps ask for
    it, and time their runs apart). Under tracemalloc the log is accounted for as it grows,
    so that its own memory does not pass for the program's.

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
