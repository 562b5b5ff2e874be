"""A profile taken while `record`'s fast path runs (the profiler is the one listener and takes
entries directly, `events.kept_record`) reports what the general path reports: the same saved
values (op, role, bytes, origin line, owned or the caller's), timeline, peak and counts, and
the same gradients, bitwise. The general path is forced by a second listener, which turns the
direct hand-over off."""

from __future__ import annotations

import gc
import weakref

import numpy as np

import checkpoint_ad as cad
from checkpoint_ad import events
from checkpoint_ad.saved import KeptBuffer


def _program(W, U, b, xs, c):
    """Leaves, an input's rows (views: the general path), a Python scalar (a shared
    constant), broadcasting, a value saved by two entries (tanh's output, matmul's input),
    two saved values in one entry (a * b), and a constant saved unedged (times `c`)."""
    h = cad.zeros(2, 3)
    loss = None
    for t in range(xs.shape[0]):
        h = cad.tanh(h @ W + xs[t] @ U + b) * 1.01
        h = h * (h + 0.5) - c * h
        loss = h.sum() if loss is None else loss + h.sum()
    return loss


def _params():
    rng = np.random.default_rng(0)
    W = cad.tensor(rng.standard_normal((3, 3)), requires_grad=True)
    U = cad.tensor(rng.standard_normal((4, 3)), requires_grad=True)
    b = cad.tensor(rng.standard_normal(3), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((5, 2, 4)))
    c = cad.tensor(rng.standard_normal((2, 3)))  # no gradient: saved without a graph edge
    return W, U, b, xs, c


def _facts(p):
    return (p.records, p.timeline_bytes, p.timeline_phase, p.peak_tape_bytes, p.aliased_bytes,
            p.primitives, p.recomputed_primitives, p.leaf_bytes, p.peak_buffers,
            p.kept_by_caller, p.originals_kept, p.also_kept, p.unrecorded_bytes)


def _profiled(general):
    W, U, b, xs, c = _params()
    stop = events.subscribe(lambda kind, _: None, kinds=["a kind nobody sends"]) if (
        general) else None
    try:
        with cad.profile() as prof:
            assert (events.kept_record is None) == general
            _program(W, U, b, xs, c).backward()
    finally:
        if stop is not None:
            stop()
    return prof, [p.grad.numpy() for p in (W, U, b)]


def test_a_profile_of_the_fast_path_reports_what_the_general_path_reports():
    fast, fast_grads = _profiled(general=False)
    general, general_grads = _profiled(general=True)
    assert _facts(fast) == _facts(general)
    assert {r.op for r in fast.records} == {"matmul", "tanh", "multiply"}
    assert all("test_profiler_fast_path.py:" in r.origin for r in fast.records)
    assert any(not r.owned for r in fast.records)  # the parameters, by reference
    for g, want in zip(fast_grads, general_grads, strict=True):
        assert np.array_equal(g, want)


def test_profiled_gradients_are_bitwise_those_of_an_unprofiled_run():
    W, U, b, xs, c = _params()
    _program(W, U, b, xs, c).backward()
    plain = [p.grad.numpy().copy() for p in (W, U, b)]
    _, profiled = _profiled(general=False)
    for g, want in zip(profiled, plain, strict=True):
        assert np.array_equal(g, want)


def test_the_fast_path_under_a_profile_keeps_a_value_saved_twice_in_one_buffer():
    x = cad.tensor(np.linspace(-1, 1, 8).reshape(2, 4), requires_grad=True)
    W = cad.tensor(np.eye(4), requires_grad=True)
    with cad.profile() as prof:
        h = cad.tanh(x)  # saves its output...
        y = h @ W  # ...which matmul saves as its input: one buffer, counted once
        assert type(h.grad_fn._saved) is KeptBuffer
        assert h.grad_fn._saved is y.grad_fn.slots[0].buffer
        assert "test_profiler_fast_path.py:" in h.grad_fn.origin  # its line, as before
        y.sum().backward()
    (tanh,) = [r for r in prof.records if r.op == "tanh"]
    matmul = [r for r in prof.records if r.op == "matmul" and r.role == "a"]
    assert matmul and matmul[0].buffer == tanh.buffer
    assert prof.peak_tape_bytes == 64 and prof.timeline_bytes[-1] == 0  # W is the caller's


def test_a_profiled_tape_frees_its_arrays_when_released_without_the_collector():
    """No reference cycle keeps a saved array alive: dropping the tape frees it at once."""
    x = cad.tensor(np.linspace(-1, 1, 1000), requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        with cad.profile() as prof:
            y = cad.tanh(cad.tanh(x))
            saved = weakref.ref(y.grad_fn._saved.packed)
            kept = weakref.ref(y.grad_fn._saved)
            del y
            assert saved() is None and kept() is None  # the tape held them, nothing else
            z = cad.tanh(cad.tanh(x))
            saved = weakref.ref(z.grad_fn._saved.packed)
            z.sum().backward()  # released by the sweep
            assert kept() is None
            del z
            assert saved() is None
    finally:
        gc.enable()
    assert prof.timeline_bytes[-1] == 0 and prof.peak_tape_bytes == 16_000


def test_entries_are_handed_over_directly_only_to_a_profiler_listening_alone():
    assert events.kept_record is None
    with cad.profile():
        assert events.kept_record is not None
        stop = events.subscribe(lambda kind, _: None, kinds=["record"])
        assert events.kept_record is None  # a second listener hears 'record' events again
        stop()
        assert events.kept_record is not None
        with cad.profile():
            assert events.kept_record is None  # two profiles: each hears the events
    assert events.kept_record is None


def test_another_threads_entries_are_not_handed_to_this_threads_profile():
    import threading

    x = cad.tensor(np.linspace(-1, 1, 100), requires_grad=True)
    with cad.profile() as prof:
        worker = threading.Thread(target=lambda: cad.tanh(cad.tanh(x)).sum().backward())
        worker.start()
        worker.join()
        cad.tanh(x).sum().backward()
    assert [r.op for r in prof.records] == ["tanh"] and prof.primitives == 2


def test_a_profiled_entry_with_attributes_keeps_them_beside_its_line():
    """An entry's attributes and its user line share one field until both are set: a
    profiled clip (attributes, a saved input, a line) keeps all three, and its gradient."""
    x = cad.tensor(np.linspace(0.0, 1.0, 12).reshape(3, 4), requires_grad=True)
    with cad.profile():
        y = cad.clip(x, 0.2, 0.8)
        entry = y.grad_fn
        assert entry.attrs == {"low": 0.2, "high": 0.8}
        assert entry.origin_frame[0] is not None
        y.sum().backward()
    inside = (x.numpy() >= 0.2) & (x.numpy() <= 0.8)
    np.testing.assert_array_equal(x.grad.numpy(), inside.astype(float))
