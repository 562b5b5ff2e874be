"""The ops, factories and Tensor methods added so PyTorch/JAX/numpy programs run with renames.

Every new differentiable op: its forward against numpy on the same values, and its gradient
against finite differences at orders 1 and 2 in float64 (over axes/keepdims combinations).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad

RNG = np.random.default_rng(7)


def leaf(a: Any) -> cad.Tensor:
    return cad.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def check(fn: Any, *arrays: np.ndarray) -> None:
    assert cad.testing.gradcheck(fn, [leaf(a) for a in arrays], order=2)


def same(fn: Any, reference: Any, *arrays: np.ndarray) -> None:
    got = fn(*(cad.tensor(a) for a in arrays))
    got = got.numpy() if isinstance(got, cad.Tensor) else np.asarray(got)
    want = np.asarray(reference(*arrays))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


# ================================================================= elementwise
UNARY = {
    "log1p": (cad.log1p, np.log1p, lambda s: RNG.uniform(-0.5, 2.0, s)),
    "expm1": (cad.expm1, np.expm1, lambda s: RNG.standard_normal(s)),
    "tan": (cad.tan, np.tan, lambda s: RNG.uniform(-1.2, 1.2, s)),
    "arctan": (cad.arctan, np.arctan, lambda s: RNG.standard_normal(s)),
    "sinh": (cad.sinh, np.sinh, lambda s: RNG.standard_normal(s)),
    "cosh": (cad.cosh, np.cosh, lambda s: RNG.standard_normal(s)),
}


@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name: str, shape: tuple) -> None:
    fn, reference, draw = UNARY[name]
    x = draw(shape)
    same(fn, reference, x)
    if shape:
        check(fn, x)
    else:  # gradcheck hands 0-d inputs back as numpy scalars: reshape them to 0-d tensors
        check(lambda t: fn(cad.reshape(t, ())), x)


def test_atan_is_arctan() -> None:
    assert cad.atan is cad.arctan


# ================================================================= reductions
AXES = [None, 0, 1, -1, (0, 2)]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
def test_prod(axis: Any, keepdims: bool) -> None:
    x = RNG.uniform(0.5, 1.5, (2, 3, 4)) * RNG.choice([-1.0, 1.0], (2, 3, 4))
    same(lambda t: cad.prod(t, axis=axis, keepdims=keepdims),
         lambda v: np.prod(v, axis=axis, keepdims=keepdims), x)
    check(lambda t: cad.prod(t, axis=axis, keepdims=keepdims), x)


@pytest.mark.parametrize("zeros", [1, 2])
def test_prod_gradient_with_exact_zeros(zeros: int) -> None:
    values = np.array([2.0, 3.0, 5.0, 7.0])
    values[:zeros] = 0.0
    x = leaf(values)
    (g,) = cad.grad(cad.prod(x), [x])
    want = [3.0 * 5.0 * 7.0, 0.0, 0.0, 0.0] if zeros == 1 else [0.0] * 4
    np.testing.assert_allclose(g.numpy(), want)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_cumsum(axis: Any) -> None:
    x = RNG.standard_normal((3, 4))
    same(lambda t: cad.cumsum(t, axis), lambda v: np.cumsum(v, axis), x)
    check(lambda t: cad.cumsum(t, axis), x)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", ["var", "std"])
def test_var_and_std(name: str, axis: Any, ddof: int, keepdims: bool) -> None:
    x = RNG.standard_normal((2, 3, 4))
    ours, theirs = getattr(cad, name), getattr(np, name)
    same(lambda t: ours(t, axis=axis, ddof=ddof, keepdims=keepdims),
         lambda v: theirs(v, axis=axis, ddof=ddof, keepdims=keepdims), x)
    check(lambda t: ours(t, axis=axis, ddof=ddof, keepdims=keepdims), x)


def test_var_torch_keywords() -> None:
    x = RNG.standard_normal((3, 5))
    same(lambda t: cad.var(t, dim=1, keepdim=True, correction=1),
         lambda v: np.var(v, axis=1, keepdims=True, ddof=1), x)
    same(lambda t: cad.std(t, dim=0, unbiased=False), lambda v: np.std(v, axis=0), x)
    with pytest.raises(cad.ShapeError, match="no degrees of freedom"):
        cad.var(cad.tensor([1.0]), ddof=1)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin(name: str, axis: Any, keepdims: bool) -> None:
    x = RNG.standard_normal((3, 4))
    ours, theirs = getattr(cad, name), getattr(np, name)
    same(lambda t: ours(t, axis, keepdims), lambda v: theirs(v, axis, keepdims=keepdims), x)
    assert not ours(leaf(x)).requires_grad


def test_reductions_take_torch_keywords() -> None:
    x = RNG.standard_normal((3, 4))
    for name in ("sum", "mean", "max", "min", "prod"):
        fn, ref = getattr(cad, name), getattr(np, name)
        got = fn(cad.tensor(x), dim=1, keepdim=True)
        values = got.values if name in ("max", "min") else got
        np.testing.assert_allclose(values.numpy(), ref(x, axis=1, keepdims=True))
        method = getattr(cad.tensor(x), name)(dim=0)
        values = method.values if name in ("max", "min") else method
        np.testing.assert_allclose(values.numpy(), ref(x, axis=0))
    with pytest.raises(TypeError, match="both axis=0 and dim=1"):
        cad.sum(cad.tensor(x), axis=0, dim=1)
    with pytest.raises(TypeError, match="both keepdims and keepdim"):
        cad.mean(cad.tensor(x), keepdims=True, keepdim=True)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [None, 0, -1, (0, 2)], ids=str)
@pytest.mark.parametrize("name", ["amax", "amin"])
def test_amax_amin(name: str, dim: Any, keepdim: bool) -> None:
    x = RNG.permutation(24).reshape(2, 3, 4) / 7.0  # no ties: finite differences are exact
    fn = {"amax": cad.amax, "amin": cad.amin}[name]
    same(lambda t: fn(t, dim, keepdim), lambda v: getattr(np, name)(v, axis=dim,
                                                                 keepdims=keepdim), x)
    check(lambda t: fn(t, dim=dim, keepdim=keepdim), x)


@pytest.mark.parametrize("beta", [1.0, 2.5])
def test_softplus(beta: float) -> None:
    x = np.array([-30.0, -2.0, -0.3, 0.4, 3.0, 30.0])
    same(lambda t: cad.softplus(t, beta, threshold=None),
         lambda v: np.logaddexp(0.0, beta * v) / beta, x)
    check(lambda t: cad.softplus(t, beta), x)


def test_max_with_dim_returns_values_and_indices_like_pytorch() -> None:
    x = np.array([[1.0, 9.0, 3.0], [4.0, 2.0, 8.0]])
    values, indices = cad.max(cad.tensor(x), dim=1)
    assert values.tolist() == [9.0, 8.0] and indices.tolist() == [1, 2]
    assert cad.tensor(x).min(dim=0).indices.tolist() == [0, 1, 0]
    t = leaf(x)
    (g,) = cad.grad(cad.sum(t.max(dim=1).values), [t])
    assert g.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    with pytest.raises(cad.ShapeError, match="one dimension"):
        cad.max(cad.tensor(x), dim=(0, 1))


# ================================================================= shape
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)], ids=str)
def test_flip(axis: Any) -> None:
    x = RNG.standard_normal((3, 4))
    same(lambda t: cad.flip(t, axis), lambda v: np.flip(v, axis), x)
    check(lambda t: cad.flip(t, axis) * cad.tensor(np.arange(12.0).reshape(3, 4)), x)


@pytest.mark.parametrize(("shift", "axis"), [(1, None), (-2, 0), (3, 1), ((1, -1), (0, 1))],
                         ids=str)
def test_roll(shift: Any, axis: Any) -> None:
    x = RNG.standard_normal((3, 4))
    same(lambda t: cad.roll(t, shift, axis), lambda v: np.roll(v, shift, axis), x)
    check(lambda t: cad.roll(t, shift, axis) * cad.tensor(np.arange(12.0).reshape(3, 4)), x)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("axis", [0, -1])
def test_sort_and_argsort(axis: int, descending: bool) -> None:
    x = RNG.standard_normal((4, 5))
    ref = np.sort(x, axis)
    ref = np.flip(ref, axis) if descending else ref
    same(lambda t: cad.sort(t, axis, descending), lambda v: ref, x)
    order = np.argsort(-x if descending else x, axis, kind="stable")
    same(lambda t: cad.argsort(t, axis, descending), lambda v: order, x)
    weights = cad.tensor(np.arange(20.0).reshape(4, 5))
    check(lambda t: cad.sort(t, axis, descending) * weights, x)
    _, indices = cad.sort(cad.tensor(x), dim=axis, descending=descending)
    np.testing.assert_array_equal(indices.numpy(), order)


@pytest.mark.parametrize("axis", [0, 1])
def test_take_along_axis_with_repeats_adds_gradients(axis: int) -> None:
    x = RNG.standard_normal((3, 4))
    index = RNG.integers(0, x.shape[axis], (5, 4) if axis == 0 else (3, 6))
    same(lambda t: cad.take_along_axis(t, index, axis),
         lambda v: np.take_along_axis(v, index, axis), x)
    check(lambda t: cad.take_along_axis(t, index, axis) ** 2, x)
    with pytest.raises(cad.ShapeError, match="same rank"):
        cad.take_along_axis(cad.tensor(x), np.array([0, 1]), axis)
    with pytest.raises(cad.ShapeError, match="integer indices"):
        cad.take_along_axis(cad.tensor(x), np.zeros((3, 4)), axis)


@pytest.mark.parametrize(("repeats", "axis"), [(2, None), (3, 0), ([1, 0, 2], 0), (2, -1)],
                         ids=str)
def test_repeat(repeats: Any, axis: Any) -> None:
    x = RNG.standard_normal((3, 2))
    same(lambda t: cad.repeat(t, repeats, axis), lambda v: np.repeat(v, repeats, axis), x)
    check(lambda t: cad.repeat(t, repeats, axis) ** 2, x)


@pytest.mark.parametrize("reps", [2, (2, 1), (1, 3), (2, 1, 2)], ids=str)
def test_tile(reps: Any) -> None:
    x = RNG.standard_normal((3, 2))
    same(lambda t: cad.tile(t, reps), lambda v: np.tile(v, reps), x)
    check(lambda t: cad.tile(t, reps) ** 2, x)


@pytest.mark.parametrize("width", [1, (1, 2), ((0, 1), (2, 0))], ids=str)
def test_pad(width: Any) -> None:
    x = RNG.standard_normal((2, 3))
    same(lambda t: cad.pad(t, width, constant_values=1.5),
         lambda v: np.pad(v, width, constant_values=1.5), x)
    check(lambda t: cad.pad(t, width) ** 2, x)
    with pytest.raises(cad.ShapeError, match="only mode='constant'"):
        cad.pad(cad.tensor(x), 1, mode="reflect")


def test_split_numpy_and_pytorch_meanings() -> None:
    x = RNG.standard_normal((6, 2))
    for got, want in zip(cad.split(cad.tensor(x), 3), np.split(x, 3)):
        np.testing.assert_array_equal(got.numpy(), want)
    for got, want in zip(cad.split(cad.tensor(x), [1, 4]), np.split(x, [1, 4])):
        np.testing.assert_array_equal(got.numpy(), want)
    assert [p.shape[0] for p in cad.split(cad.tensor(x), 4, dim=0)] == [4, 2]
    assert [p.shape[0] for p in cad.tensor(x).split([1, 5])] == [1, 5]
    assert [p.shape[0] for p in cad.chunk(cad.tensor(x), 4)] == [2, 2, 2]
    check(lambda t: cad.concatenate([p * (i + 1.0) for i, p in enumerate(cad.split(t, 3))]), x)
    check(lambda t: cad.stack([p * 2.0 for p in t.chunk(2, 1)]), x)
    with pytest.raises(cad.ShapeError, match="do not divide"):
        cad.split(cad.tensor(x), 4)
    with pytest.raises(cad.ShapeError, match="add up to"):
        cad.split(cad.tensor(x), [1, 2], dim=0)


# ================================================================= linear algebra
@pytest.mark.parametrize(("sa", "sb", "axes"), [
    ((2, 3, 4), (3, 4, 5), 2), ((2, 3), (3, 4), 1), ((3, 2), (4, 3), ((0,), (1,))),
    ((2, 3), (4, 5), 0),
], ids=str)
def test_tensordot(sa: tuple, sb: tuple, axes: Any) -> None:
    a, b = RNG.standard_normal(sa), RNG.standard_normal(sb)
    same(lambda s, t: cad.tensordot(s, t, axes), lambda u, v: np.tensordot(u, v, axes), a, b)
    check(lambda s, t: cad.tensordot(s, t, axes), a, b)


@pytest.mark.parametrize(("sa", "sb"), [((3,), (3,)), ((2, 3), (3,)), ((2, 3), (3, 4)),
                                        ((2, 2, 3), (4, 3, 2)), ((), (3,))], ids=str)
def test_dot(sa: tuple, sb: tuple) -> None:
    a, b = RNG.standard_normal(sa), RNG.standard_normal(sb)
    same(cad.dot, np.dot, a, b)
    if sa:
        check(cad.dot, a, b)


def test_outer() -> None:
    a, b = RNG.standard_normal(3), RNG.standard_normal(4)
    same(cad.outer, np.outer, a, b)
    check(cad.outer, a, b)


@pytest.mark.parametrize("k", [0, 1, -1])
def test_trace_and_diag(k: int) -> None:
    a, m = RNG.standard_normal(3), RNG.standard_normal((3, 4))
    same(lambda t: cad.diag(t, k), lambda v: np.diag(v, k), m)
    same(lambda t: cad.diag(t, k), lambda v: np.diag(v, k), a)
    check(lambda t: cad.diag(t, k), m)
    check(lambda t: cad.diag(t, k), a)
    same(lambda t: cad.trace(t, k), lambda v: np.trace(v, k), m)
    check(lambda t: cad.trace(t, k) ** 2, m)


@pytest.mark.parametrize(("ord", "axis", "keepdims"), [
    (None, None, False), (None, 1, True), (2, 0, False), (1, -1, False), (3, 1, False),
    (np.inf, 1, False), (-np.inf, 0, True), ("fro", (0, 1), False), (0.5, 1, False),
], ids=str)
def test_norm(ord: Any, axis: Any, keepdims: bool) -> None:
    x = RNG.uniform(0.3, 1.5, (3, 4)) * np.array([1.0, -1.0, 1.0, -1.0])
    x[0, 0] = 2.0  # one clear extreme for the inf norms (ties would share the gradient)
    same(lambda t: cad.linalg.norm(t, ord, axis, keepdims),
         lambda v: np.linalg.norm(v, ord, axis, keepdims), x)
    check(lambda t: cad.linalg.norm(t, ord, axis, keepdims), x)
    assert cad.norm is cad.linalg.norm


def test_norm_refusals() -> None:
    with pytest.raises(cad.ShapeError, match="needs an SVD"):
        cad.linalg.norm(cad.ones(2, 2), "nuc")
    with pytest.raises(cad.ShapeError, match="needs one axis"):
        cad.linalg.norm(cad.ones(2, 2, 2), 1)


# ================================================================= Tensor methods and factories
def test_tensor_methods_like_pytorch() -> None:
    x = cad.tensor(np.arange(24.0).reshape(2, 3, 4))
    assert x.size() == (2, 3, 4) and x.size(1) == 3 and x.size(-1) == 4
    assert x.numel() == 24 and x.dim() == 3
    assert x.view(6, 4).shape == (6, 4) and x.view((4, -1)).shape == (4, 6)
    assert x.reshape(3, 8).shape == (3, 8) and x.reshape((3, 8)).shape == (3, 8)
    assert x.unsqueeze(1).shape == (2, 1, 3, 4) and x.unsqueeze(1).squeeze(1).shape == x.shape
    assert x.permute(2, 0, 1).shape == (4, 2, 3) and x.permute((2, 0, 1)).shape == (4, 2, 3)
    np.testing.assert_array_equal(x.transpose(0, 2).numpy(), x.numpy().swapaxes(0, 2))
    np.testing.assert_array_equal(x.transpose(2, 0, 1).numpy(), x.numpy().transpose(2, 0, 1))
    m = cad.tensor(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(m.transpose(0, 1).numpy(), m.numpy().T)
    np.testing.assert_array_equal(m.t().numpy(), m.numpy().T)
    assert x.flatten().shape == (24,) and x.flatten(1).shape == (2, 12)
    assert x.flatten(0, 1).shape == (6, 4)
    assert cad.ones(3, 1).expand(3, 5).shape == (3, 5)
    assert cad.ones(3, 1).expand(2, -1, 4).shape == (2, 3, 4)
    assert x.float().dtype == np.float32 and x.double().dtype == np.float64
    assert x.half().dtype == np.float16
    assert x.to("float32").dtype == np.float32 and x.to(dtype="float32").dtype == np.float32
    assert x.to("cpu") is x and x.to(cad.ones(1)).dtype == np.float32
    np.testing.assert_array_equal(m.repeat(2, 1).numpy(), np.tile(m.numpy(), (2, 1)))
    np.testing.assert_array_equal(m.clamp(min=1, max=4).numpy(), np.clip(m.numpy(), 1, 4))
    filled = m.masked_fill(m.numpy() > 2, -1.0)
    np.testing.assert_array_equal(filled.numpy(), np.where(m.numpy() > 2, -1.0, m.numpy()))
    assert m.cumsum(1).tolist() == np.cumsum(m.numpy(), 1).tolist()
    assert m.argmax(dim=1).tolist() == [2, 2] and m.flip(0).tolist() == m.numpy()[::-1].tolist()
    assert m.prod(dim=1).tolist() == [0.0, 60.0]
    with pytest.raises(IndexError, match="no dimension 3"):
        x.size(3)


def test_methods_are_differentiable() -> None:
    x = RNG.standard_normal((2, 3))
    check(lambda t: t.view(3, 2).unsqueeze(0).permute(2, 0, 1).flatten() * 1.5, x)
    check(lambda t: t.t().expand(2, 3, 2).clamp(-0.5, 0.5).masked_fill(
        np.eye(3, 2, dtype=bool), 2.0) ** 2, x)


def test_factories() -> None:
    assert cad.zeros(2, 3).shape == (2, 3) and cad.zeros((2, 3)).dtype == np.float32
    assert cad.ones([4], dtype="float64").dtype == np.float64
    assert cad.full((2,), 3.0).tolist() == [3.0, 3.0]
    assert cad.empty(3).shape == (3,)
    assert cad.arange(3).dtype == np.int64 and cad.arange(1.0, 2.0, 0.5).tolist() == [1.0, 1.5]
    assert cad.arange(2, 5).tolist() == [2, 3, 4]
    np.testing.assert_allclose(cad.linspace(0, 1, 5).numpy(), np.linspace(0, 1, 5))
    np.testing.assert_array_equal(cad.eye(2, 3).numpy(), np.eye(2, 3))
    leafy = cad.zeros(2, requires_grad=True)
    assert leafy.requires_grad and leafy.is_leaf
    assert cad.randn(3, generator=5).tolist() == cad.randn(3, generator=5).tolist()
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    np.testing.assert_array_equal(cad.rand(4, generator=g1).numpy(),
                                  np.asarray(g2.random(4), dtype=np.float32))
    cad.manual_seed(11)
    a = cad.randn(5)
    cad.manual_seed(11)
    assert cad.randn(5).tolist() == a.tolist()
    base = cad.ones(2, 3, dtype="float64")
    for fn in (cad.zeros_like, cad.ones_like, cad.empty_like, cad.rand_like, cad.randn_like):
        made = fn(base)
        assert made.shape == (2, 3) and made.dtype == np.float64 and not made.requires_grad
    assert cad.full_like(base, 2.0).tolist() == [[2.0] * 3] * 2
    assert cad.zeros_like(base, dtype="float32").dtype == np.float32
    ints = cad.randint(0, 3, (50,), generator=0)
    assert ints.dtype == np.int64 and set(ints.tolist()) == {0, 1, 2}
    assert cad.cat([cad.ones(2), cad.zeros(1)], dim=0).tolist() == [1.0, 1.0, 0.0]


def test_factory_refusals() -> None:
    with pytest.raises(cad.ShapeError, match="non-negative ints"):
        cad.zeros(2, -1)
    with pytest.raises(cad.ShapeError, match="non-negative ints"):
        cad.ones(2.5)
    with pytest.raises(TypeError, match="generator must be"):
        cad.randn(2, generator="seed")
    with pytest.raises(cad.DTypeError, match="only floating-point"):
        cad.arange(3, requires_grad=True)
    with pytest.raises(ValueError, match="step must not be 0"):
        cad.arange(0, 3, 0)
    with pytest.raises(cad.DTypeError, match="floating dtype"):
        cad.randn_like(cad.arange(3))
    with pytest.raises(ValueError, match="high"):
        cad.randint(3, 3, (2,))


# ================================================================= coverage
ADDED_DIFFERENTIABLE = {
    "amax", "amin", "arctan", "atan", "cat", "chunk", "clamp", "cosh", "cumsum", "diag", "dot",
    "expand", "expm1", "flatten", "flip", "log1p", "masked_fill", "norm", "outer", "pad",
    "permute", "prod", "repeat", "repeat_interleave", "roll", "sinh", "softplus", "sort", "split",
    "std", "swapaxes", "take_along_axis", "tan", "tensordot", "tile", "trace", "unsqueeze", "var",
}
ADDED_OTHER = {"ValuesIndices", "argmax", "argmin", "argsort", "linalg"}


def test_every_added_op_is_listed_and_checked_here() -> None:
    """The main gradcheck file leaves these ops to this file; none may slip through."""
    import test_primitives_gradcheck as main

    added = ADDED_DIFFERENTIABLE | ADDED_OTHER
    # "expand" is counted there already: its case names start with "expand_" (expand_dims)
    assert added - {"expand"} == (main.CHECKED_ELSEWHERE - {"astype"}
                                  - main.CHECKED_IN_TEST_ATTENTION)
    with open(__file__) as f:
        source = f.read()
    for name in ADDED_DIFFERENTIABLE:
        assert f"cad.{name}" in source or f".{name}(" in source, name


@pytest.mark.parametrize("name", ["cat", "unsqueeze", "permute", "swapaxes", "expand",
                                  "repeat_interleave", "clamp", "masked_fill"])
def test_pure_renames_are_differentiable(name: str) -> None:
    x = RNG.standard_normal((2, 3))
    fns = {
        "cat": lambda t: cad.cat([t, t * 2.0], 1),
        "unsqueeze": lambda t: cad.unsqueeze(t, 1) * 2.0,
        "permute": lambda t: cad.permute(t, 1, 0) * 2.0,
        "swapaxes": lambda t: cad.swapaxes(t, 0, 1) * 2.0,
        "expand": lambda t: cad.expand(t, 4, 2, 3) * 2.0,
        "repeat_interleave": lambda t: cad.repeat_interleave(t, 2, dim=1) ** 2,
        "clamp": lambda t: cad.clamp(t, min=-0.3) ** 2,
        "masked_fill": lambda t: cad.masked_fill(t, np.eye(2, 3, dtype=bool), 1.0) ** 2,
    }
    check(fns[name], x)


def test_softmax_family_takes_pytorchs_dim_keyword() -> None:
    x = cad.tensor(np.array([[1.0, 2.0], [3.0, 5.0]]))
    np.testing.assert_array_equal(x.softmax(dim=0).numpy(), cad.softmax(x, axis=0).numpy())
    np.testing.assert_array_equal(x.log_softmax(dim=1).numpy(), cad.log_softmax(x).numpy())
    assert cad.logsumexp(x, dim=1, keepdim=True).shape == (2, 1)
    with pytest.raises(TypeError, match="both axis"):
        cad.softmax(x, axis=0, dim=1)
