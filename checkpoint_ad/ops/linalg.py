"""Linear algebra primitives: matmul (with batch broadcasting) and einsum."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

from ..errors import ShapeError
from ..tape import define, vjp
from ..tensor_base import TensorBase, as_tensor_like
from .elementwise import abs, equal, ones_like, power, sqrt, where, zeros_like
from .reductions import axis_keywords
from .reductions import max as reduce_max
from .reductions import min as reduce_min
from .reductions import sum as reduce_sum
from .shape import broadcast_to, expand_dims, matrix_transpose, reshape, squeeze


def _parse(subscripts: str, count: int) -> tuple[list[str], str]:
    spec = subscripts.replace(" ", "")
    if "." in spec:
        raise ShapeError(f"einsum: {subscripts!r}: a '.' outside one '...' per operand")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != count:
        raise ShapeError(f"einsum: {subscripts!r} names {len(terms)} operands, got {count}")
    if not arrow:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    for term in terms:
        if len(set(term)) != len(term):
            raise ShapeError(
                f"einsum: repeated index in {term!r} (diagonals) is not supported; "
                "take the diagonal with indexing first"
            )
    return terms, output


def _einsum_rule(g: Any, i: int, xs: Sequence[Any], *, subscripts: str) -> Any:
    """Gradient of operand i: contract g with every other operand back to i's indices."""
    terms, output = _parse(subscripts, len(xs))
    others = [(t, x) for j, (t, x) in enumerate(zip(terms, xs)) if j != i]
    available = set(output).union(*(set(t) for t, _ in others))
    target = "".join(c for c in terms[i] if c in available)
    spec = ",".join([output, *(t for t, _ in others)]) + "->" + target
    grad = einsum(spec, g, *(x for _, x in others))
    if target != terms[i]:  # indices summed away inside operand i alone: broadcast back
        missing = [k for k, c in enumerate(terms[i]) if c not in available]
        grad = broadcast_to(expand_dims(grad, missing), tuple(getattr(xs[i], "shape", ())))
    return grad


def _einsum_forward(xp: Any, xs: Sequence[Any], *, subscripts: str) -> Any:
    fn = getattr(xp, "einsum", None)
    if fn is None:
        raise ShapeError(f"einsum is not available for {xp.__name__} arrays; use numpy or cupy")
    return fn(subscripts, *xs)


MATMUL = define("matmul", lambda xp, a, b: xp.matmul(a, b), "a b", [
    {"a": vjp("b", lambda g, b: g @ matrix_transpose(b)),
     "b": vjp("a", lambda g, a: matrix_transpose(a) @ g)},
], broadcasts=True)
EINSUM = define("einsum", _einsum_forward, "xs", [{"xs": vjp("xs", _einsum_rule)}], variadic=True)


def matmul(a: Any, b: Any) -> Any:
    """Matrix product with numpy's rules: batch dimensions broadcast, 1-d operands are vectors."""
    if isinstance(a, TensorBase) or isinstance(b, TensorBase):
        a, b = as_tensor_like(a, like=(a, b)), as_tensor_like(b, like=(a, b))
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("matmul does not take 0-d tensors; use * for scaling")
    if a.shape[-1] != (b.shape[0] if b.ndim == 1 else b.shape[-2]):
        raise ShapeError(
            f"matmul: inner dimensions differ: a has shape {list(a.shape)} and b has shape "
            f"{list(b.shape)}; a's last dimension must equal b's second-to-last"
        )
    if a.ndim == 1 and b.ndim == 1:
        return reshape(MATMUL(reshape(a, (1, -1)), reshape(b, (-1, 1))), ())
    if a.ndim == 1:
        return squeeze(MATMUL(expand_dims(a, 0), b), -2)
    if b.ndim == 1:
        return squeeze(MATMUL(a, expand_dims(b, -1)), -1)
    return MATMUL(a, b)


