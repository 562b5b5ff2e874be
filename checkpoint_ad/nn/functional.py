"""Stateless network functions under PyTorch's names (``checkpoint_ad.nn.functional as F``).

Each is a composition of the ops, so every storage strategy applies to it and none needs a
gradient rule of its own (attention's scale, causal mask and softmax are one primitive of the op
tables, `ops.normalizing.attention_softmax`). Weights follow PyTorch's layouts (a linear
weight is (out, in)), so ``F.linear(x, w, b)`` gives the same numbers for the same arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops, random
from ..backend import to_device
from ..errors import ShapeError
from ..ops.normalizing import attention_softmax
from ..strategies.selective import ATTENTION, region
from ..tensor import Tensor
from .losses import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss

__all__ = [
    "binary_cross_entropy_with_logits", "cross_entropy", "dropout", "embedding", "gelu",
    "layer_norm", "linear", "log_softmax", "mse_loss", "nll_loss", "relu", "sigmoid", "silu",
    "scaled_dot_product_attention", "softmax", "softplus", "tanh",
]

relu = ops.relu
sigmoid = ops.sigmoid
softplus = ops.softplus
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


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit, x * Phi(x); ``approximate="tanh"`` is the tanh formula.
    One primitive (`checkpoint_ad.gelu`): it saves its input only and keeps its dtype.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> round(F.gelu(cad.tensor([1.0], dtype="float64")).item(), 5)
    0.84134
    """
    return ops.gelu(x, approximate)


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
    as PyTorch), then scaled by `weight` and shifted by `bias`. One primitive
    (`checkpoint_ad.layer_norm`): it saves x, per-row mean and 1/std, and the weight.

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
    return ops.layer_norm(x, axes, weight, bias, eps)



def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None,
) -> Tensor:
    """softmax(query @ key^T * scale + mask) @ value over the last two axes, PyTorch's function:
    query (..., L, E), key (..., S, E), value (..., S, Ev); `scale` defaults to 1/sqrt(E).

    `attn_mask` broadcasts to (..., L, S): booleans say which positions take part (True), a
    float mask is added to the scores; ``is_causal=True`` lets position i see positions <= i
    (the top-left triangle, as PyTorch). Dropout (always applied when `dropout_p` > 0, as in
    PyTorch) draws from the engine's generator. Without `attn_mask`, the scale, the causal
    mask and the softmax are one primitive that saves its output (`attention_softmax`). The
    whole core is one `region` named "attention": under `strategies.Selective` it keeps only
    q, k, v and is re-run in backward.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import functional as F
    >>> q = cad.randn(2, 3, 5, 4, generator=0)
    >>> F.scaled_dot_product_attention(q, q, q, is_causal=True).shape
    (2, 3, 5, 4)
    """
    if query.ndim < 2 or key.ndim < 2 or value.ndim < 2 or query.shape[-1] != key.shape[-1] or (
        key.shape[-2] != value.shape[-2]
    ):
        raise ShapeError(
            f"scaled_dot_product_attention: query {list(query.shape)}, key {list(key.shape)} "
            f"and value {list(value.shape)} do not fit; expected (..., L, E), (..., S, E) and "
            "(..., S, Ev)"
        )
    if is_causal and attn_mask is not None:
        raise ShapeError("scaled_dot_product_attention: pass attn_mask or is_causal=True, "
                         "not both (as in PyTorch); fold the causal triangle into the mask")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must lie in [0, 1], got "
                         f"{dropout_p!r}")
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    keep, added = _attention_mask(attn_mask)

    def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = ops.matmul(q, ops.matrix_transpose(k))
        if keep is None and added is None:  # scale, causal mask and softmax in one primitive
            weights = attention_softmax(scores, factor, is_causal)
        else:
            scores = scores * factor
            if keep is not None:
                scores = ops.masked_fill(scores, ops.logical_not(keep), -math.inf)
            if added is not None:
                scores = scores + added
            weights = ops.softmax(scores, -1)
        if dropout_p > 0.0:
            weights = dropout(weights, dropout_p)
        return ops.matmul(weights, v)

    return region(ATTENTION, core, query, key, value)


def _attention_mask(mask: Any) -> tuple[Any, Any]:
    """(where positions take part, as a boolean array, or None; a float mask to add, or None).
    A boolean mask is a constant: the re-run of a checkpointed core reads the same one."""
    if mask is None:
        return None, None
    data = mask._data if isinstance(mask, Tensor) else mask
    if "bool" in str(data.dtype):
        return data, None
    return None, mask
