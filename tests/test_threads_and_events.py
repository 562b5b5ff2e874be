"""Threads and events: a profile, a GradientTape and the engine's random generator are each the
calling thread's own; a recompute that raises still closes its events."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import events
from checkpoint_ad.models import build
from checkpoint_ad.nn import functional as F


def _in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run each job in its own thread, all started together; re-raise the first failure."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = jobs[i]()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _chain(n: int, rounds: int) -> Callable[[], tuple[int, int]]:
    """n tanh ops per round, profiled in the calling thread: (primitives, records) seen."""
    def job() -> tuple[int, int]:
        x = cad.tensor(np.ones(16), requires_grad=True)
        with cad.profile() as prof:
            for _ in range(rounds):
                h = x
                for _ in range(n):
                    h = cad.tanh(h)
        return prof.primitives, len(prof.records)
    return job


def test_a_profile_counts_only_its_own_threads_primitives():
    counts = _in_threads([_chain(3, 200), _chain(7, 200)])
    assert counts == [(600, 600), (1400, 1400)]


def test_a_gradient_tape_records_only_its_own_threads_ops():
    def job(n: int) -> tuple[int, float]:
        x = cad.tensor(0.5)
        with cad.GradientTape() as tape:
            tape.watch(x)
            y = x
            for _ in range(200):
                y = y * 1.0 + 0.0  # 2 recorded ops per round
            y = y * float(n)
        return len(list(tape.entries)), tape.gradient(y, x).item()

    results = _in_threads([lambda: job(2), lambda: job(3)])
    assert results == [(401, 2.0), (401, 3.0)]


def test_checkpointed_dropout_in_four_threads_matches_the_plain_computation():
    def region(h: Any, w: Any) -> Any:
        return cad.tanh(F.dropout(h @ w, 0.3))

    def job(seed: int) -> int:
        rng = np.random.default_rng(seed)
        dropped = 0
        for i in range(100):
            w0 = rng.standard_normal((8, 8))
            x = cad.tensor(rng.standard_normal((4, 8)))
            grads = []
            for checkpointed in (True, False):
                w = cad.tensor(w0, requires_grad=True)
                cad.random.manual_seed(1000 * seed + i)
                y = cad.checkpoint(region, x, w) if checkpointed else region(x, w)
                y.sum().backward()
                grads.append(w.grad.numpy())
            np.testing.assert_array_equal(grads[0], grads[1])
            dropped += int(np.count_nonzero(y.detach().numpy() == 0))
        return dropped

    dropped = _in_threads([lambda s=s: job(s) for s in range(4)])
    assert all(n > 0.2 * 100 * 32 for n in dropped)  # dropout really dropped (p = 0.3)


def test_a_recompute_that_raises_leaves_later_profiles_clean():
    calls = {"n": 0}

    def region(h: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the re-run for the backward sweep
            raise RuntimeError("region failed on its re-run")
        return cad.tanh(h)

    x = cad.tensor(np.ones(8), requires_grad=True)
    # one profile over both runs: had the failed sweep left 'recompute_end' or 'backward_end'
    # unsent, the plain run after it would count as recomputed, or its time as nested
    with cad.profile() as prof:
        y = cad.checkpoint(region, x).sum()
        with pytest.raises(RuntimeError, match="re-run"):
            y.backward()
        assert calls["n"] == 2
        failed_seconds = prof.backward_seconds
        cad.tanh(cad.tanh(x)).sum().backward()
    assert prof.recomputed_primitives == 0
    assert prof.backward_seconds > failed_seconds > 0
    assert prof.timeline_phase[-1] == "forward"  # neither backward nor recompute left open
    with cad.profile() as later:  # and a profile of its own afterwards
        cad.tanh(cad.tanh(x)).sum().backward()
    assert later.recomputed_primitives == 0 and later.backward_seconds > 0


def test_a_buffer_freed_in_another_thread_is_freed_in_its_makers_profile():
    """The profile that saw a value packed sees it freed, whichever thread drops it last."""
    import gc

    import numpy as np

    x = cad.tensor(np.ones(1000), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(x)  # saves its output: 8000 bytes
        holder = [y]
        del y

        def drop():
            holder.clear()
            gc.collect()

        t = threading.Thread(target=drop)
        t.start()
        t.join()
    assert prof.peak_tape_bytes == 8000
    assert prof.timeline_bytes[-1] == 0


def _profiled_heat() -> tuple[Any, ...]:
    """The heat model's peak, records and timeline (bytes and phases), profiled here."""
    model = build("heat")  # `u * 0.5`-style scalars: the engine's shared constants
    with cad.profile() as prof:
        model.run(None).backward()
    return (prof.peak_tape_bytes, tuple(prof.records), tuple(prof.timeline_bytes),
            tuple(prof.timeline_phase))


