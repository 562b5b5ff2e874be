"""Training helpers: gradient clipping and saving parameters as numpy ``.npz`` files."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import ops
from ..grad_mode import no_grad
from ..tensor import Tensor
from .module import Module

__all__ = ["clip_grad_norm_", "load_npz", "save_npz"]


def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                    norm_type: float = 2.0) -> Tensor:
    """Scale all gradients in place so their joint norm is at most `max_norm`; return the norm
    they had before (PyTorch's rule: scale by max_norm / (norm + 1e-6) when that is below 1).

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor([3.0, 4.0], requires_grad=True)
    >>> (w * w).sum().backward()           # grad = (6, 8), norm 10
    >>> round(cad.nn.utils.clip_grad_norm_([w], 1.0).item(), 3)
    10.0
    >>> round(cad.linalg.norm(w.grad).item(), 3)
    1.0
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return Tensor._wrap(np.asarray(0.0))
    with no_grad():
        flat = ops.concatenate([ops.reshape(g, (-1,)) for g in grads])
        total = ops.linalg.norm(flat, ord=None if norm_type == 2.0 else norm_type)
        scale = max_norm / (total.item() + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
    return total


def _arrays(state: Module | Mapping[str, Any]) -> dict[str, np.ndarray]:
    items = state.state_dict() if isinstance(state, Module) else state
    return {k: v.numpy() if isinstance(v, Tensor) else np.asarray(v) for k, v in items.items()}


def save_npz(state: Module | Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a module's parameters (or any state dict) to a numpy ``.npz`` file by name.

    >>> import os, tempfile, checkpoint_ad as cad
    >>> layer = cad.nn.Linear(2, 3, seed=0)
    >>> path = os.path.join(tempfile.mkdtemp(), "layer.npz")
    >>> cad.nn.utils.save_npz(layer, path)
    >>> sorted(cad.nn.utils.load_npz(path))
    ['bias', 'weight']
    """
    np.savez(path, **_arrays(state))


def load_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The arrays `save_npz` wrote, by name: pass them to ``module.load_state_dict``."""
    with np.load(path) as data:
        return {k: data[k] for k in data.files}
