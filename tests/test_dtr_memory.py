"""Eviction holds memory as the process sees it (issue 37 item 3): under `Budget` a Python loop's
tracemalloc peak stays within the budget (the pool counts the tape's and its own objects and
keeps room for the backward sweep's gradients), and a recompute of a long chain makes its
values in the program's order, holding a few at a time rather than every step's side input.

Measured with tracemalloc, the cyclic collector off; nothing is timed.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

import checkpoint_ad as cad
from checkpoint_ad.strategies import Budget, KeepAll, Rematerializing

F32 = np.float32


class _Rnn:
    """``h = tanh(h @ W + x_t @ U + b)``, loss the sum of every h_t."""

    def __init__(self, steps: int, batch: int, hidden: int) -> None:
        rng = np.random.default_rng(0)
        scale = 1 / np.sqrt(hidden)
        self.params = [
            cad.tensor((rng.standard_normal((hidden, hidden)) * scale).astype(F32),
                       requires_grad=True),
            cad.tensor((rng.standard_normal((hidden, hidden)) * scale).astype(F32),
                       requires_grad=True),
            cad.tensor((0.1 * rng.standard_normal(hidden)).astype(F32), requires_grad=True),
        ]
        self.xs = cad.tensor(rng.standard_normal((steps, batch, hidden)).astype(F32))
        self.h0 = cad.tensor(np.zeros((batch, hidden), dtype=F32))

    def run(self, strategy, marks: list[int] | None = None) -> list[np.ndarray]:
        W, U, b = self.params
        for p in self.params:
            p.grad = None
        with cad.use(strategy):
            h, loss = self.h0, None
            for t in range(self.xs.shape[0]):
                h = cad.tanh(h @ W + self.xs[t] @ U + b)
                loss = h.sum() if loss is None else loss + h.sum()
            del h
            if marks is not None:  # where the backward sweep starts
                marks.append(tracemalloc.get_traced_memory()[0])
                tracemalloc.reset_peak()
            loss.backward()
        return [p.grad.numpy().copy() for p in self.params]


def _traced(run) -> tuple[int, int]:
    """(tracemalloc peak of `run(marks)` above the level before, and above the level at its
    mark), the collector off."""
    marks: list[int] = []
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run(marks)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.enable()
    return peak - base, peak - marks[0]


def test_a_budget_holds_the_tracemalloc_peak_of_a_python_loop():
    """`with use(Budget(limit))` over a plain Python RNN loop, the limit a quarter of
    keep-all's tape: the process's peak (arrays, the tape's and the pool's objects, the
    backward sweep's gradients) stays within 5% of the limit, and the gradients are bitwise
    keep-all's. A pool counting its saved arrays alone held those to the limit while the
    rest went over it by half."""
    rnn = _Rnn(steps=100, batch=256, hidden=64)
    with cad.profile() as prof:
        reference = rnn.run(KeepAll())
    limit = prof.peak_tape_bytes // 4
    rnn.run(Budget(limit))  # warm: imports, the interpreter's free lists
    budget = Budget(limit)
    grads: list[list[np.ndarray]] = []
    peak, _ = _traced(lambda marks: grads.append(rnn.run(budget, marks)))
    assert peak <= 1.05 * limit, (peak / limit, limit)
    assert budget._pool().evictions > 0
    assert all(np.array_equal(g, r) for g, r in zip(grads[0], reference))


def test_the_pool_counts_objects_and_gradient_room_only_when_asked():
    """`Rematerializing(limit)` keeps to its saved arrays (what its peak reports);
    `process=True` counts the rest too, and forgets the gradients' room once the program's
    values are gone."""
    rnn = _Rnn(steps=20, batch=32, hidden=64)
    plain, process = Rematerializing(1 << 20), Rematerializing(1 << 20, process=True)
    rnn.run(plain)
    rnn.run(process)
    assert plain.unseen_bytes() == 0 and plain.object_bytes == 0
    assert process.object_bytes == 0 and process.gradient_bytes == 0  # all freed
    seen: list[int] = []
    W, U, b = rnn.params
    with cad.use(process):
        h = cad.tanh(rnn.h0 @ W + rnn.xs[0] @ U + b)
        seen.append(process.unseen_bytes())
        # the gradients of W, U, b, two more of W's, six of the largest value's
        assert process.gradient_bytes == (2 * 64 * 64 * 4 + 64 * 4) + 2 * 64 * 64 * 4 + (
            6 * 32 * 64 * 4)
        del h
    assert seen[0] >= process.gradient_bytes and process.object_bytes == 0


def test_recomputing_a_long_chain_holds_a_few_values_not_every_side_input():
    """A tight limit: bringing back a value tens of steps from the nearest one held re-runs the
    chain in the program's order, so each step's ``x_t @ U`` is made just before its use. A
    walk's own order made all of them first and held them until their step came (here
    120 x 8 KiB above what the pool counts)."""
    rnn = _Rnn(steps=120, batch=32, hidden=64)
    value = 32 * 64 * 4
    reference = rnn.run(KeepAll())
    pool = Rematerializing(4 * value)
    grads: list[list[np.ndarray]] = []
    _, backward = _traced(lambda marks: grads.append(rnn.run(pool, marks)))
    assert pool.rematerializations > 1000
    # the gradients (W, U and b, and W's new term and sum), the pool's 4 values, and a few
    # in flight: not the chain's 200 side inputs
    assert backward < 4 * 64 * 64 * 4 + 24 * value, backward / value
    assert all(np.array_equal(g, r) for g, r in zip(grads[0], reference))