def einsum(subscripts: str, *operands: Any) -> Any:
    """Einstein summation, numpy's rules: ``...`` stands for leading, broadcast axes, and
    without ``->`` the output is ``...`` then the indices used once, sorted. An index may not
    repeat within one operand (take a diagonal with indexing first).

    >>> import checkpoint_ad as cad
    >>> cad.einsum("...ij,...jk->...ik", cad.ones(2, 3, 4), cad.ones(4, 5)).shape
    (2, 3, 5)
    """
    shapes = [tuple(getattr(getattr(x, "_data", x), "shape", ())) for x in operands]
    if "..." in subscripts:
        subscripts = _name_ellipsis(subscripts, shapes)
    _parse(subscripts, len(operands))
    return EINSUM(list(operands), subscripts=_name_stretched(subscripts, shapes))


def _name_stretched(subscripts: str, shapes: Sequence[tuple[int, ...]]) -> str:
    """`subscripts` with a named axis of size 1 that numpy stretches against a longer one
    (``ij,ij`` over shapes (1, 3) and (4, 3)) given a letter of its own, summed away (a sum
    of one term): the forward is numpy's, and the gradient rule gives that operand back its
    size 1 instead of the stretched size."""
    inputs, arrow, output = subscripts.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != len(shapes) or any(len(t) != len(s) for t, s in zip(terms, shapes)):
        return subscripts  # numpy's own error names the mismatch
    longest: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        for c, d in zip(term, shape):
            longest[c] = max(longest.get(c, d), d)
    if all(d == longest[c] or d != 1 for t, s in zip(terms, shapes) for c, d in zip(t, s)):
        return subscripts
    if not arrow:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    unused = iter(c for c in string.ascii_letters if c not in subscripts)
    named = ["".join(next(unused) if d == 1 and longest[c] > 1 else c for c, d in zip(t, s))
             for t, s in zip(terms, shapes)]
    return ",".join(named) + "->" + output


def _name_ellipsis(subscripts: str, shapes: Sequence[tuple[int, ...]]) -> str:
    """`subscripts` with each ``...`` replaced by letters of its own, so the primitive and its
    rule see named axes only. The ellipsis axes broadcast right-aligned, as in numpy; a size-1
    axis against a longer one gets a letter of its own, summed away (a sum of one term), so
    the gradient rule gives it back its size 1."""
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(shapes):
        raise ShapeError(f"einsum: {subscripts!r} names {len(terms)} operands, got {len(shapes)}")
    unused = iter(c for c in string.ascii_letters if c not in spec)
    ranks = [_ellipsis_rank(subscripts, t, len(s)) for t, s in zip(terms, shapes)]
    width = max(ranks)
    sizes = _broadcast_sizes(subscripts, terms, shapes, ranks, width)
    shared = [next(unused) for _ in range(width)]
    named = []
    for term, shape, rank in zip(terms, shapes, ranks):
        if "..." not in term:
            named.append(term)
            continue
        start = term.index("...")
        letters = [shared[width - rank + j] if d == sizes[width - rank + j] else next(unused)
                   for j, d in enumerate(shape[start:start + rank])]
        named.append(term.replace("...", "".join(letters)))
    if not arrow:
        used = "".join(t.replace("...", "") for t in terms)
        output = "..." + "".join(sorted(c for c in set(used) if used.count(c) == 1))
    if "..." not in output and width:
        raise ShapeError(
            f"einsum: {subscripts!r}: the output leaves out the axes '...' stands for ({width}); "
            "put '...' in the output (or sum those axes first)"
        )
    return ",".join(named) + "->" + output.replace("...", "".join(shared))


def _ellipsis_rank(subscripts: str, term: str, ndim: int) -> int:
    """How many axes ``...`` stands for in one operand (0 if it has none)."""
    named = len(term.replace("...", ""))
    if "..." not in term:
        return 0
    if term.count("...") > 1 or "." in term.replace("...", "", 1):
        raise ShapeError(f"einsum: {subscripts!r}: an operand may hold one '...' at most")
    if named > ndim:
        raise ShapeError(
            f"einsum: {subscripts!r}: {term!r} names {named} axes of an operand with {ndim}"
        )
    return ndim - named


