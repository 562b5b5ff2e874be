"""A scan's carry-independent products (``x @ U``) are batched over aligned chunks of rows.

What must hold (issue 42 items 2-3): every lossless strategy gives bitwise the gradients of
keeping every step with batching on, whatever the loop's length (not a multiple of the chunk),
direction, and which inputs take a gradient; the gradients are right (finite differences in
float64) and equal to the row-by-row ones (``batch_rows=False``) to rounding; a step with
nothing to batch is unchanged; the memory peak grows by at most about one chunk.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Budget, Periodic, Recompute
from checkpoint_ad.strategies.loops import program_cache
from checkpoint_ad.strategies.loops.hoisted_rows import choose_chunk, find_hoisted
from checkpoint_ad.testing import gradcheck

LOSSLESS = [Periodic(1), Periodic(5), Binomial(2), Binomial(4), Recompute(), Budget("1GiB")]


@pytest.fixture(autouse=True)
def _fresh_programs():
    program_cache.clear()
    yield
    program_cache.clear()


def _inputs(T, dtype=np.float32, seed=0, B=4, H=8, n_in=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((H, H)).astype(dtype) * 0.3,
            rng.standard_normal((n_in, H)).astype(dtype) * 0.3,
            rng.standard_normal((T, B, n_in)).astype(dtype),
            rng.standard_normal((B, H)).astype(dtype) * 0.1)


def _rnn(arrays, strategy=None, batch_rows=True, reverse=False, xs_grad=True,
         u_leaf=True, chain=False, hoistable=True, trace=True):
    """(loss, gradients of W, U (or its leaf), xs (or None)) of an RNN over `arrays`."""
    W0, U0, X0, H0 = arrays
    W = cad.tensor(W0, requires_grad=True)
    V = cad.tensor(U0 if u_leaf else U0 / 2, requires_grad=True)
    U = V if u_leaf else V * 2.0  # a captured non-leaf
    X = cad.tensor(X0, requires_grad=xs_grad)
    c = cad.tensor(np.linspace(0.5, 1.5, U0.shape[1]).astype(U0.dtype))

    def step(h, x):
        # hoistable=False: no product takes a captured matrix on the right (nothing batched)
        u = x @ U if hoistable else x @ (U * 1.0)
        if chain:
            u = u * c
        h = cad.tanh((h @ W if hoistable else h @ (W * 1.0)) + u)
        return h, h

    h, ys = cad.scan(step, cad.tensor(H0), X, strategy=strategy, reverse=reverse,
                     batch_rows=batch_rows, trace=trace)
    loss = (ys * ys).sum() + h.sum()
    loss.backward()
    return loss.item(), [W.grad.numpy(), V.grad.numpy(),
                         None if not xs_grad else X.grad.numpy()]


def _same(a, b):
    assert a[0] == b[0]
    for g, r in zip(a[1], b[1], strict=True):
        if r is None:
            assert g is None
        else:
            np.testing.assert_array_equal(g, r)


# chunks of 8 rows at 130 steps (the last chunk of 2), of 12 at 200 (`choose_chunk`)
@pytest.mark.parametrize("T", [130, 200])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("xs_grad", [True, False])
def test_every_lossless_strategy_keeps_keep_alls_gradients_with_rows_batched(
        T, reverse, xs_grad):
    arrays = _inputs(T)
    ref = _rnn(arrays, reverse=reverse, xs_grad=xs_grad)
    for strategy in LOSSLESS:
        _same(_rnn(arrays, strategy, reverse=reverse, xs_grad=xs_grad), ref)


@pytest.mark.parametrize("u_leaf", [True, False], ids=["leaf", "non-leaf"])
@pytest.mark.parametrize("chain", [False, True], ids=["xU", "xU*c"])
def test_batched_rows_with_a_captured_non_leaf_and_a_chain(u_leaf, chain):
    arrays = _inputs(150)
    ref = _rnn(arrays, u_leaf=u_leaf, chain=chain)
    for strategy in (Periodic(4), Binomial(3), Recompute()):
        _same(_rnn(arrays, strategy, u_leaf=u_leaf, chain=chain), ref)


def test_a_second_call_reusing_the_program_keeps_the_gradients():
    arrays = _inputs(140)
    first = _rnn(arrays)  # makes the program a later call reuses (step 1 then replayed)
    for strategy in (None, Periodic(3), Binomial(2)):
        _same(_rnn(arrays, strategy), first)


def test_batching_on_and_off_agree_to_rounding():
    arrays = _inputs(300)
    on, off = _rnn(arrays), _rnn(arrays, batch_rows=False)
    assert on[0] == pytest.approx(off[0], rel=1e-5)
    for g, r in zip(on[1], off[1], strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_batching_off_is_the_recorded_loop_bitwise():
    arrays = _inputs(140, dtype=np.float64)
    recorded = _rnn(arrays, trace=False)
    _same(_rnn(arrays, batch_rows=False), recorded)
    _same(_rnn(arrays, Binomial(3), batch_rows=False), recorded)


def test_a_step_with_nothing_to_batch_is_unchanged():
    arrays = _inputs(133)
    on = _rnn(arrays, hoistable=False)
    _same(_rnn(arrays, batch_rows=False, hoistable=False), on)
    _same(_rnn(arrays, Binomial(3), hoistable=False), on)


def test_only_a_row_times_a_captured_matrix_is_batched():
    from checkpoint_ad.strategies.loops.step_trace import Instruction

    def ins(name, inputs):
        prim = type("P", (), {"name": name})()
        return Instruction(prim, inputs, {}, 9, True, (True, True), None, (), (), None)

    dtypes = [np.dtype("float32")] * 10
    # slots: 0 the carry (4, 6), 1 the row (4, 6), 2 a captured (6, 8), 3 a captured (6,)
    shapes = [(4, 6), (4, 6), (6, 8), (6,)] + [None] * 6
    found, row_bytes = find_hoisted(
        (ins("matmul", (1, 2)),  # row @ captured matrix: batched
         ins("matmul", (0, 2)),  # the carry's: not
         ins("matmul", (1, 3)),  # row @ captured vector: not
         ins("add", (1, 2))),  # not a product
        (1,), {2: None, 3: None}, dtypes, shapes)
    assert [h.index for h in found] == [0] and row_bytes == 4 * 8 * 4
    # chunks: at most 32 steps, 2 MiB, a 16th of the loop; fewer than 8 steps: none
    assert choose_chunk(row_bytes, 1000) == 32 and choose_chunk(row_bytes, 200) == 12
    assert choose_chunk(row_bytes, 100) == 0 and choose_chunk(1 << 20, 1000) == 0


def test_gradients_are_right_in_float64():
    rng = np.random.default_rng(3)
    W = cad.tensor(rng.standard_normal((3, 3)) * 0.4, requires_grad=True)
    U = cad.tensor(rng.standard_normal((2, 3)) * 0.4, requires_grad=True)
    X = cad.tensor(rng.standard_normal((130, 2, 2)) * 0.3, requires_grad=True)

    def fn(W, U, X):
        def step(h, x):
            h = cad.tanh(h @ W + x @ U)
            return h, h
        h, ys = cad.scan(step, cad.zeros(2, 3, dtype="float64"), X, strategy=Binomial(2),
                         batch_rows=True)
        return (ys * ys).sum() + h.sum()

    assert gradcheck(fn, [W, U, X], order=1)


def _peak(arrays, batch_rows, strategy):
    W0, U0, X0, H0 = arrays
    W, U = cad.tensor(W0, requires_grad=True), cad.tensor(U0, requires_grad=True)
    X = cad.tensor(X0)

    def step(h, x):
        h = cad.tanh(h @ W + x @ U)
        return h, None

    tracemalloc.start()
    try:
        h, _ = cad.scan(step, cad.tensor(H0), X, strategy=strategy, batch_rows=batch_rows)
        h.sum().backward()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("strategy", [None, Periodic(8)], ids=["keep-all", "periodic"])
def test_batching_adds_at_most_about_its_chunks_to_the_peak(strategy):
    arrays = _inputs(512, B=16, H=64, n_in=64)
    _peak(arrays, True, strategy)  # programs made, caches warm
    _peak(arrays, False, strategy)
    on, off = _peak(arrays, True, strategy), _peak(arrays, False, strategy)
    chunk = 32 * 16 * 64 * 4  # one chunk of products (or of the gradients, or of the carry)
    # keeping every step, the backward's stacked gradients and carries; a plan's backward
    # holds a chunk of products beside them
    assert on <= off + (2 if strategy is None else 3) * chunk + (64 << 10)


@pytest.mark.parametrize("batch_rows", [True, False])
def test_the_rnn_step_makes_one_product_per_chunk(monkeypatch, batch_rows):
    from checkpoint_ad.strategies.loops import hoisted_rows

    made = []
    product = hoisted_rows.RowSource._product

    def spy(self, j, h, weight, start, stop):
        made.append((start + self.offset, stop + self.offset))
        return product(self, j, h, weight, start, stop)

    monkeypatch.setattr(hoisted_rows.RowSource, "_product", spy)
    _rnn(_inputs(530), batch_rows=batch_rows)
    # steps 0 and 1 are traced; 2..529 in chunks aligned on multiples of 32
    chunks = [(2, 32)] + [(c, c + 32) for c in range(32, 512, 32)] + [(512, 530)]
    assert made == (chunks if batch_rows else [])


def test_a_scan_without_gradients_batches_as_one_with_them():
    W0, U0, X0, H0 = _inputs(145)
    W, U, X = cad.tensor(W0), cad.tensor(U0), cad.tensor(X0)

    def step(h, x):
        h = cad.tanh(h @ W + x @ U)
        return h, h

    outputs = {}
    for mode in ("no_grad", "grad", "periodic"):
        program_cache.clear()
        W.requires_grad = mode != "no_grad"
        strategy = Periodic(4) if mode == "periodic" else None
        with cad.set_grad_enabled(mode != "no_grad"):
            outputs[mode] = cad.scan(step, cad.tensor(H0), X, strategy=strategy,
                                     batch_rows=True)[1].numpy()
    np.testing.assert_array_equal(outputs["grad"], outputs["no_grad"])
    np.testing.assert_array_equal(outputs["periodic"], outputs["no_grad"])


@pytest.mark.parametrize("strategy", [None, Binomial(3)], ids=["keep-all", "binomial"])
def test_a_profile_sees_the_same_saved_values_and_counts_the_chunk(strategy):
    from checkpoint_ad.profiler import profile

    W0, U0, X0, H0 = _inputs(600)
    profiles = {}
    for batch_rows in (True, False):
        program_cache.clear()
        W, U = cad.tensor(W0, requires_grad=True), cad.tensor(U0, requires_grad=True)
        with profile() as prof:
            def step(h, x, W=W, U=U):
                h = cad.tanh(h @ W + x @ U)
                return h, h

            h, ys = cad.scan(step, cad.tensor(H0), cad.tensor(X0), strategy=strategy,
                             batch_rows=batch_rows)
            (ys.sum() + h.sum()).backward()
        profiles[batch_rows] = prof
    on, off = profiles[True], profiles[False]
    assert on.peak_tape_bytes == off.peak_tape_bytes
    assert len(on.records) == len(off.records)
    chunk = 32 * 4 * 8 * 4  # rows of a chunk, batch, hidden, float32
    extra = sum(on.loop_arrays.values()) - sum(off.loop_arrays.values())
    # a chunk of products (forward); stacked in the backward: the carry (h @ W's left
    # operand) and the gradient both products share; a plan's backward holds all three
    assert extra == (3 * chunk if strategy is not None else 2 * chunk)


@pytest.mark.parametrize("strategy", [Binomial(2), Binomial(5)])
def test_a_loop_stopped_by_until_keeps_keep_alls_gradients_with_rows_batched(strategy):
    W0, U0, X0, H0 = _inputs(400)

    def run(strategy):
        program_cache.clear()
        W, U = cad.tensor(W0, requires_grad=True), cad.tensor(U0, requires_grad=True)
        count = [0]

        def until(h):
            count[0] += 1
            return count[0] >= 170  # mid-chunk, before the end of xs

        def step(h, x):
            h = cad.tanh(h @ W + x @ U)
            return h, h

        h, ys = cad.scan(step, cad.tensor(H0), cad.tensor(X0), strategy=strategy,
                         until=until, batch_rows=True)
        assert ys.shape[0] == 170
        (ys.sum() + h.sum()).backward()
        return [W.grad.numpy(), U.grad.numpy()]

    for g, r in zip(run(strategy), run(None), strict=True):
        np.testing.assert_array_equal(g, r)


def test_a_second_backward_keeps_keep_alls_gradients_with_rows_batched():
    W0, U0, X0, H0 = _inputs(150)

    def twice(strategy):
        program_cache.clear()
        W, U = cad.tensor(W0, requires_grad=True), cad.tensor(U0, requires_grad=True)

        def step(h, x):
            h = cad.tanh(h @ W + x @ U)
            return h, h

        h, ys = cad.scan(step, cad.tensor(H0), cad.tensor(X0), strategy=strategy,
                         batch_rows=True)
        loss = ys.sum() + h.sum()
        loss.backward(retain_graph=True)
        loss.backward()  # adds onto .grad: the chunk's sums are made again
        return [W.grad.numpy(), U.grad.numpy()]

    for g, r in zip(twice(Binomial(3)), twice(None), strict=True):
        np.testing.assert_array_equal(g, r)


def test_a_product_row_the_step_returns_outlives_its_chunk():
    """A row of a product that the step returns (or saves, or views) is not made into a
    reused buffer: every step's output keeps its own row."""
    W0, U0, X0, H0 = _inputs(150)

    def run(strategy, batch_rows=True):
        program_cache.clear()
        W, U = cad.tensor(W0, requires_grad=True), cad.tensor(U0, requires_grad=True)

        def step(h, x):
            u = x @ U
            return cad.tanh(h @ W + u), u

        h, us = cad.scan(step, cad.tensor(H0), cad.tensor(X0), strategy=strategy,
                         batch_rows=batch_rows)
        ((us * us).sum() + h.sum()).backward()
        return us.numpy(), [W.grad.numpy(), U.grad.numpy()]

    ref_us, ref = run(None)
    np.testing.assert_allclose(ref_us, X0 @ U0, rtol=1e-5, atol=1e-6)
    for strategy in (Binomial(3), Periodic(7)):
        us, got = run(strategy)
        np.testing.assert_array_equal(us, ref_us)
        for g, r in zip(got, ref, strict=True):
            np.testing.assert_array_equal(g, r)


