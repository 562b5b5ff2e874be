"""Nested containers of tensors (pytrees): tensors or None at the leaves, inside tuples, lists
and dicts. Loops (`scan`) and the built-in models carry their state as pytrees; this is the one
place that knows how to take them apart and put them back together.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import ShapeError
from .tensor_base import TensorBase

LEAF = "*"  # the structure of a single leaf


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """(leaves in order, structure): the inverse of `unflatten`.

    >>> import checkpoint_ad as cad
    >>> leaves, spec = flatten({"h": cad.tensor(1.0), "c": (None, cad.tensor(2.0))})
    >>> len(leaves), unflatten(spec, leaves)["c"][0] is None
    (3, True)
    """
    leaves: list[Any] = []
    return leaves, _flatten(tree, leaves)


def _flatten(tree: Any, leaves: list[Any]) -> Any:
    if tree is None or isinstance(tree, TensorBase):
        leaves.append(tree)
        return LEAF
    if isinstance(tree, (tuple, list)):
        return (type(tree), [_flatten(t, leaves) for t in tree])
    if isinstance(tree, dict):
        return (dict, [(k, _flatten(v, leaves)) for k, v in tree.items()])
    raise TypeError(
        f"loop carries and outputs may be Tensors, None, or tuples/lists/dicts of them; got "
        f"{type(tree).__name__} (wrap numbers with checkpoint_ad.tensor)"
    )


def unflatten(spec: Any, leaves: Any) -> Any:
    """The tree of structure `spec` with `leaves` (any iterable) in order."""
    return _unflatten(spec, iter(leaves))


def _unflatten(spec: Any, leaves: Iterator[Any]) -> Any:
    if spec == LEAF:
        return next(leaves)
    kind, parts = spec
    if kind is dict:
        return {k: _unflatten(s, leaves) for k, s in parts}
    # from a list, not a generator: a tuple built from a generator is sized by a guess and
    # shrunk, and once freed joins the interpreter's free list for good (one per loop step)
    return kind([_unflatten(s, leaves) for s in parts])


def index_tree(xs: Any, i: int) -> Any:
    """Row `i` of every tensor in a tensor, tuple/list or dict of tensors (None stays None)."""
    if xs is None:
        return None
    if isinstance(xs, dict):
        return {key: index_tree(value, i) for key, value in xs.items()}
    if isinstance(xs, (tuple, list)):
        return type(xs)([index_tree(value, i) for value in xs])  # see `_unflatten`
    return xs[i]


def tree_length(xs: Any) -> int:
    """The leading-axis length shared by the tensors in `xs` (None entries are skipped)."""
    leaves, _ = flatten(xs)
    lengths = {len(x) for x in leaves if x is not None}
    if len(lengths) != 1:
        raise ShapeError(
            "scanned inputs must hold at least one tensor and share their leading axis "
            f"length, got lengths {sorted(lengths)}"
        )
    return lengths.pop()
