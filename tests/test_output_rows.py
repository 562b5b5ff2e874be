"""A planned loop's per-step outputs are written into one array per output as steps run: the
outputs are held once (not as rows, then a stack, then a copy with the last row joined on),
with the same values and gradients as a plain loop, and rows that change shape or dtype still
stack as they would."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Periodic
from checkpoint_ad.strategies.loops.output_rows import OutputRows


def _forward_peak(step, init, xs, strategy):
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        carry, ys = cad.scan(step, init, xs, strategy=strategy)
        return tracemalloc.get_traced_memory()[1] - base, carry, ys
    finally:
        tracemalloc.stop()


def test_a_loss_per_step_holds_no_row_objects():
    # each step's scalar output was kept as an array object (over 400 B a step) until the
    # loop's end; written in place, the outputs cost their 8 bytes a step
    n = 4000
    w = cad.tensor(0.5, requires_grad=True)
    xs = cad.tensor(np.linspace(0.0, 1.0, n * 4).reshape(n, 4))

    def step(h, x):
        h = cad.tanh(h * w + x)
        return h, cad.sum(h)

    peak, _, ys = _forward_peak(step, cad.zeros(4, dtype="float64"), xs, Binomial(2))
    assert ys.shape == (n,)
    assert peak < n * 100, f"{peak / n:.0f} B a step"


@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(8)])
def test_outputs_that_are_the_carry_are_held_once(strategy):
    # an RNN returning (h, h): the rows, their stack and the stack with the final carry
    # joined on were alive together (3x the outputs); now the outputs are one array
    n = 64
    w = cad.tensor(0.5, requires_grad=True)
    xs = cad.tensor(np.random.default_rng(0).standard_normal((n, 128, 64)))

    def step(h, x):
        h = cad.tanh(h * w + x)
        return h, h

    peak, carry, ys = _forward_peak(step, cad.zeros((128, 64), dtype="float64"), xs, strategy)
    assert peak < 1.5 * ys.numpy().nbytes
    assert np.array_equal(ys.numpy()[-1], carry.numpy())


def test_joined_outputs_match_a_plain_loop_bitwise():
    n = 12
    rng = np.random.default_rng(1)
    w = cad.tensor(rng.standard_normal((3, 3)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((n, 2, 3)))
    weights = cad.tensor(rng.standard_normal((n, 2, 3)))

    def step(h, x):
        h = cad.tanh(h @ w + x)
        return h, (h, cad.sum(h * h))

    def run(strategy):
        init = cad.tensor(np.ones((2, 3)), requires_grad=True)
        carry, (hs, energy) = cad.scan(step, init, xs, strategy=strategy)
        carry.retain_grad()
        loss = cad.sum(hs * weights) + cad.sum(energy) + cad.sum(carry)
        loss.backward()
        return [t.numpy().copy() for t in (hs, energy, carry, w.grad, init.grad, carry.grad)]

    plain = run(None)
    w.grad = None
    for strategy in (Binomial(3), Periodic(4)):
        got = run(strategy)
        w.grad = None
        for a, b in zip(got, plain):
            assert np.array_equal(a, b)


def test_joined_outputs_under_create_graph():
    n = 5
    w = cad.tensor(np.array(0.7), requires_grad=True)
    xs = cad.tensor(np.linspace(-1.0, 1.0, n * 2).reshape(n, 2))

    def step(h, x):
        h = cad.tanh(h * w + x)
        return h, h

    def second(strategy):
        _, hs = cad.scan(step, cad.zeros(2, dtype="float64"), xs, strategy=strategy)
        (g,) = cad.grad(cad.sum(hs * hs), [w], create_graph=True)
        (gg,) = cad.grad(g, [w])
        return g.numpy(), gg.numpy()

    for a, b in zip(second(Binomial(2)), second(None)):
        assert np.allclose(a, b, rtol=1e-12, atol=0)


def test_rows_that_change_dtype_stack_as_rows_would():
    rows = OutputRows(3)
    got = [[np.float32(1.5) * np.ones(2, np.float32)], [np.ones(2, np.float64) / 3],
           [np.arange(2, dtype=np.float32)]]
    for ys in got:
        rows.append(ys)
    (stacked,) = rows.stacked({})
    expected = np.stack([ys[0] for ys in got])
    assert stacked.dtype == expected.dtype
    assert np.array_equal(stacked, expected)


def test_rows_that_change_shape_fail_as_stacking_does():
    rows = OutputRows(2)
    rows.append([np.ones(2)])
    rows.append([np.ones(3)])
    with pytest.raises(ValueError):
        rows.stacked({})


def test_absent_outputs_and_a_carry_output_of_one_row():
    rows = OutputRows(1)
    rows.append([None, np.ones(2)])
    assert rows.stacked({1: 0}) == [None, None]  # the one row is the carry, joined on later
    assert rows.whole(1).shape == (1, 2)



def test_a_scan_keeping_every_step_holds_its_outputs_once():
    # the tape keeps every h (tanh saves its output); the outputs were the rest's rows
    # stacked, then copied again with steps 0 and 1 joined on: tape + 2x outputs at the
    # peak, now tape + 1x
    n = 64
    w = cad.tensor(0.5, requires_grad=True)
    xs = cad.tensor(np.random.default_rng(3).standard_normal((n, 128, 64)))

    def step(h, x):
        h = cad.tanh(h * w + x)
        return h, h

    peak, _, ys = _forward_peak(step, cad.zeros((128, 64), dtype="float64"), xs, None)
    assert ys.grad_fn is not None and ys.grad_fn.name == "concatenate"
    assert peak < 2.5 * ys.numpy().nbytes
    (g,) = cad.grad(cad.sum(ys * ys), [w])
    (reference,) = cad.grad(cad.sum(cad.scan(step, cad.zeros((128, 64), dtype="float64"), xs,
                                              trace=False)[1] ** 2), [w])
    assert np.array_equal(g.numpy(), reference.numpy())


def test_a_loop_of_unknown_length_holds_no_row_objects():
    # `until` loops write rows into chunks (doubling, up to a MiB), joined once the length is
    # known: a row object per output and step was 634 B a step here, now 173 (of which the
    # online plan's own record is 112, and the outputs themselves 40, held twice while joined)
    w = cad.tensor(0.5, requires_grad=True)

    def step(carry, _):
        h, t = carry
        h = cad.tanh(h * w + 0.1)
        return (h, t + 1.0), (cad.sum(h), h)

    init = (cad.zeros(4, dtype="float64"), cad.tensor(0.0, dtype="float64"))

    def run(n):
        return _until_peak(step, init, lambda c: c[1].item() >= n)

    run(500)  # warm: one-time caches
    short, (long, (h, _), (energy, hs)) = run(1000)[0], run(3000)
    assert energy.shape == (3000,) and hs.shape == (3000, 4)
    assert (long - short) / 2000 < 300, f"{(long - short) / 2000:.0f} B a step"
    assert np.array_equal(hs.numpy()[-1], h.numpy())

    _, (energy_ref, hs_ref) = cad.scan(step, init, length=3000)
    assert np.array_equal(energy.numpy(), energy_ref.numpy())
    assert np.array_equal(hs.numpy(), hs_ref.numpy())
    (g,) = cad.grad(cad.sum(hs * hs) + cad.sum(energy), [w])
    (g_ref,) = cad.grad(cad.sum(hs_ref * hs_ref) + cad.sum(energy_ref), [w])
    assert np.array_equal(g.numpy(), g_ref.numpy())


def _until_peak(step, init, until):
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        carry, ys = cad.scan(step, init, strategy=Binomial(2), until=until)
        return tracemalloc.get_traced_memory()[1] - base, carry, ys
    finally:
        tracemalloc.stop()


def test_rows_of_unknown_count_across_chunks_stack_as_rows_would():
    rows = OutputRows(None)
    got = [[np.full(2, float(i)), None] for i in range(100)]  # chunks of 16, 16, 32, 64
    for ys in got:
        rows.append(ys)
    stacked, absent = rows.stacked({})
    assert absent is None
    assert np.array_equal(stacked, np.stack([ys[0] for ys in got]))

    rows = OutputRows(None)
    for i in range(40):
        rows.append([np.full(2, float(i))])
    rows.append([np.ones(3)])  # unlike the rows before: kept as rows, which cannot stack
    with pytest.raises(ValueError):
        rows.stacked({})

    rows = OutputRows(None)
    for _ in range(20):
        rows.append([None])
    assert rows.stacked({}) == [None]


# ----------------------------------------------- a recorded loop (trace=False) writes rows too
def _plain_loop(step, h, xs):
    ys = []
    for t in range(xs.shape[0]):
        h, y = step(h, xs[t])
        ys.append(y)
    return h, cad.stack(ys, axis=0)


def test_a_recorded_scan_gives_a_plain_loops_outputs_and_gradients_bitwise():
    rng = np.random.default_rng(3)
    w = cad.tensor(rng.standard_normal((4, 4)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((6, 2, 4)), requires_grad=True)

    def step(h, x):
        h = cad.tanh(h @ w + x)
        return h, (h * 2.0, w)  # a leaf as an output: its gradient sums over the steps

    def grads(scan):
        w.grad = xs.grad = None
        h0 = cad.tensor(np.ones((2, 4)))
        if scan:
            h, (ys, ws) = cad.scan(step, h0, xs, trace=False)
        else:
            h, pairs = h0, []
            for t in range(xs.shape[0]):
                h, y = step(h, xs[t])
                pairs.append(y)
            ys, ws = (cad.stack([p[k] for p in pairs], axis=0) for k in (0, 1))
        ((ys * ys).sum() + (ws * 3.0).sum() + h.sum()).backward()
        return ys.numpy(), w.grad.numpy(), xs.grad.numpy()

    for got, want in zip(grads(True), grads(False)):
        np.testing.assert_array_equal(got, want)


def test_a_recorded_scan_runs_hooks_and_retain_grad_on_its_outputs():
    w = cad.tensor(np.array([0.5, -0.3]), requires_grad=True)
    kept, seen = [], []

    def step(h, x):
        y = cad.sin(h * w + x)
        y.retain_grad()
        y.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 2.0)
        kept.append(y)
        return y, y * 1.0

    def run(scan):
        kept.clear()
        seen.clear()
        w.grad = None
        xs = cad.tensor(np.linspace(0.0, 1.0, 8).reshape(4, 2))
        h0 = cad.tensor(np.array([0.1, 0.2]))
        _, ys = cad.scan(step, h0, xs, trace=False) if scan else _plain_loop(step, h0, xs)
        (ys * ys).sum().backward()
        return [w.grad.numpy(), *[t.grad.numpy() for t in kept], *seen]

    got, want = run(True), run(False)
    assert len(got) == len(want) == 1 + 4 + 4
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_recorded_scan_whose_rows_change_dtype_stacks_as_a_plain_loop():
    def step(h, x):
        y = h * x
        return h, y if int(x.numpy()[0]) % 2 else cad.astype(y, "float32")

    def run(scan):
        h0 = cad.tensor(np.array([0.5, 1.5]), requires_grad=True)
        xs = cad.tensor(np.arange(8.0).reshape(4, 2))
        _, ys = cad.scan(step, h0, xs, trace=False) if scan else _plain_loop(step, h0, xs)
        (ys * ys).sum().backward()
        return ys.dtype, ys.numpy(), h0.grad.numpy()

    (dtype, ys, grad), (want_dtype, want_ys, want_grad) = run(True), run(False)
    assert dtype == want_dtype
    np.testing.assert_array_equal(ys, want_ys)
    np.testing.assert_array_equal(grad, want_grad)


def test_a_recorded_scan_whose_rows_change_shape_fails_as_stacking_does():
    def step(h, x):
        return h, h[: 1 + int(x.numpy()[0])]

    xs = cad.tensor(np.array([[0.0], [1.0]]))
    h0 = cad.tensor(np.ones(3))
    with pytest.raises(Exception) as plain:
        _plain_loop(step, h0, xs)
    with pytest.raises(type(plain.value)):
        cad.scan(step, h0, xs, trace=False)
