"""Losses with PyTorch's names, arguments (``reduction``, ``ignore_index``) and formulas."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import ops
from ..backend import to_device
from ..errors import ShapeError
from ..tensor import Tensor, as_tensor

__all__ = ["binary_cross_entropy_with_logits", "cross_entropy", "mse_loss", "nll_loss"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(losses: Tensor, reduction: str, op: str) -> Tensor:
    if reduction == "mean":
        return ops.mean(losses)
    if reduction == "sum":
        return ops.sum(losses)
    if reduction == "none":
        return losses
    raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def mse_loss(prediction: Tensor, target: Any, reduction: str = "mean") -> Tensor:
    """Squared differences, averaged by default (target is broadcast against prediction).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import mse_loss
    >>> mse_loss(cad.tensor([1.0, 3.0]), cad.tensor([0.0, 0.0])).item()
    5.0
    """
    diff = prediction - target
    return _reduce(diff * diff, reduction, "mse_loss")


def _labels(target: Any) -> np.ndarray:
    return np.asarray(target.numpy() if isinstance(target, Tensor) else target)


def nll_loss(log_probs: Tensor, target: Any, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of integer class labels given log-probabilities.

    `log_probs` is (N, C) or (N, C, d1, ...) with classes on axis 1, as in PyTorch; `target`
    holds N (or N x d1 x ...) labels in [0, C). Labels equal to `ignore_index` add nothing, and
    the mean is over the others. The log-probabilities are picked by integer-array indexing, so
    the gradient is a scatter rather than a dense one-hot product.

    >>> import numpy as np, checkpoint_ad as cad
    >>> from checkpoint_ad.nn import nll_loss
    >>> nll_loss(cad.tensor([[-1.0, -2.0], [-3.0, -4.0]]), np.array([1, 0])).item()
    2.5
    """
    labels = _labels(target)
    if log_probs.ndim < 2:
        raise ShapeError(
            f"cross_entropy/nll_loss wants logits of shape (N, C) or (N, C, ...), got "
            f"{list(log_probs.shape)}"
        )
    n, classes = log_probs.shape[:2]
    expected = (n, *log_probs.shape[2:])
    if labels.shape != expected or labels.dtype.kind not in "iu":
        raise ShapeError(
            f"cross_entropy/nll_loss wants {n} integer labels (shape {list(expected)}) for "
            f"logits of shape {list(log_probs.shape)}, got labels of shape "
            f"{list(labels.shape)} and dtype {labels.dtype}"
        )
    kept = labels != ignore_index
    if kept.any() and (labels[kept].min() < 0 or labels[kept].max() >= classes):
        raise ShapeError(
            f"cross_entropy/nll_loss: labels must lie in [0, {classes}) (or equal ignore_index="
            f"{ignore_index}), got values from {labels[kept].min()} to {labels[kept].max()}"
        )
    if log_probs.ndim > 2:  # classes last, then one row per position
        order = (0, *range(2, log_probs.ndim), 1)
        log_probs = ops.reshape(ops.transpose(log_probs, order), (-1, classes))
    flat_labels = np.where(kept, labels, 0).reshape(-1)
    picked = log_probs[np.arange(flat_labels.size), flat_labels]
    weights = Tensor._wrap(to_device(kept.reshape(-1).astype(np.dtype(str(picked.dtype))),
                                     picked.device))
    losses = -picked * weights
    if reduction == "mean":
        return ops.sum(losses) / float(kept.sum())
    if reduction == "none":
        return ops.reshape(losses, labels.shape)
    return _reduce(losses, reduction, "nll_loss")


def cross_entropy(logits: Tensor, labels: Any, ignore_index: int = -100,
                  reduction: str = "mean") -> Tensor:
    """`nll_loss` of ``log_softmax(logits)`` over the class axis 1: the usual classifier loss.

    The log-probabilities come from `log_softmax`, which stays finite for large logits.

    >>> import numpy as np, checkpoint_ad as cad
    >>> from checkpoint_ad.nn import cross_entropy
    >>> loss = cross_entropy(cad.tensor([[0.0, 0.0], [0.0, 0.0]]), np.array([0, 1]))
    >>> round(loss.item(), 4)
    0.6931
    """
    if logits.ndim < 2:
        raise ShapeError(
            f"cross_entropy wants logits of shape (N, C) or (N, C, ...), got "
            f"{list(logits.shape)}"
        )
    return nll_loss(ops.log_softmax(logits, axis=1), labels, ignore_index, reduction)


def binary_cross_entropy_with_logits(logits: Tensor, target: Any, reduction: str = "mean",
                                     pos_weight: Any = None) -> Tensor:
    """Binary cross-entropy of targets in [0, 1] given logits, without overflow.

    Per entry: (1 - y) x + w softplus(-x) with w = 1 + (pos_weight - 1) y, PyTorch's
    documented formula; its gradient is sigmoid(x) - y (with w = 1) at every x, 0 included.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import binary_cross_entropy_with_logits as bce
    >>> round(bce(cad.tensor([0.0]), cad.tensor([1.0])).item(), 4)
    0.6931
    """
    y = as_tensor(target, like=(logits,))
    if y.shape != logits.shape:
        raise ShapeError(
            f"binary_cross_entropy_with_logits: target shape {list(y.shape)} differs from "
            f"logits shape {list(logits.shape)}"
        )
    softplus_neg = ops.softplus(-logits, threshold=None)
    if pos_weight is None:
        losses = (1.0 - y) * logits + softplus_neg
    else:
        weight = 1.0 + (as_tensor(pos_weight, like=(logits,)) - 1.0) * y
        losses = (1.0 - y) * logits + weight * softplus_neg
    return _reduce(losses, reduction, "binary_cross_entropy_with_logits")
