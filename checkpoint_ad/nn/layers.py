"""Layers with PyTorch's parameter names, shapes and initialisation.

Every layer takes ``dtype=``, ``device=`` and, for reproducible initialisation, ``seed=`` or a
numpy ``rng=`` (not both); with neither, parameters are drawn from the engine's generator, so
``cad.manual_seed(s)`` makes them repeatable, as ``torch.manual_seed`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import ops, random
from ..errors import ModuleConfigError
from ..tensor import Tensor
from . import functional as F
from .module import Module, Parameter, check_last_axis, check_size


def make_rng(layer: str, rng: np.random.Generator | None, seed: int | None) -> Any:
    """Where a layer's initial parameters come from: `rng`, a generator seeded with `seed`, or
    else the engine's generator (which `manual_seed` seeds)."""
    if rng is not None and seed is not None:
        raise ModuleConfigError(f"{layer}: pass either rng or seed, not both")
    if rng is not None:
        return rng
    return random.generator() if seed is None else np.random.default_rng(seed)


class Linear(Module):
    """y = x @ weight.T + bias, with weight of shape (out_features, in_features).

    The layout is PyTorch's, so its state dicts load as they are. (Before this version the
    weight was stored (in, out); transpose old saved weights once.) Both are drawn from
    U(-1/sqrt(in), 1/sqrt(in)), PyTorch's default, which keeps the output's scale independent
    of the width.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Linear
    >>> layer = Linear(3, 2, seed=0, dtype="float64")
    >>> layer.weight.shape, layer(cad.tensor([[1.0, 2.0, 3.0]], dtype="float64")).shape
    ((2, 3), (1, 2))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Any = "float32", device: str | None = None,
                 rng: np.random.Generator | None = None, seed: int | None = None) -> None:
        self.in_features = check_size("Linear", "in_features", in_features)
        self.out_features = check_size("Linear", "out_features", out_features)
        rng = make_rng("Linear", rng, seed)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)),
                                dtype=dtype, device=device)
        self.bias = (
            Parameter(rng.uniform(-bound, bound, (out_features,)), dtype=dtype, device=device)
            if bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        check_last_axis(f"Linear({self.in_features}, {self.out_features})", x,
                        self.in_features)
        return F.linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class Embedding(Module):
    """A table of `num_embeddings` vectors of size `embedding_dim`, looked up by integer index.

    Drawn from N(0, 1) (PyTorch's default); the row at `padding_idx` starts at zero and gets no
    gradient.

    >>> import numpy as np
    >>> from checkpoint_ad.nn import Embedding
    >>> Embedding(10, 4, seed=0)(np.array([[1, 2, 3]])).shape
    (1, 3, 4)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 dtype: Any = "float32", device: str | None = None,
                 rng: np.random.Generator | None = None, seed: int | None = None) -> None:
        self.num_embeddings = check_size("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = check_size("Embedding", "embedding_dim", embedding_dim)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ModuleConfigError(
                f"Embedding: padding_idx {padding_idx} is outside the table of {num_embeddings}"
            )
        self.padding_idx = padding_idx
        table = make_rng("Embedding", rng, seed).standard_normal((num_embeddings, embedding_dim))
        if padding_idx is not None:
            table[padding_idx] = 0.0
        self.weight = Parameter(table, dtype=dtype, device=device)

    def forward(self, indices: Any) -> Tensor:
        return F.embedding(indices, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Normalise over the trailing `normalized_shape` axes, then scale (`weight`, ones) and
    shift (`bias`, zeros).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import LayerNorm
    >>> LayerNorm(4)(cad.randn(2, 4, generator=0)).shape
    (2, 4)
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, dtype: Any = "float32",
                 device: str | None = None) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(
            normalized_shape)
        for d in shape:
            check_size("LayerNorm", "normalized_shape", d)
        self.normalized_shape = shape
        self.eps = float(eps)
        self.weight = Parameter(np.ones(shape), dtype=dtype, device=device) if (
            elementwise_affine) else None
        self.bias = Parameter(np.zeros(shape), dtype=dtype, device=device) if (
            elementwise_affine) else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Dropout(Module):
    """Zero entries with probability `p` while training; the identity after `eval()`.

    `generator` is where masks come from: None (the engine's generator, which checkpointed
    regions and every `scan` step replay on a re-run, in any thread), a numpy Generator owned
    by this layer, or an int seed (the layer then owns ``numpy.random.default_rng(seed)``). An
    owned generator advances on every call, the re-run for the backward sweep included, so
    under checkpointing leave `generator` None.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import Dropout
    >>> layer = Dropout(0.5, generator=0)
    >>> layer.eval()(cad.ones(3)).tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, p: float = 0.5, generator: Any = None) -> None:
        if not 0.0 <= p <= 1.0:
            raise ModuleConfigError(f"Dropout: p must lie in [0, 1], got {p!r}")
        self.p = float(p)
        if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
            generator = np.random.default_rng(int(generator))
        self.generator = generator

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training, self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class _Activation(Module):
    function: Any = None

    def forward(self, x: Tensor) -> Tensor:
        return type(self).function(x)


class ReLU(_Activation):
    """max(x, 0) as a module (for `Sequential`)."""

    function = staticmethod(ops.relu)


class Tanh(_Activation):
    """tanh as a module."""

    function = staticmethod(ops.tanh)


class Sigmoid(_Activation):
    """sigmoid as a module."""

    function = staticmethod(ops.sigmoid)


class SiLU(_Activation):
    """x * sigmoid(x) as a module."""

    function = staticmethod(F.silu)


class Softplus(_Activation):
    """`functional.softplus` as a module, PyTorch's ``nn.Softplus(beta, threshold)``."""

    def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None:
        self.beta = beta
        self.threshold = threshold

    def forward(self, x: Tensor) -> Tensor:
        return F.softplus(x, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class GELU(_Activation):
    """`functional.gelu` as a module (``approximate`` 'none' or 'tanh')."""

    def __init__(self, approximate: str = "none") -> None:
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)
