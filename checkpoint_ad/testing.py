"""Gradient checking against finite differences, public so users can test their own functions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .autograd import grad
from .backend import namespace
from .errors import DTypeError, GradcheckError
from .grad_mode import enable_grad
from .ops import concatenate, reshape, sum, zeros_like
from .tensor import Tensor


def _scalarised(fn: Callable[..., Tensor], weights: Any) -> Callable[..., Tensor]:
    def scalar(*xs: Tensor) -> Tensor:
        return sum(fn(*xs) * weights)

    return scalar


def _random_like(rng: np.random.Generator, t: Tensor) -> Any:
    xp = namespace(t._data)
    return xp.asarray(rng.standard_normal(t.shape), dtype=t.dtype)


# Inputs with at most this many elements in all get every Jacobian column checked (one finite
# difference per element): a wrong value in one element of a backward rule is caught for
# certain, which a few random directions cannot promise (a 1e-3 error in one of 100 elements
# moves a random directional derivative by about 1e-4 of its size, inside the tolerance).
# Larger inputs get RANDOM_DIRECTIONS random directions only.
FULL_CHECK_MAX_ELEMENTS = 256
RANDOM_DIRECTIONS = 2


def _directions(xs: list[Tensor], rng: np.random.Generator) -> Iterator[tuple[str, list[Any]]]:
    """(what, one direction per input): each element alone for small inputs, then random."""
    if int(np.sum([x.numel() for x in xs])) <= FULL_CHECK_MAX_ELEMENTS:  # `sum` is the op here
        for i, x in enumerate(xs):
            xp = namespace(x._data)
            for k in range(x.numel()):
                basis = np.zeros(x.numel())
                basis[k] = 1.0
                where = tuple(int(j) for j in np.unravel_index(k, x.shape))
                yield (f"element {list(where)} of inputs[{i}]",
                       [xp.asarray(basis.reshape(x.shape) if j == i else np.zeros(y.shape),
                                   dtype=y.dtype) for j, y in enumerate(xs)])
    for trial in range(RANDOM_DIRECTIONS):
        yield f"random direction {trial}", [_random_like(rng, x) for x in xs]


def _check_first_order(
    fn: Callable[..., Tensor],
    xs: list[Tensor],
    rng: np.random.Generator,
    eps: float,
    atol: float,
    rtol: float,
    label: str,
) -> None:
    out = fn(*xs)
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: the function must return a Tensor, got {type(out).__name__}")
    weights = Tensor._wrap(_random_like(rng, out))
    scalar = _scalarised(fn, weights)
    if out.requires_grad:
        grads = grad(sum(out * weights), xs, allow_unused=True)
    else:  # the output does not depend on the inputs: every derivative is zero
        grads = [None] * len(xs)
    analytic_grads = [None if g is None else np.asarray(g.numpy()) for g in grads]
    for what, directions in _directions(xs, rng):
        analytic = 0.0
        for g, v in zip(analytic_grads, directions):
            if g is not None:
                analytic += float(np.sum(g * np.asarray(v)))
        plus = [Tensor._wrap(x._data + eps * v).requires_grad_() for x, v in zip(xs, directions)]
        minus = [Tensor._wrap(x._data - eps * v).requires_grad_() for x, v in zip(xs, directions)]
        numeric = (scalar(*plus).item() - scalar(*minus).item()) / (2 * eps)
        if not abs(analytic - numeric) <= atol + rtol * abs(numeric):
            raise GradcheckError(
                f"gradcheck failed at {label} along {what}: the backward rules give a "
                f"derivative of {analytic!r}, finite differences give {numeric!r} "
                f"(difference {abs(analytic - numeric):.3g}, tolerance "
                f"{atol + rtol * abs(numeric):.3g}); the vjp rule of an op in the function "
                "disagrees with its forward"
            )


def _gradient_function(fn: Callable[..., Tensor], weights_seed: int) -> Callable[..., Tensor]:
    """x -> all first derivatives of <fn(x), w>, flattened into one vector (differentiable)."""

    def first_derivatives(*xs: Tensor) -> Tensor:
        rng = np.random.default_rng(weights_seed)
        with enable_grad():
            out = fn(*xs)
            weights = Tensor._wrap(_random_like(rng, out))
            grads = [None] * len(xs)
            if out.requires_grad:
                grads = grad(sum(out * weights), list(xs), create_graph=True, allow_unused=True)
        flat = [
            reshape(g if g is not None else zeros_like(x), (-1,)) for g, x in zip(grads, xs)
        ]
        return concatenate(flat)

    return first_derivatives


def gradcheck(
    fn: Callable[..., Tensor],
    inputs: Sequence[Tensor],
    order: int = 2,
    eps: float = 1e-6,
    atol: float = 1e-6,
    rtol: float = 1e-4,
    seed: int = 0,
) -> bool:
    """Check `fn`'s derivatives up to `order` against central finite differences.

    Each order is checked in float64 with a random output weighting: along every input
    element in turn when the inputs hold at most `FULL_CHECK_MAX_ELEMENTS` elements in all
    (so one wrong element of a gradient is found), and along two random directions. Returns
    True, or raises `GradcheckError` saying which order and element disagreed and by how much.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([0.3, -1.2], dtype="float64", requires_grad=True)
    >>> cad.testing.gradcheck(lambda x: cad.tanh(x) * x, [x])
    True
    """
    xs = list(inputs)
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"gradcheck: inputs[{i}] must be a Tensor, got {type(x).__name__}")
        if str(x.dtype) != "float64":
            raise DTypeError(
                f"gradcheck: inputs[{i}] is {x.dtype}; finite differences need float64 inputs "
                "to be accurate, convert with cad.tensor(x, dtype='float64')"
            )
    if order < 1:
        raise ValueError(f"gradcheck: order must be 1 or more, got {order}")
    leaves = [Tensor._wrap(x._data).requires_grad_() for x in xs]
    rng = np.random.default_rng(seed)
    current = fn
    for level in range(1, order + 1):
        _check_first_order(current, leaves, rng, eps, atol, rtol, f"order {level}")
        if level < order:
            current = _gradient_function(current, seed + level)
    return True
