"""JAX's names for rematerialisation: `remat` and the policies of ``jax.checkpoint_policies``.

Each named policy maps onto a strategy this library already has:

- `nothing_saveable` (JAX's default): save only the region's inputs and recompute everything
  during backward: our `Recompute` region (`checkpoint`).
- `everything_saveable`: recompute nothing: the region runs as plain code (`KeepAll`).
- `dots_saveable`: keep what matrix products (matmul, einsum: JAX's dot_general) save, and let
  every other primitive save its inputs and recompute its output inside its rule: a per-op
  `Policy` answering "save" for products and "recompute" (`StoreInputs`) otherwise. Unlike in
  JAX, an elementwise chain is not re-derived from the products alone: each of its primitives
  keeps the inputs its rule needs.
- `dots_with_no_batch_dims_saveable`: the same, deciding per call (`Policy(per_call=True)`)
  from the operands' shapes: "save" only for a product with no batch dimensions
  (`has_batch_dims`: x @ W yes, a batched (b, n, k) @ (b, k, m) no). A product keeps its
  operands either way, so its bytes are those of `dots_saveable`.
- `offload_dot_with_no_batch_dims(offload_src, offload_dst)`: what products with no batch
  dimensions save (their operands, where JAX offloads their outputs) goes through
  `Offload(level)` ("pinned_host"/"host": host memory, "disk": the disk level); the rest is
  recomputed as above.

- `save_only_these_names(*names)`, `save_any_names_but_these(*names)`,
  `save_and_offload_only_these_names(...)`: values named with `checkpoint_name(x, name)` are
  kept (or stored through `Offload`), the region keeps its inputs, and any other value is
  recomputed. As the region re-runs the whole function (Python, not a jaxpr), keeping names
  saves the re-run only where the backward reads nothing else; it never changes a gradient.

A policy may also be any callable taking a `Primitive` and answering True (save) / False
(recompute) or one of `Policy`'s answers, or any storage strategy object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .policy import (
    NamedPolicy,
    NamesPolicy,
    as_strategy,
    checkpoint_name,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    has_batch_dims,
    nothing_saveable,
    offload_dot_with_no_batch_dims,
    save_and_offload_only_these_names,
    save_any_names_but_these,
    save_only_these_names,
    save_products,
)
from .recompute import checkpoint
from .scope import use

__all__ = [
    "NamedPolicy",
    "NamesPolicy",
    "as_strategy",
    "checkpoint_name",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "has_batch_dims",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "remat",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_only_these_names",
    "save_products",
]

def remat(fn: Callable[..., Any], *, policy: Any = None, prevent_cse: bool = True,
          static_argnums: tuple[int, ...] = ()) -> Callable[..., Any]:
    """JAX's ``jax.checkpoint``/``jax.remat``: `fn` wrapped so its saved values follow `policy`.

    Returns a function (as JAX does; `checkpoint` instead runs at once, as PyTorch does). With
    no policy the region keeps only its inputs and is re-run during backward.
    `prevent_cse` and `static_argnums` are accepted for source compatibility and have no
    effect here (nothing is traced or compiled).

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor([[0.5, -1.0], [2.0, 0.3]], requires_grad=True)
    >>> layer = cad.remat(lambda h: cad.tanh(h @ w), policy=cad.checkpoint_policies.dots_saveable)
    >>> layer(cad.ones(1, 2)).sum().backward()
    >>> w.grad.shape
    (2, 2)
    """
    if not callable(fn):
        raise TypeError(f"remat needs a function, got {type(fn).__name__}")
    strategy = as_strategy(policy)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if strategy is None:
            return checkpoint(fn, *args, policy=policy, **kwargs)
        with use(strategy):
            return fn(*args, **kwargs)

    return wrapped