# ------------------------------------------- weight gradients of carry-dependent products
def _gated(arrays, strategy=None, batch_rows=True, reverse=False, python=False,
           anomaly=False):
    """(loss, gradients of W1, W2, V, b, xs) of a gated step: two products take the carry on
    the left (their gradients differ), one a carry-independent value that is not a row of
    xs, and a captured vector is broadcast-added; a Python loop with `python`; the backward
    under anomaly detection with `anomaly`."""
    W0, U0, X0, H0 = arrays
    W1, W2 = cad.tensor(W0, requires_grad=True), cad.tensor(W0.T * 0.5, requires_grad=True)
    V = cad.tensor(U0, requires_grad=True)
    b = cad.tensor(np.linspace(-0.2, 0.2, W0.shape[0]).astype(W0.dtype), requires_grad=True)
    X = cad.tensor(X0, requires_grad=True)

    def step(h, x):
        z = h @ W1 + (x * 1.0) @ V + b
        h = cad.tanh(z) * cad.sigmoid(h @ W2)
        return h, h

    if python:
        h, outs = cad.tensor(H0), []
        rows = range(X0.shape[0] - 1, -1, -1) if reverse else range(X0.shape[0])
        for t in rows:
            h, y = step(h, X[t])
            outs.append(y)
        ys = cad.stack(outs[::-1] if reverse else outs)
    else:
        h, ys = cad.scan(step, cad.tensor(H0), X, strategy=strategy, reverse=reverse,
                         batch_rows=batch_rows)
    loss = (ys * ys).sum() + h.sum()
    if anomaly:
        with cad.detect_anomaly():
            loss.backward()
    else:
        loss.backward()
    return loss.item(), [W1.grad.numpy(), W2.grad.numpy(), V.grad.numpy(), b.grad.numpy(),
                         X.grad.numpy()]


