"""Engine events for observers (the profiler): free when nobody listens.

The engine calls `emit` only behind an `if listeners:` check, so an unobserved program pays
one list truth-test per event site.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Listener = Callable[[str, Any], None]

listeners: list[Listener] = []


def emit(kind: str, payload: Any) -> None:
    """Send one event to every listener.

    Kinds and payloads: 'record' (a new tape entry), 'apply' (a primitive run without
    recording), 'pack' (a new saved buffer), 'free' (id of a saved buffer that died),
    'unpack' (a buffer read by the sweep), 'release' (an entry whose saved values were freed),
    'backward_begin' / 'backward_end' (a sweep, None), 'recompute_begin' / 'recompute_end'
    (a region or loop re-running forward work, its name).
    """
    for listener in tuple(listeners):
        listener(kind, payload)


def subscribe(listener: Listener) -> Callable[[], None]:
    """Start delivering events to `listener`; returns a function that stops it."""
    listeners.append(listener)

    def unsubscribe() -> None:
        if listener in listeners:
            listeners.remove(listener)

    return unsubscribe
