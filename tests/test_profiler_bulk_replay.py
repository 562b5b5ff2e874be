"""A replayed step under a profiler listening alone hands its new buffers over in bulk, in its
'replayed' event (`step_tape.tape_kept`: no 'pack' event per value, the arrays read by the
backward directly, the buffers held beside them only for their frees). The profile must be
the one the general path gives, where every buffer is announced by its own 'pack' event (forced
by a second listener, as in test_profiler_fast_path.py), field by field, and the gradients
bitwise those of an unprofiled run."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import events, nn
from checkpoint_ad.strategies import Binomial, KeepAll, Periodic, Quantized
from tests.profile_parity import comparable


def _profiled(run, general):
    """`run()` under a profile, on the general path (a second listener) or in bulk; the
    profile and what `run` returned."""
    stop = events.subscribe(lambda kind, _: None, kinds=["a kind nobody sends"]) if (
        general) else None
    try:
        with cad.profile() as prof:
            assert (events.kept_record is None) == general
            result = run()
    finally:
        if stop is not None:
            stop()
    return prof, result


def _gru_step(seed=0, steps=9, strategy=None):
    rng = np.random.default_rng(seed)
    model = nn.GRU(4, 5, seed=seed, strategy=strategy)
    x = cad.tensor(rng.standard_normal((steps, 3, 4)).astype(np.float32))

    def run():
        out, _ = model(x)
        ((out * out).mean()).backward()
        return [p.grad.numpy().copy() for p in model.parameters()]

    return run


def _rnn_scan(strategy=None, storage=None, retain=False, trace=True):
    """A scan whose step saves the caller's arrays by reference: a captured weight (a leaf),
    the input rows (views of the caller's data, no gradient) and the initial carry."""
    rng = np.random.default_rng(1)
    w = cad.tensor(rng.standard_normal((5, 5)).astype(np.float32) * 0.4, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((3, 5)).astype(np.float32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((8, 3, 5)).astype(np.float32))

    def step(h, x):
        h = cad.tanh(h @ w + x * x) * h
        return h, h

    def run():
        with cad.use(storage or KeepAll()):
            carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
            loss = (carry * carry).sum() + ys.sum()
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
        return [t.grad.numpy().copy() for t in (w, h0)], carry.grad_fn.op

    return run


def _assert_same(bulk, general):
    (fast, _), (slow, _) = bulk, general
    assert comparable(fast) == comparable(slow)
    assert fast.records and fast.timeline_bytes[-1] == 0


def test_a_gru_step_profiled_in_bulk_is_the_general_paths_profile():
    run = _gru_step()
    plain = run()
    bulk, general = _profiled(_gru_step(), False), _profiled(_gru_step(), True)
    _assert_same(bulk, general)
    for got, want in zip(bulk[1], plain, strict=True):
        assert np.array_equal(got, want)
    assert any(not r.owned for r in bulk[0].records)  # the recurrent weight, by reference
    assert bulk[0].peak_tape_bytes > 0 and bulk[0].aliased_bytes > 0


@pytest.mark.parametrize("strategy", [None, Binomial(3), Periodic(3)],
                         ids=["kept", "binomial", "periodic"])
def test_a_scan_saving_the_callers_arrays_profiles_the_same_in_bulk(strategy):
    bulk, general = _profiled(_rnn_scan(strategy), False), _profiled(_rnn_scan(strategy), True)
    _assert_same(bulk, general)
    (grads, op), (want, _) = bulk[1], general[1]
    for got, ref in zip(grads, want, strict=True):
        assert np.array_equal(got, ref)
    assert any(layout is not None for layout in op.program.layouts)  # it ran in bulk
    if strategy is not None:
        assert bulk[0].recomputed_primitives > 0  # steps re-taped in the recompute phase
    # the weight and the input rows are the caller's: counted apart, not as tape bytes
    assert {r.op for r in bulk[0].records if not r.owned} >= {"matmul", "multiply"}


def test_a_scan_profiled_in_bulk_is_its_recording():
    """As the replayed loop's announced events were: the same profile as recording every
    step (``trace=False``), recompute phase included."""
    bulk = _profiled(_rnn_scan(Binomial(3)), False)
    recorded = _profiled(_rnn_scan(Binomial(3), trace=False), False)
    _assert_same(bulk, recorded)


def test_a_retained_loop_profiled_in_bulk_frees_what_the_general_path_frees():
    bulk = _profiled(_rnn_scan(retain=True), False)
    general = _profiled(_rnn_scan(retain=True), True)
    _assert_same(bulk, general)


def test_a_quantized_loop_announces_each_buffer_and_profiles_the_same():
    """A packer other than keep-all may send events of its own while packing: its buffers are
    announced one by one, listening alone or not."""
    bulk = _profiled(_rnn_scan(Binomial(3), Quantized(8)), False)
    general = _profiled(_rnn_scan(Binomial(3), Quantized(8)), True)
    _assert_same(bulk, general)
    assert bulk[1][1].program.layouts == [None, None, None]
    assert any(r.strategy == "Quantized" for r in bulk[0].records)


def test_a_step_announced_in_bulk_lists_the_buffers_it_made_in_order():
    heard = []

    def listen(payload):
        heard.append(payload)

    rng = np.random.default_rng(2)
    w = cad.tensor(rng.standard_normal((4, 4)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((6, 2, 4)))
    stop = events.subscribe_handlers({"replayed": listen, events.KEPT: lambda *_: None})
    try:
        assert events.taken_directly()
        carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2,
                            cad.zeros(2, 4, dtype="float64"), xs)
    finally:
        stop()
    assert carry.grad_fn.op.mode == "replayed" and heard
    for described, held, _, _, fresh in heard:
        saved = [b for kept in held if kept for b in kept]
        firsts = list(dict.fromkeys(id(b) for b in saved))
        assert [id(b) for b in fresh] == [i for i in firsts if i in {id(b) for b in fresh}]
        assert sum(len(d.saved) for d in described.instructions if d is not None) == len(saved)
