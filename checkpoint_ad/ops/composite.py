"""Functions built only from primitives: nothing here needs a rule, a test of its own rule, or a
storage decision (the primitives they record have those).

They exist so that programs written against numpy, JAX or PyTorch run with renames only. Where
the libraries disagree on a name's meaning, the numpy meaning wins for the function and the
PyTorch one is reached with PyTorch's keyword (``dim=``) or through the Tensor method; the page
``docs/coming-from-pytorch-and-jax.md`` lists every such case.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import namespace
from ..errors import ShapeError
from ..tensor_base import as_tensor
from .elementwise import clip, exp, log1p, multiply, where, zeros_like
from .linalg import einsum, matmul, safe_root
from .reductions import axis_keywords, mean
from .reductions import sum as reduce_sum
from .shape import (
    _axis,
    broadcast_to,
    concatenate,
    expand_dims,
    getitem,
    normalize_axes,
    reshape,
    transpose,
)

__all__ = [
    "cat", "chunk", "clamp", "diag", "dot", "expand", "flatten", "masked_fill", "outer", "pad",
    "permute", "repeat", "repeat_interleave", "softplus", "split", "std", "tensordot", "tile",
    "trace", "tril", "triu", "unsqueeze", "var",
]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "_data", x).shape)


def _along(axis: int, index: Any) -> tuple[Any, ...]:
    return (*(slice(None),) * axis, index, Ellipsis)


# ------------------------------------------------------------------ shape
def cat(tensors: Sequence[Any], dim: int = 0, *, axis: int | None = None) -> Any:
    """PyTorch's name for `concatenate`.

    >>> import checkpoint_ad as cad
    >>> cad.cat([cad.ones(2), cad.zeros(1)]).tolist()
    [1.0, 1.0, 0.0]
    """
    return concatenate(tensors, axis=dim if axis is None else axis)


def unsqueeze(x: Any, dim: int) -> Any:
    """x with a size-1 axis inserted at `dim` (numpy's ``expand_dims`` with one axis).

    >>> import checkpoint_ad as cad
    >>> cad.unsqueeze(cad.zeros(2, 3), -1).shape
    (2, 3, 1)
    """
    return expand_dims(x, dim)


def flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    """Axes `start_dim`..`end_dim` (inclusive) merged into one.

    >>> import checkpoint_ad as cad
    >>> cad.flatten(cad.zeros(2, 3, 4), 1).shape
    (2, 12)
    """
    shape = _shape(x)
    if not shape:
        return reshape(x, (1,))
    start, end = _axis(start_dim, len(shape), "flatten"), _axis(end_dim, len(shape), "flatten")
    if start > end:
        raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    merged = math.prod(shape[start:end + 1])
    return reshape(x, (*shape[:start], merged, *shape[end + 1:]))


def permute(x: Any, *dims: Any) -> Any:
    """Axes reordered: result axis i is input axis ``dims[i]`` (ints or one sequence).

    >>> import checkpoint_ad as cad
    >>> cad.permute(cad.zeros(2, 3, 4), 2, 0, 1).shape
    (4, 2, 3)
    """
    if len(dims) == 1 and not isinstance(dims[0], int):
        dims = tuple(dims[0])
    return transpose(x, tuple(dims))


def expand(x: Any, *sizes: Any) -> Any:
    """x broadcast to `sizes`, where -1 keeps that axis's size (no copy is made).

    >>> import checkpoint_ad as cad
    >>> cad.expand(cad.zeros(3, 1), -1, 4).shape
    (3, 4)
    """
    if len(sizes) == 1 and not isinstance(sizes[0], int):
        sizes = tuple(sizes[0])
    shape = _shape(x)
    lead = len(sizes) - len(shape)
    if lead < 0:
        raise ShapeError(f"expand: {list(sizes)} has fewer axes than the tensor's {list(shape)}")
    target = tuple(shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(sizes))
    if any(s < 0 for s in target):
        raise ShapeError(f"expand: -1 is allowed only for existing axes, got {list(sizes)}")
    return broadcast_to(x, target)


def split(x: Any, indices_or_sections: int | Sequence[int], axis: int = 0, *,
          dim: int | None = None) -> list[Any]:
    """Pieces of x along `axis`.

    numpy's meaning (``axis=``): an int is the number of equal sections, a list gives the
    positions to cut at. PyTorch's meaning (``dim=``, and the Tensor method): an int is the size
    of each piece (the last may be smaller), a list gives the sizes.

    >>> import checkpoint_ad as cad
    >>> [p.shape for p in cad.split(cad.zeros(6), 3)]
    [(2,), (2,), (2,)]
    >>> [p.shape for p in cad.split(cad.zeros(5), 2, dim=0)]
    [(2,), (2,), (1,)]
    """
    shape = _shape(x)
    if dim is not None:
        axis = _axis(dim, len(shape), "split")
        return _split_sizes(x, _torch_sizes(shape[axis], indices_or_sections), axis)
    axis = _axis(axis, len(shape), "split")
    n = shape[axis]
    if isinstance(indices_or_sections, int):
        if indices_or_sections <= 0 or n % indices_or_sections:
            raise ShapeError(
                f"split: {n} entries along axis {axis} do not divide into "
                f"{indices_or_sections} equal sections; pass cut positions instead, or use chunk"
            )
        size = n // indices_or_sections
        return _split_sizes(x, [size] * indices_or_sections, axis)
    cuts = [0, *(min(max(c, 0), n) for c in indices_or_sections), n]
    return [getitem(x, _along(axis, slice(a, max(a, b))))
            for a, b in itertools.pairwise(cuts)]


def _torch_sizes(n: int, size_or_sizes: int | Sequence[int]) -> list[int]:
    if isinstance(size_or_sizes, int):
        if size_or_sizes <= 0:
            raise ShapeError(f"split: piece size must be positive, got {size_or_sizes}")
        return [min(size_or_sizes, n - start) for start in range(0, n, size_or_sizes)] or [0]
    sizes = list(size_or_sizes)
    if sum(sizes) != n:
        raise ShapeError(f"split: sizes {sizes} add up to {sum(sizes)}, but the axis has {n}")
    return sizes


def _split_sizes(x: Any, sizes: Sequence[int], axis: int) -> list[Any]:
    pieces, start = [], 0
    for size in sizes:
        pieces.append(getitem(x, _along(axis, slice(start, start + size))))
        start += size
    return pieces


def chunk(x: Any, chunks: int, dim: int = 0) -> list[Any]:
    """x cut into at most `chunks` pieces of ceil(n / chunks) along `dim` (PyTorch's rule).

    >>> import checkpoint_ad as cad
    >>> [p.shape for p in cad.chunk(cad.zeros(5, 2), 2)]
    [(3, 2), (2, 2)]
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ShapeError(f"chunk: chunks must be a positive int, got {chunks!r}")
    shape = _shape(x)
    axis = _axis(dim, len(shape), "chunk")
    size = max(1, -(-shape[axis] // chunks))
    return _split_sizes(x, _torch_sizes(shape[axis], size), axis)


def repeat(x: Any, repeats: int | Sequence[int], axis: int | None = None) -> Any:
    """Each entry repeated `repeats` times along `axis` (numpy's ``repeat``; PyTorch's
    ``repeat_interleave``). The flattened tensor when `axis` is None.

    >>> import checkpoint_ad as cad
    >>> cad.repeat(cad.tensor([1.0, 2.0]), 2).tolist()
    [1.0, 1.0, 2.0, 2.0]
    """
    if axis is None:
        x, axis = reshape(x, (-1,)), 0
    axis = _axis(axis, len(_shape(x)), "repeat")
    counts = np.asarray(repeats)
    if counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ShapeError(f"repeat: repeats must be non-negative ints, got {repeats!r}")
    index = np.repeat(np.arange(_shape(x)[axis]), counts)
    return getitem(x, _along(axis, index))


def repeat_interleave(x: Any, repeats: int | Sequence[int], dim: int | None = None) -> Any:
    """PyTorch's name for numpy's `repeat`.

    >>> import checkpoint_ad as cad
    >>> cad.repeat_interleave(cad.tensor([[1.0], [2.0]]), 2, dim=0).shape
    (4, 1)
    """
    return repeat(x, repeats, dim)


def tile(x: Any, reps: int | Sequence[int]) -> Any:
    """x repeated as whole blocks: numpy's ``tile`` and PyTorch's ``Tensor.repeat``.

    >>> import checkpoint_ad as cad
    >>> cad.tile(cad.tensor([1.0, 2.0]), 2).tolist()
    [1.0, 2.0, 1.0, 2.0]
    """
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    shape = _shape(x)
    ndim = max(len(shape), len(reps))
    shape = (1,) * (ndim - len(shape)) + shape
    reps = (1,) * (ndim - len(reps)) + reps
    interleaved = [d for pair in zip((1,) * ndim, shape) for d in pair]
    target = [d for pair in zip(reps, shape) for d in pair]
    spread = broadcast_to(reshape(x, interleaved), target)
    return reshape(spread, tuple(r * d for r, d in zip(reps, shape)))


def pad(x: Any, pad_width: int | Sequence[Any], mode: str = "constant",
        constant_values: float = 0) -> Any:
    """x surrounded by `constant_values` (numpy's ``pad``, constant mode).

    `pad_width` is numpy's: an int for every side, or one (before, after) pair per axis.

    >>> import checkpoint_ad as cad
    >>> cad.pad(cad.tensor([1.0, 2.0]), (1, 2)).tolist()
    [0.0, 1.0, 2.0, 0.0, 0.0]
    """
    if mode != "constant":
        raise ShapeError(f"pad: only mode='constant' is available, got {mode!r}")
    shape = _shape(x)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (len(shape), 2))
    if (widths < 0).any():
        raise ShapeError(f"pad: widths must be non-negative, got {pad_width!r}")
    x = as_tensor(x)
    for axis, (before, after) in enumerate(widths.tolist()):
        if not before and not after:
            continue
        current = list(_shape(x))
        parts = []
        for width in (before, after):
            current[axis] = width
            parts.append(_constant_block(x, tuple(current), constant_values) if width else None)
        x = concatenate([p for p in (parts[0], x, parts[1]) if p is not None], axis=axis)
    return x


def _constant_block(like: Any, shape: tuple[int, ...], value: float) -> Any:
    data = like._data
    block = namespace(data).full(shape, value, dtype=data.dtype)
    return as_tensor(block, like=(like,))


def clamp(x: Any, min: float | None = None, max: float | None = None) -> Any:
    """PyTorch's name for `clip` (keywords ``min=``/``max=``).

    >>> import checkpoint_ad as cad
    >>> cad.clamp(cad.tensor([-2.0, 0.5, 3.0]), min=-1, max=1).tolist()
    [-1.0, 0.5, 1.0]
    """
    return clip(x, min, max)


def masked_fill(x: Any, mask: Any, value: float) -> Any:
    """x with `value` where `mask` holds; no gradient flows to the filled places.

    >>> import numpy as np, checkpoint_ad as cad
    >>> cad.masked_fill(cad.tensor([1.0, 2.0]), np.array([True, False]), -9.0).tolist()
    [-9.0, 2.0]
    """
    x = as_tensor(x)
    fill = as_tensor(value, like=(x,))
    return where(getattr(mask, "_data", mask), fill, x)


def _band(x: Any, diagonal: int, lower: bool) -> Any:
    """x where column - row <= diagonal (lower) or >= diagonal (upper) in its last two axes,
    zero elsewhere; the mask is made on x's device and passes no gradient."""
    data = getattr(x, "_data", x)
    if data.ndim < 2:
        raise ShapeError(f"{'tril' if lower else 'triu'}: needs at least 2 axes, got shape "
                         f"{list(data.shape)}")
    xp = namespace(data)
    rows, cols = data.shape[-2:]
    offset = xp.arange(cols)[None, :] - xp.arange(rows)[:, None]
    keep = offset <= diagonal if lower else offset >= diagonal
    x = as_tensor(x)
    return where(keep, x, as_tensor(0.0, like=(x,)))


def tril(x: Any, diagonal: int = 0) -> Any:
    """The lower triangle of the last two axes (on and below `diagonal`), zeros above.

    >>> import checkpoint_ad as cad
    >>> cad.tril(cad.ones(2, 3)).tolist()
    [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    """
    return _band(x, diagonal, lower=True)


def triu(x: Any, diagonal: int = 0) -> Any:
    """The upper triangle of the last two axes (on and above `diagonal`), zeros below.

    >>> import checkpoint_ad as cad
    >>> cad.triu(cad.ones(2, 3), 1).tolist()
    [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    """
    return _band(x, diagonal, lower=False)


def softplus(x: Any, beta: float = 1.0, threshold: float | None = 20.0) -> Any:
    """log(1 + exp(beta * x)) / beta, without overflow (PyTorch's ``F.softplus``, JAX's
    ``jax.nn.softplus``); where beta * x > `threshold` the result is x itself, as PyTorch's
    (None: never).

    Written as log1p(exp(-|z|)) + max(z, 0) with the kinks of |z| and max at z = 0 taken from
    one branch (z <= 0 is log1p(exp(z)) whole), so the gradient is sigmoid(beta * x)
    everywhere, 0.5 at 0 included, rather than a mix of two subgradients.

    >>> import checkpoint_ad as cad
    >>> round(cad.softplus(cad.tensor(0.0, dtype="float64")).item(), 6)
    0.693147
    """
    z = x * beta if beta != 1.0 else x
    positive = z > 0
    smooth = log1p(exp(where(positive, -z, z))) + where(positive, z, zeros_like(z))
    out = smooth / beta if beta != 1.0 else smooth
    if threshold is None:
        return out
    return where(z > threshold, x, out)


# ------------------------------------------------------------------ statistics
def var(x: Any, axis: int | Sequence[int] | None = None, ddof: int = 0, keepdims: bool = False,
        *, dim: Any = None, keepdim: bool | None = None, correction: int | None = None,
        unbiased: bool | None = None) -> Any:
    """Variance over `axis`, dividing by n - ddof (numpy's default ddof=0; PyTorch's
    ``correction=``/``unbiased=`` keywords set ddof, and PyTorch's default is 1).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0, 3.0, 4.0])
    >>> cad.var(x).item(), round(cad.var(x, correction=1).item(), 4)
    (1.25, 1.6667)
    """
    axis, keepdims = axis_keywords("var", axis, keepdims, dim, keepdim)
    if correction is not None:
        ddof = correction
    if unbiased is not None:
        ddof = 1 if unbiased else 0
    shape = _shape(x)
    axes = normalize_axes(axis, len(shape), "var")
    n = math.prod(shape[a] for a in axes)
    if n - ddof <= 0:
        raise ShapeError(f"var: {n} values with ddof={ddof} leave no degrees of freedom")
    centred = x - mean(x, axis=axes, keepdims=True)
    return reduce_sum(centred * centred, axis=axes, keepdims=keepdims) / (n - ddof)


def std(x: Any, axis: int | Sequence[int] | None = None, ddof: int = 0, keepdims: bool = False,
        *, dim: Any = None, keepdim: bool | None = None, correction: int | None = None,
        unbiased: bool | None = None) -> Any:
    """Standard deviation: sqrt of `var` (same keywords); where it is 0 its gradient is 0,
    as PyTorch's, rather than 0/0.

    >>> import checkpoint_ad as cad
    >>> cad.std(cad.tensor([1.0, 3.0])).item()
    1.0
    """
    return safe_root(var(x, axis, ddof, keepdims, dim=dim, keepdim=keepdim,
                         correction=correction, unbiased=unbiased), 2)


# ------------------------------------------------------------------ products
def tensordot(a: Any, b: Any, axes: int | Sequence[Sequence[int]] = 2) -> Any:
    """Sum of products over the given axes of a and b (numpy's meaning of `axes`).

    >>> import checkpoint_ad as cad
    >>> cad.tensordot(cad.ones(2, 3, 4), cad.ones(3, 4, 5), axes=2).shape
    (2, 5)
    """
    a, b = as_tensor(a, like=(a, b)), as_tensor(b, like=(a, b))
    if isinstance(axes, int):
        if axes < 0 or axes > min(a.ndim, b.ndim):
            raise ShapeError(f"tensordot: axes={axes} is more than the operands' ranks")
        a_axes, b_axes = list(range(a.ndim - axes, a.ndim)), list(range(axes))
    else:
        a_axes, b_axes = ([i] if isinstance(i, int) else list(i) for i in axes)
        a_axes = [_axis(i, a.ndim, "tensordot") for i in a_axes]
        b_axes = [_axis(i, b.ndim, "tensordot") for i in b_axes]
    if len(a_axes) != len(b_axes):
        raise ShapeError(f"tensordot: {len(a_axes)} axes of a paired with {len(b_axes)} of b")
    for i, j in zip(a_axes, b_axes):
        if a.shape[i] != b.shape[j]:
            raise ShapeError(
                f"tensordot: axis {i} of a (size {a.shape[i]}) and axis {j} of b (size "
                f"{b.shape[j]}) are summed together but differ in size"
            )
    letters = string.ascii_letters
    if a.ndim + b.ndim > len(letters):
        raise ShapeError("tensordot: too many axes (at most 52 in all)")
    a_terms = list(letters[:a.ndim])
    b_terms = list(letters[a.ndim:a.ndim + b.ndim])
    for i, j in zip(a_axes, b_axes):
        b_terms[j] = a_terms[i]
    out = [c for k, c in enumerate(a_terms) if k not in a_axes]
    out += [c for k, c in enumerate(b_terms) if k not in b_axes]
    return einsum(f"{''.join(a_terms)},{''.join(b_terms)}->{''.join(out)}", a, b)


def dot(a: Any, b: Any) -> Any:
    """numpy's ``dot``: scaling for 0-d, matmul up to 2-d, and beyond that the sum over a's
    last axis and b's second-to-last.

    >>> import checkpoint_ad as cad
    >>> cad.dot(cad.tensor([1.0, 2.0]), cad.tensor([3.0, 4.0])).item()
    11.0
    """
    a, b = as_tensor(a, like=(a, b)), as_tensor(b, like=(a, b))
    if a.ndim == 0 or b.ndim == 0:
        return multiply(a, b)
    if b.ndim <= 2:
        return matmul(a, b)
    return tensordot(a, b, ((a.ndim - 1,), (b.ndim - 2,)))


def outer(a: Any, b: Any) -> Any:
    """Every product a_i * b_j, as a matrix (inputs are flattened first, as numpy does).

    >>> import checkpoint_ad as cad
    >>> cad.outer(cad.tensor([1.0, 2.0]), cad.tensor([1.0, 10.0])).tolist()
    [[1.0, 10.0], [2.0, 20.0]]
    """
    return multiply(reshape(a, (-1, 1)), reshape(b, (1, -1)))


def diag(x: Any, k: int = 0) -> Any:
    """From a vector: the square matrix with it on diagonal `k`; from a matrix: its diagonal `k`.

    >>> import checkpoint_ad as cad
    >>> cad.diag(cad.tensor([[1.0, 2.0], [3.0, 4.0]])).tolist()
    [1.0, 4.0]
    >>> cad.diag(cad.tensor([1.0, 2.0])).tolist()
    [[1.0, 0.0], [0.0, 2.0]]
    """
    shape = _shape(x)
    if len(shape) == 2:
        rows = np.arange(max(0, -k), min(shape[0], shape[1] - k))
        return getitem(x, (rows, rows + k))
    if len(shape) != 1:
        raise ShapeError(f"diag takes a 1-d or 2-d tensor, got shape {list(shape)}")
    x = as_tensor(x)
    n = shape[0] + abs(k)
    padded = pad(x, (0, abs(k)))
    eye = as_tensor(np.eye(n, k=k, dtype=np.dtype(str(x.dtype))), like=(x,))
    # k >= 0: v[i] sits in row i (column i + k); k < 0: in column i (row i - k)
    placed = reshape(padded, (n, 1) if k >= 0 else (1, n))
    return placed * eye


def trace(x: Any, offset: int = 0) -> Any:
    """Sum of the diagonal `offset` of a matrix.

    >>> import checkpoint_ad as cad
    >>> cad.trace(cad.tensor([[1.0, 2.0], [3.0, 4.0]])).item()
    5.0
    """
    if len(_shape(x)) != 2:
        raise ShapeError(f"trace takes a matrix, got shape {list(_shape(x))}")
    return reduce_sum(diag(x, offset))