@pytest.mark.parametrize("T", [130, 200])
@pytest.mark.parametrize("reverse", [False, True])
def test_every_lossless_strategy_keeps_keep_alls_gradients_with_weight_gradients_batched(
        T, reverse):
    arrays = _inputs(T)
    ref = _gated(arrays, reverse=reverse)
    for strategy in LOSSLESS:
        _same(_gated(arrays, strategy, reverse=reverse), ref)


@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-4), (np.float64, 1e-12)])
def test_weight_gradients_batched_agree_with_unbatched_and_a_python_loop(dtype, tolerance):
    """Equal to rounding (relative `tolerance`, and as much absolute): a chunk's product over
    stacked rows sums in another order than one product per step."""
    arrays = _inputs(300, dtype=dtype)
    on = _gated(arrays)
    for other in (_gated(arrays, batch_rows=False), _gated(arrays, python=True)):
        assert on[0] == pytest.approx(other[0], rel=tolerance)
        for g, r in zip(on[1], other[1], strict=True):
            np.testing.assert_allclose(g, r, rtol=tolerance, atol=tolerance)
    assert any(not np.array_equal(g, r) for g, r in zip(on[1], _gated(arrays, batch_rows=False)[1]))


def test_each_captured_tensor_is_summed_once_per_chunk(monkeypatch):
    from checkpoint_ad.strategies.loops import hoisted_rows

    sums = []
    step_done = hoisted_rows.RowSource.step_done

    def spy(self, t, add, positions):
        def counted(position, grad):
            sums.append((t + self.offset, grad.shape))
            add(position, grad)
        return step_done(self, t, counted, positions)

    monkeypatch.setattr(hoisted_rows.RowSource, "step_done", spy)
    _gated(_inputs(130))
    # chunks of 8 steps (the first from step 2, the last of 2): W1, V, b, W2, one sum each
    starts = [2, *range(8, 130, 8)]
    shapes = [(8, 8), (6, 8), (8,), (8, 8)]  # in the order the step makes them
    assert sums == [(s, shape) for s in reversed(starts) for shape in shapes]


