"""Shape, indexing and joining primitives. Views share their input's version counter."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..backend import broadcast_axes, broadcast_view, has_array_index, namespace, scatter_add
from ..errors import ShapeError
from ..tape import define, vjp
from ..tensor_base import TensorBase, as_tensor_like
from .elementwise import zeros_like


def _inverse(axes: Sequence[int]) -> tuple[int, ...]:
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return tuple(inverse)


def _scatter(xp: Any, g: Any, *, index: Any, shape: tuple[int, ...]) -> Any:
    target = xp.zeros(shape, dtype=g.dtype, device=getattr(g, "device", None))
    g, index = _without_new_axes(xp, g, index, len(shape))
    return scatter_add(xp, target, index, g)


def _without_new_axes(xp: Any, g: Any, index: Any, ndim: int) -> tuple[Any, Any]:
    """`index` without its `None` entries and `g` without the size-1 axes they made: the
    standard's `__setitem__`, unlike numpy's, takes no `None`."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(p is None for p in parts) or has_array_index(index):
        return g, index
    consumed = sum(1 for p in parts if p is not None and p is not Ellipsis)
    axis, new_axes = 0, set()
    for p in parts:
        if p is None:
            new_axes.add(axis)
        if p is None or isinstance(p, slice):
            axis += 1
        elif p is Ellipsis:
            axis += ndim - consumed
    kept = tuple([d for i, d in enumerate(g.shape) if i not in new_axes])  # see broadcast_axes
    return xp.reshape(g, kept), tuple([p for p in parts if p is not None])


def _setitem(xp: Any, x: Any, v: Any, *, index: Any, v_shape: Any) -> Any:
    out = xp.asarray(x, copy=True)
    out[index] = v
    return out


def _slices(axis: int, start: int, stop: int) -> tuple[Any, ...]:
    # the trailing Ellipsis: the standard (unlike numpy) wants every axis indexed
    return (*(slice(None),) * axis, slice(start, stop), Ellipsis)


def _concat_rule(g: Any, i: int, *, axis: int, sizes: tuple[int, ...]) -> Any:
    start = sum(sizes[:i])
    return getitem(g, _slices(axis, start, start + sizes[i]))


RESHAPE = define("reshape", lambda xp, x, *, shape, source: xp.reshape(x, shape), "x", [
    {"x": vjp("", lambda g, *, shape, source: reshape(g, source))},
], view=True)
TRANSPOSE = define("transpose", lambda xp, x, *, axes: xp.permute_dims(x, axes), "x", [
    {"x": vjp("", lambda g, *, axes: transpose(g, _inverse(axes)))},
], view=True)
BROADCAST_TO = define(
    "broadcast_to", lambda xp, x, *, shape, source: xp.broadcast_to(x, shape), "x", [
        {"x": vjp("", lambda g, *, shape, source: sum_to(g, source))},
    ], view=True)
GETITEM = define("getitem", lambda xp, x, *, index, source: x[index], "x", [
    {"x": vjp("", lambda g, *, index, source: scatter(g, index, source))},
], view=True)
# integer or boolean array indices copy (numpy's advanced indexing): the result is no view and
# has a storage and version counter of its own
GATHER = define("getitem", lambda xp, x, *, index, source: x[index], "x", [
    {"x": vjp("", lambda g, *, index, source: scatter(g, index, source))},
])
SCATTER = define("scatter", _scatter, "g", [
    {"g": vjp("", lambda gg, *, index, shape: getitem(gg, index))},
])
SETITEM = define("setitem", _setitem, "x v", [
    {"x": vjp("", lambda g, *, index, v_shape: setitem(g, index, zeros_like(g[index]))),
     "v": vjp("", lambda g, *, index, v_shape: sum_to(getitem(g, index), v_shape))},
])
CONCATENATE = define(
    "concatenate", lambda xp, xs, *, axis, sizes: xp.concat(list(xs), axis=axis), "xs", [
        {"xs": vjp("", _concat_rule)},
    ], variadic=True)
# one entry for the whole stack (not one reshape per tensor and a concatenation): a loop's
# recorded outputs, or a list of a thousand hidden states, stacked by one operation
STACK = define("stack", lambda xp, xs, *, axis: xp.stack(list(xs), axis=axis), "xs", [
    {"xs": vjp("", lambda g, i, *, axis: getitem(g, (slice(None),) * axis + (i, ...)))},
], variadic=True)


