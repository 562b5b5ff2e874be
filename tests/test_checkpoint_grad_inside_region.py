"""A checkpointed region whose function takes a gradient itself (issue 38).

PyTorch's non-reentrant checkpoint supports a gradient penalty inside the checkpointed
function (``torch.autograd.grad(..., create_graph=True)`` there) and double backward
through it: the re-run calls the function on the saved inputs with their history, so the
gradient it takes reaches them as the first run's did. Here every region is lossless, so
the gradients are compared bitwise with the plain function's (float64)."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Periodic

P = cad.checkpoint_policies
START = np.array([0.1, -0.2, 0.3])


def _penalty(a, b, c):
    (g,) = cad.grad((cad.sin(a) * b).sum(), [a], create_graph=True)
    return g * 0.5 + c


WRAPS = {
    "plain": lambda fn: fn,
    "checkpoint": lambda fn: lambda *x: cad.checkpoint(fn, *x),
    "checkpoint-policy": lambda fn: lambda *x: cad.checkpoint(
        fn, *x, policy=P.save_any_names_but_these("kept")),
    "remat": cad.remat,
    "remat-nothing-saveable": lambda fn: cad.remat(fn, policy=P.nothing_saveable),
}
# (a, b, c) from h: one tensor three times, or b computed from a outside the region, so
# the gradient taken inside flows through the graph before the region too
INPUTS = {
    "one-tensor-thrice": lambda h: (h, h, h),
    "b-made-from-a-outside": lambda h: (h, h * 1.0, h),
}


def _first_and_second_order(wrap, inputs):
    h0 = cad.tensor(START.copy(), requires_grad=True)
    h = h0 * 1.0
    y = WRAPS[wrap](_penalty)(*INPUTS[inputs](h))
    y.sum().backward()
    first = h0.grad.numpy().copy()
    h0 = cad.tensor(START.copy(), requires_grad=True)
    h = h0 * 1.0
    y = WRAPS[wrap](_penalty)(*INPUTS[inputs](h))
    (g,) = cad.grad((y * y).sum(), [h0], create_graph=True)
    (gg,) = cad.grad((g * g).sum(), [h0])
    return first, g.numpy().copy(), gg.numpy().copy()


@pytest.mark.parametrize("inputs", list(INPUTS))
@pytest.mark.parametrize("wrap", [w for w in WRAPS if w != "plain"])
def test_gradient_penalty_inside_checkpoint_gives_the_plain_gradients_like_torch_non_reentrant(
        wrap, inputs):
    for got, want in zip(_first_and_second_order(wrap, inputs),
                         _first_and_second_order("plain", inputs)):
        np.testing.assert_array_equal(got, want)


def test_gradient_penalty_inside_checkpoint_is_the_analytic_one():
    """The value itself: a, b and c one tensor h, the inner gradient is
    d/dh sum(sin(h) h) = cos(h) h + sin(h), and the gradient of sum(0.5 (cos(h) h + sin(h)) + h)
    is 0.5 (2 cos(h) - h sin(h)) + 1."""
    h0 = cad.tensor(START.copy(), requires_grad=True)
    h = h0 * 1.0
    cad.checkpoint(_penalty, h, h, h).sum().backward()
    want = 0.5 * (2 * np.cos(START) - START * np.sin(START)) + 1.0
    np.testing.assert_allclose(h0.grad.numpy(), want, rtol=1e-14)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_checkpoint_of_one_tensor_passed_twice_like_torch(leaf):
    """PyTorch: ``checkpoint(f, x, x)`` works; here the re-run saved the tensor's value once
    per argument where the first run saved it once, and raised RecomputeError."""
    def grads(region):
        h0 = cad.tensor(START.copy(), requires_grad=True)
        h = h0 if leaf else h0 * 1.0
        fn = lambda a, b: cad.sin(a) * b
        y = cad.checkpoint(fn, h, h) if region else fn(h, h)
        (y * y).sum().backward()
        return h0.grad.numpy()

    np.testing.assert_array_equal(grads(True), grads(False))


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_hook_and_retain_grad_inside_checkpoint_on_tensors_from_outside_act_once(leaf):
    """A hook registered inside the checkpointed function on its input or on a captured
    tensor fires once per backward, and ``retain_grad()`` there fills the caller's tensor,
    as in the plain function: the re-run, whose input carries the input's history, does not
    register them again."""
    def run(region):
        seen = []
        h0 = cad.tensor(START.copy(), requires_grad=True)
        h = h0 if leaf else h0 * 1.0
        captured = h0 * 2.0

        def fn(a):
            a.register_hook(lambda g: seen.append("input") or g * 2.0)
            captured.register_hook(lambda g: seen.append("captured") or g * 3.0)
            a.retain_grad()
            return cad.sin(a) * captured

        y = cad.checkpoint(fn, h) if region else fn(h)
        (y * 3.0).sum().backward()
        retained = None if leaf else h.grad.numpy()
        return h0.grad.numpy(), sorted(seen), retained

    got, want = run(True), run(False)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] == ["captured", "input"]
    if not leaf:
        np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("with_inputs", [False, True], ids=["backward()", "backward(inputs=)"])
@pytest.mark.parametrize("wrap", ["checkpoint", "remat"])
def test_backward_inside_a_checkpoint_fills_grad_once_like_the_plain_function(wrap, with_inputs):
    """A `backward()` in a checkpointed function fills `.grad` in its first run; the re-run
    for the saved values took the same gradients again and added them, silently (w.grad
    twice the plain function's)."""
    def grads(region):
        w = cad.tensor(np.array([0.3, -0.4]), requires_grad=True)
        v0 = cad.tensor(np.array([0.1, 0.2]), requires_grad=True)

        def f(v):
            inner = (cad.sin(v.detach() * w)).sum()
            inner.backward(inputs=[w]) if with_inputs else inner.backward()
            return cad.tanh(v * w)

        if not region:
            out = f(v0)
        elif wrap == "checkpoint":
            out = cad.checkpoint(f, v0)
        else:
            out = cad.remat(f)(v0)
        out.sum().backward()
        return w.grad.numpy(), v0.grad.numpy()

    for got, want in zip(grads(True), grads(False), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("strategy", [None, Periodic(2), Binomial(1)], ids=repr)
def test_backward_in_a_loop_step_inside_a_checkpoint_fills_grad_once(strategy):
    def grads(region):
        w = cad.tensor(np.array([0.3, -0.4]), requires_grad=True)
        v0 = cad.tensor(np.array([0.1, 0.2]), requires_grad=True)
        xs = cad.tensor(np.full((4, 2), 0.5))

        def f(v):
            def step(h, x):
                (cad.sin(h.detach() * w).sum()).backward(inputs=[w])
                return cad.tanh(h * x * w), None

            return cad.scan(step, v * 1.0, xs, strategy=strategy)[0]

        out = cad.checkpoint(f, v0) if region else f(v0)
        out.sum().backward()
        return w.grad.numpy(), v0.grad.numpy()

    for got, want in zip(grads(True), grads(False), strict=True):
        np.testing.assert_array_equal(got, want)


HOOKED = ["leaf", "made-before-the-region", "made-in-the-region", "node-post-hook"]


def _hooked_grads(wrap, where, with_inputs, strategy=None, in_loop=False):
    """Hook calls (in order) and gradients of a function whose `backward()` reaches a
    hooked tensor (each hook doubles the gradient it is given, and counts its call)."""
    calls: list[str] = []
    w = cad.tensor(np.array([0.3, -0.4]), requires_grad=True)
    v0 = cad.tensor(np.array([0.1, 0.2]), requires_grad=True)
    pre = w * 1.0
    if where == "leaf":
        w.register_hook(lambda g: calls.append("w") or g * 2.0)
    elif where == "made-before-the-region":
        pre.register_hook(lambda g: calls.append("pre") or g * 2.0)

    def inner(v):
        a = cad.sin(v.detach() * pre)
        if where == "made-in-the-region":
            a.register_hook(lambda g: calls.append("a") or g * 2.0)
        elif where == "node-post-hook":
            a.grad_fn.register_hook(lambda gi, go: calls.append("node") or (gi[0] * 2.0,))
        a.sum().backward(inputs=[w], retain_graph=True) if with_inputs else (
            a.sum().backward(retain_graph=True))
        return cad.tanh(v * w)

    def f(v):
        if not in_loop:
            return inner(v)
        xs = cad.tensor(np.full((3, 2), 0.5))
        return cad.scan(lambda h, x: (inner(h * x), None), v * 1.0, xs, strategy=strategy)[0]

    out = f(v0) if wrap == "plain" else (
        cad.checkpoint(f, v0) if wrap == "checkpoint" else cad.remat(f)(v0))
    out.sum().backward()
    return calls, w.grad.numpy(), v0.grad.numpy()


@pytest.mark.parametrize("with_inputs", [False, True], ids=["backward()", "backward(inputs=)"])
@pytest.mark.parametrize("where", HOOKED)
@pytest.mark.parametrize("wrap", ["checkpoint", "remat"])
def test_hooks_reached_by_a_backward_inside_a_checkpoint_fire_as_in_the_plain_function(
        wrap, where, with_inputs):
    """The region's re-run (for its saved values, also one the first run's own backward
    needs) runs that backward's sweep again but drops its results: it fires no hook, so a
    hook with a side effect (a counter) fires as often as in the plain function."""
    got = _hooked_grads(wrap, where, with_inputs)
    want = _hooked_grads("plain", where, with_inputs)
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("where", HOOKED)
@pytest.mark.parametrize("strategy", [None, Periodic(2), Binomial(1)], ids=repr)
def test_hooks_reached_by_a_backward_in_a_loop_step_inside_a_checkpoint_fire_once(
        strategy, where):
    """(A planned step's own hook reached by its `backward()` fired in step 0 alone: the
    loop's forward runs the other steps with a tape let go, which dropped their hooks.)"""
    got = _hooked_grads("checkpoint", where, False, strategy, in_loop=True)
    want = _hooked_grads("plain", where, False, None, in_loop=True)
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(g, w)