def _broadcast_sizes(subscripts: str, terms: Sequence[str], shapes: Sequence[tuple[int, ...]],
                     ranks: Sequence[int], width: int) -> list[int]:
    """The size of each ``...`` axis once broadcast (right-aligned, size 1 stretches)."""
    sizes = [1] * width
    for term, shape, rank in zip(terms, shapes, ranks):
        if "..." not in term:
            continue
        start = term.index("...")
        for j, d in enumerate(shape[start:start + rank]):
            k = width - rank + j
            if d != 1 and sizes[k] not in (1, d):
                raise ShapeError(
                    f"einsum: {subscripts!r}: the axes '...' stands for do not broadcast "
                    f"(sizes {sizes[k]} and {d}); operand shapes {[list(s) for s in shapes]}"
                )
            sizes[k] = max(sizes[k], d)
    return sizes


# ------------------------------------------------------------------ added for PyTorch/JAX users
def norm(x: Any, ord: float | str | None = None, axis: int | Sequence[int] | None = None,
         keepdims: bool = False, *, dim: Any = None, keepdim: bool | None = None) -> Any:
    """Vector or matrix norm (``numpy.linalg.norm``/``torch.linalg.norm``), composed of
    differentiable reductions.

    Vector norms (one axis, or a 1-d x): `ord` None or 2, 1, inf, -inf, or any p > 0. Matrix
    norms (two axes, or a 2-d x with no axis): None or 'fro' only. With no axis and more than 2
    dimensions, the 2-norm of the flattened tensor. Where the norm is 0 its gradient is 0 (the
    subgradient PyTorch picks), for every ord, rather than 0/0 = nan.

    >>> import checkpoint_ad as cad
    >>> cad.linalg.norm(cad.tensor([3.0, 4.0])).item()
    5.0
    >>> cad.linalg.norm(cad.tensor([[1.0, -2.0], [3.0, 0.0]]), ord=1, dim=1).tolist()
    [3.0, 3.0]
    """
    axis, keepdims = axis_keywords("norm", axis, keepdims, dim, keepdim)
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        ndim = len(getattr(x, "shape", ()))
    axes = (axis,) if isinstance(axis, int) else (tuple(axis) if axis is not None else None)
    matrix = (axes is not None and len(axes) == 2) or (axes is None and ndim == 2)
    if ord is None or (ord == "fro" and matrix):
        return safe_root(reduce_sum(x * x, axis=axis, keepdims=keepdims), 2)
    if matrix:
        raise ShapeError(
            f"norm: matrix norm ord={ord!r} is not available (it needs an SVD); use None or 'fro'"
        )
    if axes is None and ndim != 1:
        raise ShapeError(f"norm: ord={ord!r} needs one axis; pass dim= or flatten first")
    if ord == float("inf"):
        return reduce_max(abs(x), axis=axis, keepdims=keepdims)
    if ord == float("-inf"):
        return reduce_min(abs(x), axis=axis, keepdims=keepdims)
    if isinstance(ord, str) or ord <= 0:
        raise ShapeError(f"norm: vector ord must be inf, -inf or a number > 0, got {ord!r}")
    if ord == 1:
        return reduce_sum(abs(x), axis=axis, keepdims=keepdims)
    if ord == 2:
        return safe_root(reduce_sum(x * x, axis=axis, keepdims=keepdims), 2)
    return safe_root(reduce_sum(_zero_safe(abs(x), lambda a: power(a, ord)), axis=axis,
                                keepdims=keepdims), ord)


def _zero_safe(a: Any, fn: Any) -> Any:
    """fn(a) for a >= 0 whose gradient is taken as 0 where a == 0: fn sees 1 there and the
    result is 0, so the infinite slope of a root at 0 never meets a zero factor (0 * inf)."""
    zero = equal(a, zeros_like(a))
    value = fn(where(zero, ones_like(a), a))
    return where(zero, zeros_like(value), value)


def safe_root(total: Any, p: float) -> Any:
    """The p-th root of a sum of |x|^p (>= 0), with gradient 0 where it is 0 (x = 0), as
    PyTorch's norms and std take it."""
    return _zero_safe(total, sqrt if p == 2 else lambda s: power(s, 1.0 / p))
