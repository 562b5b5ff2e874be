"""Stateless network functions under PyTorch's names (``checkpoint_ad.nn.functional as F``).

Each is a composition of the public ops, so every storage strategy applies to it and none needs
a gradient rule of its own. Weights follow PyTorch's layouts (a linear weight is (out, in)), so
``F.linear(x, w, b)`` gives the same numbers for the same arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops, random
from ..backend import to_device
from ..errors import ShapeError
from ..tensor import Tensor
from .losses import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss

__all__ = [
    "binary_cross_entropy_with_logits", "cross_entropy", "dropout", "embedding", "gelu",
    "layer_norm", "linear", "log_softmax", "mse_loss", "nll_loss", "relu", "sigmoid", "silu",
    "softmax", "tanh",
]

relu = ops.relu
sigmoid = ops.sigmoid
tanh = ops.tanh


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) normalised over `dim` (PyTorch's keyword).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> F.softmax(cad.zeros(2, 4), dim=1).tolist()[0]
    [0.25, 0.25, 0.25, 0.25]
    """
    return ops.softmax(x, dim)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """log(softmax(x)) over `dim`, computed stably.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> round(F.log_softmax(cad.zeros(2), dim=0).tolist()[0], 4)
    -0.6931
    """
    return ops.log_softmax(x, dim)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) (also called swish).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> F.silu(cad.tensor([0.0])).tolist()
    [0.0]
    """
    return x * ops.sigmoid(x)


_ERF = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429, 0.3275911)


def _erf(x: Tensor) -> Tensor:
    """erf from Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), made of primitives."""
    a1, a2, a3, a4, a5, p = _ERF
    z = ops.abs(x)
    t = 1.0 / (1.0 + p * z)
    poly = t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5))))
    return ops.where(x >= 0, 1.0, -1.0) * (1.0 - poly * ops.exp(-z * z))


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit, x * Phi(x).

    ``approximate="tanh"`` is the tanh formula; ``"none"`` uses erf, here from a polynomial
    approximation accurate to 1.5e-7 (we have no erf primitive), so float64 results match
    PyTorch's to within 1e-7 * |x|, not to the last bit.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> round(F.gelu(cad.tensor([1.0], dtype="float64")).item(), 5)
    0.84134
    """
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + ops.tanh(inner))
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, with PyTorch's weight layout (out_features, in_features).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> F.linear(cad.ones(2, 3), cad.ones(4, 3)).shape
    (2, 4)
    """
    if weight.ndim != 2 or x.shape[-1:] != weight.shape[1:]:
        raise ShapeError(
            f"linear: input of shape {list(x.shape)} and weight of shape {list(weight.shape)} "
            "do not fit; the weight is (out_features, in_features) and the input's last axis "
            "must equal in_features"
        )
    if x.ndim > 2:  # one 2-D product, as PyTorch does: a batched one's weight gradient
        # would make a (..., in, out) product per leading index before summing them
        lead = tuple(x.shape[:-1])
        flat = ops.reshape(x, (-1, x.shape[-1]))
        return ops.reshape(linear(flat, weight, bias), (*lead, weight.shape[0]))
    out = ops.matmul(x, ops.matrix_transpose(weight))
    return out if bias is None else out + bias


def dropout(x: Tensor, p: float = 0.5, training: bool = True, generator: Any = None) -> Tensor:
    """Zero each entry with probability `p` and scale the rest by 1/(1-p) (identity when not
    training).

    The mask comes from `generator`: None draws from the engine's generator, which checkpointed
    regions and `scan` steps replay, so a re-run for the backward sweep draws the same mask;
    an int seed gives the same mask on every call; a numpy Generator advances.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> y = F.dropout(cad.ones(1000), 0.25, generator=0)
    >>> dropped = float((y == 0).numpy().mean())
    >>> sorted({round(v, 4) for v in y.tolist()}), abs(dropped - 0.25) < 0.05
    ([0.0, 1.3333], True)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must lie in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    shape, dtype, device = tuple(x.shape), np.dtype(str(x.dtype)), x.device

    def make(rng: Any) -> Any:
        draws = rng.random(shape) if isinstance(rng, np.random.Generator) else (
            rng.random_sample(shape))
        return to_device(np.asarray(draws >= p, dtype=dtype), device)

    mask = Tensor._wrap(random.sample(generator, "dropout", make, (shape, dtype, device, p)))
    return x * mask * (0.0 if p == 1.0 else 1.0 / (1.0 - p))


def embedding(indices: Any, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of `weight` picked by integer `indices` (any shape); the result has one more axis.

    Rows at `padding_idx` come out as given but pass no gradient back.

    >>> import numpy as np, checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> F.embedding(np.array([[0, 2]]), cad.eye(3)).tolist()
    [[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]
    """
    index = indices.numpy() if isinstance(indices, Tensor) else np.asarray(indices)
    if index.dtype.kind not in "iu":
        raise ShapeError(f"embedding: indices must be integers, got dtype {index.dtype}")
    rows = weight.shape[0]
    if index.size and (index.min() < -rows or index.max() >= rows):
        raise ShapeError(
            f"embedding: indices range from {index.min()} to {index.max()}, but the table has "
            f"{rows} rows"
        )
    out = weight[index]
    if padding_idx is not None:
        keep = Tensor._wrap(to_device((index != padding_idx % rows)[..., None], weight.device))
        out = ops.where(keep, out, out.detach())
    return out


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the trailing `normalized_shape` axes (biased variance,
    as PyTorch), then scaled by `weight` and shifted by `bias`.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> y = F.layer_norm(cad.tensor([[1.0, 3.0]]), 2)
    >>> [round(v, 3) for v in y.tolist()[0]]
    [-1.0, 1.0]
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[len(x.shape) - len(shape):]) != shape:
        raise ShapeError(
            f"layer_norm: input of shape {list(x.shape)} does not end in normalized_shape "
            f"{list(shape)}"
        )
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    centred = x - ops.mean(x, axis=axes, keepdims=True)
    variance = ops.mean(centred * centred, axis=axes, keepdims=True)
    out = centred / ops.sqrt(variance + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out

