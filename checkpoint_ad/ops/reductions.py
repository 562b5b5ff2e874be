"""Reductions over axes: sum, mean, max, min."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..tape import define, vjp
from .elementwise import ones_like, where, zeros_like
from .shape import SUM, broadcast_to, kept_shape, normalize_axes, reshape, unreduce

__all__ = ["SUM", "kept_shape", "max", "mean", "min", "sum", "unreduce"]


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


def sum(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Any:
    """Sum over `axis` (all axes by default)."""
    return _reduce(SUM, x, axis, keepdims)


def mean(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Any:
    """Mean over `axis` (all axes by default)."""
    return _reduce(MEAN, x, axis, keepdims)


def max(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Any:
    """Maximum over `axis`; ties share the gradient evenly."""
    return _reduce(MAX, x, axis, keepdims)


def min(x: Any, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Any:
    """Minimum over `axis`; ties share the gradient evenly."""
    return _reduce(MIN, x, axis, keepdims)

