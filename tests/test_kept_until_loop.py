"""A `scan` keeping every step that stops on `until` (and `while_loop` without a strategy)
records its first steps and replays the rest, as one of known length does: its results,
gradients, outputs and profile are those of recording every step (``trace=False``), bit for
bit, wherever `until` stops it (after step 1, 2, 3, at its bound, or never bounded), and
`until` is asked as often as the recorded loop asks it."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.profiler import profile
from checkpoint_ad.strategies import Quantized

T = 12  # xs rows: the loop's bound when it scans them


def _problem(dtype=np.float64):
    rng = np.random.default_rng(5)
    w = cad.tensor(rng.standard_normal((5, 5)).astype(dtype) * 0.5, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((3, 5)).astype(dtype), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, 3, 5)).astype(dtype), requires_grad=True)
    return w, h0, xs


def _run(trace, stop_after, scanned=True, dtype=np.float64, storage=None):
    """(results, gradients, `until` calls, the loop's mode and steps) of a loop that `until`
    stops after `stop_after` steps (counted by its calls), over xs or of `length=` 40."""
    w, h0, xs = _problem(dtype)
    asked = [0]

    def until(h):
        asked[0] += 1
        return asked[0] >= stop_after

    def step(h, x):
        h = cad.tanh(h @ w + (x if x is not None else 0.5)) + 0.01
        return h, (h, cad.sum(h))

    with cad.inspect.loops() as ran, cad.use(storage or cad.strategies.KeepAll()):
        carry, (hs, sums) = cad.scan(step, h0, xs if scanned else None,
                                     length=None if scanned else 40, until=until, trace=trace)
    loss = (carry * carry).sum() + (hs**2).sum() + sums.sum()
    grads = cad.grad(loss, [w, h0, xs] if scanned else [w, h0])
    results = [carry.numpy(), hs.numpy(), sums.numpy()] + [g.numpy() for g in grads]
    return results, asked[0], ran[0].mode, ran[0].steps


def _stopping_run(step, init, w, stop_after, trace, length=40):
    """(carry, ys and the gradient of `w`; `until`'s calls; the loop as `inspect` lists it)
    of `step` scanned from `init` until `until` has been asked `stop_after` times."""
    asked = [0]

    def until(h):
        asked[0] += 1
        return asked[0] >= stop_after

    with cad.inspect.loops() as ran:
        carry, ys = cad.scan(step, init, length=length, until=until, trace=trace)
    (g,) = cad.grad((carry * carry).sum() + ys.sum(), [w])
    return [carry.numpy(), ys.numpy(), g.numpy()], asked[0], ran[0]


@pytest.mark.parametrize("scanned", [True, False], ids=["xs", "length"])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 7, T, 50])
def test_a_kept_loop_stopping_on_until_replays_with_the_recorded_results(stop_after, scanned):
    got, asked, mode, steps = _run(True, stop_after, scanned)
    want, asked_recorded, recorded_mode, recorded_steps = _run(False, stop_after, scanned)
    bound = T if scanned else 40
    assert steps == recorded_steps == min(stop_after, bound)
    assert asked == asked_recorded == steps  # asked after every step, the last one too
    assert recorded_mode.startswith("recorded")
    assert mode.startswith("replayed") if steps > 2 else mode.startswith("recorded")
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("storage", [None, Quantized(8)], ids=["keep", "int8"])
def test_replayed_until_loops_match_in_each_dtype_and_saved_form(dtype, storage):
    got, *_ = _run(True, 9, dtype=dtype, storage=storage)
    want, *_ = _run(False, 9, dtype=dtype, storage=storage)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)


def test_while_loop_without_a_strategy_replays():
    x = cad.tensor(1.01, requires_grad=True)

    def run():
        with cad.inspect.loops() as ran:
            y = cad.while_loop(lambda v: v.item() < 100.0, lambda v: v * x + 0.1, x * 1.0)
        return y.item(), cad.grad(y, x)[0].item(), ran[0].mode, ran[0].steps

    y, g, mode, steps = run()
    assert mode.startswith("replayed") and steps > 100
    # the same loop written out in Python, recorded op by op
    v = x * 1.0
    while v.item() < 100.0:
        v = v * x + 0.1
    assert (y, g) == (v.item(), cad.grad(v, x)[0].item())


def test_the_profiler_sees_a_replayed_until_loop_as_a_recorded_one():
    def run(trace):
        with profile() as prof:
            _run(trace, 9)
        return prof

    replayed, recorded = run(True), run(False)
    rows = [sorted((r.op, r.role, r.shape, r.stored_bytes, r.owned)
                   for r in p.records if r.phase == "forward") for p in (replayed, recorded)]
    assert rows[0] == rows[1]
    assert replayed.peak_tape_bytes == recorded.peak_tape_bytes


def test_under_anomaly_detection_an_until_loop_records_its_kept_segment_and_matches():
    """Anomaly detection checks every entry's gradients, so the kept segment is recorded
    step by step (the executor's taped path), stopping where `until` says, as replayed."""
    with cad.detect_anomaly():
        got, asked, _, steps = _run(True, 7)
    want, asked_recorded, _, recorded_steps = _run(False, 7)
    assert steps == recorded_steps == 7 and asked == asked_recorded == 7
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)


def test_a_step_that_refuses_tracing_records_until_until_stops_it():
    """A step whose two traces differ is recorded to its end, `until` asked after each step."""
    rng = np.random.default_rng(2)
    w = cad.tensor(rng.standard_normal((4, 4)) * 0.5, requires_grad=True)
    calls = [0]

    def step(h, _):
        calls[0] += 1
        h = cad.tanh(h @ w) if calls[0] % 2 else cad.sin(h @ w)  # differs step to step
        return h, cad.sum(h)

    def run(trace):
        calls[0] = 0
        return _stopping_run(step, cad.ones(2, 4, dtype="float64"), w, 9, trace, length=30)

    got, asked, info = run(True)
    want, asked_recorded, _ = run(False)
    assert info.mode.startswith("recorded: the step") and info.steps == 9
    assert asked == asked_recorded == 9
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)


def test_randomness_in_a_replayed_until_loop_draws_as_the_recorded_loop():
    """Dropout in the step: each replayed step draws what the recorded step drew."""
    rng = np.random.default_rng(4)
    w = cad.tensor(rng.standard_normal((6, 6)) * 0.5, requires_grad=True)

    def step(h, _):
        h = cad.nn.functional.dropout(cad.tanh(h @ w), 0.3, training=True)
        return h, cad.sum(h)

    def run(trace, seed=7):
        cad.random.manual_seed(seed)
        results, _, info = _stopping_run(step, cad.ones(3, 6, dtype="float64"), w, 11, trace)
        return results, info.mode

    (got, mode), (want, _) = run(True), run(False)
    assert mode.startswith("replayed")
    assert not np.array_equal(got[1], run(True, seed=8)[0][1])  # the draws matter
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)
