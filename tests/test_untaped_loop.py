"""`scan` without gradients (no_grad, inference mode): steps 2.. replayed from the program
steps 0 and 1 traced to, with the results of running every step, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import nn
from checkpoint_ad.models import MODELS, build
from checkpoint_ad.nn import functional as F
from checkpoint_ad.pytree import flatten


def _leaves(tree):
    return [None if t is None else t.numpy() for t in flatten(tree)[0]]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_replayed_without_grad_match_every_step_run(name, dtype):
    model = build(name, dtype=dtype)
    results = {}
    for run, trace in (("recorded", False), ("replayed", True), ("program reused", True)):
        with cad.no_grad():
            # rows not batched (`hoisted_rows.py`): the replay itself is what is compared
            results[run] = _leaves(cad.scan(model.step, model.init_carry(), model.inputs(),
                                            trace=trace, batch_rows=False))
    for run in ("replayed", "program reused"):
        for recorded, replayed in zip(results["recorded"], results[run]):
            assert (recorded is None) == (replayed is None)
            if recorded is not None:
                assert replayed.dtype == recorded.dtype and replayed.shape == recorded.shape
                np.testing.assert_array_equal(replayed, recorded)


def _counting_step(calls, w):
    def step(h, x):
        calls.append(1)
        h = cad.tanh(h @ w + x)
        return h, h.sum()
    return step


@pytest.mark.parametrize("mode", [cad.no_grad, cad.inference_mode])
def test_the_step_runs_twice_and_the_rest_is_replayed(mode):
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((4, 4)) * 0.5, requires_grad=True)
    xs = cad.tensor(rng.standard_normal((12, 4)))
    outs = {}
    for trace in (False, True):
        calls = []
        step = _counting_step(calls, w)
        with mode():
            h, ys = cad.scan(step, cad.zeros(4, dtype="float64"), xs, trace=trace)
        assert not h.requires_grad and not ys.requires_grad
        outs[trace] = (len(calls), h.numpy(), ys.numpy())
    assert outs[False][0] == 12 and outs[True][0] == 2
    np.testing.assert_array_equal(outs[True][1], outs[False][1])
    np.testing.assert_array_equal(outs[True][2], outs[False][2])
    assert outs[True][2].shape == (12,)
    # called again: step 0 runs, and the program the first call made runs the rest
    calls.clear()
    with mode():
        h, ys = cad.scan(step, cad.zeros(4, dtype="float64"), xs)
    assert len(calls) == 1
    np.testing.assert_array_equal(h.numpy(), outs[False][1])
    np.testing.assert_array_equal(ys.numpy(), outs[False][2])


def test_a_step_that_reads_a_value_runs_every_step():
    w = cad.tensor(0.9, dtype="float64")
    xs = cad.tensor(np.linspace(-1.0, 1.0, 8))
    calls = []

    def step(h, x):
        calls.append(1)
        scale = 2.0 if float(h) > 0 else 0.5  # Python control flow on a value: not traceable
        h = cad.tanh(h * w * scale + x)
        return h, h

    with cad.no_grad():
        h, ys = cad.scan(step, cad.tensor(0.1, dtype="float64"), xs)
    expected, hs = 0.1, []
    for x in np.linspace(-1.0, 1.0, 8):
        expected = np.tanh(expected * 0.9 * (2.0 if expected > 0 else 0.5) + x)
        hs.append(expected)
    assert len(calls) == 8
    np.testing.assert_allclose(ys.numpy(), hs, rtol=1e-12)
    np.testing.assert_allclose(h.numpy(), hs[-1], rtol=1e-12)


def test_randomness_drawn_through_the_engine_replays_in_order():
    rng = np.random.default_rng(1)
    w = cad.tensor(rng.standard_normal((6, 6)) * 0.3)
    xs = cad.tensor(rng.standard_normal((10, 6)))

    def step(h, x):
        h = cad.tanh(F.dropout(h @ w, 0.3, training=True) + x + cad.randn(6) * 0.1)
        return h, h

    outs = []
    for trace in (False, True):
        cad.random.manual_seed(7)
        with cad.no_grad():
            h, ys = cad.scan(step, cad.zeros(6, dtype="float64"), xs, trace=trace)
        outs.append((h.numpy(), ys.numpy(), cad.randn(3).numpy()))
    for recorded, replayed in zip(*outs):
        np.testing.assert_array_equal(replayed, recorded)


def test_gradients_after_an_untaped_call_of_the_same_step():
    """A program traced without gradients is not reused by a later call with them."""
    rng = np.random.default_rng(2)
    w = cad.tensor(rng.standard_normal((5, 5)) * 0.4, requires_grad=True)
    xs = cad.tensor(rng.standard_normal((9, 5)))
    step = _counting_step([], w)
    grads = []
    for warm_up in (False, True):
        if warm_up:
            with cad.no_grad():
                cad.scan(step, cad.zeros(5, dtype="float64"), xs)
        h, ys = cad.scan(step, cad.zeros(5, dtype="float64"), xs, trace=not warm_up)
        (g,) = cad.grad(ys.sum() + h.sum(), [w])
        grads.append(g.numpy())
    assert np.abs(grads[0]).sum() > 0
    np.testing.assert_array_equal(grads[1], grads[0])


def test_a_profile_counts_the_replayed_primitives():
    cell = nn.GRUCell(3, 4)
    xs = cad.tensor(np.random.default_rng(3).standard_normal((7, 2, 3)).astype(np.float32))
    counts = []
    for trace in (False, True):
        with cad.no_grad(), cad.profile() as prof:
            # no outputs per step: a recorded loop stacks them by primitives, a replayed one
            # writes its rows in place
            cad.scan(lambda h, x: (cell(x, h), None), cad.zeros(2, 4), xs, trace=trace)
        counts.append((prof.primitives, prof.peak_tape_bytes))
    assert counts[0][0] > 7 and counts[1] == counts[0]
    assert counts[0][1] == 0


@pytest.mark.parametrize("stop_after, length", [(7, None), (2, None), (50, 12), (1, None)])
def test_a_loop_with_until_replays_and_stops_where_the_recorded_one_does(stop_after, length):
    rng = np.random.default_rng(4)
    w = cad.tensor(rng.standard_normal((3, 3)) * 0.5)
    outs, calls, asked = {}, [], []

    def until(carry):
        asked.append(float(carry[1]))
        return carry[1] >= stop_after

    def step(carry, x):
        calls.append(1)
        h, k = carry
        h = cad.tanh(h @ w + 0.1)
        return (h, k + 1.0), h.sum()

    for trace in (False, True, True):  # recorded, replayed, replayed from a reused program
        calls.clear()
        asked.clear()
        with cad.no_grad():
            (h, k), ys = cad.scan(step, (cad.ones(3, dtype="float64"), cad.tensor(0.0)),
                                  length=length, until=until, trace=trace)
        if trace and True in outs:  # the second replayed call: step 0 alone runs as code
            assert len(calls) == 1 and list(asked) == outs[False][4]
            np.testing.assert_array_equal(ys.numpy(), outs[False][3])
            continue
        outs[trace] = (len(calls), h.numpy(), float(k), ys.numpy(), list(asked))
    ran = min(stop_after, length or stop_after)
    assert outs[True][4] == outs[False][4]  # asked once per step, after it, on equal carries
    assert outs[False][0] == ran and outs[True][0] == min(ran, 2)
    assert outs[True][2] == outs[False][2] == ran and outs[True][3].shape == (ran,)
    np.testing.assert_array_equal(outs[True][1], outs[False][1])
    np.testing.assert_array_equal(outs[True][3], outs[False][3])


def test_while_loop_without_gradients_replays():
    x = cad.tensor(1.5)
    calls = []

    def body(c):
        calls.append(1)
        return c * 0.5

    with cad.no_grad():
        out = cad.while_loop(lambda c: c > 0.01, body, x)
    assert out.numpy() == 1.5 * 0.5 ** 8 and len(calls) == 2
