"""The profile's accounting, done when the profile is read rather than while the program runs.

The recorder (recorder.py) hears the engine's events inside the profiled program, so every
instruction it spends there is a cost the profile would then measure. It only writes what it
saw to a flat log: each entry's saved values, already classified (whether the tape owns each
one or it is the caller's memory: only the live objects can say), the buffers it packed, the
deaths of buffers, phase changes, with a clock reading each. This module reads that log, in
order, and keeps what the profile reports: live and peak tape bytes, per-level bytes, the
records and the timeline, primitive counts, what `explain` reads. It runs at the first read of
any of those fields (`records._Filled`), during the block or after it, and again for what was
logged since.

Owned and aliased bytes: a saved value stored by reference whose memory belongs to a leaf the
caller holds anyway (a parameter, a slice of the input data) costs nothing a strategy could
save, so it is counted apart (`Profile.aliased_bytes`), not in `peak_tape_bytes`. Which one a
buffer is can only be told from the entry that saved it, so a buffer stored by reference waits
(uncounted) from its packing to the record of its entry, which follows at once in the engine;
one that no record claims before the next other event is owned (a loop's snapshots, a
checkpointed region's inputs). The counting itself (live and peak bytes, aliases once per
array, storage levels, the timeline's points) is `live_bytes.LiveBytes`, the accountant's base.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .gathered import JUDGED, judge_buffers, settle_raw
from .live_bytes import Buffer, LiveBytes

# What the log holds: an opcode, then the items its line names (`time`: perf_counter() then;
# `serial`: a buffer's number; `new buffer`: serial, stored by reference?, stored bytes, then
# the id of the array it holds by reference or the storage level of its packed form; a saved
# value's description is (serial, role, owned, view, fields): `owned` as its entry's record
# classified it, `view` None or (serial of the base array, id of the base, bytes of the base
# beyond the view), `fields` what its record lists (shape, dtype, logical bytes, stored
# bytes, strategy)).
POINT = 0  # time: a timeline point (the block begins)
BY_REFERENCE = 1  # new buffer: stored as is, waiting for its record to say whose it is
PACKED = 2  # new buffer: packed into a new stored form, counted at the next other event
KEPT = 3  # serial, array id, original, fields, op, frame, role, owned, view, time: a new
# buffer by reference, and the entry saving it
RECORD = 4  # op, frame, saved (descriptions, flat), time: a tape entry
NOTHING = 5  # time: a tape entry that saved nothing, after a buffer was logged
FREE = 6  # serial, time: a buffer died
APPLY = 7  # time: a primitive run without a tape entry, after a buffer was logged
REPLAYING = 8  # time: a replayed loop step begins
REPLAYED = 9  # step, fresh (serial, stored bytes, array id, original of each new buffer by
# reference, flat), saved (descriptions, flat: as many per instruction as its description
# lists), time
PHASE = 10  # phase, time: the sweep or a recompute began or ended
EVICT = 11  # serial or None, time: a pool dropped a saved value's array
REMATERIALIZE = 12  # serial or None, time: ... and brought it back
SETTLE = 13  # time: another event (storage I/O, a dry run ended)
TRACK = 14  # new buffer: saved before the block began, known from now on
END = 15  # time: the block ended
QUIET = 16  # count: entries and applied primitives that saved nothing, not logged one by one
ORIGINAL = 17  # serial, original, packed?: a forward value's original array (a weak reference),
# which `explain` judges at the end; an `original` item elsewhere is one too, or None


class Accountant(LiveBytes):
    """Reads a recorder's log into its profile's fields; called with the profile (as its
    `_fill`). The bytes it counts are its base's (live_bytes.py); it decides from the log
    when each buffer counts and as whose, and lists the records."""

    def __init__(self, log: list[Any], started: float,
                 before_reading: Callable[[], None]) -> None:
        super().__init__()
        self.log = log
        self.before_reading = before_reading
        self.lock = threading.RLock()
        # what `explain` judges once the block ended: serial -> weak reference of the forward's
        # saved arrays, and which of those serials were stored packed
        self.originals: dict[int, Any] = {}
        self.packed_originals: set[int] = set()
        self.started = started
        self.records: list[Any] = []  # RECORD_FIELDS items per saved value (gathered.py)
        self.primitives = 0
        self.recomputed = 0
        self.evictions = 0
        self.rematerializations = 0
        self.described: dict[int, tuple[Any, list[Any]]] = {}  # id(step) -> its instructions
        self.pending: dict[int, Buffer] = {}  # serial -> buffer by reference, unclaimed
        self.packed: list[Buffer] = []  # packed since the latest other event: counted there
        self.before_step: Any = ()  # serials waiting in `pending` when a replayed step began
        self.released: set[int] = set()  # serials of owned buffers the tape let go of
        self.noted_bases: set[int] = set()  # serials of view bases counted in `view_bases`
        self.unrecorded: dict[str, int] = {}
        self.view_bases: dict[str, int] = {}
        self.ended = False
        # opcode -> (its reader, how many items follow it in the log)
        self.table: dict[int, tuple[Callable[..., None], int]] = {
            POINT: (self._point, 1), BY_REFERENCE: (self._by_reference, 4),
            PACKED: (self._packed, 4), KEPT: (self._kept, 10), RECORD: (self._entry_saving, 4),
            NOTHING: (self._nothing, 1), FREE: (self._free, 2), APPLY: (self._apply, 1),
            REPLAYING: (self._replaying, 1), REPLAYED: (self._replayed, 4),
            PHASE: (self._phase, 2), EVICT: (self._evict, 2),
            REMATERIALIZE: (self._rematerialize, 2), SETTLE: (self._settled, 1),
            TRACK: (self._new, 4), END: (self._end, 1), QUIET: (self._entries, 1),
            ORIGINAL: (self._original, 3),
        }

    def __call__(self, profile: Any, field: str | None = None) -> None:
        """Account for everything logged since the last call, into `profile`'s fields. Once
        the block ended, reading `field` (None: every field) that `explain` reads also judges
        which saved arrays outlived the tape (`gathered.judge_buffers`: it collects garbage
        first, a full collection, so it waits until asked). One thread at a time: a profile
        may be read from another thread while its block runs."""
        with self.lock:
            self._account(profile, field)

    def _account(self, profile: Any, field: str | None) -> None:
        if not self.ended:
            self.before_reading()
        log = self.log
        if log:
            items = log[:]  # a buffer dying meanwhile (another thread) appends to `log`
            del log[:len(items)]
            table, i, n = self.table, 0, len(items)
            while i < n:
                read, arity = table[items[i]]
                read(*items[i + 1:i + 1 + arity])
                i += 1 + arity
        fields = profile.__dict__
        fields["_primitives"] = self.primitives
        fields["_recomputed_primitives"] = self.recomputed
        fields["_peak_tape_bytes"] = self.peak
        fields["_aliased_bytes"] = self.aliased_peak
        fields["_evictions"] = self.evictions
        fields["_rematerializations"] = self.rematerializations
        fields["_unrecorded_bytes"].update(self.unrecorded)
        self.unrecorded.clear()
        fields["_view_base_bytes"].update(self.view_bases)
        self.view_bases.clear()
        levels = fields["_level_peak_bytes"]
        levels.update(self.level_peak)
        if self.ended:
            levels["device"] = self.peak
        self.moved += len(self.points)
        settle_raw(profile, self.records, self.points, self.started)
        if self.ended and (field is None or field in JUDGED):
            fields.pop("_fill", None)
            fields["_alias_buffers"].update(self._aliases_at_peak())
            judge_buffers(self.originals, self.packed_originals, self.released,
                          self._at_peak(), profile)

    # ------------------------------------------------------------- settling and records
    def _count_packed(self, time: float) -> None:
        """Count the buffers packed since the latest other event, in pack order."""
        packed, self.packed = self.packed, []
        for t in packed:
            self._count(t, True)
            self._point(time)

    def _claim_pending(self, time: float, serials: Any = None) -> None:
        """Buffers stored by reference that no entry claimed (all, or those of `serials`
        still waiting): owned."""
        if serials is None:
            claimed = list(self.pending.values())
            self.pending.clear()
        else:
            claimed = [self.pending.pop(s) for s in serials if s in self.pending]
        for t in claimed:
            self._count(t, True)
            self.unrecorded[str(t.serial)] = t.size
        self._point(time)

    def _settled(self, time: float) -> None:
        """What every event but a pack or a record does first: count the values packed since
        the latest event, claim the buffers by reference that no record came for."""
        if self.packed:
            self._count_packed(time)
        if self.pending:
            self._claim_pending(time)

    def _list(self, op: str, role: str, fields: tuple[Any, ...], frame: Any, t: Buffer,
              owned: bool) -> None:
        self.records.extend((op, role, fields[0], fields[1], fields[2], fields[3], frame,
                             t.serial, self.phase, owned, t.level or "device", fields[4]))

    def _saved(self, op: str, role: str, frame: Any, t: Buffer, owned: bool,
               view: Any, fields: tuple[Any, ...]) -> None:
        """One value an entry saved: count its buffer if new, and list its record. A buffer
        saved again (a parameter, by every step) lists the fields its first record found, and
        one counted as the caller's stays the caller's; one counted as the tape's before its
        entry (a loop's snapshot) but now seen to be the caller's is counted again as such."""
        if t.counted and t.fields is not None:
            if not t.owned:
                self._list(op, role, t.fields, frame, t, False)
                return
            if owned:
                if view is not None:
                    self._note_view(t, view)
                self._list(op, role, t.fields, frame, t, True)
                return
        if t.by_reference and self.pending.pop(t.serial, None) is not None:
            t.fields = fields  # its first record: counted as it classified it
            if not owned and view is not None:  # a view of the caller's array: that array
                t.array_id = view[1]
            self._count(t, owned, fields[3])
            if owned and view is not None:
                self._note_view(t, view)
            self._list(op, role, fields, frame, t, owned)
            return
        if t.counted:  # one buffer, one classification...
            if t.owned and not owned:  # ...but claimed as owned before its entry
                self.live -= t.size
                t.owned = False
                self._add(False, t.size)
            owned = t.owned
            if t.by_reference:
                t.fields = fields
        if owned and t.by_reference and view is not None:
            self._note_view(t, view)
        self._list(op, role, fields, frame, t, owned)

    def _note_view(self, t: Buffer, view: tuple[int, int, int]) -> None:
        """A saved view keeps its whole base alive: note the bytes beyond the view's own (once
        per base, and not if the base is itself a saved value the tape owns)."""
        base, root_id, extra = view
        if base in self.noted_bases or self.roots.get(root_id):
            return
        self.noted_bases.add(base)
        if extra > 0:
            self.view_bases[str(t.serial)] = extra

    def _entries(self, count: int) -> None:
        """`count` primitives run (recorded or not) in the current phase."""
        self.primitives += count
        if self.phase == "recompute":
            self.recomputed += count

    # ------------------------------------------------------------- log entries
    def _by_reference(self, serial: int, by_reference: bool, stored: int, where: Any) -> None:
        """A new buffer stored as is: it waits for its first record to say whose it is."""
        self.pending[serial] = self._new(serial, by_reference, stored, where)

    def _packed(self, serial: int, by_reference: bool, stored: int, where: Any) -> None:
        self.packed.append(self._new(serial, by_reference, stored, where))

    def _original(self, serial: int, original: Any, packed: bool) -> None:
        self.originals[serial] = original
        if packed:
            self.packed_originals.add(serial)

    def _kept(self, serial: int, array_id: int, original: Any, fields: tuple[Any, ...],
              op: str, frame: Any, role: str, owned: bool, view: Any, time: float) -> None:
        if original is not None:
            self.originals[serial] = original
        self._by_reference(serial, True, fields[3], array_id)
        self._entry_saving(op, frame, (serial, role, owned, view, fields), time)

    def _entry_saving(self, op: str, frame: Any, saved: Any, time: float) -> None:
        if self.packed:
            self._count_packed(time)
        self._entries(1)
        buffers = self.buffers
        for k in range(0, len(saved), 5):
            self._saved(op, saved[k + 1], frame, buffers[saved[k]], saved[k + 2], saved[k + 3],
                        saved[k + 4])
        if self.pending:  # saved by reference but held by no slot of this entry
            self._claim_pending(time)
        elif saved:
            self._point(time)

    def _nothing(self, time: float) -> None:
        self._entry_saving("", None, (), time)

    def _free(self, serial: int, time: float) -> None:
        self._settled(time)
        t = self.buffers.pop(serial, None)
        if t is None:  # its recorder failed before logging it: nothing was counted
            return
        if t.level_size is not None:
            self._add_level(t.level, -t.level_size)  # type: ignore[arg-type]
        if not t.counted:
            return
        size = t.size
        if t.owned:
            self.live -= size
            serial = t.serial
            if serial in self.originals:
                self.released.add(serial)
            if t.born_at is not None and t.born_at <= self.peak_at:
                self.freed_since_peak.extend((serial, t.born_size))
        else:
            self.live_aliased -= size
            self._unalias(t)
            if t.born_at is not None:  # owned when counted: listed at the peak as such
                self.freed_reclassified.append((t.born_at, t.serial, t.born_size))
        root_id = t.root_id
        if root_id is not None:
            if self.roots[root_id] == 1:
                del self.roots[root_id]
            else:
                self.roots[root_id] -= 1
        self._point(time)

    def _apply(self, time: float) -> None:
        self._settled(time)
        self._entries(1)

    def _phase(self, phase: str, time: float) -> None:
        """The sweep or a recompute began or ended: a point marks where the new phase begins
        (the timeline's phases run from one such point to the next)."""
        self._settled(time)
        if phase != self.phase:
            self.phase = phase
            self._point(time)

    def _evict(self, serial: int | None, time: float) -> None:
        """A pool dropped the array of a saved value (it is recomputed when needed): its bytes
        leave the tape until it is rematerialized or freed."""
        self._settled(time)
        self.evictions += 1
        t = self.buffers.get(serial)  # type: ignore[arg-type]
        if t is None or not t.counted or t.evicted is not None:
            return
        size = t.evicted = t.size
        t.size = 0
        self._add(t.owned, -size)
        self._point(time)

    def _rematerialize(self, serial: int | None, time: float) -> None:
        """One primitive re-run to bring an evicted value back; its bytes return."""
        self._settled(time)
        self.rematerializations += 1
        t = self.buffers.get(serial)  # type: ignore[arg-type]
        if t is None or not t.counted or t.evicted is None:
            return
        size, t.evicted = t.evicted, None
        t.size = size
        self._add(t.owned, size)
        self._point(time)

    def _replaying(self, time: float) -> None:
        """A replayed step begins: the values packed before it are counted now, so that those
        packed until it ends are its own. (Buffers by reference wait on: the step's first
        instruction may claim them, as its first record would.)"""
        if self.packed:
            self._count_packed(time)
        self.before_step = list(self.pending) if self.pending else ()

    def _replayed(self, step: Any, fresh: list[Any], saved: list[Any], time: float) -> None:
        """A replayed loop step, counted as the entries recording it would have made,
        instruction by instruction (`DescribedStep`, in step_profiled.py, says what each would
        hold); the values it packed are counted in order with them, each instruction's before
        its record, as recording would have."""
        for k in range(0, len(fresh), 4):  # its new buffers by reference
            serial = fresh[k]
            self._by_reference(serial, True, fresh[k + 1], fresh[k + 2])
            if fresh[k + 3] is not None:
                self.originals[serial] = fresh[k + 3]
        buffers = self.buffers
        packed, self.packed = self.packed, []
        n_packed, at = len(packed), 0
        before, self.before_step = self.before_step, ()
        self._entries(step.primitives)
        described = self.described.get(id(step))
        if described is None or described[0] is not step:
            described = self.described[id(step)] = (
                step, [d for d in step.instructions if d is not None])
        start = 0
        for instruction in described[1]:
            end = start + 5 * len(instruction.saved)
            if end > start:
                if at < n_packed:
                    for k in range(start, end, 5):
                        if at < n_packed and packed[at].serial == saved[k]:
                            self._count(packed[at], True)
                            self._point(time)
                            at += 1
                op, frame = instruction.op, instruction.origin
                for k in range(start, end, 5):
                    self._saved(op, saved[k + 1], frame, buffers[saved[k]], saved[k + 2],
                                saved[k + 3], saved[k + 4])
            # those waiting from before the step that its first instruction did not claim are
            # claimed now, as its first record would have
            if before and any(s in self.pending for s in before):
                self._claim_pending(time, before)
            elif end > start:
                self._point(time)
            before = ()
            start = end
        if at < n_packed:  # packed by none of its instructions (not expected): as at an event
            self.packed = packed[at:] + self.packed
            self._count_packed(time)

    def _end(self, time: float) -> None:
        self._settled(time)
        self._point(time)
        self.ended = True
        self.before_reading = _nothing_to_log


def _nothing_to_log() -> None:
    """`before_reading` once the block ended (the recorder is let go)."""


def make_accountant(profile: Any, log: list[Any], started: float,
                    before_reading: Callable[[], None]) -> Accountant:
    """The profile's `_fill`: its fields are accounted for from `log` when first read
    (`before_reading()` called first, while the block runs: the recorder logs what it
    counted without logging)."""
    accountant = Accountant(log, started, before_reading)
    profile.__dict__["_fill"] = accountant
    return accountant


__all__ = ["Accountant", "make_accountant"]
