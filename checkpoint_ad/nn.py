"""Just enough of a module system to write training loops: parameters, modules, Linear, losses.

A `Module` finds its parameters by looking at its attributes (and lists, tuples and dicts of
them), so a model is ordinary Python: assign a `Parameter` or a sub-module to `self` and the
optimizers in `checkpoint_ad.optim` will see it. Nothing here is on the tape: every computation
goes through the public ops, so the storage strategies apply to models built from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import CheckpointADError, ShapeError
from .grad_mode import no_grad
from .ops import copy, log_softmax, matmul, mean
from .ops import sum as reduce_sum
from .tensor import Tensor, tensor


class ModuleConfigError(CheckpointADError, ValueError):
    """A layer was asked for with sizes or options that cannot work (e.g. zero features)."""


class Parameter(Tensor):
    """A leaf tensor that requires grad and that a `Module` collects as one of its parameters.

    Why a subclass: a module may also hold constant tensors (targets, masks); only attributes
    that are Parameters are trained. The data is converted like `checkpoint_ad.tensor` does,
    then copied: optimizers update parameters in place, which must not write through to the
    caller's array (`checkpoint_ad.tensor` keeps a numpy array's storage).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Parameter
    >>> w = Parameter([1.0, 2.0], dtype="float64")
    >>> w.requires_grad, w.is_leaf, w.dtype.name
    (True, True, 'float64')
    """

    __slots__ = ()

    def __init__(
        self,
        data: Any,
        dtype: Any = None,
        device: str | None = None,
        requires_grad: bool = True,
    ) -> None:
        with no_grad():
            owned = copy(tensor(data, dtype=dtype, device=device))
        super().__init__(owned.data, requires_grad=requires_grad)


class Module:
    """Base class of layers and models: parameter discovery, `zero_grad`, and `__call__`.

    Parameters are found in attribute assignment order, recursing into sub-modules and into
    lists, tuples and dicts of modules or parameters; a parameter reachable twice is listed once.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Linear, Module
    >>> class TwoLayer(Module):
    ...     def __init__(self):
    ...         self.layers = [Linear(3, 4, seed=0), Linear(4, 1, seed=1)]
    ...     def forward(self, x):
    ...         return self.layers[1](cad.tanh(self.layers[0](x)))
    >>> [name for name, _ in TwoLayer().named_parameters()]
    ['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias']
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) pairs, each parameter once."""
        seen: set[int] = set()
        for name, p in _walk(vars(self), prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> list[Parameter]:
        """The parameters in `named_parameters` order (what an optimizer takes)."""
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        """Forget accumulated gradients (set `.grad` to None) before the next backward."""
        for p in self.parameters():
            p.grad = None


def _walk(items: Any, prefix: str) -> Iterator[tuple[str, Parameter]]:
    """Depth-first over attribute values, without recursion into tensors or other objects."""
    pairs = items.items() if isinstance(items, dict) else enumerate(items)
    for key, value in pairs:
        name = f"{prefix}{key}"
        if isinstance(value, Parameter):
            yield name, value
        elif isinstance(value, Module):
            yield from _walk(vars(value), f"{name}.")
        elif isinstance(value, (list, tuple, dict)):
            yield from _walk(value, f"{name}.")


class Linear(Module):
    """y = x @ weight + bias, with weight of shape (in_features, out_features).

    The weight is stored input-major so that `x @ weight` needs no transpose. Both are drawn
    from U(-1/sqrt(in), 1/sqrt(in)) (PyTorch's default), which keeps the output's scale
    independent of the width. Pass `seed` or a numpy `rng` for reproducible initialisation.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Linear
    >>> layer = Linear(3, 2, seed=0, dtype="float64")
    >>> layer(cad.tensor([[1.0, 2.0, 3.0]], dtype="float64")).shape
    (1, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: Any = "float32",
        device: str | None = None,
        rng: np.random.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        for label, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModuleConfigError(
                    f"Linear: {label} must be a positive int, got {value!r}"
                )
        if rng is not None and seed is not None:
            raise ModuleConfigError("Linear: pass either rng or seed, not both")
        rng = rng if rng is not None else np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(
            rng.uniform(-bound, bound, (in_features, out_features)), dtype=dtype, device=device
        )
        self.bias = (
            Parameter(rng.uniform(-bound, bound, (out_features,)), dtype=dtype, device=device)
            if bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.in_features,):
            raise ShapeError(
                f"Linear({self.in_features}, {self.out_features}) got input of shape "
                f"{list(x.shape)}; its last axis must have size {self.in_features}"
            )
        out = matmul(x, self.weight)
        return out if self.bias is None else out + self.bias

    def __repr__(self) -> str:
        return (
            f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"
        )


def mse_loss(prediction: Tensor, target: Any) -> Tensor:
    """Mean of the squared differences (target is broadcast against prediction).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import mse_loss
    >>> mse_loss(cad.tensor([1.0, 3.0]), cad.tensor([0.0, 0.0])).item()
    5.0
    """
    diff = prediction - target
    return mean(diff * diff)


def cross_entropy(logits: Tensor, labels: Any) -> Tensor:
    """Mean negative log-likelihood of integer class `labels` under softmax(`logits`).

    `logits` has shape (N, C) and `labels` N integers in [0, C). The log-probabilities come
    from `log_softmax`, which stays finite for large logits, and are picked by integer-array
    indexing, so the gradient is a scatter rather than a dense one-hot product.

    >>> import numpy as np, checkpoint_ad as cad
    >>> from checkpoint_ad.nn import cross_entropy
    >>> loss = cross_entropy(cad.tensor([[0.0, 0.0], [0.0, 0.0]]), np.array([0, 1]))
    >>> round(loss.item(), 4)
    0.6931
    """
    labels = np.asarray(labels.numpy() if isinstance(labels, Tensor) else labels)
    if logits.ndim != 2:
        raise ShapeError(
            f"cross_entropy wants logits of shape (N, C), got {list(logits.shape)}"
        )
    n, classes = logits.shape
    if labels.shape != (n,) or labels.dtype.kind not in "iu":
        raise ShapeError(
            f"cross_entropy wants {n} integer labels for logits of shape {[n, classes]}, got "
            f"labels of shape {list(labels.shape)} and dtype {labels.dtype}"
        )
    if n and (labels.min() < 0 or labels.max() >= classes):
        raise ShapeError(
            f"cross_entropy: labels must lie in [0, {classes}), got values from "
            f"{labels.min()} to {labels.max()}"
        )
    picked = log_softmax(logits, axis=-1)[np.arange(n), labels]
    return -reduce_sum(picked) / n
