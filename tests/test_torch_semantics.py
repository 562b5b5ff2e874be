"""Autograd behaviours ported from PyTorch (`test/test_autograd.py`), HIPS autograd and JAX.

Each test names the library whose behaviour it matches. Expected values come from formulas
derived by hand or from central finite differences in float64, never from this engine.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad


def leaf(values, dtype="float64"):
    return cad.tensor(np.asarray(values, dtype=dtype), requires_grad=True)


# ----------------------------------------------------------------- 1. power at zero
@pytest.mark.parametrize("c", [0, 1, 2, 3])
def test_power_at_zero_is_finite_and_right(c):
    """PyTorch `test_pow_zero_tensor_gradient` / HIPS autograd `test_pow`: d/dx x**c at
    x = 0 is c * 0**(c-1) for c >= 1 and 0 for c = 0 (never nan)."""
    x = leaf([0.0, 0.0])
    (x**c).sum().backward()
    expected = 0.0 if c != 1 else 1.0  # c * 0**(c - 1), with 0**0 = 1
    np.testing.assert_array_equal(x.grad.numpy(), [expected, expected])


@pytest.mark.parametrize("c", [0, 1, 2, 3])
def test_power_gradcheck_through_zero_up_to_third_order(c):
    """HIPS autograd `check_grads(order=3)` on `x ** c` with points at 0 and either side."""
    x = leaf([0.0, 0.7, -1.3])
    assert cad.testing.gradcheck(lambda t: t**c, [x], order=3)


def test_power_exponent_gradient_at_zero_base():
    """PyTorch: d/dc 0**c is 0 for c > 0 (0**c is constant 0 there), and the base rule stays
    exact elsewhere: c * a**(c-1) and a**c * log a."""
    a, c = leaf([0.0, 2.0]), leaf([2.0, 1.5])
    (a**c).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [0.0, 1.5 * 2.0**0.5], rtol=1e-12)
    np.testing.assert_allclose(c.grad.numpy(), [0.0, 2.0**1.5 * np.log(2.0)], rtol=1e-12)


# ----------------------------------------------------------------- 7. grad modes
def test_one_no_grad_object_entered_twice_restores_the_mode():
    """PyTorch `test_no_grad_python_function` / nested `torch.no_grad()` objects: each exit
    restores what its own entry replaced."""
    ng = cad.no_grad()
    with ng:
        with ng:
            assert not cad.is_grad_enabled()
        assert not cad.is_grad_enabled()
    assert cad.is_grad_enabled()
    eg = cad.enable_grad()
    with ng, eg:
        with ng:
            assert not cad.is_grad_enabled()
        assert cad.is_grad_enabled()
    assert cad.is_grad_enabled()


def test_set_grad_enabled_as_function_context_and_decorator():
    """PyTorch `test_set_grad_enabled`: a call sets the mode, a block restores it."""
    x = leaf([1.0])
    with cad.set_grad_enabled(False):
        assert not (x * 2).requires_grad
        with cad.set_grad_enabled(True):
            assert (x * 2).requires_grad
        assert not cad.is_grad_enabled()
    assert cad.is_grad_enabled()
    try:
        cad.set_grad_enabled(False)
        assert not cad.is_grad_enabled() and not (x * 2).requires_grad
    finally:
        cad.set_grad_enabled(True)
    assert cad.is_grad_enabled()

    @cad.set_grad_enabled(False)
    def double(t):
        return t * 2

    assert cad.is_grad_enabled()  # decorating changes nothing
    assert not double(x).requires_grad and cad.is_grad_enabled()
    assert repr(cad.set_grad_enabled(True)) == "set_grad_enabled(True)"


# ----------------------------------------------------------------- 4. hooks, backward(inputs=)
def test_leaf_hook_sees_the_summed_gradient_once_and_may_replace_it():
    """PyTorch `test_hooks`: a leaf's hook runs once per backward with the total gradient,
    and what it returns is what reaches `.grad`."""
    x = leaf([1.0, 2.0])
    seen = []

    def hook(g):
        seen.append(g.numpy().copy())
        return g * 10

    handle = x.register_hook(hook)
    (x * x + 3 * x).sum().backward()  # two paths into x
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], 2 * x.numpy() + 3)
    np.testing.assert_allclose(x.grad.numpy(), 10 * (2 * x.numpy() + 3))
    handle.remove()
    handle.remove()  # twice is harmless
    x.grad = None
    (x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy())
    assert len(seen) == 1 and "removed" in repr(handle)


def test_non_leaf_hook_changes_what_flows_below_it():
    """PyTorch `test_hooks` on an intermediate: the hook's result is the gradient passed on,
    with backward() and with grad() alike; returning None keeps the gradient."""
    x = leaf([1.0, -2.0])
    h = x * 3
    calls = []
    h.register_hook(lambda g: calls.append(1))  # observes only
    h.register_hook(lambda g: g * 2)
    (h * h).sum().backward(retain_graph=True)
    np.testing.assert_allclose(x.grad.numpy(), 2 * (2 * h.numpy()) * 3)
    (gx,) = cad.grad((h * h).sum(), [x])
    np.testing.assert_allclose(gx.numpy(), 2 * (2 * h.numpy()) * 3)
    assert len(calls) == 2


def test_hook_errors_are_specific():
    """PyTorch: a hook on a tensor without grad is refused; a bad replacement is reported."""
    with pytest.raises(cad.BackwardError, match="does not require grad"):
        cad.tensor([1.0]).register_hook(lambda g: g)
    x = leaf([1.0, 2.0])
    x.register_hook(lambda g: cad.tensor(np.ones(3)))
    with pytest.raises(cad.ShapeError, match="keep the shape"):
        (x * 2).sum().backward()
    y = leaf([1.0])
    z = y * 2
    z.register_hook(lambda g: 3.0)
    with pytest.raises(cad.BackwardError, match="returned float"):
        z.sum().backward()
    with pytest.raises(TypeError, match="callable"):
        y.register_hook(3)


def test_entry_hook_sees_input_and_output_gradients():
    """PyTorch `Node.register_hook(fn(grad_inputs, grad_outputs))`: may replace grad_inputs."""
    a, b = leaf([2.0]), leaf([5.0])
    y = a * b
    seen = {}

    def hook(grad_inputs, grad_outputs):
        seen["in"] = [g.item() for g in grad_inputs]
        seen["out"] = [g.item() for g in grad_outputs]
        return (grad_inputs[0] * 0, grad_inputs[1])

    y.grad_fn.register_hook(hook)
    (y * 3).sum().backward()
    assert seen == {"in": [3 * 5.0, 3 * 2.0], "out": [3.0]}
    assert a.grad.item() == 0.0 and b.grad.item() == 6.0


def test_backward_over_several_outputs_sums_in_one_pass():
    """PyTorch `torch.autograd.backward(tensors, grad_tensors)`: one pass, gradients summed
    (so outputs sharing a graph need no retain_graph)."""
    x = leaf([1.0, 2.0])
    h = cad.tanh(x)
    a, b = (h * 2).sum(), h * h
    cad.backward([a, b], grad_tensors=[None, cad.tensor(np.array([1.0, 10.0]))])
    t = np.tanh(x.numpy())
    np.testing.assert_allclose(x.grad.numpy(), (2 + np.array([1.0, 10.0]) * 2 * t) * (1 - t * t))
    with pytest.raises(ValueError, match="grad_tensors has 1 entries"):
        cad.backward([x * 2, x * 3], grad_tensors=[None])
    with pytest.raises(ValueError, match="at least one"):
        cad.backward([])


def test_backward_inputs_accumulates_only_into_those():
    """PyTorch `test_backward_with_inputs`: leaves and non-leaves named in inputs get .grad,
    nothing else does."""
    x, w = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    h = x * w
    y = (h * h).sum()
    y.backward(inputs=[x], retain_graph=True)
    np.testing.assert_allclose(x.grad.numpy(), 2 * h.numpy() * w.numpy())
    assert w.grad is None and h.grad is None
    cad.backward(y, inputs=[h, w, w])
    np.testing.assert_allclose(h.grad.numpy(), 2 * h.numpy())
    np.testing.assert_allclose(w.grad.numpy(), 2 * h.numpy() * x.numpy())
    np.testing.assert_allclose(x.grad.numpy(), 2 * h.numpy() * w.numpy())  # unchanged
    with pytest.raises(cad.BackwardError, match="does not require grad"):
        (x * 2).sum().backward(inputs=[cad.tensor([1.0])])
    with pytest.raises(ValueError, match="no tensors"):
        (x * 2).sum().backward(inputs=[])


# ----------------------------------------------------------------- 6. detect_anomaly
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_detect_anomaly_names_the_op_its_line_and_the_input():
    """PyTorch `test_anomaly_detect_nan`: inside detect_anomaly the first backward making a
    nan/inf raises, naming the forward op and, where the forward ran inside detect_anomaly too
    (as PyTorch's forward traces), where it was recorded."""
    import inspect

    b = leaf([0.0, 1.0])
    one = cad.tensor(np.ones(2))
    with cad.detect_anomaly():
        y = one / b  # d/db = -1/b**2: inf, then nan, at b = 0
        line = inspect.currentframe().f_lineno - 1
    z = (y * 0 + 1).sum()
    with cad.detect_anomaly(), pytest.raises(cad.AnomalyError) as info:
        z.backward(retain_graph=True)
    message = str(info.value)
    assert "'divide'" in message and f"test_torch_semantics.py:{line}" in message
    assert "input 1 ('b')" in message
    recorded_outside = (one / b).sum()
    with cad.detect_anomaly(), pytest.raises(cad.AnomalyError, match="record_origins"):
        recorded_outside.backward()  # the message says how to see the line
    assert isinstance(info.value, RuntimeError)
    assert not cad.is_anomaly_enabled()
    z.backward()  # outside: no check, the nan goes through silently (as in PyTorch)
    assert np.isnan(b.grad.numpy()[0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_detect_anomaly_is_quiet_for_finite_gradients_and_can_be_disabled():
    """PyTorch `detect_anomaly(check_nan=...)`-style switch: enabled=False turns it off."""
    x = leaf([0.5, 2.0])
    with cad.detect_anomaly():
        cad.log(x).sum().backward()
        with cad.detect_anomaly(enabled=False):
            assert not cad.is_anomaly_enabled()
            cad.sqrt(x - 0.5).sum().backward()  # inf at x = 0.5, unchecked
        assert cad.is_anomaly_enabled()
    np.testing.assert_allclose(x.grad.numpy(), [np.inf, 0.5 + 1 / (2 * np.sqrt(1.5))])
    assert "enabled=True" in repr(cad.detect_anomaly())


# ----------------------------------------------------------------- 2. in-place on non-leaves
def test_inplace_writes_the_same_storage_seen_by_views_and_detached_aliases():
    """PyTorch `test_inplace_on_view_*` / `test_detach`: an in-place op on a non-leaf changes
    its storage, so views and detached aliases see it and share the bumped version."""
    x = leaf([1.0, 2.0, 3.0])
    y = x * 2
    d, v = y.detach(), y[0:2]
    version = y.version
    y.mul_(3)
    np.testing.assert_allclose(d.numpy(), 6 * x.numpy())
    np.testing.assert_allclose(v.numpy(), 6 * x.numpy()[:2])
    assert y.version == d.version == v.version == version + 1
    assert y.requires_grad and y.grad_fn.name == "multiply"
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 6.0, 6.0])


def test_every_recorded_inplace_form_changes_the_storage():
    """PyTorch: `y += z`, `y[idx] = v`, `zero_()`, `copy_()` all write into y's storage."""
    x, z = leaf([1.0, 2.0]), leaf([10.0, 20.0])
    forms = {
        "iadd": (lambda y: y.__iadd__(z), lambda a: a + z.numpy()),
        "setitem": (lambda y: y.__setitem__(0, z[1]), lambda a: np.array([20.0, a[1]])),
        "zero_": (lambda y: y.zero_(), lambda a: np.zeros(2)),
        "copy_": (lambda y: y.copy_(z), lambda a: z.numpy()),
    }
    for name, (change, expected) in forms.items():
        y = x * 1
        alias = y.detach()
        before = y.numpy().copy()
        change(y)
        np.testing.assert_allclose(alias.numpy(), expected(before), err_msg=name)
        assert y.requires_grad, name


def test_a_saved_value_changed_in_place_is_caught():
    """PyTorch `test_inplace_*` 'one of the variables needed for gradient computation has
    been modified by an inplace operation': saved inputs and saved outputs alike."""
    x = leaf([1.0, 2.0])
    y = x * 2
    z = (y * y).sum()  # saves y
    y.mul_(2)
    with pytest.raises(cad.SavedValueModifiedError, match="modified in place"):
        z.backward()
    e = cad.exp(x)  # saves its output
    e.add_(1)
    with pytest.raises(cad.SavedValueModifiedError):
        e.sum().backward()
    h = x * 2
    z = (h * h).sum()
    h[0:1].mul_(3)  # through a view: the same storage, the same counter
    with pytest.raises(cad.SavedValueModifiedError):
        z.backward()


@pytest.mark.parametrize("packing", ["keep", "aliasing hooks"])
def test_an_inplace_op_keeps_the_value_it_needs_itself(packing):
    """PyTorch saves `original_self` for in-place ops whose rule needs it: y.mul_(w) then
    backward works, with d/dw = y before the change (x * 3 here), also when a packer keeps
    the very array it was given."""
    x, w = leaf([1.0, 2.0]), leaf([5.0, 7.0])
    y = x * 3
    if packing == "keep":
        y.mul_(w)
        y.mul_(w)  # y = 3 x w^2
    else:
        with cad.saved_values_hooks(lambda a: a, lambda a: a):
            y.mul_(w)
            y.mul_(w)
    y.sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 6 * x.numpy() * w.numpy())
    np.testing.assert_allclose(x.grad.numpy(), 3 * w.numpy() ** 2)


