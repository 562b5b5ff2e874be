"""One saved buffer as the recorder watches it: the weak reference that hears it die.

The recorder (recorder.py) makes one per buffer it sees; the buffer's death calls the recorder
back through it, with no lookup. It carries only what the recorder needs while the buffer
lives: its log names buffers by serial, and the accountant (accountant.py) keeps its own
per-buffer totals when it reads the log, so a watched buffer costs nothing once dead.
"""

from __future__ import annotations

import weakref
from typing import Any


class Tracked(weakref.ref):
    """A weak reference to one saved buffer: `key` (its id while alive), `serial` (its
    number: ids are reused, serials not), `stored_id` (id of its stored form if packed,
    evictions name the stored form; None for a buffer stored as is, by reference), `facts`
    (what its records list: shape, dtype, logical bytes, stored bytes, strategy; for a buffer
    by reference, found at its first record), `seen` (how the recorder last described it:
    see `_Recorder._describe`)."""

    __slots__ = ("facts", "key", "seen", "serial", "stored_id")

    key: int
    serial: int
    stored_id: int | None
    facts: tuple[Any, ...] | None
    seen: tuple[Any, ...] | None
