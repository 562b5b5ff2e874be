"""Autograd semantics as PyTorch users expect them, every error path included."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import checkpoint_ad as cad


def leaf(values, dtype="float64"):
    return cad.tensor(np.asarray(values, dtype=dtype), requires_grad=True)


# ----------------------------------------------------------------- tensor construction
def test_tensor_dtypes_follow_the_rules():
    assert cad.tensor([1, 2]).dtype == np.float32
    assert cad.tensor(3.0).dtype == np.float32
    assert cad.tensor(np.arange(3)).dtype == np.arange(3).dtype
    assert cad.tensor(np.ones(2, dtype=np.float64)).dtype == np.float64
    assert cad.tensor([1, 2], dtype="float64").dtype == np.float64


def test_tensor_attributes():
    x = cad.tensor(np.ones((2, 3)), requires_grad=True)
    assert x.shape == (2, 3) and x.ndim == 2 and x.numel() == 6 and x.device == "cpu"
    assert x.is_leaf and x.grad_fn is None and x.grad is None
    y = x * 2
    assert not y.is_leaf and y.grad_fn.name == "multiply"
    assert isinstance(y.numpy(), np.ndarray)
    assert cad.tensor(2.5).item() == 2.5
    d = y.detach()
    assert not d.requires_grad and d.is_leaf


def test_integer_tensors_cannot_require_grad():
    with pytest.raises(cad.DTypeError, match="floating-point"):
        cad.tensor(np.arange(3), requires_grad=True)


def test_requires_grad_cannot_be_cleared_on_non_leaf():
    y = leaf([1.0]) * 2
    with pytest.raises(cad.BackwardError, match="detach"):
        y.requires_grad = False


def test_item_needs_one_element():
    with pytest.raises(ValueError, match="exactly one element"):
        cad.tensor([1.0, 2.0]).item()


def test_unknown_device_and_missing_gpu_are_clear():
    with pytest.raises(cad.DeviceError, match="unknown device"):
        cad.tensor([1.0], device="tpu")
    if cad.backend.cupy_or_none() is None:
        with pytest.raises(cad.DeviceError, match="no CUDA GPU"):
            cad.tensor([1.0], device="cuda")


def test_mixing_array_libraries_is_rejected():
    strict = pytest.importorskip("array_api_strict")
    a = cad.tensor(np.ones(2))
    b = cad.tensor(strict.ones(2, dtype=strict.float64))
    with pytest.raises(cad.DeviceError, match="different devices"):
        a + b


def test_shape_errors_name_the_op_and_the_shapes():
    a, b = leaf(np.ones((2, 3))), leaf(np.ones((4, 5)))
    with pytest.raises(cad.ShapeError, match=r"matmul: inner dimensions differ.*\[2, 3\]"):
        a @ b
    with pytest.raises(cad.ShapeError, match=r"'add' cannot run on inputs"):
        a + b
    with pytest.raises(cad.ShapeError, match="cannot reshape"):
        a.reshape((4, 2))


# ----------------------------------------------------------------- backward and .grad
def test_backward_accumulates_into_leaf_grad():
    x = leaf([1.0, 2.0])
    (x * x).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2 + 3, 4 + 3])


def test_intermediates_get_grad_only_when_retained():
    x = leaf([1.0, 2.0])
    h = x * 3
    k = x * 4
    h.retain_grad()
    (h * k).sum().backward()
    np.testing.assert_allclose(h.grad.numpy(), k.numpy())
    assert k.grad is None


def test_non_scalar_backward_needs_a_gradient():
    y = leaf([1.0, 2.0]) * 2
    with pytest.raises(cad.BackwardError, match="pass gradient="):
        y.backward()
    x = leaf([1.0, 2.0])
    (x * 2).backward(gradient=cad.tensor(np.array([1.0, 10.0])))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 20.0])
    with pytest.raises(cad.ShapeError, match="must match"):
        (x * 2).backward(gradient=cad.tensor(np.ones(3)))


def test_backward_on_tensor_without_history_is_an_error():
    with pytest.raises(cad.BackwardError, match="does not require grad"):
        cad.tensor([1.0]).sum().backward()


def test_second_backward_through_freed_tape_says_retain_graph():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward()
    with pytest.raises(cad.BackwardError, match="retain_graph=True"):
        y.backward()


def test_retain_graph_allows_a_second_backward():
    x = leaf([1.0, 2.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 8.0])


def test_gradients_keep_the_leaf_dtype_under_promotion():
    x = cad.tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    w = cad.tensor(np.full(3, 2.0), requires_grad=True)  # float64
    (x * w).sum().backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float64


# ----------------------------------------------------------------- grad()
def test_grad_returns_and_fills_nothing():
    x, w = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    gx, gw = cad.grad((x * w).sum(), [x, w])
    np.testing.assert_allclose(gx.numpy(), [3.0, 4.0])
    np.testing.assert_allclose(gw.numpy(), [1.0, 2.0])
    assert x.grad is None and w.grad is None


def test_grad_with_respect_to_an_intermediate():
    x = leaf([1.0, 2.0])
    h = x * 3
    (gh,) = cad.grad((h * h).sum(), [h])
    np.testing.assert_allclose(gh.numpy(), 2 * h.numpy())


def test_grad_of_a_single_tensor_returns_a_tuple_like_torch_autograd_grad():
    """torch.autograd.grad always returns a tuple, so `(g,) = grad(loss, x)` unpacks it; a bare
    tensor would unpack along its first axis instead (a (1, 3) x gave g of shape (3,))."""
    x = cad.tensor(np.ones((1, 3)), requires_grad=True)
    result = cad.grad((x * x).sum(), x)
    assert isinstance(result, tuple) and len(result) == 1
    (g,) = result
    assert g.shape == (1, 3)
    np.testing.assert_array_equal(g.numpy(), 2 * np.ones((1, 3)))
    assert isinstance(cad.grad((x * x).sum(), [x]), tuple)


def test_grad_unused_input():
    x, z = leaf([1.0]), leaf([5.0])
    y = (x * 2).sum()
    with pytest.raises(cad.BackwardError, match="allow_unused=True"):
        cad.grad(y, [x, z], retain_graph=True)
    gx, gz = cad.grad(y, [x, z], allow_unused=True)
    assert gz is None and gx.item() == 2.0


def test_grad_argument_errors():
    x = leaf([1.0])
    with pytest.raises(cad.BackwardError, match="does not require grad"):
        cad.grad((x * 2).sum(), [cad.tensor([1.0])])
    with pytest.raises(ValueError, match="grad_outputs has 2 entries"):
        cad.grad((x * 2).sum(), [x], grad_outputs=[None, None])
    with pytest.raises(TypeError, match="must be a Tensor"):
        cad.grad((x * 2).sum(), [np.ones(1)])
    with pytest.raises(ValueError, match="at least one"):
        cad.grad((x * 2).sum(), [])


def test_grad_with_grad_outputs_and_several_outputs():
    x = leaf([1.0, 2.0])
    a, b = x * 2, x * x
    (gx,) = cad.grad([a, b], [x], grad_outputs=[cad.tensor(np.ones(2)), cad.tensor(np.ones(2))])
    np.testing.assert_allclose(gx.numpy(), 2 + 2 * x.numpy())


# ----------------------------------------------------------------- modes
def test_no_grad_and_enable_grad_as_context_and_decorator():
    x = leaf([1.0])
    with cad.no_grad():
        assert not (x * 2).requires_grad
        with cad.enable_grad():
            assert (x * 2).requires_grad

    @cad.no_grad()
    def f(t):
        return t * 2

    assert not f(x).requires_grad
    assert cad.is_grad_enabled()


def test_inference_tensors_cannot_be_saved_for_backward():
    x = leaf([1.0, 2.0])
    with cad.inference_mode():
        frozen = cad.tensor(np.ones(2)) * 3
    assert not frozen.requires_grad
    with pytest.raises(cad.InplaceError, match="inference tensor"):
        x * frozen
    (x + frozen).sum().backward()  # nothing needs saving: fine
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 1.0])


# ----------------------------------------------------------------- in-place and versions
def test_inplace_bumps_the_version_counter():
    x = cad.tensor(np.ones(2))
    v = x.version
    x.add_(1)
    x += 1
    x[0] = 5.0
    assert x.version == v + 3
    np.testing.assert_allclose(x.numpy(), [5.0, 3.0])


def test_modifying_a_saved_value_raises_at_backward():
    w = leaf([1.0, 2.0])
    x = cad.tensor(np.array([3.0, 4.0]))
    y = (x * w).sum()  # saves x for dy/dw
    x.mul_(2)
    with pytest.raises(cad.SavedValueModifiedError, match=r"'multiply'.*modified in place"):
        y.backward()


def test_modifying_a_view_of_a_saved_value_is_caught():
    w = leaf([1.0, 2.0])
    x = cad.tensor(np.array([3.0, 4.0]))
    y = (x * w).sum()
    x.detach().zero_()
    with pytest.raises(cad.SavedValueModifiedError):
        y.backward()


def test_inplace_on_leaf_requiring_grad_is_refused_but_allowed_under_no_grad():
    w = leaf([1.0, 2.0])
    with pytest.raises(cad.InplaceError, match="no_grad"):
        w.add_(1)
    with cad.no_grad():
        w.sub_(0.5)
    np.testing.assert_allclose(w.numpy(), [0.5, 1.5])


def test_inplace_on_non_leaf_is_differentiated():
    x = leaf([1.0, 2.0])
    h = x * 2
    h.mul_(x)  # h = 2 x^2
    h += 1
    h.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * x.numpy())


def test_setitem_builds_differentiable_tensors():
    a, b = leaf([1.0, 2.0]), leaf([3.0])
    h = cad.tensor(np.zeros(3))
    h[0:2] = a * 2
    h[2] = b[0] * b[0]
    (h * cad.tensor(np.array([1.0, 10.0, 100.0]))).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [2.0, 20.0])
    np.testing.assert_allclose(b.grad.numpy(), [600.0])


def test_inplace_on_a_view_is_recorded_through_its_base():
    x = leaf([1.0, 2.0])
    h = x * 2
    h[0:1].add_(x[0:1])  # h = [3 x0, 2 x1]
    h.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 2.0])


def test_inplace_on_a_view_of_a_leaf_that_requires_grad_is_refused():
    x = leaf([1.0, 2.0])
    with pytest.raises(cad.InplaceError, match="view of a leaf"):
        x[0:1].add_(1.0)


def test_copy_and_zero():
    x = leaf([1.0, 2.0])
    h = (x * 2).clone()
    h.copy_(x * x)
    h.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * x.numpy())
    z = cad.tensor(np.ones(2))
    z.zero_()
    np.testing.assert_allclose(z.numpy(), [0.0, 0.0])


# ----------------------------------------------------------------- higher order
def test_second_derivative_and_hessian_vector_product():
    x = leaf([0.5, -1.0, 2.0])
    y = (x**3).sum()
    (g,) = cad.grad(y, [x], create_graph=True)
    np.testing.assert_allclose(g.numpy(), 3 * x.numpy() ** 2)
    v = cad.tensor(np.array([1.0, 0.0, 2.0]))
    (hv,) = cad.grad((g * v).sum(), [x])
    np.testing.assert_allclose(hv.numpy(), 6 * x.numpy() * v.numpy())


def test_backward_create_graph_then_grad_of_grad():
    x = leaf(1.5)
    cad.tanh(x).backward(create_graph=True)
    first = x.grad
    assert first.requires_grad
    (second,) = cad.grad(first, [x])
    t = np.tanh(1.5)
    np.testing.assert_allclose(second.item(), -2 * t * (1 - t * t))


def test_third_order():
    x = leaf(0.7)
    y = cad.sin(x)
    (d1,) = cad.grad(y, [x], create_graph=True)
    (d2,) = cad.grad(d1, [x], create_graph=True)
    (d3,) = cad.grad(d2, [x])
    np.testing.assert_allclose(d3.item(), -np.cos(0.7))


# ----------------------------------------------------------------- custom functions
class Cube(cad.Function):
    @staticmethod
    def forward(ctx, x, scale=1.0):
        ctx.scale = scale
        ctx.save_for_backward(x)
        return x * x * x * scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x * x * ctx.scale, None


class ExpWithOutput(cad.Function):
    @staticmethod
    def forward(ctx, x):
        y = cad.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_custom_function_gradients_and_higher_order():
    x = leaf([1.0, 2.0])
    Cube.apply(x, 2.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 6 * x.numpy() ** 2)
    z = leaf(0.3)
    (d1,) = cad.grad(ExpWithOutput.apply(z), [z], create_graph=True)
    (d2,) = cad.grad(d1, [z])
    np.testing.assert_allclose(d2.item(), np.exp(0.3))
    assert cad.testing.gradcheck(lambda t: Cube.apply(t, 1.5), [leaf([0.2, -0.4])])


def test_custom_function_saved_tensors_go_through_the_saving_path():
    seen = []
    x = leaf([1.0, 2.0])
    with cad.saved_values_hooks(lambda a: seen.append(a.shape) or a, lambda a: a):
        y = Cube.apply(x).sum()
    assert seen == [(2,)]
    y.backward()
    assert y.grad_fn is not None


def test_custom_function_wrong_gradient_count_is_reported():
    class Bad(cad.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g, g

    with pytest.raises(cad.BackwardError, match="returned 2 gradients"):
        Bad.apply(leaf([1.0])).sum().backward()


def test_custom_function_wrong_gradient_shape_is_reported():
    class Bad(cad.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return cad.tensor(np.ones(5))

    with pytest.raises(cad.ShapeError, match="gradient of shape"):
        Bad.apply(leaf([1.0])).sum().backward()


def test_custom_function_must_return_tensors():
    class Bad(cad.Function):
        @staticmethod
        def forward(ctx, x):
            return 3.0

    with pytest.raises(TypeError, match="must return Tensors"):
        Bad.apply(leaf([1.0]))


# ----------------------------------------------------------------- GradientTape
def test_one_shot_gradient_tape_frees_itself():
    x = leaf([1.0, 2.0])
    with cad.GradientTape() as tape:
        y = (x * x).sum()
    assert [e.op for e in tape.entries] == ["multiply", "sum"]
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [2.0, 4.0])
    assert x.grad is None
    with pytest.raises(cad.BackwardError, match="persistent=True"):
        tape.gradient(y, x)


def test_persistent_gradient_tape_answers_repeatedly():
    x, z = leaf([1.0, 2.0]), leaf([3.0])
    with cad.GradientTape(persistent=True) as tape:
        y = (x * x).sum()
    for _ in range(3):
        gx, gz = tape.gradient(y, [x, z])
        np.testing.assert_allclose(gx.numpy(), [2.0, 4.0])
        assert gz is None
    tape.release()
    with pytest.raises(cad.BackwardError, match="released"):
        tape.gradient(y, x)


def test_gradient_tape_watch_and_misuse():
    c = cad.tensor(np.array([2.0]))
    with cad.GradientTape() as tape:
        tape.watch(c)
        y = (c * c).sum()
        with pytest.raises(cad.BackwardError, match="after its `with` block"):
            tape.gradient(y, c)
    np.testing.assert_allclose(tape.gradient(y, c).numpy(), [4.0])
    with pytest.raises(TypeError):
        tape.watch(np.ones(1))


# ----------------------------------------------------------------- tape inspection
def test_tape_listing_shows_ops_shapes_saved_bytes_and_origin():
    x = cad.tensor(np.ones((4, 3), dtype=np.float32), requires_grad=True)
    w = cad.tensor(np.ones((3, 2), dtype=np.float32), requires_grad=True)
    with cad.record_origins():  # lines are kept where asked for (or under a profiler)
        y = cad.tanh(x @ w).sum()
    view = cad.tape_of(y)
    ops = [e.op for e in view]
    assert ops == ["matmul", "tanh", "sum"]
    matmul, tanh_entry = view[0], view[1]
    assert matmul.output_shapes == ((4, 2),)
    assert {s.name for s in matmul.saved} == {"a", "b"}
    assert matmul.saved_nbytes == 4 * 3 * 4 + 3 * 2 * 4
    assert tanh_entry.form == "output" and tanh_entry.saved_nbytes == 4 * 2 * 4
    assert "test_semantics.py" in matmul.origin
    assert view.saved_nbytes == 48 + 24 + 32
    assert "matmul" in view.table() and "bytes saved" in repr(view)


def test_a_buffer_saved_by_two_entries_is_stored_once():
    x = cad.tensor(np.ones(1000), requires_grad=True)
    h = cad.tanh(x)  # saves its output h
    y = (h * h).sum()  # saves h twice more (as a and b)
    assert cad.tape_of(y).saved_nbytes == 8000


# ----------------------------------------------------------------- the saving path
def test_every_saved_value_of_a_model_passes_through_a_custom_packer():
    packed, unpacked = [], []

    class Box:
        def __init__(self, a):
            self.a = a

    def pack(a):
        packed.append(id(a))
        return Box(a.copy())

    def unpack(box):
        unpacked.append(box)
        return box.a

    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((4, 4)), requires_grad=True)
    h = cad.tensor(rng.standard_normal((2, 4)))
    with cad.saved_values_hooks(pack, unpack):
        for _ in range(3):
            h = cad.tanh(h @ w)
        loss = cad.log_softmax(h, axis=1).sum()
    # no saved slot holds anything but the packer's boxes
    for entry in cad.tape_of(loss)._entries:
        for slot in entry.slots:
            assert isinstance(slot.buffer.packed, Box)
    n_buffers = len({id(s.buffer) for e in cad.tape_of(loss)._entries for s in e.slots})
    assert len(packed) == n_buffers
    loss.backward()
    assert unpacked  # the sweep read through unpack


def test_packer_contract_violation_is_reported():
    x = leaf([1.0, 2.0])
    with cad.saved_values_hooks(lambda a: a, lambda a: a[:1]):
        y = (x * x).sum()
    with pytest.raises(cad.BackwardError, match="broke its contract"):
        y.backward()


def test_use_packer_rejects_non_packers():
    with pytest.raises(TypeError, match="not a packer"), cad.use_packer(object()):
        pass


# ----------------------------------------------------------------- no leaks
def test_nothing_retained_after_an_undifferentiated_forward():
    x = cad.tensor(np.ones(100), requires_grad=True)
    y = x
    for _ in range(50):
        y = cad.tanh(y) * 1.01
    saved = [weakref.ref(slot.buffer.packed) for entry in cad.tape_of(y)._entries
             for slot in entry.slots if slot.name == "out"]  # what each tanh kept
    assert len(saved) == 50 and all(ref() is not None for ref in saved)
    gc.disable()
    try:
        del y
        assert all(ref() is None for ref in saved)  # freed by reference counting alone
    finally:
        gc.enable()


def test_nothing_retained_by_a_packer_after_an_undifferentiated_forward():
    gc.collect()
    before = cad.saved.live_buffer_count()
    x = cad.tensor(np.ones(100), requires_grad=True)
    with cad.saved_values_hooks(lambda a: a * 1, lambda a: a):
        y = x
        for _ in range(50):
            y = cad.tanh(y) * 1.01
    assert cad.saved.live_buffer_count() > before
    del y
    assert cad.saved.live_buffer_count() == before  # freed by reference counting alone


def test_a_100k_op_chain_runs_forward_and_backward():
    x = cad.tensor(np.array([0.5]), requires_grad=True)
    y = x
    for _ in range(100_000):
        y = y * 0.99999
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [0.99999**100_000], rtol=1e-9)
