"""Elementwise primitives and their vector-Jacobian rules.

Rules are written with operators and the public functions of this package, so they run on raw
arrays during a plain backward sweep and on Tensors (recorded again) under ``create_graph``.
Broadcasting is undone by the engine for primitives marked ``broadcasts=True``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import device_name, namespace, resolve_dtype
from ..backend import erf as _erf_array
from ..backend import to_device as _move
from ..tape import define, vjp


def _mask(cond: Any, g: Any) -> Any:
    """`g` where `cond` holds, zero elsewhere (no 0 * inf = nan)."""
    return where(cond, g, zeros_like(g))


def _sigmoid(xp: Any, x: Any) -> Any:
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _in_place(g: Any, out: Any) -> Any:
    """The namespace of `g` and `out` where they are arrays (not Tensors, which
    `create_graph` records) of one type, dtype and shape, not 0-d (numpy makes scalars of
    those), else None: a rule may then compute in place in a temporary it made, with the same
    operations in the same order per element (bitwise the same result), in fewer passes over
    memory and with fewer arrays made."""
    kind = type(out)
    if kind is not type(g) or g.dtype != out.dtype or g.shape != out.shape or not out.ndim:
        return None
    if kind is np.ndarray:
        return np
    return namespace(out) if kind.__module__.startswith("cupy") else None


def _tanh_rule(g: Any, out: Any) -> Any:
    """``g * (1 - out * out)``."""
    xp = _in_place(g, out)
    if xp is None:
        return g * (1 - out * out)
    t = out * out
    xp.subtract(1, t, out=t)
    return xp.multiply(g, t, out=t)


def _sigmoid_rule(g: Any, out: Any) -> Any:
    """``g * out * (1 - out)``."""
    xp = _in_place(g, out)
    if xp is None:
        return g * out * (1 - out)
    t = g * out
    return xp.multiply(t, xp.subtract(1, out), out=t)


def _inside(x: Any, low: Any, high: Any) -> Any:
    if low is None:
        return x <= high
    if high is None:
        return x >= low
    return logical_and(x >= low, x <= high)


# ------------------------------------------------------------------ arithmetic
ADD = define("add", lambda xp, a, b: a + b, "a b", [
    {"a": vjp("", lambda g: g), "b": vjp("", lambda g: g)},
], broadcasts=True)
SUBTRACT = define("subtract", lambda xp, a, b: a - b, "a b", [
    {"a": vjp("", lambda g: g), "b": vjp("", lambda g: -g)},
], broadcasts=True)
MULTIPLY = define("multiply", lambda xp, a, b: a * b, "a b", [
    {"a": vjp("b", lambda g, b: g * b), "b": vjp("a", lambda g, a: g * a)},
], broadcasts=True)
DIVIDE = define("divide", lambda xp, a, b: a / b, "a b", [
    {"a": vjp("b", lambda g, b: g / b), "b": vjp("out b", lambda g, out, b: -g * out / b)},
    {"a": vjp("b", lambda g, b: g / b), "b": vjp("a b", lambda g, a, b: -g * (a / b) / b)},
], broadcasts=True)
POWER = define("power", lambda xp, a, b: a**b, "a b", [
    # b == 0 takes exponent 1 (not -1): the factor b makes it 0 either way, and 0 ** -1 = inf
    # would turn 0 * inf into nan at a = 0 (d/da a**0 is 0 everywhere, also at any order)
    {"a": vjp("a b", lambda g, a, b: g * b * a ** where(b == 0, ones_like(b), b - 1)),
     "b": vjp("a out", lambda g, a, out: g * out * log(where(a > 0, a, ones_like(a))))},
], broadcasts=True)
NEGATIVE = define("negative", lambda xp, x: -x, "x", [{"x": vjp("", lambda g: -g)}])
MAXIMUM = define("maximum", lambda xp, a, b: xp.maximum(a, b), "a b", [
    {"a": vjp("a b", lambda g, a, b: where(a > b, g, _mask(a == b, g * 0.5))),
     "b": vjp("a b", lambda g, a, b: where(b > a, g, _mask(a == b, g * 0.5)))},
], broadcasts=True)
MINIMUM = define("minimum", lambda xp, a, b: xp.minimum(a, b), "a b", [
    {"a": vjp("a b", lambda g, a, b: where(a < b, g, _mask(a == b, g * 0.5))),
     "b": vjp("a b", lambda g, a, b: where(b < a, g, _mask(a == b, g * 0.5)))},
], broadcasts=True)
WHERE = define("where", lambda xp, cond, a, b: xp.where(cond, a, b), "cond a b", [
    {"a": vjp("cond", lambda g, cond: _mask(cond, g)),
     "b": vjp("cond", lambda g, cond: where(cond, zeros_like(g), g))},
], broadcasts=True)

# ------------------------------------------------------------- unary: rules from input or output
EXP = define("exp", lambda xp, x: xp.exp(x), "x", [
    {"x": vjp("out", lambda g, out: g * out)},
    {"x": vjp("x", lambda g, x: g * exp(x))},
])
LOG = define("log", lambda xp, x: xp.log(x), "x", [{"x": vjp("x", lambda g, x: g / x)}])
SIN = define("sin", lambda xp, x: xp.sin(x), "x", [{"x": vjp("x", lambda g, x: g * cos(x))}])
COS = define("cos", lambda xp, x: xp.cos(x), "x", [{"x": vjp("x", lambda g, x: -g * sin(x))}])
TANH = define("tanh", lambda xp, x: xp.tanh(x), "x", [
    {"x": vjp("out", _tanh_rule)},
    {"x": vjp("x", lambda g, x: g * (1 - tanh(x) ** 2))},
])
SIGMOID = define("sigmoid", _sigmoid, "x", [
    {"x": vjp("out", _sigmoid_rule)},
    {"x": vjp("x", lambda g, x: g * sigmoid(x) * (1 - sigmoid(x)))},
])
RELU = define("relu", lambda xp, x: xp.where(x > 0, x, xp.zeros_like(x)), "x", [
    {"x": vjp("out", lambda g, out: _mask(out > 0, g))},
    {"x": vjp("x", lambda g, x: _mask(x > 0, g))},
])
SQRT = define("sqrt", lambda xp, x: xp.sqrt(x), "x", [
    {"x": vjp("out", lambda g, out: g / (2 * out))},
    {"x": vjp("x", lambda g, x: g / (2 * sqrt(x)))},
])
ABS = define("abs", lambda xp, x: xp.abs(x), "x", [{"x": vjp("x", lambda g, x: g * sign(x))}])
CLIP = define("clip", lambda xp, x, *, low, high: xp.clip(x, low, high), "x", [
    {"x": vjp("x", lambda g, x, *, low, high: _mask(_inside(x, low, high), g))},
])
COPY = define("copy", lambda xp, x: xp.asarray(x, copy=True), "x", [{"x": vjp("", lambda g: g)}])
ASTYPE = define("astype", lambda xp, x, *, dtype, source: xp.astype(x, dtype), "x", [
    {"x": vjp("", lambda g, *, dtype, source: astype(g, source))},
])
TO_DEVICE = define("to_device", lambda xp, x, *, device, source: _move(x, device), "x", [
    {"x": vjp("", lambda g, *, device, source: to_device(g, source))},
])

# ------------------------------------------------------------------ not differentiable
SIGN = define("sign", lambda xp, x: xp.sign(x), differentiable=False)
ZEROS_LIKE = define("zeros_like", lambda xp, x: xp.zeros_like(x), differentiable=False)
ONES_LIKE = define("ones_like", lambda xp, x: xp.ones_like(x), differentiable=False)
LESS = define("less", lambda xp, a, b: a < b, "a b", differentiable=False)
LESS_EQUAL = define("less_equal", lambda xp, a, b: a <= b, "a b", differentiable=False)
GREATER = define("greater", lambda xp, a, b: a > b, "a b", differentiable=False)
GREATER_EQUAL = define("greater_equal", lambda xp, a, b: a >= b, "a b", differentiable=False)
EQUAL = define("equal", lambda xp, a, b: a == b, "a b", differentiable=False)
NOT_EQUAL = define("not_equal", lambda xp, a, b: a != b, "a b", differentiable=False)
LOGICAL_AND = define("logical_and", lambda xp, a, b: xp.logical_and(a, b), "a b",
                     differentiable=False)
LOGICAL_OR = define("logical_or", lambda xp, a, b: xp.logical_or(a, b), "a b",
                    differentiable=False)
LOGICAL_NOT = define("logical_not", lambda xp, x: xp.logical_not(x), differentiable=False)
ISFINITE = define("isfinite", lambda xp, x: xp.isfinite(x), differentiable=False)


# ------------------------------------------------------------------ public functions
def add(a: Any, b: Any) -> Any:
    """a + b, broadcasting."""
    return ADD(a, b)


def subtract(a: Any, b: Any) -> Any:
    """a - b, broadcasting."""
    return SUBTRACT(a, b)


def multiply(a: Any, b: Any) -> Any:
    """a * b, broadcasting."""
    return MULTIPLY(a, b)


def divide(a: Any, b: Any) -> Any:
    """a / b, broadcasting."""
    return DIVIDE(a, b)


def power(a: Any, b: Any) -> Any:
    """a ** b; the gradient in b is taken as 0 where a <= 0 (log a undefined)."""
    return POWER(a, b)


def negative(x: Any) -> Any:
    return NEGATIVE(x)


def exp(x: Any) -> Any:
    return EXP(x)


def log(x: Any) -> Any:
    return LOG(x)


def sin(x: Any) -> Any:
    return SIN(x)


def cos(x: Any) -> Any:
    return COS(x)


def tanh(x: Any) -> Any:
    return TANH(x)


def sigmoid(x: Any) -> Any:
    """1 / (1 + exp(-x)), computed without overflow for large |x|."""
    return SIGMOID(x)


def relu(x: Any) -> Any:
    """max(x, 0); its gradient at 0 is 0."""
    return RELU(x)


def sqrt(x: Any) -> Any:
    return SQRT(x)


def abs(x: Any) -> Any:
    """|x|; its gradient at 0 is 0."""
    return ABS(x)


def maximum(a: Any, b: Any) -> Any:
    """Elementwise max; where a == b the gradient is split evenly."""
    return MAXIMUM(a, b)


def minimum(a: Any, b: Any) -> Any:
    """Elementwise min; where a == b the gradient is split evenly."""
    return MINIMUM(a, b)


def where(cond: Any, a: Any, b: Any) -> Any:
    """a where cond holds, else b (cond is not differentiated)."""
    return WHERE(cond, a, b)


def clip(x: Any, low: float | None = None, high: float | None = None) -> Any:
    """x limited to [low, high]; the gradient passes where low <= x <= high."""
    if low is None and high is None:
        raise ValueError("clip needs at least one of low and high")
    return CLIP(x, low=low, high=high)


def copy(x: Any) -> Any:
    """A copy of x with its own storage (differentiable)."""
    return COPY(x)


def astype(x: Any, dtype: Any) -> Any:
    """x converted to `dtype`; gradients are converted back."""
    data = getattr(x, "_data", x)
    dtype = resolve_dtype(namespace(data), dtype)
    if data.dtype == dtype:
        return x
    return ASTYPE(x, dtype=dtype, source=data.dtype)


def to_device(x: Any, device: str) -> Any:
    """x moved to `device`; gradients move back."""
    return TO_DEVICE(x, device=device, source=device_name(getattr(x, "_data", x)))


def sign(x: Any) -> Any:
    return SIGN(x)


def zeros_like(x: Any) -> Any:
    return ZEROS_LIKE(x)


def ones_like(x: Any) -> Any:
    return ONES_LIKE(x)


def isfinite(x: Any) -> Any:
    return ISFINITE(x)


def less(a: Any, b: Any) -> Any:
    return LESS(a, b)


def less_equal(a: Any, b: Any) -> Any:
    return LESS_EQUAL(a, b)


def greater(a: Any, b: Any) -> Any:
    return GREATER(a, b)


def greater_equal(a: Any, b: Any) -> Any:
    return GREATER_EQUAL(a, b)


def equal(a: Any, b: Any) -> Any:
    return EQUAL(a, b)


def not_equal(a: Any, b: Any) -> Any:
    return NOT_EQUAL(a, b)


def logical_and(a: Any, b: Any) -> Any:
    return LOGICAL_AND(a, b)


def logical_or(a: Any, b: Any) -> Any:
    return LOGICAL_OR(a, b)


def logical_not(x: Any) -> Any:
    return LOGICAL_NOT(x)


# ------------------------------------------------------------------ added for PyTorch/JAX users
LOG1P = define("log1p", lambda xp, x: xp.log1p(x), "x", [{"x": vjp("x", lambda g, x: g / (1 + x))}])
EXPM1 = define("expm1", lambda xp, x: xp.expm1(x), "x", [
    {"x": vjp("out", lambda g, out: g * (out + 1))},
    {"x": vjp("x", lambda g, x: g * exp(x))},
])
TAN = define("tan", lambda xp, x: xp.tan(x), "x", [
    {"x": vjp("out", lambda g, out: g * (1 + out * out))},
    {"x": vjp("x", lambda g, x: g / cos(x) ** 2)},
])
ARCTAN = define("arctan", lambda xp, x: xp.atan(x) if hasattr(xp, "atan") else xp.arctan(x),
                "x", [{"x": vjp("x", lambda g, x: g / (1 + x * x))}])
SINH = define("sinh", lambda xp, x: xp.sinh(x), "x", [{"x": vjp("x", lambda g, x: g * cosh(x))}])
COSH = define("cosh", lambda xp, x: xp.cosh(x), "x", [{"x": vjp("x", lambda g, x: g * sinh(x))}])


def log1p(x: Any) -> Any:
    """log(1 + x), accurate for tiny x.

    >>> import checkpoint_ad as cad
    >>> round(cad.log1p(cad.tensor(1e-10, dtype="float64")).item() * 1e10, 6)
    1.0
    """
    return LOG1P(x)


def expm1(x: Any) -> Any:
    """exp(x) - 1, accurate for tiny x.

    >>> import checkpoint_ad as cad
    >>> round(cad.expm1(cad.tensor(1e-10, dtype="float64")).item() * 1e10, 6)
    1.0
    """
    return EXPM1(x)


def tan(x: Any) -> Any:
    """Tangent (radians).

    >>> import checkpoint_ad as cad
    >>> round(cad.tan(cad.tensor(0.5)).item(), 4)
    0.5463
    """
    return TAN(x)


def arctan(x: Any) -> Any:
    """Inverse tangent, in (-pi/2, pi/2); PyTorch's ``atan``.

    >>> import checkpoint_ad as cad
    >>> round(cad.arctan(cad.tensor(1.0)).item(), 4)
    0.7854
    """
    return ARCTAN(x)


def sinh(x: Any) -> Any:
    """Hyperbolic sine.

    >>> import checkpoint_ad as cad
    >>> round(cad.sinh(cad.tensor(1.0)).item(), 4)
    1.1752
    """
    return SINH(x)


def cosh(x: Any) -> Any:
    """Hyperbolic cosine.

    >>> import checkpoint_ad as cad
    >>> round(cad.cosh(cad.tensor(1.0)).item(), 4)
    1.5431
    """
    return COSH(x)


atan = arctan


# ------------------------------------------------------------------ for transformers
# gelu is one primitive (not x * Phi(x) composed) so that it saves its input only and computes
# in the input's dtype: composed, the erf form kept about a dozen arrays of the input's size
_SQRT_HALF = math.sqrt(0.5)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_SCALE = math.sqrt(2.0 / math.pi)  # the tanh form: tanh(c * (x + 0.044715 x^3))
_TANH_CUBIC = 0.044715


def _gelu(xp: Any, x: Any, *, approximate: str) -> Any:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + xp.tanh(_TANH_SCALE * (x + _TANH_CUBIC * x * x * x)))
    return 0.5 * x * (1.0 + _erf_array(x * _SQRT_HALF))


def _gelu_rule(g: Any, x: Any, *, approximate: str) -> Any:
    xp = _in_place(g, x)
    if xp is not None:  # arrays: the same operations in place, in 3 temporaries (was 6-7)
        return (_gelu_tanh_rule_in_place(xp, g, x) if approximate == "tanh"
                else _gelu_erf_rule_in_place(xp, g, x))
    if approximate == "tanh":
        t = tanh(_TANH_SCALE * (x + _TANH_CUBIC * x * x * x))
        slope = _TANH_SCALE * (1.0 + 3.0 * _TANH_CUBIC * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope)
    return g * (0.5 * (1.0 + erf(x * _SQRT_HALF)) + x * exp(-0.5 * x * x) * _INV_SQRT_2PI)


def _gelu_tanh_rule_in_place(xp: Any, g: Any, x: Any) -> Any:
    """The tanh form's rule with the expression's operations in its order, in place in three
    arrays it made: a transformer's MLP backward held six or seven of its hidden size here,
    at the peak of a GPT's backward (issue 37's memory-truth row)."""
    t = xp.multiply(_TANH_CUBIC, x)
    t *= x
    t *= x
    xp.add(x, t, out=t)
    t *= _TANH_SCALE
    xp.tanh(t, out=t)  # t
    p = xp.add(1.0, t)
    p *= 0.5  # 0.5 (1 + t)
    xp.multiply(t, t, out=t)
    xp.subtract(1.0, t, out=t)  # 1 - t^2
    q = xp.multiply(0.5, x)
    q *= t
    xp.multiply(3.0 * _TANH_CUBIC, x, out=t)
    t *= x
    xp.add(1.0, t, out=t)
    t *= _TANH_SCALE  # the slope
    q *= t
    p += q
    return xp.multiply(g, p, out=p)


def _gelu_erf_rule_in_place(xp: Any, g: Any, x: Any) -> Any:
    """The erf form's rule likewise (`_gelu_tanh_rule_in_place`)."""
    p = erf(xp.multiply(x, _SQRT_HALF))
    xp.add(1.0, p, out=p)
    p *= 0.5
    q = xp.multiply(-0.5, x)
    q *= x
    xp.exp(q, out=q)
    xp.multiply(x, q, out=q)
    q *= _INV_SQRT_2PI
    p += q
    return xp.multiply(g, p, out=p)


ERF = define("erf", lambda xp, x: _erf_array(x), "x", [
    {"x": vjp("x", lambda g, x: g * _TWO_OVER_SQRT_PI * exp(-(x * x)))},
])
GELU = define("gelu", _gelu, "x", [{"x": vjp("x", _gelu_rule)}])


def erf(x: Any) -> Any:
    """The error function, 2/sqrt(pi) times the integral of exp(-t^2) from 0 to x.

    >>> import checkpoint_ad as cad
    >>> round(cad.erf(cad.tensor(1.0, dtype="float64")).item(), 6)
    0.842701
    """
    return ERF(x)


def gelu(x: Any, approximate: str = "none") -> Any:
    """Gaussian error linear unit x * Phi(x) (Phi the standard normal CDF, through erf), or
    with ``approximate="tanh"`` 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). One
    primitive: it saves its input only, and its result has the input's dtype.

    >>> import checkpoint_ad as cad
    >>> round(cad.gelu(cad.tensor(1.0, dtype="float64")).item(), 6)
    0.841345
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELU(x, approximate=approximate)
