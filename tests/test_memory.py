"""Memory behaviour of the tape, measured with tracemalloc (never computed)."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad

CHAIN = 100_000


def _traced() -> int:
    return tracemalloc.get_traced_memory()[0]


def test_saved_values_are_freed_during_the_sweep_of_a_100k_chain():
    x = cad.tensor(np.full(16, 0.5), requires_grad=True)
    gc.collect()
    tracemalloc.start()
    try:
        base = _traced()
        y = x
        for _ in range(CHAIN):
            y = cad.tanh(y)  # saves its 128-byte output
        loss = y.sum()
        after_forward, forward_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loss.backward()
        after_backward, backward_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    grad_bytes = x.grad.data.nbytes
    # the sweep frees as it goes: its peak stays at the forward's, give or take the gradients
    assert backward_peak - base <= forward_peak - base + grad_bytes + 64 * 1024
    # every saved array (128 data bytes each, plus its header) is gone after the sweep
    assert after_forward - after_backward >= CHAIN * 128
    np.testing.assert_allclose(x.grad.numpy(), _tanh_chain_derivative(0.5, CHAIN), rtol=1e-6)


def _tanh_chain_derivative(x0: float, steps: int) -> np.ndarray:
    value, derivative = x0, 1.0
    for _ in range(steps):
        value = np.tanh(value)
        derivative *= 1 - value * value
    return np.full(16, derivative)


def test_nothing_is_retained_after_a_forward_that_is_never_differentiated():
    x = cad.tensor(np.full(64, 0.5), requires_grad=True)
    gc.disable()  # prove it is reference counting, not the cycle collector, that frees it
    tracemalloc.start()
    try:
        base = _traced()
        y = x
        for _ in range(20_000):
            y = cad.tanh(y) * 1.0001
        grown = _traced() - base
        del y
        left = _traced() - base
    finally:
        tracemalloc.stop()
        gc.enable()
    assert grown > 20_000 * 512  # the tape really held the saved values...
    # ...and released them with the last tensor that needed them: what is left is the
    # interpreter's free lists for small tuples, bounded and independent of the chain length
    assert left < 0.02 * grown
    assert cad.saved.live_buffer_count() == 0
    assert not any(type(o) is cad.tape.Entry for o in gc.get_objects())


def test_retain_graph_keeps_and_default_frees_saved_values():
    x = cad.tensor(np.ones(10_000), requires_grad=True)
    y = cad.tanh(cad.exp(x)).sum()
    view = cad.tape_of(y)
    kept = view.saved_nbytes
    assert kept == 2 * 80_000
    y.backward(retain_graph=True)
    assert cad.tape_of(y).saved_nbytes == kept
    y.backward()
    assert cad.tape_of(y).saved_nbytes == 0


# ----------------------------------------------------------------- strategies, measured
def _rnn_setup(T=1000, B=64, H=256, In=16):
    rng = np.random.default_rng(0)
    W = cad.tensor((rng.standard_normal((H, H)) / 16).astype(np.float32), requires_grad=True)
    U = cad.tensor((rng.standard_normal((In, H)) / 4).astype(np.float32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, B, In)).astype(np.float32))
    h0 = cad.tensor(np.zeros((B, H), dtype=np.float32))

    def step(h, x):
        h = cad.tanh(h @ W + x @ U)
        return h, h.sum()  # the loss is the sum of all hidden states

    return step, h0, xs, [W, U]


def _peak_of_scan(step, h0, xs, params, strategy) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        base = _traced()
        _, ys = cad.scan(step, h0, xs, strategy=strategy)
        grads = cad.grad(ys.sum(), params)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del grads
    return peak


def test_binomial_peak_is_s_carries_plus_one_step_on_a_1000_step_rnn():
    step, h0, xs, params = _rnn_setup()
    _peak_of_scan(step, h0, xs[:3], params, cad.strategies.Binomial(2))  # warm caches, imports
    carry = h0.data.nbytes  # 64 KiB
    one_step = _peak_of_scan(step, h0, xs[:1], params, None)  # one step's tape, grads included
    keep_all = _peak_of_scan(step, h0, xs, params, None)
    # the small constant: the state in hand, the final carry and two carry adjoints; the
    # parameter gradients summed so far plus the sum being formed; 512 KiB of bookkeeping
    # (per-step outputs before stacking, the plan, tape entries)
    constant = 4 * carry + 2 * sum(p.data.nbytes for p in params) + 512 * 1024
    for s in (4, 16, 64):
        peak = _peak_of_scan(step, h0, xs, params, cad.strategies.Binomial(s))
        assert peak <= s * carry + one_step + constant, (s, peak)
    assert keep_all > 20 * _peak_of_scan(step, h0, xs, params, cad.strategies.Binomial(4))


def test_a_checkpoint_region_holds_only_its_inputs():
    x = cad.tensor(np.full(100_000, 0.5), requires_grad=True)  # 800 kB

    def deep(h):
        for _ in range(10):
            h = cad.tanh(h)
        return h

    def held_after_forward(run) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            base = _traced()
            y = run(x)
            held = _traced() - base - y.data.nbytes  # what is kept besides the output
        finally:
            tracemalloc.stop()
        return held

    plain = held_after_forward(deep)
    region = held_after_forward(lambda h: cad.checkpoint(deep, h))
    assert plain >= 9 * x.data.nbytes  # ten tanh outputs, the last one being y itself
    assert region < 64 * 1024  # handles and tape entries only: x is the caller's


def _backward_peak(n: int, kept: bool = False, outputs: bool = False) -> int:
    """Peak bytes traced during a loop's backward (`Binomial(2)`, or a plain `scan` keeping
    every step when `kept`; `outputs`: the loss sums every step's output, not the last
    carry), above the level at its start."""
    strategy = None if kept else cad.strategies.Binomial(2)
    rng = np.random.default_rng(2)
    w = cad.tensor(rng.standard_normal((1, 8)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((n, 4, 8)))

    def step(h, x):
        h = cad.tanh(h * w + x)  # w broadcasts: its gradient is summed back each step
        return h, cad.sum(h) if outputs else None

    tracemalloc.start()
    try:
        init = cad.zeros((4, 8), dtype="float64")
        carry, ys = cad.scan(step, init, xs, strategy=strategy)
        loss = cad.sum(ys) if outputs else cad.sum(carry)
        gc.collect()  # empties the interpreter's free lists
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cad.grad(loss, [w])
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_planned_backward_holds_nothing_that_grows_with_its_steps():
    # tuples built from generators on the backward's per-rule paths joined the interpreter's
    # free list once freed, one or two a step, so a long loop's backward held (and
    # tracemalloc counted) up to about 100 KiB per tuple size more than a short one's: 112 B
    # a step here; what still grows with the loop is its plan (about three actions a step
    # under Binomial(2)), under 30 B a step
    _backward_peak(50)  # warm: one-time caches
    short, long = _backward_peak(200), _backward_peak(800)
    assert (long - short) / 600 < 60, f"{(long - short) / 600:.0f} B a step"


def _binomial_backward_peak_in_weights() -> float:
    """Peak bytes traced during the backward of an RNN-like loop under Binomial(2) whose
    weights outweigh everything else, in units of one weight matrix."""
    rng = np.random.default_rng(0)
    size = 256
    W = cad.tensor((rng.standard_normal((size, size)) / 16).astype(np.float32),
                   requires_grad=True)
    U = cad.tensor((rng.standard_normal((size, size)) / 16).astype(np.float32),
                   requires_grad=True)
    xs = cad.tensor(rng.standard_normal((16, 8, size)).astype(np.float32))

    def step(h, x):
        return cad.tanh(h @ W + x @ U), None

    tracemalloc.start()
    try:
        carry, _ = cad.scan(step, cad.zeros((8, size)), xs,
                            strategy=cad.strategies.Binomial(2))
        loss = cad.sum(carry)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cad.grad(loss, [W, U])
        return (tracemalloc.get_traced_memory()[1] - base) / W.numpy().nbytes
    finally:
        tracemalloc.stop()


def test_a_planned_backward_sums_weight_gradients_in_place():
    # the floor holds each weight's running sum and one step's gradient at a time: 3 weight
    # sizes here. The first sum of each weight was a new array beside the two it added, and
    # the sums from before a pull-back stayed referenced during it: 5.2 weight sizes
    _binomial_backward_peak_in_weights()  # warm: one-time caches
    assert _binomial_backward_peak_in_weights() < 3.6


def test_sums_in_place_never_write_into_an_array_someone_else_holds():
    from checkpoint_ad.autograd import Capture

    held = np.ones(3)
    sink = Capture({}, initial=[None], owned={})
    sink.add(0, held)
    sink.add(0, np.full(3, 2.0))
    assert np.array_equal(held, np.ones(3)) and np.array_equal(sink.values[0], np.full(3, 3.0))

    base = np.ones(6)
    sink = Capture({}, initial=[None], owned={})
    sink.add(0, base[:3])  # a view: its memory is base's
    sink.add(0, np.full(3, 2.0))
    assert np.array_equal(base, np.ones(6))

    sink = Capture({}, initial=[None], owned={})
    sink.add(0, np.ones(3, dtype=np.float32))
    sink.add(0, np.full(3, 2.0))  # float64 onto float32: the sum is float64, as before
    assert sink.values[0].dtype == np.float64

    sink = Capture({}, initial=[None], owned={})
    sink.add(0, np.ones(3))  # nobody else holds it: summed into, the same values
    memory = sink.values[0].__array_interface__["data"][0]
    sink.add(0, np.full(3, 2.0))
    assert sink.values[0].__array_interface__["data"][0] == memory  # a new sum: elsewhere
    assert np.array_equal(sink.values[0], np.full(3, 3.0))


def _retaped_step_peak_in_carries(chain: int, strategy: Any) -> float:
    """Peak bytes traced during the backward of a loop whose step is a chain of `chain`
    operations that save nothing (adding a captured tensor, negating), in carries."""
    rng = np.random.default_rng(3)
    shift = cad.tensor(rng.standard_normal((64, 64)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((8, 64, 64)))

    def step(h, x):
        for _ in range(chain):
            h = -(h + shift)
        return cad.tanh(h + x), None

    tracemalloc.start()
    try:
        carry, _ = cad.scan(step, cad.zeros((64, 64), dtype="float64"), xs, strategy=strategy)
        loss = cad.sum(carry)
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        cad.grad(loss, [shift])
        return (tracemalloc.get_traced_memory()[1] - base) / (64 * 64 * 8)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("strategy", [cad.strategies.Binomial(1), cad.strategies.Periodic(4)],
                         ids=["binomial", "periodic"])
def test_a_retaped_step_frees_what_its_backward_does_not_read(strategy):
    # a planned backward tapes steps again from a snapshot; a taped step held every value it
    # made until it ended, so its peak grew with the step's length: 2 carries per operation
    # of the chain here (40 carries at 20 operations), none of which its backward reads
    _retaped_step_peak_in_carries(2, strategy)  # warm: one-time caches
    short = _retaped_step_peak_in_carries(2, strategy)
    long = _retaped_step_peak_in_carries(20, strategy)
    assert long - short < 4, f"{short:.1f} -> {long:.1f} carries"


def _held_after_forward(snapshots: int, n: int = 200) -> int:
    """Bytes a `Binomial(snapshots)` loop over a carry of 8 floats holds once it ran."""
    rng = np.random.default_rng(4)
    w = cad.tensor(rng.standard_normal(8), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((n, 8)))

    def step(h, x):
        return cad.tanh(h * w + x), None

    init = cad.zeros(8, dtype="float64")
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        loop_result = cad.scan(step, init, xs, strategy=cad.strategies.Binomial(snapshots))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        del loop_result  # (held until here: its entry keeps the snapshots)
        return held
    finally:
        tracemalloc.stop()


def test_a_snapshot_of_a_small_carry_costs_little_more_than_the_carry():
    # each snapshot kept its own copy of the engine's random state (a few hundred bytes in
    # dictionaries and integers), though steps that draw nothing leave it unchanged: 1,170 B
    # a snapshot of a 64-byte carry; the carry, its buffer, the snapshot and the loop entry's
    # slot for it are about 560
    _held_after_forward(8), _held_after_forward(64)  # warm: one-time caches
    per_snapshot = (_held_after_forward(64) - _held_after_forward(8)) / 56
    assert per_snapshot < 750, f"{per_snapshot:.0f} B a snapshot"


def test_a_kept_loops_backward_holds_no_per_step_roots_or_sums_at_once():
    # the pull-back of a replayed segment took every step's output gradient (a row view in a
    # tuple in a tuple) and began every step's sums (a list of the step's slots) before
    # running back: about 340 B a step at the backward's peak, all steps at once
    _backward_peak(100, kept=True, outputs=True)  # warm: one-time caches
    short = _backward_peak(200, kept=True, outputs=True)
    long = _backward_peak(800, kept=True, outputs=True)
    assert (long - short) / 600 < 100, f"{(long - short) / 600:.0f} B a step"
