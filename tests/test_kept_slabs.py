"""A long taped segment moves each step's kept values into rows of large arrays (slabs).

What must hold: the same loss and bitwise the same gradients as keeping each value where it
was made, under keep-all and every lossless plan, whether or not the slabs' chunks divide the
loop; a step whose value does not match the traced shape keeps it as made; and the final
carry the caller keeps holds no slab alive: once the rest is dropped, the memory left is the
carry's own.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Budget, Periodic
from checkpoint_ad.strategies.loops import kept_slabs, program_cache

PLANS = [None, Periodic(4), Periodic(7), Binomial(3), Budget("1GiB")]


@pytest.fixture(autouse=True)
def _fresh_programs():
    program_cache.clear()
    yield
    program_cache.clear()


@pytest.fixture
def small_slabs(monkeypatch):
    """Slabs for any segment, in chunks of 3 rows of the RNN below (so they rarely divide);
    the list counts the values moved into a row (so a test knows the slabs were used)."""
    monkeypatch.setattr(kept_slabs, "LEAST_SLAB_BYTES", 1)
    monkeypatch.setattr(kept_slabs, "CHUNK_BYTES", 3 * 4 * 8 * 8)
    moved = []
    place = kept_slabs.KeptSlabs.place

    def counted(self, slot, t, value):
        out = place(self, slot, t, value)
        if out is not value:
            moved.append(t)
        return out

    monkeypatch.setattr(kept_slabs.KeptSlabs, "place", counted)
    return moved


def _no_slabs(monkeypatch):
    monkeypatch.setattr(kept_slabs.KeptSlabs, "for_segment", classmethod(lambda cls, *a: None))


def _rnn(T, strategy=None, seed=0):
    rng = np.random.default_rng(seed)
    W = cad.tensor(rng.standard_normal((8, 8)) * 0.3, requires_grad=True)
    U = cad.tensor(rng.standard_normal((5, 8)) * 0.3, requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, 4, 5)), requires_grad=True)

    def step(h, x):
        a = cad.tanh(h @ W + x @ U)
        h = cad.sigmoid(a) * a + h * 0.5
        return h, a

    h, ys = cad.scan(step, cad.tensor(np.full((4, 8), 0.1)), xs, strategy=strategy)
    loss = (ys * ys).sum() + (h * h).sum()
    loss.backward()
    return float(loss.numpy()), [W.grad.numpy(), U.grad.numpy(), xs.grad.numpy()]


@pytest.mark.parametrize("strategy", PLANS, ids=repr)
@pytest.mark.parametrize("T", [9, 23])
def test_slabs_give_bitwise_the_gradients_of_values_kept_where_made(small_slabs, monkeypatch,
                                                                    strategy, T):
    loss, grads = _rnn(T, strategy)
    if strategy is None or isinstance(strategy, Periodic):  # segments of several steps
        assert small_slabs  # values were moved
    with monkeypatch.context() as m:
        _no_slabs(m)
        program_cache.clear()
        loss_plain, grads_plain = _rnn(T, strategy)
    assert loss == loss_plain
    for got, want in zip(grads, grads_plain):
        assert np.array_equal(got, want)


def test_slabs_give_bitwise_a_python_loops_gradients(small_slabs):
    loss, grads = _rnn(17)
    rng = np.random.default_rng(0)
    W = cad.tensor(rng.standard_normal((8, 8)) * 0.3, requires_grad=True)
    U = cad.tensor(rng.standard_normal((5, 8)) * 0.3, requires_grad=True)
    xs = cad.tensor(rng.standard_normal((17, 4, 5)), requires_grad=True)
    h, rows = cad.tensor(np.full((4, 8), 0.1)), []
    for t in range(17):
        a = cad.tanh(h @ W + xs[t] @ U)
        h = cad.sigmoid(a) * a + h * 0.5
        rows.append(a)
    ys = cad.stack(rows)
    loop_loss = (ys * ys).sum() + (h * h).sum()
    loop_loss.backward()
    assert loss == float(loop_loss.numpy())
    for got, want in zip(grads, [W.grad.numpy(), U.grad.numpy(), xs.grad.numpy()]):
        assert np.array_equal(got, want)


def test_a_value_of_another_shape_than_traced_is_kept_as_made(small_slabs):
    slabs = kept_slabs.KeptSlabs({0: ((2, 3), np.dtype(np.float32), 4)}, 10)
    odd = np.ones((3, 2), np.float32)
    assert slabs.place(0, 0, odd) is odd
    wider = np.ones((2, 3), np.float64)
    assert slabs.place(0, 1, wider) is wider
    fits = np.arange(6, dtype=np.float32).reshape(2, 3)
    row = slabs.place(0, 2, fits)
    assert np.array_equal(row, fits) and row is not fits
    assert slabs.place(0, 10, fits) is fits  # past the segment


def _held_after(step_arrays):
    """Bytes tracemalloc still sees after a keep-all scan's backward, its final carry kept
    (collector off; a first run, untraced, made the program and warmed the caches)."""
    W0, X0 = step_arrays
    held = []
    for _ in range(2):
        W = cad.tensor(W0, requires_grad=True)
        xs = cad.tensor(X0)

        def step(h, x, W=W):
            h = cad.tanh(h @ W + x)
            return h, None

        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            h, _ = cad.scan(step, cad.tensor(np.zeros((16, 64), np.float32)), xs)
            h.sum().backward()
            del W, xs, step
            held.append(tracemalloc.get_traced_memory()[0] - base)
        finally:
            tracemalloc.stop()
            gc.enable()
    return held[-1]


def test_the_final_carry_holds_no_slab_alive(small_slabs, monkeypatch):
    """A caller keeping the loop's final carry keeps what it kept without slabs."""
    monkeypatch.setattr(kept_slabs, "CHUNK_BYTES", 8 * 16 * 64 * 4)  # 8 rows a chunk
    rng = np.random.default_rng(1)
    arrays = (rng.standard_normal((64, 64)).astype(np.float32) * 0.1,
              rng.standard_normal((40, 16, 64)).astype(np.float32))
    with_slabs = _held_after(arrays)
    assert small_slabs
    with monkeypatch.context() as m:
        _no_slabs(m)
        without = _held_after(arrays)
    # a chunk kept alive would be 8 rows of 4 KiB
    assert with_slabs <= without + 4096