def _data(x: Any) -> Any:
    return getattr(x, "_data", x)


def _axis(axis: int, ndim: int, op: str) -> int:
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{op}: axis {axis} is out of range for a {ndim}-d tensor")
    return axis % ndim


def normalize_axes(axis: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...]:
    """`axis` as a sorted tuple of non-negative ints (None: every axis)."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    normalized = tuple(sorted(_axis(a, max(ndim, 1) if ndim else 0, op) for a in axes))
    if len(set(normalized)) != len(normalized):
        raise ShapeError(f"{op}: repeated axis in {axis}")
    return normalized


def reshape(x: Any, shape: Sequence[int] | int, *more: int) -> Any:
    """x with a new shape (one entry may be -1); ``reshape(x, 3, 2)`` works as PyTorch's."""
    source = tuple(_data(x).shape)
    target = (shape,) if isinstance(shape, int) else tuple(shape)
    target += tuple(more)
    size = math.prod(source)
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        if target.count(-1) > 1 or known == 0 or size % known:
            raise ShapeError(f"reshape: cannot reshape {list(source)} to {list(target)}")
        target = tuple(size // known if d == -1 else d for d in target)
    if math.prod(target) != size:
        raise ShapeError(
            f"reshape: cannot reshape a tensor of shape {list(source)} ({size} elements) "
            f"to {list(target)} ({math.prod(target)} elements)"
        )
    return RESHAPE(x, shape=target, source=source)


def transpose(x: Any, axes: Sequence[int] | int | None = None, *more: int) -> Any:
    """Permute axes (reverse them when `axes` is None).

    Two ints, ``transpose(x, a, b)``, swap axes a and b (PyTorch's meaning); more ints are a
    permutation (numpy's ``x.transpose(1, 0, 2)``).
    """
    ndim = _data(x).ndim
    if isinstance(axes, int):
        axes = (axes, *more)
        if len(axes) == 2:
            return swapaxes(x, *axes)
    elif more:
        raise ShapeError("transpose: pass the axes as one sequence or as separate ints")
    if axes is None:
        axes = tuple(reversed(range(ndim)))
    axes = tuple(_axis(a, ndim, "transpose") for a in axes)
    if sorted(axes) != list(range(ndim)):
        raise ShapeError(f"transpose: axes {list(axes)} are not a permutation of {ndim} axes")
    return TRANSPOSE(x, axes=axes)


def matrix_transpose(x: Any) -> Any:
    """Swap the last two axes."""
    ndim = _data(x).ndim
    if ndim < 2:
        raise ShapeError(f"matrix_transpose needs at least 2 dimensions, got {ndim}")
    if type(x) is np.ndarray:  # as in a backward rule: the same view, made without a
        return x.swapaxes(-1, -2)  # primitive's dispatch (or numpy's Python layers)
    if not isinstance(x, TensorBase):  # another library's array
        return namespace(x).matrix_transpose(x)
    return TRANSPOSE(x, axes=(*range(ndim - 2), ndim - 1, ndim - 2))


def expand_dims(x: Any, axis: int | Sequence[int]) -> Any:
    """Insert size-1 axes at `axis` (positions in the result)."""
    shape = list(_data(x).shape)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    ndim = len(shape) + len(axes)
    for a in sorted(_axis(a, ndim, "expand_dims") for a in axes):
        shape.insert(a, 1)
    return reshape(x, shape)


def squeeze(x: Any, axis: int | Sequence[int] | None = None) -> Any:
    """Remove size-1 axes (all of them when `axis` is None)."""
    shape = tuple(_data(x).shape)
    if axis is None:
        axes = tuple(i for i, d in enumerate(shape) if d == 1)
    else:
        axes = normalize_axes(axis, len(shape), "squeeze")
        for a in axes:
            if shape[a] != 1:
                raise ShapeError(f"squeeze: axis {a} of shape {list(shape)} has size {shape[a]}")
    return reshape(x, [d for i, d in enumerate(shape) if i not in axes])


def broadcast_to(x: Any, shape: Sequence[int]) -> Any:
    source = tuple(_data(x).shape)
    shape = tuple(shape)
    if source == shape:
        return x
    return BROADCAST_TO(x, shape=shape, source=source)


def sum_to(g: Any, shape: Sequence[int]) -> Any:
    """Sum `g` down to `shape`: the adjoint of broadcasting `shape` up to g's shape."""
    shape = tuple(shape)
    g_shape = tuple(_data(g).shape)
    if g_shape == shape:
        return g
    axes = broadcast_axes(shape, g_shape)
    return reshape(SUM(g, axis=axes, keepdims=True, source=g_shape), shape)


# Summing is broadcasting's adjoint and the other way round, so the two primitives live in one
# table; the public reductions (`sum`, `mean`, ...) are in reductions.py.
def kept_shape(source: tuple[int, ...], axis: tuple[int, ...]) -> tuple[int, ...]:
    """`source` with the reduced axes kept as size 1."""
    return tuple([1 if i in axis else d for i, d in enumerate(source)])  # see broadcast_axes


def unreduce(g: Any, source: tuple[int, ...], axis: tuple[int, ...]) -> Any:
    """Spread a reduced gradient back over the reduced axes."""
    kept = kept_shape(source, axis)
    if isinstance(g, TensorBase):
        return broadcast_to(reshape(g, kept), source)
    # an array (a plain backward, a replayed step): what the primitives compute, without
    # their dispatch, which costs more than the reshape and broadcast themselves
    spread = g.reshape(kept) if isinstance(g, (np.ndarray, np.generic)) else namespace(
        g).reshape(g, kept)
    return spread if spread.shape == source else broadcast_view(spread, source)


SUM = define("sum", lambda xp, x, *, axis, keepdims, source: np.add.reduce(
    x, axis, None, None, keepdims) if xp is np else xp.sum(x, axis=axis, keepdims=keepdims), "x", [
    {"x": vjp("", lambda g, *, axis, keepdims, source: unreduce(g, source, axis))},
])

def _normalize_index(index: Any) -> Any:
    parts = index if isinstance(index, tuple) else (index,)
    fixed = []
    for p in parts:
        p = getattr(p, "_data", p)
        if isinstance(p, list):
            p = np.asarray(p)
        fixed.append(p)
    return tuple(fixed) if isinstance(index, tuple) else fixed[0]


def getitem(x: Any, index: Any) -> Any:
    """x[index]: ints, slices, None, Ellipsis, and integer or boolean arrays."""
    index = _normalize_index(index)
    data = _data(x)
    if has_array_index(index) and not isinstance(data, type(getattr(index, "_data", index))):
        parts = index if isinstance(index, tuple) else (index,)
        xp = namespace(data)
        converted = tuple(
            xp.asarray(p) if not isinstance(p, (int, slice, type(None), type(Ellipsis))) else p
            for p in parts
        )
        index = converted if isinstance(index, tuple) else converted[0]
    prim = GATHER if has_array_index(index) else GETITEM
    return prim(x, index=index, source=tuple(data.shape))


def scatter(g: Any, index: Any, shape: Sequence[int]) -> Any:
    """Zeros of `shape` with `g` added at `index` (repeated indices add up)."""
    return SCATTER(g, index=index, shape=tuple(shape))


def setitem(x: Any, index: Any, value: Any) -> Any:
    """A copy of x with x[index] = value (the out-of-place form of item assignment)."""
    index = _normalize_index(index)
    if isinstance(x, TensorBase):
        value = as_tensor_like(value, like=(x,))
    return SETITEM(x, value, index=index, v_shape=tuple(_data(value).shape))


def concatenate(xs: Sequence[Any], axis: int = 0) -> Any:
    """Join tensors along an existing axis."""
    xs = list(xs)
    if not xs:
        raise ShapeError("concatenate needs at least one tensor")
    ndim = _data(xs[0]).ndim
    axis = _axis(axis, ndim, "concatenate")
    for i, x in enumerate(xs):
        shape = tuple(_data(x).shape)
        first = tuple(_data(xs[0]).shape)
        if len(shape) != ndim or shape[:axis] + shape[axis + 1:] != first[:axis] + first[axis + 1:]:
            raise ShapeError(
                f"concatenate along axis {axis}: tensor {i} has shape {list(shape)}, which does "
                f"not match tensor 0's {list(first)} outside that axis"
            )
    sizes = tuple(int(_data(x).shape[axis]) for x in xs)
    return CONCATENATE(xs, axis=axis, sizes=sizes)


def stack(xs: Sequence[Any], axis: int = 0) -> Any:
    """Join tensors along a new axis."""
    xs = list(xs)
    if not xs:
        raise ShapeError("stack needs at least one tensor")
    ndim = _data(xs[0]).ndim + 1
    axis = _axis(axis, ndim, "stack")
    first = tuple(_data(xs[0]).shape)
    for i, x in enumerate(xs):
        if tuple(_data(x).shape) != first:
            raise ShapeError(f"stack: tensor {i} has shape {list(_data(x).shape)}, but tensor "
                             f"0 has {list(first)}; stacked tensors must all have one shape")
    return STACK(xs, axis=axis)


# ------------------------------------------------------------------ added for PyTorch/JAX users
def _index_grid(xp: Any, indices: Any, axis: int) -> tuple[Any, ...]:
    """Integer arrays that address, for every entry of `indices`, its place in the source."""
    ndim = len(indices.shape)
    grid = []
    for d, n in enumerate(indices.shape):
        if d == axis:
            grid.append(indices)
        else:
            shape = tuple(n if i == d else 1 for i in range(ndim))
            grid.append(xp.reshape(xp.arange(n), shape))
    return tuple(grid)


def _put_along(xp: Any, g: Any, *, indices: Any, axis: int, source: tuple[int, ...]) -> Any:
    target = xp.zeros(source, dtype=g.dtype, device=getattr(g, "device", None))
    return scatter_add(xp, target, _index_grid(xp, indices, axis), g)


FLIP = define("flip", lambda xp, x, *, axis: xp.flip(x, axis=axis), "x", [
    {"x": vjp("", lambda g, *, axis: FLIP(g, axis=axis))},
])
ROLL = define("roll", lambda xp, x, *, shift, axis: xp.roll(x, shift, axis=axis), "x", [
    {"x": vjp("", lambda g, *, shift, axis: ROLL(g, shift=tuple(-s for s in shift), axis=axis))},
])
TAKE_ALONG_AXIS = define(
    "take_along_axis", lambda xp, x, *, indices, axis, source: xp.take_along_axis(
        x, indices, axis=axis), "x", [
        {"x": vjp("", lambda g, *, indices, axis, source: PUT_ALONG_AXIS(
            g, indices=indices, axis=axis, source=source))},
    ])
PUT_ALONG_AXIS = define("put_along_axis", _put_along, "g", [
    {"g": vjp("", lambda gg, *, indices, axis, source: TAKE_ALONG_AXIS(
        gg, indices=indices, axis=axis, source=source))},
])
ARGSORT = define("argsort", lambda xp, x, *, axis, descending: xp.argsort(
    -x if descending else x, axis=axis, stable=True), differentiable=False)


def swapaxes(x: Any, a: int, b: int) -> Any:
    """x with axes `a` and `b` exchanged (PyTorch's ``transpose(a, b)``).

    >>> import checkpoint_ad as cad
    >>> cad.swapaxes(cad.zeros(2, 3, 4), 0, 2).shape
    (4, 3, 2)
    """
    ndim = _data(x).ndim
    a, b = _axis(a, ndim, "swapaxes"), _axis(b, ndim, "swapaxes")
    axes = list(range(ndim))
    axes[a], axes[b] = axes[b], axes[a]
    return TRANSPOSE(x, axes=tuple(axes))


class ValuesIndices(NamedTuple):
    """What ``sort``, ``max`` and ``min`` return when called with PyTorch's ``dim=``."""

    values: Any
    indices: Any


def flip(x: Any, axis: int | Sequence[int] | None = None, *,
         dims: int | Sequence[int] | None = None) -> Any:
    """x with the order of entries reversed along `axis` (every axis when None).

    >>> import checkpoint_ad as cad
    >>> cad.flip(cad.tensor([[1.0, 2.0], [3.0, 4.0]]), dims=1).tolist()
    [[2.0, 1.0], [4.0, 3.0]]
    """
    if dims is not None:
        if axis is not None:
            raise TypeError("flip: pass axis or dims, not both")
        axis = dims
    return FLIP(x, axis=normalize_axes(axis, _data(x).ndim, "flip"))


def roll(x: Any, shift: int | Sequence[int], axis: int | Sequence[int] | None = None, *,
         dims: int | Sequence[int] | None = None) -> Any:
    """Entries shifted cyclically by `shift` along `axis` (the flattened tensor when None).

    >>> import checkpoint_ad as cad
    >>> cad.roll(cad.tensor([1.0, 2.0, 3.0]), 1).tolist()
    [3.0, 1.0, 2.0]
    """
    if dims is not None:
        if axis is not None:
            raise TypeError("roll: pass axis or dims, not both")
        axis = dims
    shifts = (shift,) if isinstance(shift, int) else tuple(shift)
    if axis is None:
        if len(shifts) != 1:
            raise ShapeError(f"roll without an axis takes one shift, got {list(shifts)}")
        flat = reshape(x, (-1,))
        return reshape(ROLL(flat, shift=shifts, axis=(0,)), _data(x).shape)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(axes) != len(shifts):
        raise ShapeError(f"roll: {len(shifts)} shifts for {len(axes)} axes; give one per axis")
    ndim = _data(x).ndim
    return ROLL(x, shift=shifts, axis=tuple(_axis(a, ndim, "roll") for a in axes))


def take_along_axis(x: Any, indices: Any, axis: int = -1) -> Any:
    """Entries of x picked along `axis` by integer `indices` of the same rank (PyTorch's
    ``gather``); repeated indices add up in the gradient.

    >>> import numpy as np, checkpoint_ad as cad
    >>> x = cad.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> cad.take_along_axis(x, np.array([[1], [0]]), 1).tolist()
    [[2.0], [3.0]]
    """
    data = _data(x)
    index = _data(indices)
    if not hasattr(index, "dtype"):
        index = np.asarray(index)
    if "int" not in str(index.dtype):
        raise ShapeError(f"take_along_axis wants integer indices, got dtype {index.dtype}")
    if len(index.shape) != data.ndim:
        raise ShapeError(
            f"take_along_axis: indices have {len(index.shape)} dimensions, x has {data.ndim}; "
            "give indices the same rank (size 1 along axes you do not pick from is not enough)"
        )
    axis = _axis(axis, data.ndim, "take_along_axis")
    for d, (n, m) in enumerate(zip(index.shape, data.shape)):
        if d != axis and n != m:
            raise ShapeError(
                f"take_along_axis: indices of shape {list(index.shape)} and x of shape "
                f"{list(data.shape)} differ along axis {d}; they may differ only along {axis}"
            )
    if not isinstance(index, type(data)):
        index = namespace(data).asarray(index)
    return TAKE_ALONG_AXIS(x, indices=index, axis=axis, source=tuple(data.shape))


def argsort(x: Any, axis: int = -1, descending: bool = False, *, dim: int | None = None) -> Any:
    """Positions that sort x along `axis` (stable: ties keep their order).

    >>> import checkpoint_ad as cad
    >>> cad.argsort(cad.tensor([3.0, 1.0, 2.0])).tolist()
    [1, 2, 0]
    """
    if dim is not None:
        axis = dim
    axis = _axis(axis, _data(x).ndim, "argsort")
    return ARGSORT(x, axis=axis, descending=bool(descending))


def sort(x: Any, axis: int = -1, descending: bool = False, *, dim: int | None = None) -> Any:
    """x sorted along `axis`; the gradient goes back to each value's original place.

    numpy's spelling returns the sorted values; PyTorch's (``dim=``) returns
    ``(values, indices)`` as PyTorch does.

    >>> import checkpoint_ad as cad
    >>> cad.sort(cad.tensor([3.0, 1.0, 2.0])).tolist()
    [1.0, 2.0, 3.0]
    >>> cad.sort(cad.tensor([3.0, 1.0, 2.0]), dim=0, descending=True).indices.tolist()
    [0, 2, 1]
    """
    order = argsort(x, axis if dim is None else dim, descending)
    values = take_along_axis(x, order, axis if dim is None else dim)
    return values if dim is None else ValuesIndices(values, order)
