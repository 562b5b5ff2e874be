"""JAX's ``jax.checkpoint_policies``: the named policies `remat` and `checkpoint(policy=...)`
take, and nothing else (``dir()`` lists the policies alone; how each maps onto a strategy of
this library is in `jax_policies`).

>>> import checkpoint_ad as cad
>>> cad.checkpoint_policies.dots_saveable
checkpoint_policies.dots_saveable
"""

from __future__ import annotations

from .policy import (
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    offload_dot_with_no_batch_dims,
    save_and_offload_only_these_names,
    save_any_names_but_these,
    save_only_these_names,
)

__all__ = [
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "offload_dot_with_no_batch_dims",
    "save_and_offload_only_these_names",
    "save_any_names_but_these",
    "save_only_these_names",
]


def __dir__() -> list[str]:
    return list(__all__)
