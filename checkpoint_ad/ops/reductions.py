"""Reductions over axes: sum, mean, max, min."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..errors import ShapeError
from ..tape import define, vjp
from .elementwise import ones_like, where, zeros_like
from .shape import (
    SUM,
    ValuesIndices,
    broadcast_to,
    flip,
    kept_shape,
    normalize_axes,
    reshape,
    squeeze,
    take_along_axis,
    unreduce,
)

__all__ = ["SUM", "amax", "amin", "kept_shape", "max", "mean", "min", "sum", "unreduce"]


def _extreme_rule(g: Any, x: Any, out: Any, *, axis: Any, keepdims: Any, source: Any) -> Any:
    """Gradient of max/min: to the extreme elements, split evenly among ties."""
    hit = x == reshape(out, kept_shape(source, axis))
    counts = SUM(where(hit, ones_like(x), zeros_like(x)), axis=axis, keepdims=True, source=source)
    share = reshape(g, kept_shape(source, axis)) / counts
    return where(hit, broadcast_to(share, source), zeros_like(x))


MEAN = define("mean", lambda xp, x, *, axis, keepdims, source: xp.mean(
    x, axis=axis, keepdims=keepdims), "x", [
    {"x": vjp("", lambda g, *, axis, keepdims, source: unreduce(g, source, axis)
              / math.prod(source[a] for a in axis))},
])
MAX = define("max", lambda xp, x, *, axis, keepdims, source: xp.max(
    x, axis=axis, keepdims=keepdims), "x", [{"x": vjp("x out", _extreme_rule)}])
MIN = define("min", lambda xp, x, *, axis, keepdims, source: xp.min(
    x, axis=axis, keepdims=keepdims), "x", [{"x": vjp("x out", _extreme_rule)}])


def _reduce(prim: Any, x: Any, axis: Any, keepdims: bool) -> Any:
    source = tuple(getattr(x, "_data", x).shape)
    axes = normalize_axes(axis, len(source), prim.name)
    return prim(x, axis=axes, keepdims=bool(keepdims), source=source)


def sum(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
        dim: int | Sequence[int] | None = None, keepdim: bool | None = None) -> Any:
    """Sum over `axis` (all axes by default); PyTorch's ``dim=``/``keepdim=`` work too."""
    axis, keepdims = axis_keywords("sum", axis, keepdims, dim, keepdim)
    return _reduce(SUM, x, axis, keepdims)


def mean(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
        dim: int | Sequence[int] | None = None, keepdim: bool | None = None) -> Any:
    """Mean over `axis` (all axes by default); PyTorch's ``dim=``/``keepdim=`` work too."""
    axis, keepdims = axis_keywords("mean", axis, keepdims, dim, keepdim)
    return _reduce(MEAN, x, axis, keepdims)


def max(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
        dim: int | None = None, keepdim: bool | None = None) -> Any:
    """Maximum over `axis`; ties share the gradient evenly (as PyTorch's ``amax`` and its
    ``max()`` of the whole tensor, and JAX's ``max``).

    Spelled PyTorch's way, ``max(x, dim=d)`` returns ``(values, indices)`` as PyTorch does, and
    as there the whole gradient goes to the entry at the returned index.
    """
    if dim is not None:
        return _extreme_with_indices("max", x, dim, bool(keepdim))
    axis, keepdims = axis_keywords("max", axis, keepdims, None, keepdim)
    return _reduce(MAX, x, axis, keepdims)


def min(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
        dim: int | None = None, keepdim: bool | None = None) -> Any:
    """Minimum over `axis`; ties share the gradient evenly (as PyTorch's ``amin`` and its
    ``min()`` of the whole tensor, and JAX's ``min``).

    Spelled PyTorch's way, ``min(x, dim=d)`` returns ``(values, indices)`` as PyTorch does, and
    as there the whole gradient goes to the entry at the returned index.
    """
    if dim is not None:
        return _extreme_with_indices("min", x, dim, bool(keepdim))
    axis, keepdims = axis_keywords("min", axis, keepdims, None, keepdim)
    return _reduce(MIN, x, axis, keepdims)