def test_retain_grad_then_inplace_stores_the_gradient_of_the_new_version():
    """PyTorch `test_retain_grad_inplace`: y.retain_grad(); y.mul_(2) gives y.grad = 1."""
    x = leaf([1.0, 2.0])
    y = x * 1
    y.retain_grad()
    y.mul_(2)
    y.sum().backward()
    np.testing.assert_allclose(y.grad.numpy(), [1.0, 1.0])
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0])


def test_zero_and_copy_of_a_constant_keep_the_history_with_gradient_zero():
    """PyTorch: zero_()/copy_(constant) on a non-leaf leave it requiring grad (ZeroBackward,
    CopyBackwards): the gradient through it is 0, through the other use it is intact."""
    x = leaf([1.0, 2.0])
    y = x * 2
    y.zero_()
    assert y.requires_grad and not y.is_leaf
    (y + x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 1.0])
    x.grad = None
    y = x * 2
    y.copy_(3.0)
    assert y.requires_grad
    np.testing.assert_allclose(y.numpy(), [3.0, 3.0])
    (y * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 3.0])


def test_copy_of_a_tensor_sends_the_gradient_to_the_source():
    """PyTorch `test_copy_`: y.copy_(src) differentiates into src, and y's old history gets
    no gradient (its old value is gone)."""
    x, w = leaf([1.0, 2.0]), leaf([3.0, -1.0])
    y = x * 2
    y.copy_(w * w)
    (y * y).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 4 * w.numpy() ** 3)
    assert x.grad is None or not x.grad.numpy().any()


