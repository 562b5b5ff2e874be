"""The per-op recording path's shortcuts keep the engine's semantics: shared scalar constants,
shared origin pairs and metadata, the cached "no packer anywhere" answer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import checkpoint_ad as cad


def _chain(x, n):
    y = x
    for _ in range(n):
        y = cad.sin(y * 1.01 + 0.1)
    return y


def test_scalar_operands_are_one_saved_constant_and_gradients_stay_bitwise():
    x = cad.tensor(np.linspace(0.1, 0.9, 7), requires_grad=True)
    y = _chain(x, 20)
    saved = [s for e in cad.tape_of(y) for s in e.saved if e.op == "multiply"]
    assert len(saved) == 20 and len({s.buffer_id for s in saved}) == 1  # stored once
    cad.sum(y).backward()
    reference = np.linspace(0.1, 0.9, 7)
    g = np.ones(7)
    values = []
    for _ in range(20):
        values.append(reference * 1.01 + 0.1)
        reference = np.sin(values[-1])
    for v in reversed(values):
        g = g * np.cos(v) * 1.01
    assert np.array_equal(x.grad.numpy(), g)


def test_the_shared_constant_cannot_be_changed_in_place():
    x = cad.tensor(np.ones(3), requires_grad=True)
    y = x * 2.5
    (slot,) = y.grad_fn.slots
    with pytest.raises(ValueError, match="read-only"):
        slot.buffer.packed += 1


@pytest.mark.parametrize("scalar", [0.0, -0.0, float("nan"), True, 3])
def test_scalars_that_sharing_would_blur_keep_their_exact_value(scalar):
    x = cad.tensor(np.array([1.0, -2.0]), requires_grad=True)
    y = x * scalar
    np.testing.assert_array_equal(y.numpy(), np.array([1.0, -2.0]) * scalar)
    y.sum().backward()
    expected = np.full(2, scalar, dtype=np.float64)
    assert np.array_equal(x.grad.numpy(), expected, equal_nan=True)
    assert np.array_equal(np.signbit(x.grad.numpy()), np.signbit(expected))


def test_float32_constants_keep_float32():
    x = cad.tensor(np.ones(2, dtype=np.float32), requires_grad=True)
    assert (x * 1.01).dtype == np.float32 and (1.01 * x).dtype == np.float32


def test_entries_recorded_on_one_line_share_one_origin_that_names_it():
    x = cad.tensor(np.ones(2), requires_grad=True)
    with cad.record_origins():
        ys = [cad.tanh(x) * 2.0 for _ in range(3)]  # the line recorded, through an operator too
    entries = [y.grad_fn for y in ys] + [y.grad_fn.edges[0][0] for y in ys]
    assert len({id(e.origin_frame) for e in entries}) == 1
    assert entries[0].origin.endswith(f"test_hot_path.py:{_line_of('ys = [cad.tanh')}")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def test_entries_share_metadata_of_equal_shapes_but_keep_their_own_values():
    x = cad.tensor(np.ones((2, 3)), requires_grad=True)
    a, b = cad.exp(x), cad.exp(x * 2.0)
    assert a.grad_fn.out_meta is b.grad_fn.out_meta
    assert a.grad_fn.out_meta == (((2, 3), np.dtype("float64")),)


def test_a_packer_in_one_thread_leaves_another_thread_keeping_all():
    seen, ready, done = [], threading.Event(), threading.Event()

    def other_thread():
        with cad.saved_values_hooks(lambda a: seen.append(a.shape) or a, lambda a: a):
            ready.set()
            done.wait(10)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        ready.wait(10)
        x = cad.tensor(np.ones(4), requires_grad=True)
        cad.sum(cad.tanh(x)).backward()  # recorded here while the other thread packs
        assert seen == []
    finally:
        done.set()
        worker.join()
    assert not cad.saved._pushed  # the blocks closed: none left


def test_plain_runs_skip_the_origin_line_and_say_how_to_get_it():
    x = cad.tensor(np.ones(2), requires_grad=True)
    y = cad.tanh(x)
    assert y.grad_fn.origin == "<unknown>"
    assert "cad.record_origins()" in y.grad_fn.describe()
    with pytest.raises(cad.BackwardError, match=r"'tanh' \(record under cad.record_origins"):
        y.requires_grad = False


def test_record_origins_detect_anomaly_and_profiles_keep_the_line():
    x = cad.tensor(np.ones(2), requires_grad=True)
    with cad.record_origins():
        a = cad.tanh(x)
        with cad.record_origins(False):
            off = cad.tanh(x)
        b = cad.tanh(x)
    with cad.detect_anomaly():
        c = cad.tanh(x)
    with cad.profile():
        d = cad.tanh(x)
    after = cad.tanh(x)
    assert off.grad_fn.origin == after.grad_fn.origin == "<unknown>"
    for y in (a, b, c, d):
        assert "test_hot_path.py:" in y.grad_fn.origin
        assert "(recorded at " in y.grad_fn.describe()
    assert not cad.grad_mode.origin_blocks  # every block closed


def test_a_profile_finds_the_lines_of_the_entries_that_save_values():
    """A profile lists saved values with their lines; an entry that saves nothing (an add)
    is not looked up under a profiler alone, and is under record_origins."""
    x = cad.tensor(np.ones(2), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(x) + 1.0
    assert "test_hot_path.py:" in y.grad_fn.edges[0][0].origin  # tanh saves its output
    assert y.grad_fn.origin == "<unknown>"  # the add saves nothing
    assert all("test_hot_path.py:" in r.origin for r in prof.records)
    with cad.profile(), cad.record_origins():
        z = cad.tanh(x) + 1.0
    assert "test_hot_path.py:" in z.grad_fn.origin


def test_record_origins_in_one_thread_leaves_another_without_lines():
    seen, ready, done = [], threading.Event(), threading.Event()

    def other_thread():
        with cad.record_origins():
            ready.set()
            done.wait(10)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        ready.wait(10)
        seen.append(cad.tanh(cad.tensor(np.ones(2), requires_grad=True)).grad_fn.origin)
    finally:
        done.set()
        worker.join()
    assert seen == ["<unknown>"]


def test_record_origins_restores_the_mode_when_its_block_raises():
    with pytest.raises(RuntimeError), cad.record_origins():
        raise RuntimeError("inside")
    assert not cad.grad_mode.origins_wanted()
    assert repr(cad.record_origins(False)) == "record_origins(enabled=False)"


def test_released_entries_say_so_whether_or_not_they_saved_values():
    x = cad.tensor(np.ones(3), requires_grad=True)
    s = x + 1.0  # saves nothing
    t = cad.tanh(s)  # saves its output
    loss = cad.sum(t)
    assert not s.grad_fn.released and not t.grad_fn.released
    loss.backward()
    assert s.grad_fn.released and t.grad_fn.released
    assert "(freed)" in cad.tape_of(t).table()
    t.grad_fn.release()  # a second release keeps "freed", not "nothing saved"
    with pytest.raises(cad.BackwardError, match="second time"):
        loss.backward()
    x.grad = None
    cad.sum(s).backward()  # nothing was saved for x + 1.0: it can run again
    assert np.array_equal(x.grad.numpy(), np.ones(3))


def test_a_listing_without_lines_says_how_to_get_them():
    x = cad.tensor(np.ones(3), requires_grad=True)
    plain = cad.tape_of(cad.tanh(x)).table()
    assert "<unknown>" in plain and "cad.record_origins()" in plain
    with cad.record_origins():
        y = cad.tanh(x)
    listed = cad.tape_of(y).table()
    assert "test_hot_path.py:" in listed and "record_origins" not in listed


def test_a_constant_first_made_under_inference_mode_can_still_be_saved():
    with cad.inference_mode():
        cad.tensor(np.ones(2)) * 7.25  # the first use of 7.25 makes its shared constant
    x = cad.tensor(np.ones(2), requires_grad=True)
    (x * 7.25).sum().backward()  # multiply saves the constant for x's gradient
    assert np.array_equal(x.grad.numpy(), np.full(2, 7.25))