def test_stacks_share_a_buffer_while_handed_the_same_array():
    from checkpoint_ad.strategies.loops.hoisted_rows import Stacks

    stacks = Stacks(4)
    rows = [np.full(3, float(r)) for r in range(4)]
    other = np.full(3, -1.0)
    stacks.begin(4)
    stacks.put("a", 3, rows[3])
    stacks.put("b", 3, rows[3])  # shares "a"'s buffer
    stacks.put("c", 2, rows[2])  # nothing at row 3: zeros there
    for r in (2, 1, 0):
        stacks.put("a", r, rows[r])
        stacks.put("b", r, other if r == 1 else rows[r])  # handed another array: split
        if r < 2:
            stacks.put("c", r, rows[r]) if r == 0 else None  # nothing at row 1
    a, b, c = (stacks.stacked(k) for k in "abc")
    np.testing.assert_array_equal(a, np.stack(rows))
    np.testing.assert_array_equal(b, np.stack([rows[0], other, rows[2], rows[3]]))
    np.testing.assert_array_equal(c, np.stack([rows[0], 0 * other, rows[2], 0 * other]))
    assert a.base is not b.base and a.base is not c.base


def test_weight_and_bias_gradients_are_right_in_float64():
    rng = np.random.default_rng(5)
    W = cad.tensor(rng.standard_normal((3, 3)) * 0.4, requires_grad=True)
    b = cad.tensor(rng.standard_normal(3) * 0.2, requires_grad=True)
    X = cad.tensor(rng.standard_normal((130, 2, 3)) * 0.3, requires_grad=True)

    def fn(W, b, X):
        def step(h, x):
            h = cad.tanh(h @ W + x + b)
            return h, h
        h, ys = cad.scan(step, cad.zeros(2, 3, dtype="float64"), X, strategy=Periodic(9),
                         batch_rows=True)
        return (ys * ys).sum() + h.sum()

    assert gradcheck(fn, [W, b, X], order=1)