def test_inplace_cannot_change_the_shape():
    """PyTorch: 'output with shape [2] doesn't match the broadcast shape [2, 2]'."""
    y = leaf([1.0, 2.0]) * 1
    with pytest.raises(cad.ShapeError, match="cannot change the shape"):
        y += leaf(np.ones((2, 2)))
    c = cad.tensor(np.ones(2))  # not recorded: the same rule
    with pytest.raises(cad.ShapeError, match="cannot change the shape"):
        c.add_(np.ones((2, 2)))
    np.testing.assert_array_equal(c.numpy(), [1.0, 1.0])


# ----------------------------------------------------------------- 3. in-place on views
def test_inplace_on_a_view_rebases_the_base():
    """PyTorch `test_inplace_on_view_backward`: v = y[0:2]; v.mul_(3) changes y, and the
    gradient to y's inputs reflects it; the view itself is re-derived from the new base."""
    x = leaf([1.0, 2.0, 3.0, 4.0])
    y = x * 2
    v = y[0:2]
    v.mul_(3)
    np.testing.assert_allclose(y.numpy(), [6.0, 12.0, 6.0, 8.0])
    (y * y).sum().backward(retain_graph=True)
    np.testing.assert_allclose(x.grad.numpy(), 2 * y.numpy() * [6, 6, 2, 2])
    x.grad = None
    (v * v).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2 * 6.0 * 6, 2 * 12.0 * 6, 0.0, 0.0])  # v = 6 x


