"""Gradient checking against finite differences, public so users can test their own functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    for trial in range(2):
        directions = [_random_like(rng, x) for x in xs]
        analytic = 0.0
        for g, v in zip(grads, directions):
            if g is not None:
                analytic += float(np.sum(np.asarray(g.numpy()) * np.asarray(v)))
        plus = [Tensor._wrap(x._data + eps * v).requires_grad_() for x, v in zip(xs, directions)]
        minus = [Tensor._wrap(x._data - eps * v).requires_grad_() for x, v in zip(xs, directions)]
        numeric = (scalar(*plus).item() - scalar(*minus).item()) / (2 * eps)
        if not abs(analytic - numeric) <= atol + rtol * abs(numeric):
            raise GradcheckError(
                f"gradcheck failed at {label} (random direction {trial}): the backward rules "
                f"give a directional derivative of {analytic!r}, finite differences give "
                f"{numeric!r} (difference {abs(analytic - numeric):.3g}, tolerance "
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

    Each order is checked along two random directions with a random output weighting, in
    float64. Returns True, or raises `GradcheckError` saying which order disagreed and by how
    much.

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