# ------------------------------------------------------------------ added for PyTorch/JAX users
def amax(x: Any, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *,
         axis: int | Sequence[int] | None = None, keepdims: bool | None = None) -> Any:
    """Maximum over `dim` (every axis by default) without indices; ties share the gradient
    evenly, as PyTorch's ``amax`` and numpy's/JAX's ``amax``.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([[1.0, 3.0, 3.0]], requires_grad=True)
    >>> cad.amax(x, dim=1).sum().backward()
    >>> x.grad.tolist()
    [[0.0, 0.5, 0.5]]
    """
    axis, keepdims = axis_keywords("amax", axis, bool(keepdims), dim, keepdim)
    return _reduce(MAX, x, axis, keepdims)


def amin(x: Any, dim: int | Sequence[int] | None = None, keepdim: bool | None = None, *,
         axis: int | Sequence[int] | None = None, keepdims: bool | None = None) -> Any:
    """Minimum over `dim` (every axis by default) without indices; ties share the gradient
    evenly, as PyTorch's ``amin`` and numpy's/JAX's ``amin``.

    >>> import checkpoint_ad as cad
    >>> cad.amin(cad.tensor([[4.0, 2.0], [1.0, 5.0]]), dim=0).tolist()
    [1.0, 2.0]
    """
    axis, keepdims = axis_keywords("amin", axis, bool(keepdims), dim, keepdim)
    return _reduce(MIN, x, axis, keepdims)


def axis_keywords(op: str, axis: Any, keepdims: Any, dim: Any, keepdim: Any) -> tuple[Any, bool]:
    """One (axis, keepdims) pair from numpy's and PyTorch's spellings, refusing both at once."""
    if dim is not None:
        if axis is not None:
            raise TypeError(f"{op}: got both axis={axis!r} and dim={dim!r}; pass one of them")
        axis = dim
    if keepdim is not None:
        if keepdims:
            raise TypeError(f"{op}: got both keepdims and keepdim; pass one of them")
        keepdims = keepdim
    return axis, bool(keepdims)


def _prod_rule(g: Any, x: Any, out: Any, *, axis: Any, keepdims: Any, source: Any) -> Any:
    """d prod / d x_i is the product of the others; exact zeros are handled without 0/0."""
    zero = x == 0
    safe = where(zero, ones_like(x), x)
    zeros_in_slice = SUM(where(zero, ones_like(x), zeros_like(x)), axis=axis, keepdims=True,
                         source=source)
    nonzero_product = PROD(safe, axis=axis, keepdims=True, source=source)
    at_the_zero = where(zeros_in_slice == 1, nonzero_product, zeros_like(nonzero_product))
    elsewhere = broadcast_to(reshape(out, kept_shape(source, axis)), source) / safe
    return unreduce(g, source, axis) * where(zero, broadcast_to(at_the_zero, source), elsewhere)


def _cumsum(xp: Any, x: Any, *, axis: int) -> Any:
    return xp.cumulative_sum(x, axis=axis) if hasattr(xp, "cumulative_sum") else xp.cumsum(
        x, axis=axis)


PROD = define("prod", lambda xp, x, *, axis, keepdims, source: xp.prod(
    x, axis=axis, keepdims=keepdims), "x", [{"x": vjp("x out", _prod_rule)}])
CUMSUM = define("cumsum", _cumsum, "x", [
    {"x": vjp("", lambda g, *, axis: flip(cumsum(flip(g, axis), axis), axis))},
])
ARGMAX = define("argmax", lambda xp, x, *, axis, keepdims: xp.argmax(
    x, axis=axis, keepdims=keepdims), differentiable=False)
