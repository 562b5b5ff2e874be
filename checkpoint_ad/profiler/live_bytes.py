"""Live and peak bytes of saved values, counted buffer by buffer as the accountant reads the log.

A buffer counts as the tape's (owned) or the caller's (aliased), apart: the tape's peak is what
a strategy could save, the caller's arrays (a parameter saved by every step, a slice of the
input) count once per array alive. A buffer holding the very array a live owned buffer holds
(a loop's restored snapshot, saved again by the step re-run from it) adds no bytes; an
offloaded one counts on its storage level, not in the tape's bytes; an evicted one leaves the
count until it is rematerialized. Each change is a point of the timeline (time, live bytes,
phase), and what was alive at either peak is kept for `explain` and the profile's listings.
This class is the accountant's base (accountant.py): the accountant decides, from the log,
when a buffer is counted and as whose.
"""

from __future__ import annotations

from typing import Any


class Buffer:
    """What the accountant keeps of one buffer: how it is stored (`by_reference`, `stored`
    bytes, `array_id` of the array it holds by reference, `level` of a packed form), and
    whether it is `counted` in the live totals, as `owned` (the tape's) or the caller's,
    `size` bytes of them (0 while evicted, the rest in `evicted`); `root_id`: the array it
    holds, if owned and by reference; `born_at`/`born_size`: timeline index and bytes when
    first counted as owned; `level_size`: bytes counted on an off-device level; `fields`: set
    once a record classified it (later records list these)."""

    __slots__ = ("alias_born", "alias_id", "array_id", "born_at", "born_size", "by_reference",
                 "counted", "evicted", "fields", "level", "level_size", "owned", "root_id",
                 "serial", "size", "stored")

    def __init__(self, serial: int, by_reference: bool, stored: int, where: Any) -> None:
        self.serial = serial
        self.by_reference = by_reference
        self.stored = stored
        self.array_id, self.level = (where, None) if by_reference else (None, where)
        self.counted = False
        self.owned = True
        self.size = 0
        self.root_id: int | None = None
        self.born_at: int | None = None
        self.born_size = 0
        self.level_size: int | None = None
        self.evicted: int | None = None
        self.fields: tuple[Any, ...] | None = None
        self.alias_id: int | None = None  # the caller's array it holds, counted as an alias
        self.alias_born = 0  # `LiveBytes.alias_clock` when counted as an alias


