"""Normalising primitives used by networks: softmax, log_softmax, logsumexp."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..tape import define, vjp
from .elementwise import exp
from .reductions import SUM, axis_keywords, kept_shape, unreduce
from .shape import normalize_axes, reshape


def _sum_kept(g: Any, axis: tuple[int, ...], source: tuple[int, ...]) -> Any:
    return SUM(g, axis=axis, keepdims=True, source=source)


def _logsumexp(xp: Any, x: Any, *, axis: Any, keepdims: bool, source: Any) -> Any:
    peak = xp.max(x, axis=axis, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, xp.zeros_like(peak))
    out = xp.log(xp.sum(xp.exp(x - peak), axis=axis, keepdims=True)) + peak
    return out if keepdims else xp.reshape(out, tuple(d for i, d in enumerate(source)
                                                      if i not in axis))


def _softmax(xp: Any, x: Any, *, axis: Any, source: Any) -> Any:
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def _log_softmax(xp: Any, x: Any, *, axis: Any, source: Any) -> Any:
    return x - _logsumexp(xp, x, axis=axis, keepdims=True, source=source)


LOGSUMEXP = define("logsumexp", _logsumexp, "x", [
    {"x": vjp("x out", lambda g, x, out, *, axis, keepdims, source:
              unreduce(g, source, axis) * exp(x - reshape(out, kept_shape(source, axis))))},
    {"x": vjp("x", lambda g, x, *, axis, keepdims, source: unreduce(g, source, axis)
              * exp(x - reshape(logsumexp(x, axis), kept_shape(source, axis))))},
])
SOFTMAX = define("softmax", _softmax, "x", [
    {"x": vjp("out", lambda g, out, *, axis, source:
              out * (g - _sum_kept(g * out, axis, source)))},
    {"x": vjp("x", lambda g, x, *, axis, source:
              softmax(x, axis) * (g - _sum_kept(g * softmax(x, axis), axis, source)))},
])
LOG_SOFTMAX = define("log_softmax", _log_softmax, "x", [
    {"x": vjp("out", lambda g, out, *, axis, source:
              g - exp(out) * _sum_kept(g, axis, source))},
    {"x": vjp("x", lambda g, x, *, axis, source:
              g - exp(log_softmax(x, axis)) * _sum_kept(g, axis, source))},
])


def _axes(x: Any, axis: Any, op: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    source = tuple(getattr(x, "_data", x).shape)
    return normalize_axes(axis, len(source), op), source


def logsumexp(
    x: Any,
    axis: int | Sequence[int] | None = None,
    keepdims: bool = False,
    *,
    dim: int | Sequence[int] | None = None,
    keepdim: bool | None = None,
) -> Any:
    """log(sum(exp(x))) over `axis` (or PyTorch's `dim`), without overflow."""
    axis, keepdims = axis_keywords("logsumexp", axis, keepdims, dim, keepdim)
    axes, source = _axes(x, axis, "logsumexp")
    return LOGSUMEXP(x, axis=axes, keepdims=bool(keepdims), source=source)


def softmax(
    x: Any, axis: int | Sequence[int] | None = None, *, dim: int | Sequence[int] | None = None
) -> Any:
    """exp(x) normalised to sum to 1 over `axis` (or PyTorch's `dim`; the last by default)."""
    axis = _last_by_default(axis_keywords("softmax", axis, False, dim, None)[0])
    axes, source = _axes(x, axis, "softmax")
    return SOFTMAX(x, axis=axes, source=source)


def log_softmax(
    x: Any, axis: int | Sequence[int] | None = None, *, dim: int | Sequence[int] | None = None
) -> Any:
    """log(softmax(x)) over `axis` (or `dim`; the last by default), computed stably."""
    axis = _last_by_default(axis_keywords("log_softmax", axis, False, dim, None)[0])
    axes, source = _axes(x, axis, "log_softmax")
    return LOG_SOFTMAX(x, axis=axes, source=source)


def _last_by_default(axis: Any) -> Any:
    return -1 if axis is None else axis
