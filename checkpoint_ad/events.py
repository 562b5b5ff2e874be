"""Engine events for observers (the profiler): free when nobody listens, cheap when some do.

The engine calls `emit` only behind an `if listeners:` check, so an unobserved program pays
one list truth-test per event site; the most frequent kinds that a profile does not hear (a
saved value read back, an entry released) test ``kind in wanted`` instead, and skip even the
call while only other kinds are heard. A listener hears the events of the thread that subscribed
it only: a profile taken in one thread does not count another thread's work. Subscriptions are
kept as a table from kind to its handlers, rebuilt at each (rare) subscribe, so an event costs
one lookup (and, heard by one handler, no loop), and an event nobody asked for costs nothing
more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from threading import get_ident  # bound once: `emit` runs for every recorded entry
from typing import Any

Listener = Callable[[str, Any], None]
Handler = Callable[[Any], None]


class Subscription:
    """One subscriber: its thread, its handler per kind, or one listener for every kind."""

    __slots__ = ("ended", "every", "handlers", "thread")

    def __init__(self, handlers: Mapping[str, Handler] | None, every: Listener | None) -> None:
        self.thread = threading.get_ident()
        self.handlers = handlers
        self.every = every
        self.ended = False  # unsubscribed (while `muted`: not to be put back)


class _EveryKind:
    """What `wanted` is while some listener hears every kind."""

    def __contains__(self, kind: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "<every kind>"


listeners: list[Subscription] = []  # every thread's; the engine only tests it for emptiness
# kinds some listener of any thread hears: an engine site whose event is frequent and seldom
# heard (a saved value read back, an entry released) tests ``kind in wanted`` rather than
# `listeners`, and skips even the call to `emit` while only other kinds are heard
wanted: frozenset[str] | _EveryKind = frozenset()
# what `emit` reads, rebuilt from `listeners` at each subscribe:
# kind -> ((subscribing thread, handler(payload)), ...)
_routes: dict[str, tuple[tuple[int, Handler], ...]] = {}
# the kinds of `_routes` with one handler (while one profile listens: every kind it hears),
# each as its (thread, handler) pair: no loop per event
_sole: dict[str, tuple[int, Handler]] = {}
_hear_every_kind = False  # some listener hears every kind
# (thread, handler) of the one subscription, while it is the only one and takes recorded
# entries directly (its handler for `KEPT`, the profiler's): `record`'s fast path then runs
# under it and hands it each entry with its saved value, no 'record' event made; else None
kept_record: tuple[int, Callable[..., None]] | None = None
# the handler kind that asks for `kept_record`: called as ``handler(entry, buffer, fresh,
# role, unedged, frame)`` for an entry of `record`'s fast path, which 'pack' and 'record'
# events would otherwise announce (`buffer` its single saved value's, `fresh` whether it was
# made now, None for an entry whose saved values are slots, announced by 'pack' already)
KEPT = "record_kept"
_lock = threading.Lock()


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
    'planned' (a budget's dry run, run `muted`, ended: (its seconds, the most tape bytes it
    held)), 'step' (a loop evaluated one step, recorded or replayed: its count so far),
    'replaying' / 'replayed' (a loop step replayed from its step program begins / ended, sent
    only while 'replayed' is heard: the step's `DescribedStep`, its saved values per
    instruction, its values and the carry slots the previous step made; what recording the
    step would have sent as 'record' and 'apply' events, one event per step; and the buffers
    the step made, in the order it made them, when it sent no 'pack' event for them (see
    `taken_directly`), else None), 'traced_step' (a loop step traced for its step program
    returned: the tensors it made, which the trace held while it ran, let go now).
    """
    sole = _sole.get(kind)
    if sole is not None:
        if sole[0] == get_ident():
            sole[1](payload)
        return
    route = _routes.get(kind)
    if route is None:
        if not _hear_every_kind:
            return
        route = _catch_all(kind)
    thread = get_ident()
    for subscriber, handler in route:
        if subscriber == thread:
            handler(payload)


def emit_to(thread: int, kind: str, payload: Any) -> None:
    """Send one event to the listeners subscribed from `thread` (for a saved buffer that dies
    in another thread than the one that made it: its 'free' belongs to its maker's profile)."""
    route = _routes.get(kind)
    if route is None:
        if not _hear_every_kind:
            return
        route = _catch_all(kind)
    for subscriber, handler in route:
        if subscriber == thread:
            handler(payload)