class LiveBytes:
    """The live and peak bytes, the timeline's points, and the buffers alive at each peak."""

    def __init__(self) -> None:
        self.points: list[Any] = []  # POINT_FIELDS items per timeline point (gathered.py)
        self.moved = 0  # items of `points` moved into the profile at earlier reads
        self.phase = "forward"
        self.live = 0
        self.live_aliased = 0
        self.peak = 0
        self.peak_at = 0  # index in `points` of the latest new peak, counting `moved` ones
        self.aliased_peak = 0
        self.roots: dict[int, int] = {}  # id(array) -> live owned buffers holding it
        # the same for the caller's arrays saved by reference (a parameter saved by every
        # step counts once), and what was alive at the aliases' peak, as for the tape's
        self.alias_roots: dict[int, int] = {}
        self.alias_clock = 0
        self.alias_peak_at = 0
        self.alias_freed_since_peak: list[int] = []
        self.buffers: dict[int, Buffer] = {}  # serial -> the buffers not yet dead
        self.level_live: dict[str, int] = {}  # owned stored bytes off the device, per level
        self.level_peak: dict[str, int] = {}
        # owned buffers freed since the latest new peak that were alive at it (serial, bytes,
        # serial, bytes, ...): with the live ones born before it, what the tape owned at its
        # peak; and buffers born owned but found the caller's later
        self.freed_since_peak: list[int] = []
        self.freed_reclassified: list[tuple[int, int, int]] = []  # (born at, serial, bytes)

    def _point(self, time: float) -> None:
        self.points.extend((time, self.live, self.phase))

    def _new(self, serial: int, by_reference: bool, stored: int, where: Any) -> Buffer:
        """A new buffer (`where`: the id of the array it holds by reference, or the level of
        its packed form)."""
        t = self.buffers[serial] = Buffer(serial, by_reference, stored, where)
        return t

    def _count(self, t: Buffer, owned: bool, size: int | None = None) -> None:
        """Start counting a live buffer as owned (tape memory) or aliased (the caller's),
        `size` its stored bytes if its record found them. A buffer stored by reference holding
        the very array a live owned buffer holds (a loop's restored snapshot, saved again by
        the step re-run from it) adds no bytes."""
        root_id = None
        if size is None:
            size = t.stored
        if t.by_reference:
            if owned:
                root_id = t.array_id
                held = self.roots.get(root_id, 0)
                if held:
                    size = 0
                self.roots[root_id] = held + 1
            else:
                size = self._alias(t, size)
        elif t.level != "device":  # offloaded: counted on its level, not in the tape bytes
            t.level_size = size
            self._add_level(t.level, size)  # type: ignore[arg-type]
            size = 0
        self._counted(t, owned, size, root_id)

    def _alias(self, t: Buffer, size: int) -> int:
        """Count a buffer holding the caller's array: its bytes once per array alive."""
        alias_id = t.alias_id = t.array_id
        held = self.alias_roots.get(alias_id, 0)  # type: ignore[arg-type]
        self.alias_roots[alias_id] = held + 1  # type: ignore[index]
        self.alias_clock += 1
        t.alias_born = self.alias_clock
        return 0 if held else size

    def _unalias(self, t: Buffer) -> None:
        alias_id = t.alias_id
        if alias_id is None:
            return
        t.alias_id = None
        if self.alias_roots[alias_id] == 1:
            del self.alias_roots[alias_id]
        else:
            self.alias_roots[alias_id] -= 1
        if t.size and t.alias_born <= self.alias_peak_at:
            self.alias_freed_since_peak.extend((t.serial, t.size))

    def _counted(self, t: Buffer, owned: bool, size: int, root_id: int | None) -> None:
        t.counted, t.owned, t.size, t.root_id = True, owned, size, root_id
        if owned:
            t.born_at, t.born_size = self.moved + len(self.points), size
        self._add(owned, size)

    def _add(self, owned: bool, size: int) -> None:
        if owned:
            self.live += size
            if self.live > self.peak:
                self.peak = self.live
                self.peak_at = self.moved + len(self.points)
                self.freed_since_peak.clear()
        else:
            self.live_aliased += size
            if self.live_aliased > self.aliased_peak:
                self.aliased_peak = self.live_aliased
                self.alias_peak_at = self.alias_clock
                self.alias_freed_since_peak.clear()

    def _add_level(self, level: str, size: int) -> None:
        live = self.level_live[level] = self.level_live.get(level, 0) + size
        self.level_peak[level] = max(self.level_peak.get(level, 0), live)

    def _aliases_at_peak(self) -> dict[str, int]:
        """Serial -> bytes counted of the caller's arrays alive at the aliases' peak."""
        freed = self.alias_freed_since_peak
        at = {str(s): size for s, size in zip(freed[0::2], freed[1::2])}
        at.update((str(t.serial), t.size) for t in self.buffers.values()
                  if t.alias_id is not None and t.size and t.alias_born <= self.alias_peak_at)
        return at

    def _at_peak(self) -> list[tuple[int, int]]:
        """(serial, bytes) of the owned buffers alive at the tape's peak."""
        freed = self.freed_since_peak
        peak_at = self.peak_at
        return list(zip(freed[0::2], freed[1::2])) + [
            (t.serial, t.born_size) for t in self.buffers.values()
            if t.born_at is not None and t.born_at <= peak_at] + [
            (serial, size) for born, serial, size in self.freed_reclassified
            if born <= peak_at]