ARGMIN = define("argmin", lambda xp, x, *, axis, keepdims: xp.argmin(
    x, axis=axis, keepdims=keepdims), differentiable=False)


def prod(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False, *,
         dim: int | Sequence[int] | None = None, keepdim: bool | None = None) -> Any:
    """Product over `axis`; its gradient stays exact where an entry is 0.

    >>> import checkpoint_ad as cad
    >>> cad.prod(cad.tensor([[1.0, 2.0], [3.0, 4.0]]), dim=1).tolist()
    [2.0, 12.0]
    """
    axis, keepdims = axis_keywords("prod", axis, keepdims, dim, keepdim)
    return _reduce(PROD, x, axis, keepdims)


def cumsum(x: Any, axis: int | None = None, *, dim: int | None = None) -> Any:
    """Running sum along `axis` (over the flattened tensor when no axis is given, as numpy).

    >>> import checkpoint_ad as cad
    >>> cad.cumsum(cad.tensor([1.0, 2.0, 3.0]), dim=0).tolist()
    [1.0, 3.0, 6.0]
    """
    axis, _ = axis_keywords("cumsum", axis, False, dim, None)
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    shape = tuple(getattr(x, "_data", x).shape)
    if not isinstance(axis, int):
        raise ShapeError(f"cumsum takes one axis (an int), got {axis!r}")
    (axis,) = normalize_axes(axis, len(shape), "cumsum")
    return CUMSUM(x, axis=axis)


def _arg_extreme(prim: Any, x: Any, axis: Any, keepdims: bool) -> Any:
    shape = tuple(getattr(x, "_data", x).shape)
    if axis is None:
        flat = reshape(x, (-1,))
        return prim(flat, axis=0, keepdims=False) if not keepdims else reshape(
            prim(flat, axis=0, keepdims=False), (1,) * len(shape))
    if not isinstance(axis, int):
        raise ShapeError(f"{prim.name} takes one axis (an int) or None, got {axis!r}")
    (axis,) = normalize_axes(axis, len(shape), prim.name)
    return prim(x, axis=axis, keepdims=keepdims)


def argmax(x: Any, axis: int | None = None, keepdims: bool = False, *, dim: int | None = None,
           keepdim: bool | None = None) -> Any:
    """Position of the largest entry along `axis` (of the flattened tensor by default).

    >>> import checkpoint_ad as cad
    >>> cad.argmax(cad.tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1).tolist()
    [1, 0]
    """
    axis, keepdims = axis_keywords("argmax", axis, keepdims, dim, keepdim)
    return _arg_extreme(ARGMAX, x, axis, keepdims)


def argmin(x: Any, axis: int | None = None, keepdims: bool = False, *, dim: int | None = None,
           keepdim: bool | None = None) -> Any:
    """Position of the smallest entry along `axis` (of the flattened tensor by default).

    >>> import checkpoint_ad as cad
    >>> cad.argmin(cad.tensor([3.0, 1.0, 2.0])).item()
    1
    """
    axis, keepdims = axis_keywords("argmin", axis, keepdims, dim, keepdim)
    return _arg_extreme(ARGMIN, x, axis, keepdims)


def _extreme_with_indices(op: str, x: Any, dim: Any, keepdim: bool) -> ValuesIndices:
    """(values, indices) with the values picked at the indices, so that, as in PyTorch, the
    gradient goes to the returned entry alone when several tie."""
    if not isinstance(dim, int):
        raise ShapeError(f"{op}(dim=...) takes one dimension (an int), got {dim!r}")
    (axis,) = normalize_axes(dim, len(getattr(x, "_data", x).shape), op)
    kept = (argmax if op == "max" else argmin)(x, axis, True)
    values = take_along_axis(x, kept, axis)
    if keepdim:
        return ValuesIndices(values, kept)
    return ValuesIndices(squeeze(values, axis), squeeze(kept, axis))