def _view_program(x, w):
    y = x * x
    y[1:3].mul_(w)  # a view of a non-leaf, scaled by a differentiable tensor
    m = (y * 1).reshape((2, 2)).T  # transpose of a reshape
    m[0].add_(cad.sin(w))  # column 0 of the 2x2, via two view primitives
    return m * y.reshape((2, 2))


def test_inplace_on_views_gradcheck_second_order():
    """HIPS autograd `check_grads(order=2)` through in-place updates of nested views."""
    x, w = leaf([0.3, -0.7, 1.1, 0.5]), leaf([1.3, -0.4])
    assert cad.testing.gradcheck(_view_program, [x, w], order=2)


def test_other_views_follow_the_base_after_an_inplace_change():
    """PyTorch regenerates a view's grad_fn when its base changed in place."""
    x = leaf([1.0, 2.0, 3.0])
    y = x * 2
    a, b = y[0:2], y[1:3]
    a.mul_(5)  # y = [10 x0, 10 x1, 2 x2]
    (b * 1).sum().backward()
    np.testing.assert_allclose(b.numpy(), [20.0, 6.0])
    np.testing.assert_allclose(x.grad.numpy(), [0.0, 10.0, 2.0])


def test_inplace_on_a_view_of_a_constant_makes_it_differentiable():
    """PyTorch: h = zeros(3); h[0:2].add_(a) gives h a history (CopySlices)."""
    a = leaf([1.0, 2.0])
    h = cad.tensor(np.zeros(3))
    rest = h[1:3]
    h[0:2].add_(a * a)
    assert h.requires_grad
    (h * cad.tensor(np.array([1.0, 10.0, 100.0]))).sum().backward(retain_graph=True)
    np.testing.assert_allclose(a.grad.numpy(), [2.0, 40.0])
    assert rest.requires_grad  # re-derived from the new base
    np.testing.assert_allclose(rest.numpy(), [4.0, 0.0])


