"""Engine events for observers (the profiler): free when nobody listens.

The engine calls `emit` only behind an `if listeners:` check, so an unobserved program pays
one list truth-test per event site. A listener hears the events of the thread that subscribed
it only: a profile taken in one thread does not count another thread's work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

Listener = Callable[[str, Any], None]

# (subscribing thread, listener, the kinds it hears or None for all), every thread's
listeners: list[tuple[int, Listener, frozenset[str] | None]] = []


def emit(kind: str, payload: Any) -> None:
    """Send one event to every listener subscribed from the calling thread.

    Kinds and payloads: 'record' (a new tape entry), 'apply' (a primitive run without
    recording), 'pack' (a new saved buffer), 'free' (id of a saved buffer that died),
    'unpack' (a buffer read by the sweep), 'release' (an entry whose saved values were freed),
    'backward_begin' / 'backward_end' (a sweep, None), 'recompute_begin' / 'recompute_end'
    (a region or loop re-running forward work, its name), 'evict' (a saved value's stored form
    whose array a rematerializing pool dropped), 'rematerialize' (one primitive re-run to bring
    an evicted value back: the stored form held again, or None), 'io_write' / 'io_read'
    (bytes handed to or read back from a storage level), 'io_stall' (seconds spent waiting),
    'step' (a loop evaluated one step, recorded or replayed: its count so far).
    """
    thread = threading.get_ident()
    for subscriber, listener, kinds in tuple(listeners):
        if subscriber == thread and (kinds is None or kind in kinds):
            listener(kind, payload)


def hears(kind: str) -> bool:
    """Whether a listener in the calling thread would hear `kind` (work that only feeds a
    listener, such as a replayed loop describing its steps to a profiler, asks first)."""
    if not listeners:
        return False
    thread = threading.get_ident()
    return any(subscriber == thread and (kinds is None or kind in kinds)
               for subscriber, _, kinds in listeners)


def emit_to(thread: int, kind: str, payload: Any) -> None:
    """Send one event to the listeners subscribed from `thread` (for a saved buffer that dies
    in another thread than the one that made it: its 'free' belongs to its maker's profile)."""
    for subscriber, listener, kinds in tuple(listeners):
        if subscriber == thread and (kinds is None or kind in kinds):
            listener(kind, payload)


def subscribe(listener: Listener, kinds: Iterable[str] | None = None) -> Callable[[], None]:
    """Start delivering the calling thread's events (of `kinds` only, when given) to
    `listener`; returns a function that stops it."""
    item = (threading.get_ident(), listener, None if kinds is None else frozenset(kinds))
    listeners.append(item)

    def unsubscribe() -> None:
        if item in listeners:
            listeners.remove(item)

    return unsubscribe


@contextmanager
def recomputing(name: str) -> Iterator[None]:
    """Bracket forward work re-run for the backward sweep with 'recompute_begin'/'_end'; the
    end is sent even when the work raises, so observers never stay in the recompute phase."""
    if not listeners:
        yield
        return
    emit("recompute_begin", name)
    try:
        yield
    finally:
        emit("recompute_end", name)