def test_a_budget_counts_the_stacked_rows_and_its_tape_fits():
    from checkpoint_ad.profiler import profile
    from checkpoint_ad.strategies.loops.hoisted_rows import choose_chunk

    arrays = _inputs(256, B=16, H=32, n_in=32)
    ref = _gated(arrays)
    outside = 256 * 16 * 32 * 4  # ys, which the loss's ys * ys saves
    for limit in (1 << 30, 300 << 10):  # keep-all fits (2 MiB), then does not
        peaks = {}
        for batch_rows in (False, True):
            program_cache.clear()
            budget = Budget(limit)
            with profile() as prof:
                got = _gated(arrays, budget, batch_rows=batch_rows)
            peaks[batch_rows] = prof.peak_tape_bytes
        _same(got, ref)
        assert peaks[True] == peaks[False] <= limit + outside
    assert budget.last.chosen.strategy is not None  # a plan re-running steps
    row = 16 * 32 * 4  # a step's carry, or its gradient
    # stacked per chunk: the carry (both products' left operand), the gradients reaching
    # z (shared by W1's and V's products and the bias) and h @ W2, x * 1.0 (V's left)
    assert budget.last.fixed_bytes["batched rows (a chunk of products, or of their gradients)"] == \
        choose_chunk(row, 256) * 4 * row


@pytest.mark.parametrize("strategy", [Periodic(7), Binomial(3)])
def test_a_backward_under_anomaly_detection_sums_the_chunk_replayed_steps_began(strategy):
    """Under anomaly detection a plan records the steps it re-runs, but its last segment,
    taped in the forward, was replayed: the chunk its steps began is summed before the
    recorded steps below it pull back row by row (it was lost: wrong gradients)."""
    arrays = _inputs(150, dtype=np.float64)
    got = _gated(arrays, strategy, anomaly=True)  # (the forward runs as without it)
    ref = _gated(arrays, batch_rows=False)
    for g, r in zip(got[1], ref[1], strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