def test_inplace_on_views_that_are_not_views_or_cannot_be_written():
    """PyTorch: advanced indexing copies (the base is untouched); a view of a leaf that
    requires grad, or of an expanded tensor, cannot be modified in place."""
    x = leaf([1.0, 2.0, 3.0])
    y = x * 2
    c = y[np.array([0, 2])]
    c.mul_(10)
    np.testing.assert_allclose(y.numpy(), 2 * x.numpy())
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(cad.InplaceError, match="view of a leaf"):
        x[0:2].mul_(2)
    wide = cad.broadcast_to(x * 1, (2, 3))
    with pytest.raises(cad.InplaceError, match="broadcast_to"):
        wide.mul_(2)


# ----------------------------------------------------------------- 5. custom Function extras
class _ScaleInPlace(cad.Function):
    """forward modifies its input in place (PyTorch `test_mark_dirty`-style)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        x.mul_(k)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


def test_mark_dirty_rebases_the_modified_input():
    """PyTorch `test_dirty_tensors`-style: the returned input is the same tensor, modified,
    with the function as its history; values saved from it before are caught."""
    x = leaf([1.0, 2.0])
    y = x * 2
    alias = y.detach()
    z = (y * y).sum()  # saves y before the change
    out = _ScaleInPlace.apply(y, 3.0)
    assert out is y and y.grad_fn.name == "_ScaleInPlace"
    np.testing.assert_allclose(alias.numpy(), 6 * x.numpy())
    (y * 1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 6.0])
    with pytest.raises(cad.SavedValueModifiedError):
        z.backward()
    with pytest.raises(cad.InplaceError, match="leaf tensor that requires grad"):
        _ScaleInPlace.apply(leaf([1.0]), 2.0)


def test_mark_dirty_misuse_is_reported():
    """PyTorch: a dirty tensor must be an input, and be returned."""

    class NotReturned(cad.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

    class NotAnInput(cad.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 1
            ctx.mark_dirty(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(cad.BackwardError, match="did not return"):
        NotReturned.apply(leaf([1.0]) * 1)
    with pytest.raises(cad.BackwardError, match="not one of its inputs"):
        NotAnInput.apply(leaf([1.0]) * 1)


class _SortWithIndices(cad.Function):
    """Two outputs, the second (the permutation) not differentiable."""

    @staticmethod
    def forward(ctx, x):
        order = np.argsort(x.numpy())
        ctx.order = order
        values = cad.tensor(x.numpy()[order])
        indices = cad.tensor(order.astype(np.float64))
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx, g_values, g_indices):
        ctx.seen = g_indices
        grad = np.zeros_like(g_values.numpy())
        grad[ctx.order] = g_values.numpy()
        return cad.tensor(grad)


def test_mark_non_differentiable_outputs_do_not_require_grad():
    """PyTorch `test_mark_non_differentiable`: the marked output does not require grad and
    backward gets zeros for it."""
    x = leaf([3.0, 1.0, 2.0])
    values, indices = _SortWithIndices.apply(x)
    assert values.requires_grad and not indices.requires_grad
    (values * cad.tensor(np.array([1.0, 10.0, 100.0]))).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [100.0, 1.0, 10.0])
    assert values.grad_fn.op.ctx.seen.numpy().tolist() == [0.0, 0.0, 0.0]


def test_set_materialize_grads_false_passes_none():
    """PyTorch `test_set_materialize_grads`: backward gets None for an unused output."""
    seen = []

    class Two(cad.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, ga, gb):
            seen.append((ga is None, gb is None))
            return ga * 2 if ga is not None else None

    x = leaf([1.0])
    a, _ = Two.apply(x)
    a.sum().backward()
    assert seen == [(False, True)] and x.grad.item() == 2.0


class _CubeOnce(cad.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    @cad.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


def test_once_differentiable_gives_first_order_and_refuses_second():
    """PyTorch `test_once_differentiable`: first order works (also under create_graph), a
    second order through it raises instead of silently giving 0."""
    x = leaf([0.5, -2.0])
    _CubeOnce.apply(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 3 * x.numpy() ** 2)
    (g,) = cad.grad(_CubeOnce.apply(x).sum(), [x], create_graph=True)
    np.testing.assert_allclose(g.numpy(), 3 * x.numpy() ** 2)
    with pytest.raises(cad.BackwardError, match="once_differentiable"):
        cad.grad(g.sum(), [x])


def test_array_indexing_copies_so_changing_the_copy_leaves_its_source_alone() -> None:
    """PyTorch/numpy: `y[[0, 2]]` is a copy (not a view): an in-place change to it neither
    changes `y` nor bumps `y`'s version, so a value saved from `y` stays valid."""
    x = cad.tensor([1.0, 2.0, 3.0], dtype="float64", requires_grad=True)
    y = x * 2.0
    z = y[[0, 2]]
    mask = y[np.array([True, False, True])]
    s = (y * y).sum()
    with cad.no_grad():
        z.mul_(3.0)
        mask.add_(1.0)
    assert y.version == 0 and y.tolist() == [2.0, 4.0, 6.0]
    s.backward()
    np.testing.assert_array_equal(x.grad.numpy(), 8.0 * np.array([1.0, 2.0, 3.0]))
    w = x[0:2]  # a slice still is a view
    assert w.version == x.version
