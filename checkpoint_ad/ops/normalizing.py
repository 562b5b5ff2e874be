"""Normalising primitives used by networks: softmax, log_softmax, logsumexp, layer_norm."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import namespace
from ..errors import ShapeError
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


# ------------------------------------------------------------------ attention_softmax
# The attention core's scale, causal mask and softmax as one primitive (`scaled_dot_product_
# attention` calls it): composed of a multiply, a `where` and `softmax`, the core made seven
# fresh (batch, heads, s, s) arrays forward and six backward, and `selective` recomputation
# pays the forward twice. On numpy and cupy the forward works in place on the one buffer it
# returns and the rule on the one it makes; every step is the composition's, in its order,
# so the values are bitwise the same.
_CAUSAL: dict[tuple[int, int], Any] = {}  # (rows, cols) -> numpy's left-out positions


def _left_out(xp: Any, rows: int, cols: int) -> Any:
    """The positions a causal row does not see (column > row, PyTorch's top-left triangle),
    made once per shape on numpy (a constant; every layer shares it)."""
    if xp is not np:
        return xp.arange(cols)[None, :] > xp.arange(rows)[:, None]
    mask = _CAUSAL.get((rows, cols))
    if mask is None:
        if len(_CAUSAL) >= 64:
            _CAUSAL.clear()
        mask = _CAUSAL[(rows, cols)] = np.triu(np.ones((rows, cols), dtype=bool), 1)
    return mask


def _in_place(xp: Any) -> bool:
    return xp is np or getattr(xp, "__name__", "") == "cupy"


def _attention_softmax(xp: Any, x: Any, *, scale: float, causal: bool) -> Any:
    if not _in_place(xp):  # the array API: no `out=`
        t = x * scale
        if causal:
            t = xp.where(_left_out(xp, *x.shape[-2:]), xp.asarray(-math.inf, dtype=x.dtype), t)
        e = xp.exp(t - xp.max(t, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)
    out = xp.multiply(x, scale)
    if causal:
        xp.copyto(out, -math.inf, where=_left_out(xp, *x.shape[-2:]))
    out -= xp.max(out, axis=-1, keepdims=True)
    xp.exp(out, out=out)
    out /= xp.sum(out, axis=-1, keepdims=True)
    return out


def _attention_softmax_rule(g: Any, out: Any, *, scale: float, causal: bool) -> Any:
    """scale·out·(g - sum(g·out)): softmax's rule, the mask's (out is 0 where it left a
    position out) and the scale's."""
    if isinstance(g, TensorBase) or isinstance(out, TensorBase) or not _in_place(
            namespace(g)):  # create_graph: differentiable ops
        return out * (g - _sum_kept(g * out, (g.ndim - 1,), tuple(g.shape))) * scale
    xp = namespace(g)
    t = xp.multiply(g, out)
    xp.subtract(g, xp.sum(t, axis=-1, keepdims=True), out=t)
    xp.multiply(out, t, out=t)
    if scale != 1.0:
        t *= scale
    return t


ATTENTION_SOFTMAX = define("attention_softmax", _attention_softmax, "x", [
    {"x": vjp("out", _attention_softmax_rule)},
    {"x": vjp("x", lambda g, x, *, scale, causal: _attention_softmax_rule(
        g, attention_softmax(x, scale, causal), scale=scale, causal=causal))},
])


def attention_softmax(x: Any, scale: float = 1.0, causal: bool = False) -> Any:
    """softmax(scale·x) over the last axis, with the positions above the diagonal of the last
    two axes left out when `causal` (they get 0): `scaled_dot_product_attention`'s weights
    from its scores, in one primitive that saves its output.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.ops.normalizing import attention_softmax
    >>> attention_softmax(cad.zeros(2, 2), causal=True).tolist()
    [[1.0, 0.0], [0.5, 0.5]]
    """
    if getattr(x, "ndim", 0) < 2 and causal:
        raise ShapeError(f"attention_softmax: causal needs at least 2 axes, got shape "
                         f"{list(getattr(x, 'shape', ()))}")
    return ATTENTION_SOFTMAX(x, scale=float(scale), causal=bool(causal))


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
