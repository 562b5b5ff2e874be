"""A gradient taken inside a step whose value, keeping every step, flows through the history
of the step's carry or row of `xs` (issue 38: a wrong value is worse than an error).

A Python loop (and `scan` keeping every step, and PyTorch's autograd on a plain loop) hands
step 0 the caller's carry itself and every step rows of `xs`: `grad` inside the step follows
their history into what it differentiates. A plan that re-runs steps gives the step copies
without that history; where the history matters it now raises `StepGradientCutError`
instead of a silently different value, and where it does not, it agrees bitwise as before.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import BackwardError, StepGradientCutError
from checkpoint_ad.strategies import Binomial, Budget, Periodic, Recompute

H0 = np.array([0.1, -0.2, 0.3])
W0 = np.array([0.5, 0.7, 0.9])
STRATEGIES = [Binomial(1), Binomial(2), Periodic(2), Recompute(), "budget"]


def _grad(out, wrt):
    (g,) = cad.grad(out, [wrt], create_graph=True)
    return g


def _resolve(strategy, step, init, xs=None, length=None):
    """A budget only the leanest plan fits (one that re-runs steps), or `strategy`."""
    if strategy != "budget":
        return strategy
    table = cad.estimate(step, init, xs, length=length, budget=Budget(1 << 40))
    return Budget(table.minimum_bytes)


def _sin_step(h, x):
    return _grad((cad.sin(h) * x).sum(), h) * 0.5, None


def _xs_from_carry_run(strategy, trace=True, n=3, detach=False):
    """(final carry, h0.grad) of a loop over xs computed from its initial carry."""
    h0 = cad.tensor(H0.copy(), requires_grad=True)
    h = h0 * 1.0
    xs = cad.stack([h * (1.0 + t) for t in range(n)])
    if detach:
        xs = xs.detach()
    strategy = _resolve(strategy, _sin_step, h, xs)
    final, _ = cad.scan(_sin_step, h, xs, strategy=strategy, trace=trace)
    final.sum().backward()
    return final.numpy(), h0.grad.numpy()


def _python_loop_run(n=3):
    h0 = cad.tensor(H0.copy(), requires_grad=True)
    h = h0 * 1.0
    xs = cad.stack([h * (1.0 + t) for t in range(n)])
    carry = h
    for t in range(n):
        carry, _ = _sin_step(carry, xs[t])
    carry.sum().backward()
    return carry.numpy(), h0.grad.numpy()


@pytest.mark.parametrize("trace", [True, False])
def test_keep_all_scan_differentiates_through_xs_made_from_its_carry_like_a_python_loop(trace):
    """The reference the plans are held to: keeping every step is a Python loop, also where
    the step's gradient flows through xs into the initial carry."""
    for mine, want in zip(_xs_from_carry_run(None, trace), _python_loop_run()):
        np.testing.assert_allclose(mine, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_gradient_through_xs_made_from_the_initial_carry_raises_not_a_silently_other_value(
        strategy, trace):
    """A Python loop's `grad` w.r.t. step 0's carry also flows through x = xs[0], computed
    from that carry; a plan's copy of the carry cannot, so it refuses, saying what to do."""
    with pytest.raises(StepGradientCutError, match="keeping every step") as info:
        _xs_from_carry_run(strategy, trace)
    assert "strategy=None" in str(info.value) and "detach" in str(info.value)
    assert issubclass(StepGradientCutError, BackwardError)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_gradient_with_xs_detached_from_the_carry_matches_keep_all_bitwise(strategy, trace):
    """What the error advises: xs without the carry's history, and plans agree bitwise."""
    want = _xs_from_carry_run(None, trace, detach=True)
    got = _xs_from_carry_run(strategy, trace, detach=True)
    for mine, ref in zip(got, want):
        np.testing.assert_array_equal(mine, ref)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_gradient_through_a_capture_made_from_the_initial_carry_raises(strategy, trace):
    """A Python loop: step 0's `grad` w.r.t. its carry also flows through a captured
    tensor computed from that carry (here the carry itself, captured by the closure)."""
    h0 = cad.tensor(H0.copy(), requires_grad=True)
    h = h0 * 1.0
    scale = h * 2.0

    def step(c, _):
        return c + 0.1 * _grad((cad.sin(c) * scale).sum(), c), None

    strategy = _resolve(strategy, step, h, length=3)
    with pytest.raises(StepGradientCutError, match="from outside the step computed from"):
        cad.scan(step, h, length=3, strategy=strategy, trace=trace)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_gradient_wrt_a_capture_a_later_carry_was_computed_from_raises(strategy, trace):
    """A Python loop: at step t > 0, `grad` w.r.t. a captured w also flows back through the
    carry, which earlier steps computed from w; a plan's step t starts from a copy."""
    w = cad.tensor(W0.copy(), requires_grad=True)
    h = cad.tensor(H0.copy(), requires_grad=True)

    def step(c, _):
        return c * w + 0.1 * _grad((c * w).sum(), w), None

    strategy = _resolve(strategy, step, h, length=3)
    with pytest.raises(StepGradientCutError, match="carry's leaf 0 at step"):
        cad.scan(step, h, length=3, strategy=strategy, trace=trace)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_gradient_wrt_a_capture_the_initial_carry_was_computed_from_raises(strategy):
    """A Python loop: step 0's `grad` w.r.t. a captured w also flows back through its
    carry, computed from w before the loop; a plan's step 0 starts from a copy."""
    w = cad.tensor(W0.copy(), requires_grad=True)
    h = cad.tensor(H0.copy(), requires_grad=True) * w

    def step(c, _):
        return c + _grad((c * w).sum(), w), None

    want, _ = cad.scan(step, h, length=2)
    resolved = _resolve(strategy, step, h, length=2)
    if strategy == "budget":  # a loop this small may keep every step even at its leanest
        try:  # (the fastest of the leanest plans, by the machine's timing)
            got, _ = cad.scan(step, h, length=2, strategy=resolved)
        except StepGradientCutError:  # it chose a plan that re-runs step 0
            assert resolved.last.chosen.evaluations > resolved.last.n_steps
            return
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        return
    with pytest.raises(StepGradientCutError, match="at step 0"):
        cad.scan(step, h, length=2, strategy=resolved)


@pytest.mark.parametrize("strategy", STRATEGIES[:-1], ids=repr)
def test_backward_with_inputs_through_xs_made_from_the_carry_raises_too(strategy):
    """`backward(inputs=...)` inside the step takes the same gradient as `grad`."""
    def step(h, x):
        cad.backward((cad.sin(h) * x).sum(), inputs=[h])
        return h * 0.5, None

    h = cad.tensor(H0.copy(), requires_grad=True) * 1.0
    xs = cad.stack([h, h])
    strategy = _resolve(strategy, step, h, xs)
    with pytest.raises(StepGradientCutError):
        cad.scan(step, h, xs, strategy=strategy)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", [Binomial(1), Recompute()], ids=repr)
def test_planned_loop_inside_a_keep_all_scan_step_raises_as_alone(strategy, trace):
    """As tests/test_loop_compositions_property.py found it: the inner loop's xs is made
    from its carry inside an outer step that keeps every step."""
    def outer(h, _):
        inner = h * 1.0
        final, _ = cad.scan(_sin_step, inner, cad.stack([inner]), strategy=strategy,
                            trace=trace)
        return final, None

    h0 = cad.tensor(H0.copy(), requires_grad=True)
    with pytest.raises(StepGradientCutError):
        cad.scan(outer, h0, length=2, trace=trace)


def test_gradient_wrt_a_later_carry_alone_still_matches_keep_all_bitwise():
    """No false alarm: `grad` w.r.t. the carry of a descent step, xs and captures not made
    from it, is the same under a plan as keeping every step (at every step t > 0 too)."""
    results = []
    for strategy in (None, Binomial(2), Periodic(2), Recompute()):
        w = cad.tensor(W0.copy(), requires_grad=True)
        h = cad.tensor(H0.copy(), requires_grad=True)
        xs = cad.tensor(np.linspace(0.1, 0.6, 12).reshape(4, 3))

        def step(c, x, w=w):
            return c - 0.3 * _grad((cad.tanh(c * w + x) ** 2).sum(), c), c

        final, ys = cad.scan(step, h, xs, strategy=strategy)
        (final.sum() + (ys * ys).sum()).backward()
        results.append((final.numpy(), w.grad.numpy(), h.grad.numpy()))
    for got in results[1:]:
        for mine, want in zip(got, results[0]):
            np.testing.assert_array_equal(mine, want)


def _backward_everything_run(strategy, carry_from_w, trace=False):
    """(w.grad after the forward, w.grad after the loss) of a loop whose step calls
    ``backward()`` without ``inputs=`` on an energy of its carry and a captured `w`."""
    w = cad.tensor(W0.copy(), requires_grad=True)
    xs = cad.tensor(np.linspace(0.1, 0.6, 12).reshape(4, 3))

    def step(h, x):
        (cad.sin(h * w) * x).sum().backward(retain_graph=True)
        return (cad.tanh(h * w + x) if carry_from_w else cad.tanh(h + x)), None

    h0 = cad.tensor(H0.copy())
    strategy = _resolve(strategy, step, h0, xs)
    h, _ = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    after_forward = w.grad.numpy().copy()
    (h.sum() + (w * w).sum()).backward()
    return after_forward, w.grad.numpy()


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_backward_without_inputs_through_a_carry_made_from_a_weight_raises(strategy, trace):
    """PyTorch's `loss.backward()` in a Python loop's body goes on through the carry's
    history (earlier steps, the weights they used) and adds into every leaf's `.grad`; a
    plan runs the step on a copy without that history, so it refuses (it gave other
    values silently) and says to pass ``inputs=`` or keep every step."""
    keep = _backward_everything_run(None, carry_from_w=True, trace=trace)
    assert keep[0] is not None  # the plain loop works (retain_graph: history kept)
    with pytest.raises(StepGradientCutError, match="without inputs="):
        _backward_everything_run(strategy, carry_from_w=True, trace=trace)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_backward_without_inputs_through_a_carry_without_grad_history_matches_keep_all(
        strategy):
    """No false alarm: where the carry's history needs no gradient (nothing it was made
    from requires grad), ``backward()`` in the step fills `w.grad` as keeping every step,
    bitwise, before and after the loop's own backward."""
    want = _backward_everything_run(None, carry_from_w=False)
    for got, expected in zip(_backward_everything_run(strategy, carry_from_w=False), want):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("strategy", STRATEGIES[:-1], ids=repr)
def test_backward_without_inputs_reaching_the_callers_carry_raises(strategy):
    """Step 0's carry is, in a Python loop, the caller's tensor, whose history (its leaf
    `h0`) ``backward()`` fills; the plan's copy would fill nothing of the caller's."""
    def step(h, x):
        (cad.sin(h) * x).sum().backward(retain_graph=True)
        return h * 0.5, None

    h0 = cad.tensor(H0.copy(), requires_grad=True)
    with pytest.raises(StepGradientCutError, match="step 0"):
        cad.scan(step, h0 * 1.0, cad.tensor(np.ones((3, 3))), strategy=strategy, trace=False)


@pytest.mark.parametrize("inputs", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_backward_inside_a_step_fills_grad_once_per_step_as_a_python_loop(strategy, inputs):
    """A Python loop runs each step once, so a ``backward()`` in its body adds into
    `w.grad` once per step; a plan's re-runs of the step (and a budget's dry run) add
    nothing more: `w.grad` is keeping every step's, bitwise, after the loop and after
    its backward (which does not read `w`). (The re-runs added into it again before.)"""
    def run(strategy):
        w = cad.tensor(W0.copy(), requires_grad=True)
        v = cad.tensor(W0.copy() * 0.5, requires_grad=True)
        xs = cad.tensor(np.linspace(0.1, 0.6, 15).reshape(5, 3))

        def step(h, x):
            energy = (cad.sin(w) * x).sum()
            if inputs:
                energy.backward(inputs=[w])
            else:
                energy.backward()
            return cad.tanh(h * v + x), None

        h0 = cad.tensor(H0.copy())
        resolved = _resolve(strategy, step, h0, xs) if strategy is not None else None
        h, _ = cad.scan(step, h0, xs, strategy=resolved, trace=False)
        after_forward = w.grad.numpy().copy()
        h.sum().backward()
        return after_forward, w.grad.numpy(), v.grad.numpy()

    for got, want in zip(run(strategy), run(None)):
        np.testing.assert_array_equal(got, want)
