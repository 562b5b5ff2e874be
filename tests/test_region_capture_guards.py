"""A checkpointed region re-reads the tensors it captures: modified in place since, it raises
(issue 38).

PyTorch raises "one of the variables needed for gradient computation has been modified by an
inplace operation" when a tensor the backward needs was changed in place after it was saved.
A checkpointed region saves nothing of the tensors its function captures by closure: its
re-run reads them again. Changed in place between the forward and the backward, the re-run
would read the new values and differentiate another function than the plain one, silently;
so the re-run refuses with `SavedValueModifiedError`, as a planned `scan` does for a tensor
its step captures. Changes before the region ran, after the backward, or made by the region
itself are no one's error. A policy that saves what the region reads never re-runs it, and
gives the plain function's gradient.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import checkpoint_ad as cad

P = cad.checkpoint_policies
H = np.array([0.1, 0.2, 0.3])
C = np.array([0.3, -0.2, 0.5])

REGIONS = {
    "checkpoint": lambda f, h: cad.checkpoint(f, h),
    "checkpoint-no-rng": lambda f, h: cad.checkpoint(f, h, preserve_rng_state=False),
    "remat": lambda f, h: cad.remat(f)(h),
    "remat-nothing-saveable": lambda f, h: cad.remat(f, policy=P.nothing_saveable)(h),
    "checkpoint-save-only-names": lambda f, h: cad.checkpoint(
        f, h, policy=P.save_only_these_names("s")),
    "checkpoint_sequential": lambda f, h: cad.checkpoint_sequential(
        [f, lambda v: v * 2.0], 2, h),
}


def _captured(kind):
    """(leaf requiring grad, the captured tensor, how to modify it in place)."""
    c0 = cad.tensor(C.copy(), requires_grad=True)
    if kind == "non-leaf":
        c = cad.tanh(c0) * 0.5
        return c0, c, lambda: c.mul_(1.5)
    if kind == "leaf":
        def change():
            with cad.no_grad():
                c0.mul_(1.5)
        return c0, c0, change
    k = cad.tensor(C.copy())  # a constant: no gradient, read again all the same
    return c0, k, lambda: k.mul_(1.5)


def _function(c):
    def f(a):
        s = cad.checkpoint_name(a + c, "s")  # reads c; saves nothing of c itself
        return a / (1.0 + s * s)
    return f


@pytest.mark.parametrize("kind", ["non-leaf", "leaf", "constant"])
@pytest.mark.parametrize("region", sorted(REGIONS))
def test_captured_tensor_modified_inplace_before_backward_raises(region, kind):
    _, c, change = _captured(kind)
    h = cad.tensor(H.copy(), requires_grad=True)
    y = REGIONS[region](_function(c), h)
    change()
    with pytest.raises(cad.SavedValueModifiedError) as caught:
        y.sum().backward()
    message = str(caught.value)
    assert "float64[3]" in message and "modified in place" in message
    assert "captures" in message and "after the backward" in message


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_policy_saving_what_it_reads_never_reruns_and_matches_plain(policy):
    def run(wrap):
        c0, c, change = _captured("non-leaf")
        h = cad.tensor(H.copy(), requires_grad=True)
        y = wrap(_function(c))(h)
        change()
        y.sum().backward()
        return h.grad.numpy(), c0.grad.numpy()

    plain = run(lambda f: f)
    saved = run(lambda f: cad.remat(f, policy=getattr(P, policy)))
    for a, b in zip(plain, saved):
        np.testing.assert_array_equal(a, b)


def _plain_grads(change_at=None, kind="non-leaf"):
    c0, c, change = _captured(kind)
    h = cad.tensor(H.copy(), requires_grad=True)
    if change_at == "before":
        change()
    y = _function(c)(h)
    y.sum().backward()
    return h.grad.numpy(), c0.grad.numpy()


@pytest.mark.parametrize("kind", ["non-leaf", "leaf"])
def test_change_before_the_region_ran_is_no_error(kind):
    c0, c, change = _captured(kind)
    change()
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(_function(c), h)
    y.sum().backward()
    plain = _plain_grads("before", kind)
    np.testing.assert_array_equal(h.grad.numpy(), plain[0])
    np.testing.assert_array_equal(c0.grad.numpy(), plain[1])


def test_change_after_the_backward_is_no_error():
    c0, c, change = _captured("non-leaf")
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(_function(c), h)
    y.sum().backward()
    change()
    plain = _plain_grads()
    np.testing.assert_array_equal(h.grad.numpy(), plain[0])
    np.testing.assert_array_equal(c0.grad.numpy(), plain[1])


def test_retain_graph_twice_is_no_error_and_a_change_between_raises():
    c0, c, change = _captured("non-leaf")
    h = cad.tensor(H.copy(), requires_grad=True)
    loss = cad.checkpoint(_function(c), h).sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    plain = _plain_grads()
    np.testing.assert_array_equal(h.grad.numpy(), 2 * plain[0])
    np.testing.assert_array_equal(c0.grad.numpy(), 2 * plain[1])
    change()
    with pytest.raises(cad.SavedValueModifiedError):
        loss.backward()


def test_change_made_by_the_region_itself_is_no_error():
    """A region that bumps a captured counter (a step count, a running statistic) in place:
    its first run and each re-run change it, which is its own business."""
    _, c, _ = _captured("non-leaf")
    calls = cad.zeros(1)

    def f(a):
        calls.add_(1.0)
        return _function(c)(a) + calls.detach() * 0.0

    h = cad.tensor(H.copy(), requires_grad=True)
    loss = cad.checkpoint(f, h).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert calls.numpy()[0] == 3.0  # the first run, then one re-run per backward
    plain = _plain_grads()
    np.testing.assert_array_equal(h.grad.numpy(), 2 * plain[0])


def test_argument_modified_inplace_is_caught_by_its_saved_slot():
    h = cad.tensor(H.copy(), requires_grad=True)
    a = h * 1.0
    y = cad.checkpoint(lambda v: cad.tanh(v) * 2.0, a)
    a.mul_(2.0)
    with pytest.raises(cad.SavedValueModifiedError):
        y.sum().backward()


def test_nested_region_capture_is_guarded_by_both():
    _, c, change = _captured("non-leaf")
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(lambda a: cad.checkpoint(_function(c), a * 2.0), h)
    change()
    with pytest.raises(cad.SavedValueModifiedError):
        y.sum().backward()


def test_custom_function_reading_a_capture_is_guarded():
    class AddRaw(cad.Function):  # reads its operands' arrays: no recorded operation inside
        @staticmethod
        def forward(ctx, a, k):
            return cad.tensor(a.numpy() + k.numpy())

        @staticmethod
        def backward(ctx, g):
            return g, None

    _, k, change = _captured("constant")
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(lambda a: cad.tanh(AddRaw.apply(a, k)), h)
    change()
    with pytest.raises(cad.SavedValueModifiedError):
        y.sum().backward()


@pytest.mark.parametrize("read", ["numpy", "data", "asarray", "item"])
@pytest.mark.parametrize("through", ["closure", "attribute"])
def test_custom_function_reading_a_capture_through_another_object_is_guarded(read, through):
    """A `Function` whose forward reads a tensor that is not its argument (a closure, an
    attribute of an object) as an array: the region's re-run reads it again, so a change
    in place since the forward raises, as for one it is given."""
    _, k, change = _captured("constant")
    holder = type("Holder", (), {"k": k})()
    values = {"numpy": lambda t: t.numpy(), "data": lambda t: t.data,
              "asarray": np.asarray, "item": lambda t: t.sum().item()}[read]

    class AddCaptured(cad.Function):
        @staticmethod
        def forward(ctx, a):
            captured = k if through == "closure" else holder.k
            return cad.tensor(a.detach().numpy() + values(captured))

        @staticmethod
        def backward(ctx, g):
            return g

    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(lambda a: cad.tanh(AddCaptured.apply(a * 1.0)), h)
    change()
    with pytest.raises(cad.SavedValueModifiedError, match=f"first read by '{read}"
                       if read in ("numpy", "data") else "first read by"):
        y.sum().backward()


def test_printing_a_capture_in_a_region_guards_nothing():
    """Printing reads no value the region computes with: a change after it is no error."""
    _, k, change = _captured("constant")
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(lambda a: (repr(k), cad.tanh(a * 2.0))[1], h)
    change()
    y.sum().backward()
    np.testing.assert_allclose(h.grad.numpy(), 2.0 / np.cosh(2.0 * H) ** 2)


@pytest.mark.parametrize("trace", [True, False])
def test_region_in_a_keep_all_scan_step_raises(trace):
    _, c, change = _captured("non-leaf")
    h = cad.tensor(H.copy(), requires_grad=True)

    def step(carry, x):
        out = cad.checkpoint(_function(c), carry * x)
        return out, out.sum()

    carry, ys = cad.scan(step, h, cad.tensor(np.array([1.0, 0.5, 2.0])), trace=trace)
    change()
    with pytest.raises(cad.SavedValueModifiedError):
        (carry.sum() + ys.sum()).backward()


@pytest.mark.parametrize("trace", [True, False])
def test_region_in_a_keep_all_scan_step_unchanged_matches_plain(trace):
    def run(region):
        c0, c, _ = _captured("non-leaf")
        h = cad.tensor(H.copy(), requires_grad=True)

        def step(carry, x):
            v = carry * x
            out = cad.checkpoint(_function(c), v) if region else _function(c)(v)
            return out, out.sum()

        carry, ys = cad.scan(step, h, cad.tensor(np.array([1.0, 0.5, 2.0])), trace=trace)
        (carry.sum() + ys.sum()).backward()
        return h.grad.numpy(), c0.grad.numpy()

    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)


def test_guard_keeps_no_captured_tensor_alive():
    class Block:
        def __init__(self):
            self.k = cad.tensor(C.copy())

        def __call__(self, a):
            return cad.tanh(a * self.k)

    block = Block()
    h = cad.tensor(H.copy(), requires_grad=True)
    y = cad.checkpoint(block, h)
    first = weakref.ref(block.k)
    block.k = cad.tensor(C.copy())  # replaced, not modified: the re-run reads equal values
    gc.collect()
    assert first() is None
    y.sum().backward()
    plain = cad.tensor(H.copy(), requires_grad=True)
    block(plain).sum().backward()
    np.testing.assert_array_equal(h.grad.numpy(), plain.grad.numpy())
