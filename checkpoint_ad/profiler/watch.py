"""What a recorder knows of each saved buffer, held by the weak reference that hears it die.

The engine's 'free' event goes through `hears`, a watch table and `emit_to` for every buffer,
and a recorder would then look the buffer's id up in a table per fact it keeps. Here the
recorder watches the buffers it saw itself, with one weak reference each that also carries
those facts (`Tracked`): the reference's callback hands them back at the buffer's death, with
no lookup. A buffer can die in another thread than its maker's (the collector runs in whichever
thread allocates): it then waits in a queue that the maker's thread drains at its next event,
so the recorder's state is only ever touched by one thread (no lock around every event), and
in the order the buffers died.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any


class Tracked(weakref.ref):
    """A weak reference to one saved buffer and what the recorder counts for it.

    `counted`: its bytes are in the live totals, as `owned` (the tape's) or aliased (the
    caller's memory), `size` bytes of them (0 while evicted, which keeps the rest in
    `evicted`); `root_id`: id of the array it holds by reference, if owned; `born_at`/`born_size`:
    timeline index and bytes when first counted as owned (two fields, not a pair: one object
    fewer per buffer for the collector to visit); `level`/`level_size`: where it lives if off the
    device; `stored_id`: id of its stored form, if packed (events name the stored form);
    `fields`: (shape, dtype, logical bytes, stored bytes, strategy) that the records of a
    buffer stored by reference list, once counted (read again for each entry saving it)."""

    __slots__ = ("born_at", "born_size", "counted", "evicted", "fields", "key", "level",
                 "level_size", "owned", "root_id", "serial", "size", "stored_id")

    key: int
    serial: int
    counted: bool
    owned: bool
    size: int
    root_id: int | None
    born_at: int | None
    born_size: int
    level: str | None
    level_size: int
    stored_id: int | None
    evicted: int | None
    fields: tuple[Any, ...] | None


class Watch:
    """The tracked buffers of one recorder, by id. `on_free(tracked, drained=False)` is each
    reference's own callback (one call per death: the recorder's). Called as a buffer dies,
    it pops `tracked` from `tracked` (gone: closed meanwhile, nothing to do); in another
    thread than `thread` it appends it to `foreign` and returns, for the maker thread's next
    `drain()` to call ``on_free(tracked, True)``; else it drains the earlier foreign deaths
    first, then counts its own. Nothing is reported once `close()`d."""

    __slots__ = ("_callback", "_on_free", "foreign", "thread", "tracked")

    def __init__(self, on_free: Callable[[Tracked, bool], None]) -> None:
        self.thread = threading.get_ident()
        self._on_free = self._callback = on_free  # bound once, not per buffer
        self.tracked: dict[int, Tracked] = {}  # id(buffer) -> its reference, while alive
        self.foreign: deque[Tracked] = deque()  # buffers that died in another thread

    def track(self, buffer: Any, key: int, serial: int) -> Tracked:
        """Start tracking a live buffer (`key` is its id), not counted yet."""
        ref = Tracked(buffer, self._callback)
        ref.key, ref.serial, ref.counted, ref.born_at = key, serial, False, None
        ref.level, ref.stored_id, ref.evicted, ref.fields = None, None, None, None
        self.tracked[key] = ref
        return ref

    def drain(self) -> None:
        """Report the buffers that died in other threads since the last drain (in the maker's
        thread only)."""
        foreign = self.foreign
        while foreign:
            self._on_free(foreign.popleft(), True)

    def close(self) -> None:
        """Stop watching: the references die, and with them their callbacks."""
        self.tracked.clear()