def test_a_profile_with_a_neighbour_computing_counts_what_it_counts_alone():
    """Like torch.profiler's per-thread CPU memory events: a neighbour's work never changes
    this thread's profile. A scalar constant shared by every thread once shared its saved
    buffer too, so this profile missed its pack or saw it die after the neighbour's backward."""
    alone = {_profiled_heat() for _ in range(3)}
    assert len(alone) == 1
    stop = threading.Event()

    def neighbour() -> None:
        while not stop.is_set():
            build("heat").run(None).backward()

    worker = threading.Thread(target=neighbour)
    worker.start()
    try:
        beside = {_profiled_heat() for _ in range(25)}
    finally:
        stop.set()
        worker.join()
    assert beside == alone


def test_a_kind_heard_once_or_twice_reaches_exactly_its_own_threads_handlers():
    """One handler of a kind is called without the per-handler loop; the thread filter and a
    second handler of the same kind behave the same either way."""
    heard: list[tuple[str, int]] = []
    started, done = threading.Event(), threading.Event()

    def other_thread():
        stop = events.subscribe_handlers({"step": lambda n: heard.append(("other", n))})
        started.set()
        done.wait(10)
        stop()

    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(10)
    try:
        events.emit("step", 1)  # heard only by the other thread's handler: not here
        stop_a = events.subscribe_handlers({"step": lambda n: heard.append(("a", n))})
        events.emit("step", 2)
        stop_b = events.subscribe_handlers({"step": lambda n: heard.append(("b", n))})
        events.emit("step", 3)
        stop_a()
        events.emit("step", 4)
        stop_b()
        events.emit("step", 5)
    finally:
        done.set()
        worker.join()
    assert heard == [("a", 2), ("a", 3), ("b", 3), ("b", 4)]


def test_a_muted_block_reaches_none_of_its_threads_listeners_and_then_all_again():
    """`events.muted` sets aside the calling thread's subscriptions for the block alone: other
    threads still hear their own events, and one unsubscribed inside the block stays gone."""
    heard: list[tuple[str, int]] = []
    started, emitted, done = threading.Event(), threading.Event(), threading.Event()

    def other_thread():
        stop = events.subscribe_handlers({"step": lambda n: heard.append(("other", n))})
        started.set()
        emitted.wait(10)
        events.emit("step", 20)  # while the main thread is muted
        stop()
        done.set()

    stop_a = events.subscribe_handlers({"step": lambda n: heard.append(("a", n))})
    stop_b = events.subscribe_handlers({"step": lambda n: heard.append(("b", n))})
    worker = threading.Thread(target=other_thread)
    worker.start()
    started.wait(10)
    try:
        with events.muted():
            events.emit("step", 1)
            assert not events.hears("step")
            emitted.set()
            done.wait(10)
            stop_b()  # ended while set aside: not put back
        events.emit("step", 2)
    finally:
        emitted.set()
        worker.join()
        stop_a()
    assert heard == [("other", 20), ("a", 2)]
    assert not any(s.handlers and "step" in s.handlers for s in events.listeners)


# ------------------------------------------------------------------ progress bars
def test_a_progress_bar_counts_every_step_a_plan_evaluates_and_leaves_no_listener():
    import io

    from checkpoint_ad import events
    from checkpoint_ad.strategies import Binomial

    w = cad.tensor(0.5, requires_grad=True)
    step = lambda h, x: (cad.tanh(h * w + x),) * 2
    xs = cad.tensor(np.linspace(0.0, 1.0, 20), dtype="float32")
    out = io.StringIO()
    with cad.progress(total=Binomial(3).plan(20).evaluations, file=out) as bar:
        _, ys = cad.scan(step, cad.tensor(0.0), xs, strategy=Binomial(3))
        ys.sum().backward()
    assert bar.n == Binomial(3).plan(20).evaluations > 20  # the backward's re-runs included
    assert "step" in out.getvalue() and not events.listeners  # nothing costs after the block


def test_scan_progress_shows_the_forwards_steps_and_costs_nothing_when_off(monkeypatch):
    import tqdm

    from checkpoint_ad import events

    made = []

    class Bar(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": __import__("io").StringIO()})
            made.append(self)

    monkeypatch.setattr("checkpoint_ad.progress_bar.tqdm", Bar)
    heard = []
    monkeypatch.setattr(events, "emit", lambda kind, payload: heard.append(kind))
    cad.scan(lambda h, x: (h + x, h), cad.tensor(0.0), cad.tensor([1.0] * 7))
    assert made == [] and heard == []  # off: no bar, no events at all
    monkeypatch.undo()
    monkeypatch.setattr("checkpoint_ad.progress_bar.tqdm", Bar)
    cad.scan(lambda h, x: (h + x, h), cad.tensor(0.0), cad.tensor([1.0] * 7), progress=True)
    assert [(bar.total, bar.n) for bar in made] == [(7, 7)]
