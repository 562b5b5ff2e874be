"""Every differentiable primitive against finite differences, at orders 1 and 2, in float64.

Each op family is checked over every combination of shapes, axes, keepdims, broadcasting and
argument kinds (tensor, Python scalar, raw array, constant tensor), in the style of HIPS
autograd's `check_grads`/`combo_check`. Inputs are drawn away from the points where an op is not
differentiable (divisors near 0, kinks of relu/abs/clip, ties of maximum/minimum).

Beyond finite differences: every backward *form* of a primitive is forced and checked; float32
gradients are compared with float64 ones; a 2-layer MLP and an unrolled RNN are compared with
backward passes derived by hand in numpy; a subset runs on `array_api_strict` (proving the engine
makes no numpy-only call) and, where a GPU is present, on cupy.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import backend
from checkpoint_ad.ops import elementwise, linalg, normalizing, reductions
from checkpoint_ad.ops import shape as shape_ops
from checkpoint_ad.tape import Primitive

SEED = 20240617


# ----------------------------------------------------------------- helpers
def leaf(array: Any) -> cad.Tensor:
    return cad.tensor(np.asarray(array, dtype=np.float64), requires_grad=True)


def const(array: Any) -> cad.Tensor:
    return cad.tensor(np.asarray(array, dtype=np.float64))


def check(fn: Any, *inputs: cad.Tensor) -> None:
    """Orders 1 and 2 against central finite differences along random directions."""
    if any(x.ndim == 0 for x in inputs):
        # gradcheck perturbs a 0-d input into a numpy scalar that the engine then rejects
        # (see test_gradcheck_takes_0d_inputs); a reshape hands the op under test a 0-d array
        # again, as a user's 0-d tensor would
        inner = fn
        fn = lambda *ts: inner(*(cad.reshape(t, ()) if t.ndim == 0 else t for t in ts))
    assert cad.testing.gradcheck(fn, list(inputs), order=2)


def same_values(fn: Any, reference: Any, *arrays: np.ndarray) -> None:
    """The forward on tensors equals `reference` computed by numpy on the same values (a
    gradient check alone would accept a wrong forward with a matching wrong rule)."""
    got = fn(*(const(a) for a in arrays)).numpy()
    want = np.asarray(reference(*arrays))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def away_from(
    rng: np.random.Generator, shape: tuple[int, ...], points: tuple[float, ...] = (0.0,),
    gap: float = 0.15, span: float = 1.5,
) -> np.ndarray:
    """Uniform values in [-span, span], each at least `gap` from every one of `points`."""
    values = rng.uniform(-span, span, size=shape)
    while True:
        close = np.zeros(values.shape, dtype=bool)
        for p in points:
            close |= np.abs(values - p) < gap
        if not close.any():
            return values
        values = np.where(close, rng.uniform(-span, span, size=shape), values)


def draw(rng: np.random.Generator, shape: tuple[int, ...], domain: str) -> np.ndarray:
    """Values for one argument: 'any', 'positive' (0.5..2) or 'nonzero' (|x| in 0.5..2)."""
    if domain == "any":
        return rng.standard_normal(shape)
    magnitude = rng.uniform(0.5, 2.0, size=shape)
    if domain == "positive":
        return magnitude
    if domain == "nonzero":
        return magnitude * rng.choice([-1.0, 1.0], size=shape)
    raise ValueError(domain)


def untied(rng: np.random.Generator, a: np.ndarray, shape_b: tuple[int, ...]) -> np.ndarray:
    """Values for b whose every broadcast pair with `a` differs by at least 0.05."""
    while True:
        b = rng.standard_normal(shape_b)
        if np.min(np.abs(a - b), initial=np.inf) >= 0.05:
            return b


@dataclass(frozen=True)
class FormPicker(cad.strategies.Strategy):
    """A lossless packer that also forces which backward form each primitive records."""

    kind: str

    def pack(self, array: Any) -> Any:
        return array

    def unpack(self, packed: Any) -> Any:
        return packed

    def choose_form(self, prim: Primitive) -> Any:
        return prim.form(self.kind) or prim.forms[0]


# ================================================================= binary elementwise
def _where(cond: np.ndarray) -> Any:
    return lambda a, b: cad.where(cond, a, b)


# name -> (function, operator or None, domain of a, domain of b); b 'untied' means away from a.
BINARY = {
    "add": (cad.add, operator.add, "any", "any"),
    "subtract": (cad.subtract, operator.sub, "any", "any"),
    "multiply": (cad.multiply, operator.mul, "any", "any"),
    "divide": (cad.divide, operator.truediv, "any", "nonzero"),
    "power": (cad.power, operator.pow, "positive", "any"),
    "maximum": (cad.maximum, None, "any", "untied"),
    "minimum": (cad.minimum, None, "any", "untied"),
    "where": (None, None, "any", "any"),
}
NUMPY_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
                "divide": np.divide, "power": np.power, "maximum": np.maximum,
                "minimum": np.minimum}
SHAPE_PAIRS = [((), (3,)), ((3,), ()), ((2, 3), (3,)), ((2, 1), (1, 3)), ((4, 1, 3), (2, 3)),
               ((2, 3), (2, 3))]
# How the two operands are passed: both tensors through the function or the operator; one
# tensor with the other a constant tensor; one tensor with the other a raw numpy array.
PAIR_MODES = ["function", "operator", "a_only", "b_only", "ndarray_left", "ndarray_right"]
BINARY_PARAMS = [
    pytest.param(name, shapes, mode, id=f"{name}-{shapes}-{mode}")
    for name in BINARY for shapes in SHAPE_PAIRS for mode in PAIR_MODES
    if mode != "operator" or BINARY[name][1] is not None
]


def _binary_setup(name: str, shape_a: tuple, shape_b: tuple, rng: np.random.Generator) -> tuple:
    function, op, domain_a, domain_b = BINARY[name]
    a = draw(rng, shape_a, domain_a)
    b = untied(rng, a, shape_b) if domain_b == "untied" else draw(rng, shape_b, domain_b)
    reference = NUMPY_BINARY.get(name)
    if name == "where":
        cond = rng.random(np.broadcast_shapes(shape_a, shape_b)) < 0.5
        function, reference = _where(cond), (lambda x, y: np.where(cond, x, y))
    return function, op, reference, a, b


@pytest.mark.parametrize(("name", "shapes", "mode"), BINARY_PARAMS)
def test_binary_broadcasting(name: str, shapes: tuple, mode: str) -> None:
    rng = np.random.default_rng(SEED)
    function, op, reference, a, b = _binary_setup(name, *shapes, rng)
    call = op if (op is not None and mode != "function") else function
    if mode == "function":
        same_values(function, reference, a, b)
        check(function, leaf(a), leaf(b))
    elif mode == "operator":
        check(op, leaf(a), leaf(b))
    elif mode == "a_only":
        check(lambda x: call(x, const(b)), leaf(a))
    elif mode == "b_only":
        check(lambda y: call(const(a), y), leaf(b))
    elif mode == "ndarray_left":  # numpy defers to the tensor's reflected operator
        check(lambda y: call(a, y), leaf(b))
    else:
        check(lambda x: call(x, b), leaf(a))


# name -> (tensor on the left, tensor on the right, domain of the tensor); the scalar is 0.7.
def _scalar_cases(rng: np.random.Generator, shape: tuple) -> dict[str, tuple]:
    cond = rng.random(shape) < 0.5
    return {
        "add": (lambda x: x + 0.7, lambda x: 0.7 + x, "any"),
        "subtract": (lambda x: x - 0.7, lambda x: 0.7 - x, "any"),
        "multiply": (lambda x: x * 0.7, lambda x: 0.7 * x, "any"),
        "divide": (lambda x: x / 0.7, lambda x: 0.7 / x, "nonzero"),
        "power": (lambda x: x**1.7, lambda x: 0.7**x, "positive"),
        "maximum": (lambda x: cad.maximum(x, 0.7), lambda x: cad.maximum(0.7, x), "untied"),
        "minimum": (lambda x: cad.minimum(x, 0.7), lambda x: cad.minimum(0.7, x), "untied"),
        "where": (lambda x: cad.where(cond, x, 0.7), lambda x: cad.where(cond, 0.7, x), "any"),
    }


@pytest.mark.parametrize("side", ["tensor_left", "scalar_left"])
@pytest.mark.parametrize("shape", [(), (3,), (2, 3)], ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_with_python_scalar(name: str, shape: tuple, side: str) -> None:
    rng = np.random.default_rng(SEED)
    left, right, domain = _scalar_cases(rng, shape)[name]
    x = away_from(rng, shape, (0.7,)) if domain == "untied" else draw(rng, shape, domain)
    check(left if side == "tensor_left" else right, leaf(x))


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_elementwise_extreme_ties_share_the_gradient(name: str) -> None:
    a_values = np.array([[0.5, -1.0, 2.0], [3.0, 3.0, -4.0]])
    b_values = np.array([0.5, 1.0, -4.0])
    a, b = leaf(a_values), leaf(b_values)
    ga, gb = cad.grad(cad.sum(getattr(cad, name)(a, b)), [a, b])
    wins = {"maximum": np.greater, "minimum": np.less}[name]
    tie = 0.5 * (a_values == b_values)
    np.testing.assert_allclose(ga.numpy(), wins(a_values, b_values) + tie)
    np.testing.assert_allclose(gb.numpy(), (wins(b_values, a_values) + tie).sum(axis=0))


@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=str)
@pytest.mark.parametrize("exponent", [2, 3, -1])
def test_integer_power_of_negative_base(shape: tuple, exponent: int) -> None:
    x = draw(np.random.default_rng(SEED), shape, "nonzero")
    check(lambda t: t**exponent, leaf(x))


def test_python_scalars_keep_the_tensor_dtype() -> None:
    x = cad.tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    for y in (x + 1.5, 1.5 - x, x * 2, 2 / x, x**2.0, 2.0**x, cad.maximum(x, 0.5)):
        assert y.dtype == np.float32


# ================================================================= unary elementwise
UNARY = {
    # name -> (function, numpy reference, domain); 'kink' draws values away from 0, 'clip' away
    # from +-0.5.
    "exp": (cad.exp, np.exp, "any"),
    "log": (cad.log, np.log, "positive"),
    "sin": (cad.sin, np.sin, "any"),
    "cos": (cad.cos, np.cos, "any"),
    "tanh": (cad.tanh, np.tanh, "any"),
    "sigmoid": (cad.sigmoid, lambda x: np.exp(-np.logaddexp(0.0, -x)), "any"),
    "relu": (cad.relu, lambda x: np.maximum(x, 0.0), "kink"),
    "sqrt": (cad.sqrt, np.sqrt, "positive"),
    "abs": (cad.abs, np.abs, "kink"),
    "negative": (cad.negative, np.negative, "any"),
    "erf": (cad.erf, np.vectorize(math.erf), "any"),
    "gelu": (cad.gelu, lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
             "any"),
    "clip_low": (lambda x: cad.clip(x, low=-0.5), lambda x: np.maximum(x, -0.5), "clip"),
    "clip_high": (lambda x: cad.clip(x, high=0.5), lambda x: np.minimum(x, 0.5), "clip"),
    "clip_both": (lambda x: cad.clip(x, -0.5, 0.5), lambda x: np.clip(x, -0.5, 0.5), "clip"),
}


def _unary_input(rng: np.random.Generator, shape: tuple, domain: str) -> np.ndarray:
    if domain == "kink":
        return away_from(rng, shape, (0.0,))
    if domain == "clip":
        return away_from(rng, shape, (-0.5, 0.5))
    return draw(rng, shape, domain)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3)], ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name: str, shape: tuple) -> None:
    fn, reference, domain = UNARY[name]
    x = _unary_input(np.random.default_rng(SEED), shape, domain)
    same_values(fn, reference, x)
    check(fn, leaf(x))


@pytest.mark.parametrize(
    "method", ["exp", "log", "sin", "cos", "tanh", "sigmoid", "relu", "sqrt", "abs"]
)
def test_unary_methods_and_operators_match_functions(method: str) -> None:
    x = leaf(draw(np.random.default_rng(SEED), (2, 3), "positive"))
    np.testing.assert_array_equal(getattr(x, method)().numpy(), getattr(cad, method)(x).numpy())
    np.testing.assert_array_equal((-x).numpy(), cad.negative(x).numpy())
    np.testing.assert_array_equal(abs(x).numpy(), cad.abs(x).numpy())
    np.testing.assert_array_equal(x.clip(0.7, 1.2).numpy(), cad.clip(x, 0.7, 1.2).numpy())


def test_sigmoid_is_finite_and_differentiable_at_large_magnitudes() -> None:
    x = leaf([-800.0, -40.0, 40.0, 800.0])
    y = cad.sigmoid(x)
    (g,) = cad.grad(cad.sum(y), [x])
    expected = np.exp(-np.logaddexp(0.0, -x.numpy()))
    assert np.all(np.isfinite(y.numpy())) and np.all(np.isfinite(g.numpy()))
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-14, atol=0)
    np.testing.assert_allclose(g.numpy(), expected * (1 - expected), rtol=1e-12, atol=0)


def test_clip_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="at least one"):
        cad.clip(leaf([1.0]))


# ================================================================= reductions
REDUCTIONS = {
    "sum": cad.sum, "mean": cad.mean, "max": cad.max, "min": cad.min, "logsumexp": cad.logsumexp,
}


def _np_logsumexp(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    return np.log(np.sum(np.exp(x), axis=axis, keepdims=keepdims))


NUMPY_REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min,
                    "logsumexp": _np_logsumexp}
AXES = [None, 0, 1, -1, (0, 2)]


@pytest.mark.parametrize("keepdims", [True, False])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction(name: str, axis: Any, keepdims: bool) -> None:
    x = np.random.default_rng(SEED).standard_normal((2, 3, 4))
    fn, reference = REDUCTIONS[name], NUMPY_REDUCTIONS[name]
    same_values(lambda t: fn(t, axis=axis, keepdims=keepdims),
                lambda v: reference(v, axis=axis, keepdims=keepdims), x)
    check(lambda t: fn(t, axis=axis, keepdims=keepdims), leaf(x))


@pytest.mark.parametrize(
    ("shape", "axis"), [((), None), ((5,), None), ((5,), -1), ((3, 4), (0, 1))], ids=str
)
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction_low_rank(name: str, shape: tuple, axis: Any) -> None:
    x = np.random.default_rng(SEED).standard_normal(shape)
    same_values(lambda t: REDUCTIONS[name](t, axis=axis),
                lambda v: NUMPY_REDUCTIONS[name](v, axis=axis), x)
    check(lambda t: REDUCTIONS[name](t, axis=axis), leaf(x))


@pytest.mark.parametrize("name", ["max", "min"])
def test_extreme_ties_share_the_gradient(name: str) -> None:
    values = np.array([[1.0, 3.0, 3.0, -2.0], [-2.0, 0.5, -2.0, -2.0]])
    x = leaf(values)
    (g,) = cad.grad(cad.sum(REDUCTIONS[name](x, axis=1)), [x])
    extreme = getattr(np, name)(values, axis=1, keepdims=True)
    hit = values == extreme
    np.testing.assert_allclose(g.numpy(), hit / hit.sum(axis=1, keepdims=True))


@pytest.mark.parametrize(("shape", "axis"), [((2, 3, 4), 0), ((2, 3, 4), -1), ((2, 3, 4), (0, 2)),
                                             ((5,), -1), ((3, 4), 1)], ids=str)
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_family(name: str, shape: tuple, axis: Any) -> None:
    x = np.random.default_rng(SEED).standard_normal(shape)
    fn = getattr(cad, name)
    logp = x - _np_logsumexp(x, axis=axis, keepdims=True)
    want = logp if name == "log_softmax" else np.exp(logp)
    same_values(lambda t: fn(t, axis=axis), lambda v: want, x)
    check(lambda t: fn(t, axis=axis), leaf(x))


def test_softmax_family_is_stable_for_large_inputs() -> None:
    values = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1002.0, -1001.0]])
    x = leaf(values)
    shifted = values - values.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(cad.log_softmax(x, axis=1).numpy(), logp, rtol=1e-12)
    np.testing.assert_allclose(cad.softmax(x, axis=1).numpy(), np.exp(logp), rtol=1e-12)
    lse = values.max(axis=1) + np.log(np.exp(shifted).sum(axis=1))
    np.testing.assert_allclose(cad.logsumexp(x, axis=1).numpy(), lse, rtol=1e-12)
    check(lambda t: cad.log_softmax(t, axis=1), x)


# ================================================================= shape, indexing, joining
def _np_setitem(x: np.ndarray, index: Any, v: np.ndarray) -> np.ndarray:
    out = x.copy()
    out[index] = v
    return out


MASK = np.arange(12).reshape(3, 4) % 3 == 1
SHAPE_CASES = {
    # id -> (input shapes, function, numpy reference)
    "reshape": ([(2, 3, 4)], lambda x: cad.reshape(x, (4, 6)), lambda x: x.reshape(4, 6)),
    "reshape_minus1": ([(2, 3, 4)], lambda x: cad.reshape(x, (3, -1)),
                       lambda x: x.reshape(3, -1)),
    "reshape_flat": ([(2, 3, 4)], lambda x: x.reshape(-1), lambda x: x.reshape(-1)),
    "reshape_to_0d": ([(1, 1)], lambda x: cad.reshape(x, ()), lambda x: x.reshape(())),
    "transpose_default": ([(2, 3, 4)], cad.transpose, np.transpose),
    "transpose_axes": ([(2, 3, 4)], lambda x: cad.transpose(x, (1, 2, 0)),
                       lambda x: np.transpose(x, (1, 2, 0))),
    "transpose_negative_axes": ([(2, 3, 4)], lambda x: x.transpose((-1, 0, 1)),
                                lambda x: np.transpose(x, (-1, 0, 1))),
    "T": ([(2, 3, 4)], lambda x: x.T, lambda x: x.T),
    "matrix_transpose": ([(2, 3, 4)], cad.matrix_transpose, lambda x: np.swapaxes(x, -1, -2)),
    "mT": ([(3, 4)], lambda x: x.mT, lambda x: x.T),
    "expand_dims_int": ([(2, 3)], lambda x: cad.expand_dims(x, 1),
                        lambda x: np.expand_dims(x, 1)),
    "expand_dims_negative": ([(2, 3)], lambda x: cad.expand_dims(x, -1),
                             lambda x: np.expand_dims(x, -1)),
    "expand_dims_tuple": ([(2, 3)], lambda x: cad.expand_dims(x, (0, 3)),
                          lambda x: np.expand_dims(x, (0, 3))),
    "squeeze_all": ([(1, 3, 1, 2)], cad.squeeze, np.squeeze),
    "squeeze_int": ([(1, 3, 1, 2)], lambda x: cad.squeeze(x, 2), lambda x: np.squeeze(x, 2)),
    "squeeze_tuple": ([(1, 3, 1, 2)], lambda x: x.squeeze((0, -2)),
                      lambda x: np.squeeze(x, (0, -2))),
    "getitem_int": ([(3, 4)], lambda x: x[1], lambda x: x[1]),
    "getitem_negative_int": ([(3, 4)], lambda x: x[-1], lambda x: x[-1]),
    "getitem_int_pair": ([(3, 4)], lambda x: x[2, -3], lambda x: x[2, -3]),
    "getitem_slices_steps": ([(5, 6)], lambda x: x[1::2, ::3], lambda x: x[1::2, ::3]),
    "getitem_negative_step": ([(5, 6)], lambda x: x[::-2, 4:0:-1], lambda x: x[::-2, 4:0:-1]),
    "getitem_none": ([(3, 4)], lambda x: x[None, :, None], lambda x: x[None, :, None]),
    "getitem_ellipsis": ([(2, 3, 4)], lambda x: x[..., 1], lambda x: x[..., 1]),
    "getitem_ellipsis_none": ([(2, 3, 4)], lambda x: x[0, ..., None, 1:],
                              lambda x: x[0, ..., None, 1:]),
    "getitem_int_array_repeats": ([(4, 3)], lambda x: x[np.array([0, 2, 0, 0, 3])],
                                  lambda x: x[[0, 2, 0, 0, 3]]),
    "getitem_int_list": ([(4, 3)], lambda x: x[:, [2, 2, 0]], lambda x: x[:, [2, 2, 0]]),
    "getitem_int_arrays_pair": ([(4, 3)], lambda x: x[np.array([0, 1, 0]), np.array([2, 2, 2])],
                                lambda x: x[[0, 1, 0], [2, 2, 2]]),
    "getitem_bool_mask": ([(3, 4)], lambda x: x[MASK], lambda x: x[MASK]),
    "getitem_bool_rows": ([(3, 4)], lambda x: x[np.array([True, False, True])],
                          lambda x: x[[0, 2]]),
    "getitem_bool_tensor": ([(3, 4)], lambda x: x[cad.tensor(MASK)], lambda x: x[MASK]),
    "concatenate_axis0": ([(2, 3), (1, 3), (3, 3)], lambda *xs: cad.concatenate(xs, axis=0),
                          lambda *xs: np.concatenate(xs, axis=0)),
    "concatenate_axis1": ([(2, 3), (2, 1), (2, 2)], lambda *xs: cad.concatenate(xs, axis=1),
                          lambda *xs: np.concatenate(xs, axis=1)),
    "concatenate_axis_neg": ([(2, 2, 3), (2, 2, 1), (2, 2, 2)],
                             lambda *xs: cad.concatenate(xs, axis=-1),
                             lambda *xs: np.concatenate(xs, axis=-1)),
    "stack_axis0": ([(2, 3), (2, 3), (2, 3)], lambda *xs: cad.stack(xs, axis=0),
                    lambda *xs: np.stack(xs, axis=0)),
    "stack_axis_neg": ([(2, 3), (2, 3)], lambda *xs: cad.stack(xs, axis=-1),
                       lambda *xs: np.stack(xs, axis=-1)),
    "broadcast_to": ([(3, 1)], lambda x: cad.broadcast_to(x, (2, 3, 4)),
                     lambda x: np.broadcast_to(x, (2, 3, 4))),
    "broadcast_to_from_0d": ([()], lambda x: cad.broadcast_to(x, (2, 3)),
                             lambda x: np.broadcast_to(x, (2, 3))),
    "sum_to": ([(2, 3, 4)], lambda x: cad.sum_to(x, (3, 1)),
               lambda x: x.sum(axis=(0, 2))[:, None]),
    "copy": ([(2, 3)], cad.copy, np.copy),
    "to_device_cpu": ([(2, 3)], lambda x: cad.to_device(x, "cpu"), np.asarray),
    "setitem_value_and_base": ([(3, 4), (4,)], lambda x, v: cad.setitem(x, 1, v),
                               lambda x, v: _np_setitem(x, 1, v)),
    "setitem_broadcast_slice": ([(3, 4), (1,)], lambda x, v: cad.setitem(x, (slice(None), 2), v),
                                lambda x, v: _np_setitem(x, (slice(None), 2), v)),
}


@pytest.mark.parametrize("case", list(SHAPE_CASES))
def test_shape_ops(case: str) -> None:
    shapes, fn, reference = SHAPE_CASES[case]
    rng = np.random.default_rng(SEED)
    arrays = [rng.standard_normal(s) for s in shapes]
    same_values(fn, reference, *arrays)
    check(fn, *(leaf(a) for a in arrays))


def test_stack_is_one_entry_whatever_it_stacks() -> None:
    """A thousand hidden states stacked are one tape entry, with each input's gradient its
    own slice; tensors of different shapes are refused, saying which."""
    rng = np.random.default_rng(0)
    xs = [cad.tensor(rng.standard_normal((2, 3)), requires_grad=True) for _ in range(1000)]
    for axis in (0, 1, -1):
        y = cad.stack(xs, axis=axis)
        assert len(cad.tape_of(y)) == 1
        weights = rng.standard_normal(y.shape)
        grads = cad.grad((y * cad.tensor(weights)).sum(), xs)
        for i in (0, 17, 999):
            np.testing.assert_array_equal(grads[i].numpy(), np.take(weights, i, axis=axis))
    with pytest.raises(cad.errors.ShapeError, match=r"tensor 2 has shape \[3, 2\]"):
        cad.stack([xs[0], xs[1], cad.tensor(np.zeros((3, 2)))])


def test_repeated_integer_indices_add_up() -> None:
    index = np.array([3, 0, 3, 3, 1])
    x = leaf(np.random.default_rng(SEED).standard_normal((5, 2)))
    weights = np.random.default_rng(1).standard_normal((len(index), 2))
    (g,) = cad.grad(cad.sum(x[index] * weights), [x])
    expected = np.zeros((5, 2))
    for row, w in zip(index, weights):
        expected[row] += w
    np.testing.assert_allclose(g.numpy(), expected, rtol=1e-15)


# ================================================================= matmul and einsum
MATMUL_SHAPES = [
    ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (2, 4, 5)), ((2, 3, 4), (2, 4, 5)),
    ((1, 3, 4), (5, 4, 2)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 5)), ((3, 4), (4,)),
    ((4,), (4,)), ((4,), (2, 4, 3)), ((2, 3, 4), (4,)),
]


@pytest.mark.parametrize("spelling", ["operator", "function", "method"])
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(shapes: tuple, spelling: str) -> None:
    rng = np.random.default_rng(SEED)
    a, b = (leaf(rng.standard_normal(s)) for s in shapes)
    fn = {"operator": operator.matmul, "function": cad.matmul, "method": cad.Tensor.matmul}
    out = fn[spelling](a, b)
    np.testing.assert_allclose(out.numpy(), a.numpy() @ b.numpy(), rtol=1e-14)
    check(fn[spelling], a, b)


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4,)), ((4,), (4,))], ids=str)
def test_matmul_with_one_constant_operand(shapes: tuple) -> None:
    rng = np.random.default_rng(SEED)
    a, b = (rng.standard_normal(s) for s in shapes)
    check(lambda x: x @ b, leaf(a))  # raw numpy array on the right
    check(lambda y: a @ y, leaf(b))  # reflected: numpy array on the left
    check(lambda y: const(a) @ y, leaf(b))


EINSUM_CASES = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->j", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,ij->", [(3, 4), (3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
    ("ijk,k->i", [(2, 3, 4), (4,)]),
    # a named axis of size 1 stretched against a longer one, as numpy allows: the size-1
    # operand's gradient is summed back to size 1 (was a ShapeError in the backward)
    ("ij,ij->ij", [(1, 3), (4, 3)]),
    ("ab,ab->b", [(4, 1), (4, 3)]),
    ("bij,bjk->bik", [(1, 3, 4), (2, 4, 5)]),
]


@pytest.mark.parametrize(("subscripts", "shapes"), EINSUM_CASES,
                         ids=[f"{c[0]} {c[1]}" for c in EINSUM_CASES])
def test_einsum(subscripts: str, shapes: list) -> None:
    rng = np.random.default_rng(SEED)
    xs = [leaf(rng.standard_normal(s)) for s in shapes]
    out = cad.einsum(subscripts, *xs)
    np.testing.assert_allclose(out.numpy(), np.einsum(subscripts, *(x.numpy() for x in xs)),
                               rtol=1e-13)
    check(lambda *ts: cad.einsum(subscripts, *ts), *xs)


def test_einsum_with_one_constant_operand() -> None:
    rng = np.random.default_rng(SEED)
    w = const(rng.standard_normal((4, 5)))
    check(lambda x: cad.einsum("ij,jk->ik", x, w), leaf(rng.standard_normal((3, 4))))


# ================================================================= every backward form
def _primitives() -> list[Primitive]:
    modules = (elementwise, reductions, normalizing, linalg, shape_ops)
    found = {id(v): v for m in modules for v in vars(m).values() if isinstance(v, Primitive)}
    return sorted(found.values(), key=lambda p: p.name)


# primitive name -> (function, input shapes, domain) exercising it
FORM_EXAMPLES = {
    "exp": (cad.exp, [(2, 3)], "any"),
    "tanh": (cad.tanh, [(2, 3)], "any"),
    "sigmoid": (cad.sigmoid, [(2, 3)], "any"),
    "relu": (cad.relu, [(2, 3)], "kink"),
    "sqrt": (cad.sqrt, [(2, 3)], "positive"),
    "softmax": (lambda x: cad.softmax(x, axis=(0, 2)), [(2, 3, 4)], "any"),
    "log_softmax": (lambda x: cad.log_softmax(x, axis=-1), [(2, 3, 4)], "any"),
    "logsumexp": (lambda x: cad.logsumexp(x, axis=1, keepdims=False), [(2, 3, 4)], "any"),
    "divide": (cad.divide, [(2, 3), (3,)], "positive"),
    "expm1": (cad.expm1, [(2, 3)], "any"),
    "tan": (lambda x: cad.tan(cad.tanh(x)), [(2, 3)], "any"),  # inside (-1, 1): far from pi/2
    "attention_softmax": (lambda x: normalizing.attention_softmax(x, 0.7, causal=True),
                          [(2, 3, 4)], "any"),
}
MULTI_FORM = [(p.name, f.kind) for p in _primitives() if len(p.forms) > 1 for f in p.forms]


def test_every_multi_form_primitive_has_an_example() -> None:
    names = {name for name, _ in MULTI_FORM}
    assert names == set(FORM_EXAMPLES)
    expected = {"tanh", "exp", "sigmoid", "relu", "sqrt", "softmax", "log_softmax", "logsumexp",
                "divide"}
    assert expected <= names


def _form_inputs(name: str) -> tuple[Any, list[cad.Tensor]]:
    fn, shapes, domain = FORM_EXAMPLES[name]
    rng = np.random.default_rng(SEED)
    return fn, [leaf(_unary_input(rng, s, domain)) for s in shapes]


@pytest.mark.parametrize(("name", "kind"), MULTI_FORM, ids=[f"{n}-{k}" for n, k in MULTI_FORM])
def test_each_backward_form(name: str, kind: str) -> None:
    fn, xs = _form_inputs(name)
    picker = FormPicker(kind)

    def forced(*ts: cad.Tensor) -> cad.Tensor:
        with cad.use_packer(picker):
            return fn(*ts)

    y = forced(*xs)
    entries = [e for e in cad.tape_of(y) if e.op == name]
    assert entries and all(e.form == kind for e in entries)
    prim = next(p for p in _primitives() if p.name == name)
    needs = prim.form(kind).needs
    assert all({s.name for s in e.saved} == needs for e in entries)
    check(forced, *xs)
    # every lossless form gives the same gradients as the default one
    weights = np.random.default_rng(1).standard_normal(y.shape)
    forced_grads = cad.grad(cad.sum(y * weights), xs)
    default_grads = cad.grad(cad.sum(fn(*xs) * weights), xs)
    for g, d in zip(forced_grads, default_grads):
        np.testing.assert_allclose(g.numpy(), d.numpy(), rtol=1e-13, atol=1e-15)


# ================================================================= coverage of the public ops
NOT_DIFFERENTIABLE = {
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and",
    "logical_or", "logical_not", "isfinite", "sign", "zeros_like", "ones_like",
}
# checked in the float32 tests (a float32 cast cannot be finite-differenced in float64)
CHECKED_ELSEWHERE = {"astype"}
# the ops added for PyTorch/JAX users: tests/test_ops_added.py gradchecks each and checks this list
CHECKED_ELSEWHERE |= {
    "ValuesIndices", "amax", "amin", "arctan", "argmax", "argmin", "argsort", "atan", "cat",
    "chunk", "clamp", "cosh", "cumsum", "diag", "dot", "expm1", "flatten", "flip", "linalg",
    "log1p", "masked_fill", "norm", "outer", "pad", "permute", "prod", "repeat",
    "repeat_interleave", "roll", "sinh", "softplus", "sort", "split", "std", "swapaxes",
    "take_along_axis", "tan", "tensordot", "tile", "trace", "unsqueeze", "var",
}
# the ops added for transformers: tests/test_attention.py gradchecks them (gelu's tanh form too)
CHECKED_IN_TEST_ATTENTION = {"layer_norm", "tril", "triu"}
CHECKED_ELSEWHERE |= CHECKED_IN_TEST_ATTENTION


def _gradchecked_names() -> set[str]:
    names = set(BINARY) | set(REDUCTIONS) | {"softmax", "log_softmax", "matmul", "einsum"}
    names |= {"clip"} | {n for n in UNARY if not n.startswith("clip_")}
    for case in SHAPE_CASES:  # case ids start with the op's name
        names |= {op for op in cad.ops.__all__ if case == op or case.startswith(op + "_")}
    return names


def test_every_public_differentiable_op_is_gradchecked() -> None:
    public = set(cad.ops.__all__)
    assert public - NOT_DIFFERENTIABLE - CHECKED_ELSEWHERE == _gradchecked_names()


@pytest.mark.parametrize("name", sorted(NOT_DIFFERENTIABLE))
def test_non_differentiable_ops_record_nothing(name: str) -> None:
    x = leaf([-1.0, 0.0, 2.0])
    fn = getattr(cad, name)
    arity = 1 if name in {"logical_not", "isfinite", "sign", "zeros_like", "ones_like"} else 2
    args = [x > 0] * arity if name.startswith("logical") else [x] * arity
    out = fn(*args)
    assert not out.requires_grad and out.grad_fn is None


# ================================================================= 0-d values
def test_gradcheck_takes_0d_inputs() -> None:
    assert cad.testing.gradcheck(lambda x: cad.log(x) * x, [leaf(1.5)], order=2)


@pytest.mark.parametrize("via", ["grad", "backward"])
def test_accumulated_0d_gradient_is_usable(via: str) -> None:
    x = leaf(0.5)
    y = x * 2.0 + x * 3.0  # two uses of x: its gradient is a sum
    if via == "grad":
        (g,) = cad.grad(y, [x])
    else:
        y.backward()
        g = x.grad
    np.testing.assert_allclose((g * const(np.ones(3))).numpy(), np.full(3, 5.0))


# ================================================================= float32
FLOAT32_CASES = {
    "tanh": ([(3, 4)], "any", cad.tanh),
    "sigmoid": ([(3, 4)], "any", cad.sigmoid),
    "exp": ([(3, 4)], "any", cad.exp),
    "log": ([(3, 4)], "positive", cad.log),
    "divide": ([(3, 4), (4,)], "positive", cad.divide),
    "power": ([(3, 4), (3, 1)], "positive", cad.power),
    "maximum": ([(3, 4), ()], "any", cad.maximum),
    "logsumexp": ([(2, 3, 4)], "any", lambda x: cad.logsumexp(x, axis=(0, 2))),
    "softmax": ([(3, 4)], "any", lambda x: cad.softmax(x, axis=0)),
    "log_softmax": ([(3, 4)], "any", cad.log_softmax),
    "max": ([(3, 4)], "any", lambda x: cad.max(x, axis=1)),
    "mean": ([(3, 4)], "any", lambda x: cad.mean(x, axis=0, keepdims=True)),
    "matmul": ([(2, 3, 4), (4, 5)], "any", cad.matmul),
    "einsum": ([(3, 4), (4,)], "any", lambda a, b: cad.einsum("ij,j->i", a, b)),
    "getitem": ([(4, 3)], "any", lambda x: x[np.array([0, 0, 3]), 1:]),
    "concatenate": ([(2, 3), (1, 3)], "any", lambda a, b: cad.concatenate([a, b])),
    "astype_round_trip": ([(3, 4)], "any", lambda x: cad.astype(cad.astype(x, "float64") * 3,
                                                              x.dtype)),
}


@pytest.mark.parametrize("name", list(FLOAT32_CASES))
def test_float32_first_derivatives_match_float64(name: str) -> None:
    shapes, domain, fn = FLOAT32_CASES[name]
    rng = np.random.default_rng(SEED)
    arrays = [draw(rng, s, domain) for s in shapes]
    weights = None
    grads = {}
    for dtype in (np.float64, np.float32):
        xs = [cad.tensor(a.astype(dtype), requires_grad=True) for a in arrays]
        y = fn(*xs)
        assert y.dtype == dtype
        if weights is None:
            weights = rng.standard_normal(y.shape)
        cad.sum(y * weights.astype(dtype)).backward()
        for x in xs:
            assert x.grad is not None and x.grad.dtype == dtype
        grads[dtype] = [x.grad.numpy() for x in xs]
    for g32, g64 in zip(grads[np.float32], grads[np.float64]):
        np.testing.assert_allclose(g32, g64, rtol=2e-5, atol=2e-5)


def test_gradients_of_mixed_precision_keep_each_leaf_dtype() -> None:
    rng = np.random.default_rng(SEED)
    x32 = cad.tensor(rng.standard_normal((3,)).astype(np.float32), requires_grad=True)
    w64 = cad.tensor(rng.standard_normal((2, 3)), requires_grad=True)
    cad.sum(cad.tanh(x32 * w64)).backward()
    assert x32.grad.dtype == np.float32 and w64.grad.dtype == np.float64
    expected = (w64.numpy() * (1 - np.tanh(x32.numpy() * w64.numpy()) ** 2)).sum(axis=0)
    np.testing.assert_allclose(x32.grad.numpy(), expected, rtol=1e-6)


# ================================================================= hand-derived references
def _softmax_np(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("kind", ["inputs", "output"])
def test_mlp_matches_hand_derived_backward(kind: str) -> None:
    rng = np.random.default_rng(SEED)
    n, d, hidden, classes = 6, 4, 5, 3
    x = rng.standard_normal((n, d))
    labels = rng.integers(0, classes, size=n)
    params = {"w1": rng.standard_normal((d, hidden)) * 0.5, "b1": rng.standard_normal(hidden),
              "w2": rng.standard_normal((hidden, classes)) * 0.5,
              "b2": rng.standard_normal(classes)}

    # numpy forward and hand-derived backward
    h = np.tanh(x @ params["w1"] + params["b1"])
    p = _softmax_np(h @ params["w2"] + params["b2"])
    loss = -np.mean(np.log(p[np.arange(n), labels]))
    dlogits = (p - np.eye(classes)[labels]) / n
    dh = dlogits @ params["w2"].T
    dz = dh * (1 - h**2)
    expected = {"w2": h.T @ dlogits, "b2": dlogits.sum(axis=0), "w1": x.T @ dz,
                "b1": dz.sum(axis=0), "x": dz @ params["w1"].T}

    ts = {k: leaf(v) for k, v in params.items()}
    tx = leaf(x)
    with cad.use_packer(FormPicker(kind)):
        th = cad.tanh(tx @ ts["w1"] + ts["b1"])
        logp = cad.log_softmax(th @ ts["w2"] + ts["b2"], axis=-1)
        tloss = -cad.mean(logp[np.arange(n), labels])
    np.testing.assert_allclose(tloss.item(), loss, rtol=1e-10, atol=1e-10)
    names = [*ts, "x"]
    grads = cad.grad(tloss, [*ts.values(), tx])
    for name, g in zip(names, grads):
        np.testing.assert_allclose(g.numpy(), expected[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["inputs", "output"])
def test_rnn_matches_hand_derived_bptt(kind: str) -> None:
    rng = np.random.default_rng(SEED)
    steps, batch, d, hidden = 5, 2, 3, 4
    xs = rng.standard_normal((steps, batch, d))
    h0 = rng.standard_normal((batch, hidden)) * 0.5
    w = rng.standard_normal((hidden, hidden)) * 0.5
    u = rng.standard_normal((d, hidden)) * 0.5
    b = rng.standard_normal(hidden) * 0.1

    # numpy forward
    hs = [h0]
    for t in range(steps):
        hs.append(np.tanh(hs[-1] @ w + xs[t] @ u + b))
    loss = sum(h.sum() for h in hs[1:])
    # backpropagation through time, by hand
    dw, du, db = np.zeros_like(w), np.zeros_like(u), np.zeros_like(b)
    dxs = np.zeros_like(xs)
    dh_next = np.zeros_like(h0)
    for t in reversed(range(steps)):
        dh = 1.0 + dh_next  # d loss / d h_{t+1}: its own term plus what flows back from later
        dz = dh * (1 - hs[t + 1] ** 2)
        dw += hs[t].T @ dz
        du += xs[t].T @ dz
        db += dz.sum(axis=0)
        dxs[t] = dz @ u.T
        dh_next = dz @ w.T
    expected = [dw, du, db, dxs, dh_next]

    tw, tu, tb, tx, th0 = leaf(w), leaf(u), leaf(b), leaf(xs), leaf(h0)
    with cad.use_packer(FormPicker(kind)):
        h = th0
        total = None
        for t in range(steps):
            h = cad.tanh(h @ tw + tx[t] @ tu + tb)
            total = cad.sum(h) if total is None else total + cad.sum(h)
    np.testing.assert_allclose(total.item(), loss, rtol=1e-10, atol=1e-10)
    grads = cad.grad(total, [tw, tu, tb, tx, th0])
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-10)


# ================================================================= array_api_strict
@pytest.fixture
def xps() -> Any:
    """array_api_strict: a second, minimal namespace that proves no numpy-only call hides."""
    return pytest.importorskip("array_api_strict")


def _strict_leaf(xps: Any, array: np.ndarray) -> cad.Tensor:
    return cad.tensor(xps.asarray(array, dtype=xps.float64), requires_grad=True)


def _second_derivatives(grads: list[cad.Tensor], xs: list[cad.Tensor]) -> list[Any]:
    """d/dx of sum(g * g) over the first derivatives g (None where nothing depends on x): runs
    the backward rules themselves through the engine."""
    total = cad.sum(cad.concatenate([cad.reshape(g * g, (-1,)) for g in grads]))
    if not total.requires_grad:  # every first derivative is constant
        return [None] * len(xs)
    return cad.grad(total, xs, allow_unused=True)


def _numpy_of(t: Any) -> np.ndarray:
    return np.asarray(t.numpy())


STRICT_CASES = {
    # id -> (input shapes, domain, function); indexes name every axis, as the standard requires
    "add_broadcast": ([(2, 3), (3,)], "any", lambda a, b: a + b),
    "subtract_scalar": ([(2, 3)], "any", lambda a: 1.5 - a),
    "multiply": ([(2, 1), (1, 3)], "any", lambda a, b: a * b),
    "divide": ([(2, 3), (3,)], "positive", lambda a, b: a / b),
    "power": ([(2, 3), (3,)], "positive", lambda a, b: a**b),
    "maximum": ([(2, 3), ()], "any", lambda a, b: cad.maximum(a, b + 5.0)),
    "minimum": ([(2, 3), ()], "any", lambda a, b: cad.minimum(a, b + 5.0)),
    "where": ([(2, 3), (2, 3)], "any", lambda a, b: cad.where(a > b, a, b)),
    "exp_log_sqrt": ([(2, 3)], "positive", lambda x: cad.log(x) * cad.exp(x) + cad.sqrt(x)),
    "trig": ([(2, 3)], "any", lambda x: cad.sin(x) * cad.cos(x)),
    "tanh_sigmoid": ([(2, 3)], "any", lambda x: cad.tanh(x) + cad.sigmoid(x)),
    "relu_abs_neg": ([(2, 3)], "any", lambda x: cad.relu(x) * 2 + cad.abs(x) - x),
    "clip": ([(2, 3)], "any", lambda x: cad.clip(x, -0.5, 0.5) * x),
    "sum_mean": ([(2, 3, 4)], "any", lambda x: cad.sum(x, axis=(0, 2)) * cad.mean(x, axis=(0, 2))),
    "max_min": ([(2, 3, 4)], "any",
                lambda x: cad.max(x, axis=0, keepdims=True) * cad.min(x, axis=-1, keepdims=True)),
    "logsumexp": ([(2, 3, 4)], "any", lambda x: cad.logsumexp(x, axis=(0, 2)) ** 2),
    "softmax": ([(2, 3, 4)], "any", lambda x: cad.softmax(x, axis=1) ** 2),
    "log_softmax": ([(2, 3, 4)], "any", lambda x: cad.log_softmax(x, axis=(0, 2)) ** 2),
    "reshape_transpose": ([(2, 3, 4)], "any", lambda x: cad.reshape(x.T, (4, -1)) ** 2),
    "expand_squeeze": ([(2, 3)], "any", lambda x: cad.squeeze(cad.expand_dims(x, (0, 2))) ** 2),
    "getitem_basic": ([(4, 5)], "any", lambda x: x[1::2, ::-2] * x[-1, ::2]),
    "getitem_none": ([(4, 5)], "any", lambda x: x[None, 1:, None, 2] ** 2),
    "concatenate_stack": ([(2, 3), (2, 3)], "any",
                          lambda a, b: cad.concatenate([a, b * b, a], axis=0)
                          * cad.stack([a, b, a], axis=0).reshape((6, 3))),
    "broadcast_to": ([(3, 1)], "any", lambda x: cad.broadcast_to(x, (2, 3, 4)) ** 2),
    "matmul": ([(2, 3, 4), (4, 5)], "any", lambda a, b: (a @ b) ** 2),
    "matmul_vectors": ([(4,), (4, 2), (4,)], "any", lambda a, w, b: (a @ w) * (a @ b)),
    "mT": ([(2, 3, 4)], "any", lambda x: (x.mT @ x) ** 2),
    "attention_softmax": ([(2, 3, 4)], "any",
                          lambda x: normalizing.attention_softmax(x, 0.7, causal=True) ** 2),
}


@pytest.mark.parametrize("case", list(STRICT_CASES))
def test_array_api_strict_matches_numpy(xps: Any, case: str) -> None:
    shapes, domain, fn = STRICT_CASES[case]
    rng = np.random.default_rng(SEED)
    arrays = [draw(rng, s, domain) for s in shapes]
    results = {}
    for lib in ("numpy", "strict"):
        xs = [leaf(a) if lib == "numpy" else _strict_leaf(xps, a) for a in arrays]
        y = fn(*xs)
        weights = np.random.default_rng(1).standard_normal(y.shape)
        w = cad.tensor(weights) if lib == "numpy" else cad.tensor(xps.asarray(weights))
        grads = cad.grad(cad.sum(y * w), xs, create_graph=True)
        hvp = _second_derivatives(grads, xs)
        if lib == "strict":
            for t in (y, *grads):
                assert type(t.data).__module__.startswith("array_api_strict")
        results[lib] = [_numpy_of(y), *(_numpy_of(g) for g in grads),
                        *(None if h is None else _numpy_of(h) for h in hvp)]
    for got, want in zip(results["strict"], results["numpy"]):
        if want is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_array_api_strict_einsum_is_refused_clearly(xps: Any) -> None:
    x = _strict_leaf(xps, np.ones((2, 3)))
    with pytest.raises(cad.ShapeError, match=r"einsum is not available.*numpy or cupy"):
        cad.einsum("ij->j", x)


def test_array_api_strict_integer_array_index_gradient_is_refused_clearly(xps: Any) -> None:
    values = np.arange(4.0)
    x = _strict_leaf(xps, values)
    y = x[xps.asarray([0, 0, 2])]  # the forward is standard
    np.testing.assert_array_equal(_numpy_of(y), values[[0, 0, 2]])
    with pytest.raises(NotImplementedError, match=r"no scatter-add.*numpy/cupy"):
        cad.grad(cad.sum(y), [x])


def test_strict_values_can_be_saved() -> None:
    strict = pytest.importorskip("array_api_strict")
    x = cad.tensor(strict.asarray([1.0, 2.0], dtype=strict.float64), requires_grad=True)
    (g,) = cad.grad(cad.sum(x * x), [x])
    np.testing.assert_allclose(_numpy_of(g), [2.0, 4.0])


def test_array_api_strict_boolean_mask_gradient(xps: Any) -> None:
    values = np.arange(6.0).reshape(2, 3)
    mask = values % 2 == 0
    x = _strict_leaf(xps, values)
    (g,) = cad.grad(cad.sum(x[xps.asarray(mask)] ** 2), [x])
    np.testing.assert_allclose(_numpy_of(g), np.where(mask, 2 * values, 0.0))


# ================================================================= GPU (cupy)
@pytest.fixture
def cupy() -> Any:
    module = pytest.importorskip("cupy")
    if backend.cupy_or_none() is None:
        pytest.skip("cupy is installed but no CUDA device is visible")
    return module


GPU_CASES = {
    "tanh_divide": ([(3, 4), (4,)], lambda a, b: cad.tanh(a) / (b * b + 1.0)),
    "softmax": ([(2, 3, 4)], lambda x: cad.softmax(x, axis=(0, 2))),
    "logsumexp_max": ([(2, 3, 4)], lambda x: cad.logsumexp(x, axis=1) * cad.max(x, axis=1)),
    "matmul_batched": ([(2, 3, 4), (4, 5)], lambda a, b: a @ b),
    "einsum": ([(3, 4), (4, 5)], lambda a, b: cad.einsum("ij,jk->ik", a, b)),
    "getitem_repeats": ([(4, 3)], lambda x: x[np.array([0, 0, 3, 1]), 1:] ** 2),
    "concatenate": ([(2, 3), (1, 3)], lambda a, b: cad.concatenate([a, b, a], axis=0)),
    "attention_softmax": ([(2, 3, 4)],
                          lambda x: normalizing.attention_softmax(x, 0.7, causal=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_gradients_match_cpu(cupy: Any, case: str) -> None:
    shapes, fn = GPU_CASES[case]
    rng = np.random.default_rng(SEED)
    arrays = [rng.standard_normal(s) for s in shapes]
    results = {}
    for device in ("cpu", "cuda"):
        xs = [cad.tensor(a, dtype="float64", device=device, requires_grad=True) for a in arrays]
        y = fn(*xs)
        assert y.device.startswith(device)
        weights = cad.tensor(np.random.default_rng(1).standard_normal(y.shape), device=device,
                             dtype="float64")
        grads = cad.grad(cad.sum(y * weights), xs, create_graph=True)
        hvp = _second_derivatives(grads, xs)
        results[device] = [y.numpy(), *(g.numpy() for g in grads),
                           *(None if h is None else h.numpy() for h in hvp)]
    for got, want in zip(results["cuda"], results["cpu"]):
        if want is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_cuda_float32_gradients_stay_on_device(cupy: Any) -> None:
    x = cad.tensor(np.linspace(-1, 1, 6).reshape(2, 3), dtype="float32", device="cuda",
                   requires_grad=True)
    cad.sum(cad.tanh(x) * 3).backward()
    assert x.grad.device.startswith("cuda") and x.grad.dtype == cupy.float32
    expected = 3 * (1 - np.tanh(x.numpy()) ** 2)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6)
