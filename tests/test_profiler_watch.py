"""What keeps profiling cheap without changing what it reports: `events.wanted` lets the engine
skip the kinds nobody hears, and a recorder watches the buffers it saw itself (a buffer that dies
in another thread is logged as it dies, and counted in the profile of the thread that made it)."""

from __future__ import annotations

import gc
import threading

import numpy as np

import checkpoint_ad as cad
from checkpoint_ad import events


def test_wanted_lists_the_kinds_some_listener_hears():
    assert "record" not in events.wanted
    stop_one = events.subscribe_handlers({"record": lambda _: None})
    stop_two = events.subscribe(lambda kind, _: None, kinds=["unpack"])
    assert events.wanted == frozenset({"record", "unpack"})
    stop_one()
    assert events.wanted == frozenset({"unpack"})
    stop_every = events.subscribe(lambda kind, _: None)  # every kind, even one not named yet
    assert "release" in events.wanted and "a kind made up here" in events.wanted
    assert repr(events.wanted) == "<every kind>"
    stop_every()
    stop_two()
    assert not events.wanted


def test_the_engine_sends_a_frequent_kind_only_while_it_is_heard():
    x = cad.tensor(np.ones(4), requires_grad=True)
    heard: list[str] = []
    stop = events.subscribe(lambda kind, _: heard.append(kind), kinds=["record"])
    try:
        cad.tanh(x).sum().backward()
    finally:
        stop()
    assert heard == ["record", "record"]  # no 'unpack' nor 'release' went out...
    stop = events.subscribe(lambda kind, _: heard.append(kind), kinds=["unpack", "release"])
    try:
        cad.tanh(x).sum().backward()
    finally:
        stop()
    assert heard[2:].count("unpack") == 1 and heard[2:].count("release") == 2  # ...until asked


def test_a_profile_reports_the_same_with_and_without_free_events_heard_elsewhere():
    """The engine's own 'free' event still goes out to whoever hears it; the profile does not
    depend on it."""
    x = cad.tensor(np.ones(1000), requires_grad=True)
    freed: list[int] = []
    stop = events.subscribe(lambda _, key: freed.append(key), kinds=["free"])
    try:
        with cad.profile() as heard:
            cad.tanh(cad.tanh(x)).sum().backward()
    finally:
        stop()
    with cad.profile() as alone:
        cad.tanh(cad.tanh(x)).sum().backward()
    assert len(freed) == 2  # both saved outputs died in the sweep
    assert heard.timeline_bytes == alone.timeline_bytes
    assert heard.peak_tape_bytes == alone.peak_tape_bytes == 16_000


def test_a_buffer_freed_in_another_thread_counts_when_it_died():
    x = cad.tensor(np.ones(1000), requires_grad=True)
    with cad.profile() as prof:
        holder = [cad.tanh(x)]  # saves its output: 8000 bytes

        def drop() -> None:
            holder.clear()
            gc.collect()

        t = threading.Thread(target=drop)
        t.start()
        t.join()
        before_next = len(prof.timeline_bytes)
        cad.exp(x)  # saves its output: 8000 bytes, after the other thread's free
    bytes_ = prof.timeline_bytes
    assert bytes_[:before_next][-2:] == [8000, 0]  # counted, then freed in the other thread
    assert bytes_[before_next] == 8000  # exp's saved output
    assert prof.peak_tape_bytes == 8000


def test_a_buffer_that_dies_after_the_block_leaves_the_profile_as_it_was():
    x = cad.tensor(np.ones(1000), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(x)
    final = list(prof.timeline_bytes)
    del y
    gc.collect()
    assert prof.timeline_bytes == final and final[-1] == 8000
