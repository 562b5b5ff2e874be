"""Normalising primitives used by networks: softmax, log_softmax, logsumexp, layer_norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..tape import define, vjp
from ..tensor_base import TensorBase
from .elementwise import exp, sqrt
from .reductions import SUM, axis_keywords, kept_shape, mean, unreduce
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


# ------------------------------------------------------------------ layer_norm
# One primitive with the scale inside (the shift, which saves nothing, is added after): it
# saves its input, the per-row statistics (mean and 1/std, stacked: shape (2, rows...)) and
# the scale, as PyTorch's kernel does; composed of means and divisions it kept three arrays of
# the input's size. The statistics come from a primitive without gradient: the rules below
# are the total derivative through them.
def _statistics(xp: Any, x: Any, *, axis: tuple[int, ...], eps: float) -> Any:
    centre = xp.mean(x, axis=axis, keepdims=True)
    centred = x - centre
    rstd = 1.0 / xp.sqrt(xp.mean(centred * centred, axis=axis, keepdims=True) + eps)
    return xp.stack([centre, rstd])


def _normalized(x: Any, stats: Any, axis: tuple[int, ...], eps: float) -> tuple[Any, Any]:
    """(x - mean) * rstd and rstd. Under create_graph (tensors) the statistics are computed
    again from x with differentiable ops, so that higher derivatives see how they depend on x;
    the saved ones would be constants there."""
    if isinstance(x, TensorBase):
        centred = x - mean(x, axis, keepdims=True)
        rstd = 1.0 / sqrt(mean(centred * centred, axis, keepdims=True) + eps)
        return centred * rstd, rstd
    return (x - stats[0]) * stats[1], stats[1]


def _layer_norm_x(g: Any, x: Any, stats: Any, weight: Any, *, axis: Any, eps: Any) -> Any:
    y, rstd = _normalized(x, stats, axis, eps)
    gy = g * weight
    return rstd * (gy - mean(gy, axis, keepdims=True) - y * mean(gy * y, axis, keepdims=True))


LAYER_NORM_STATISTICS = define("layer_norm_statistics", _statistics, differentiable=False)
LAYER_NORM = define(
    "layer_norm", lambda xp, x, stats, weight, *, axis, eps: (x - stats[0]) * stats[1] * weight,
    "x stats weight", [
        {"x": vjp("x stats weight", _layer_norm_x),
         "weight": vjp("x stats", lambda g, x, stats, *, axis, eps:
                       g * _normalized(x, stats, axis, eps)[0])},
    ], broadcasts=True)


def layer_norm(
    x: Any, axis: int | Sequence[int] = -1, weight: Any = None, bias: Any = None,
    eps: float = 1e-5,
) -> Any:
    """(x - mean) / sqrt(var + eps) over `axis` (biased variance, as PyTorch), times `weight`,
    plus `bias`. Saves x, per-row mean and 1/std, and the weight; computes in x's dtype.

    >>> import checkpoint_ad as cad
    >>> y = cad.layer_norm(cad.tensor([[1.0, 3.0]]))
    >>> [round(v, 3) for v in y.tolist()[0]]
    [-1.0, 1.0]
    """
    axes, _ = _axes(x, axis, "layer_norm")
    stats = LAYER_NORM_STATISTICS(x, axis=axes, eps=float(eps))
    out = LAYER_NORM(x, stats, 1.0 if weight is None else weight, axis=axes, eps=float(eps))
    return out if bias is None else out + bias
