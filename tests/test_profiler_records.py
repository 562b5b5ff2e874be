"""A profile's records are what the tape saved: checked against the tape's own listing
(`cad.tape_of`, which reads the entries, not the profiler's events), on a loop whose parameters
and input rows are saved by every step (the caller's memory) beside values the tape owns."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import KeepAll, Quantized


def _rnn(steps=6, batch=3, size=4):
    rng = np.random.default_rng(1)
    w = cad.tensor(rng.standard_normal((size, size)).astype(np.float32), requires_grad=True)
    u = cad.tensor(rng.standard_normal((size, size)).astype(np.float32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((steps, batch, size)).astype(np.float32))
    return w, u, xs


def _callers(array, w, u, xs):
    """Whether a saved array is memory the caller holds anyway: a parameter, or a row of the
    input data (told from the arrays themselves)."""
    return array is w._data or array is u._data or array.base is xs._data


@pytest.mark.parametrize("storage", [KeepAll(), Quantized(8)], ids=["keep", "int8"])
def test_records_list_every_saved_value_of_the_tape_in_order(storage):
    w, u, xs = _rnn()
    with cad.profile() as prof, cad.use(storage):
        h = cad.zeros(3, 4, dtype="float32")
        total = None
        for t in range(xs.shape[0]):
            h = cad.tanh(h @ w + xs[t] @ u)
            total = h.sum() if total is None else total + h.sum()
        listed = [(e.op, s.name, s.shape, s.dtype, s.logical_nbytes, s.stored_nbytes,
                   s.buffer_id) for e in cad.tape_of(total) for s in e.saved]
        entries = cad.tape_of(total)._entries
        callers = [_callers(slot.buffer.packed, w, u, xs) if slot.buffer.source is None
                   else False for e in entries for slot in e.slots]
        total.backward()
    records = [r for r in prof.records if r.phase == "forward"]
    assert [(r.op, r.role, r.shape, r.dtype, r.logical_bytes, r.stored_bytes)
            for r in records] == [row[:6] for row in listed]
    # records share a buffer exactly where the tape's slots do
    by_buffer = {}
    for r, row in zip(records, listed):
        assert by_buffer.setdefault(row[6], r.buffer) == r.buffer
    assert len(set(by_buffer.values())) == len(by_buffer)
    # the caller's memory is not the tape's, every time it is saved again
    assert [not r.owned for r in records] == callers
    # every step saves its input row (for u's gradient) and, from the second on (the first
    # multiplies a constant h), w (for h's gradient)
    assert sum(callers) == 2 * xs.shape[0] - 1
    assert prof.timeline_bytes[-1] == 0


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("storage", ["StoreOutputs", "StoreInputs"])
def test_strategies_that_only_choose_values_count_the_callers_arrays_as_aliases(storage, trace):
    """StoreOutputs and StoreInputs keep what they save as is: a saved weight or input row is
    the caller's memory, counted apart from the tape's as under KeepAll (it was once counted
    as owned, once per step, doubling the RNN's peak tape), and its records name the
    strategy that chose it."""
    from checkpoint_ad import strategies

    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((8, 8)), requires_grad=True)
    u = cad.tensor(rng.standard_normal((4, 8)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((5, 3, 4)))

    def step(h, x):
        h = cad.tanh(h @ w + x @ u)
        return h, cad.sum(h)

    def profiled(strategy):
        with cad.profile() as prof:
            with cad.use(strategy):
                _, ys = cad.scan(step, cad.zeros((3, 8), dtype="float64"), xs, trace=trace)
            cad.sum(ys).backward()
        return prof

    keep, chosen = profiled(KeepAll()), profiled(getattr(strategies, storage)())
    assert chosen.aliased_bytes == keep.aliased_bytes > 0
    if storage == "StoreOutputs":  # tanh's output is what KeepAll saves too: the same tape
        assert chosen.peak_tape_bytes == keep.peak_tape_bytes
    weights = [r for r in chosen.records if r.shape == (8, 8)]
    assert weights and not any(r.owned for r in weights)
    assert {r.strategy for r in chosen.records} == {storage}
