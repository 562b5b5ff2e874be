"""Linear algebra primitives: matmul (with batch broadcasting) and einsum."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ShapeError
from ..tape import define, vjp
from ..tensor_base import TensorBase, as_tensor_like
from .shape import broadcast_to, expand_dims, matrix_transpose, reshape, squeeze


def _parse(subscripts: str, count: int) -> tuple[list[str], str]:
    spec = subscripts.replace(" ", "")
    if "." in spec:
        raise ShapeError("einsum: '...' (ellipsis) is not supported; name every axis")
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
    """Einstein summation (no ellipsis or repeated indices within one operand)."""
    _parse(subscripts, len(operands))
    return EINSUM(list(operands), subscripts=subscripts)