def hears(kind: str) -> bool:
    """Whether a listener subscribed from the calling thread hears `kind` (lets the engine
    skip work that only a listener needs: watching a buffer for its 'free', a replayed loop
    describing its steps to a profiler)."""
    route = _routes.get(kind)
    if route is None:
        if not _hear_every_kind:
            return False
        route = _catch_all(kind)
    thread = threading.get_ident()
    return any(subscriber == thread for subscriber, _ in route)


def taken_directly() -> bool:
    """Whether the calling thread's events go to one listener alone that takes entries
    directly (`kept_record`, the profiler's): what only that listener reads may then be handed
    to it in bulk (a replayed step's new saved buffers, in its 'replayed' event) rather than
    announced one event each."""
    heard = kept_record
    return heard is not None and heard[0] == get_ident()


def _catch_all(kind: str) -> tuple[tuple[int, Handler], ...]:
    """Handlers for a kind no subscriber named: the listeners that hear every kind."""
    return tuple((s.thread, partial(s.every, kind)) for s in tuple(listeners)
                 if s.every is not None)


def _rebuild() -> None:
    """Recompute `_routes` from `listeners` (under `_lock`; `emit` reads the old table or
    the new one, never half of one)."""
    named = {kind for s in listeners if s.handlers is not None for kind in s.handlers}
    routes: dict[str, list[tuple[int, Handler]]] = {kind: [] for kind in named}
    for s in listeners:
        for kind in named:
            if s.handlers is None:
                routes[kind].append((s.thread, partial(s.every, kind)))  # type: ignore[arg-type]
            elif kind in s.handlers:
                routes[kind].append((s.thread, s.handlers[kind]))
    global _routes, _sole, _hear_every_kind, wanted, kept_record
    routes.pop(KEPT, None)  # not an event: handed to `kept_record` instead
    _routes = {kind: tuple(route) for kind, route in routes.items()}
    _sole = {kind: route[0] for kind, route in _routes.items() if len(route) == 1}
    _hear_every_kind = any(s.every is not None for s in listeners)
    wanted = _EveryKind() if _hear_every_kind else frozenset(_routes)
    only = listeners[0] if len(listeners) == 1 else None
    kept_record = (only.thread, only.handlers[KEPT]) if (
        only is not None and only.handlers is not None and KEPT in only.handlers) else None


def _add(subscription: Subscription) -> Callable[[], None]:
    with _lock:
        listeners.append(subscription)
        _rebuild()

    def unsubscribe() -> None:
        with _lock:
            subscription.ended = True
            if subscription in listeners:
                listeners.remove(subscription)
                _rebuild()

    return unsubscribe


def subscribe(listener: Listener, kinds: Iterable[str] | None = None) -> Callable[[], None]:
    """Start delivering the calling thread's events (of `kinds` only, when given) to
    `listener(kind, payload)`; returns a function that stops it."""
    if kinds is None:
        return _add(Subscription(None, listener))
    return _add(Subscription({kind: partial(listener, kind) for kind in kinds}, None))


def subscribe_handlers(handlers: Mapping[str, Handler]) -> Callable[[], None]:
    """Start delivering the calling thread's events of each kind in `handlers` to its
    handler, called with the payload alone (one call per event: the profiler's way in);
    returns a function that stops it."""
    return _add(Subscription(dict(handlers), None))


@contextmanager
def muted() -> Iterator[None]:
    """The calling thread's events reach nobody in this block; its subscriptions resume after
    it. For work the library does for itself rather than for the program a listener watches:
    a budget's dry run prices a loop by running some of its steps, which a profile would
    otherwise count as the program's primitives, saved values and time (and the figures the
    dry run measures would include the profiler's own cost). Other threads are not touched."""
    thread = threading.get_ident()
    with _lock:
        mine = [s for s in listeners if s.thread == thread]
        if mine:
            listeners[:] = [s for s in listeners if s.thread != thread]
            _rebuild()
    try:
        yield
    finally:
        if mine:
            with _lock:
                listeners.extend(s for s in mine if not s.ended)
                _rebuild()


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
