"""Attention and transformer encoder layers with PyTorch's names, parameters and state dict keys.

`MultiheadAttention` holds ``in_proj_weight`` (3E, E), ``in_proj_bias`` (3E) and ``out_proj``
(a `Linear`), so a PyTorch state dict loads as it is; `TransformerEncoderLayer` and
`TransformerEncoder` follow ``torch.nn``'s structure (``self_attn``, ``linear1``, ``linear2``,
``norm1``, ``norm2``; ``layers.N.``). The attention core runs through
`functional.scaled_dot_product_attention` when no weights are asked for, so
`strategies.Selective` recomputes it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ops
from ..backend import to_device
from ..errors import ModuleConfigError, ShapeError
from ..tensor import Tensor
from . import functional as F
from .layers import Dropout, LayerNorm, Linear, make_rng
from .module import Module, ModuleList, Parameter, check_size


class MultiheadAttention(Module):
    """Multi-head attention, PyTorch's ``nn.MultiheadAttention`` (query, key and value of one
    width `embed_dim`).

    Inputs are (L, N, E), or (N, L, E) with ``batch_first=True``, or unbatched (L, E).
    `forward` returns ``(attn_output, attn_weights)``: the weights (after dropout, as PyTorch)
    averaged over heads, per head with ``average_attn_weights=False``, or None when
    ``need_weights=False``. Boolean masks mark the positions that may NOT be attended
    (PyTorch's meaning here, the opposite of `scaled_dot_product_attention`'s); float masks
    are added to the scores.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import MultiheadAttention
    >>> mha = MultiheadAttention(8, 2, batch_first=True, seed=0)
    >>> x = cad.randn(3, 5, 8, generator=0)
    >>> out, weights = mha(x, x, x)
    >>> out.shape, weights.shape, list(mha.state_dict())
    ((3, 5, 8), (3, 5, 5), ['in_proj_weight', 'in_proj_bias', 'out_proj.weight', 'out_proj.bias'])
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, dtype: Any = "float32", device: str | None = None,
                 rng: np.random.Generator | None = None, seed: int | None = None) -> None:
        self.embed_dim = check_size("MultiheadAttention", "embed_dim", embed_dim)
        self.num_heads = check_size("MultiheadAttention", "num_heads", num_heads)
        if embed_dim % num_heads:
            raise ModuleConfigError(
                f"MultiheadAttention: embed_dim {embed_dim} must be divisible by num_heads "
                f"{num_heads}"
            )
        if not 0.0 <= dropout <= 1.0:
            raise ModuleConfigError(f"MultiheadAttention: dropout must lie in [0, 1], got "
                                    f"{dropout!r}")
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        rng = make_rng("MultiheadAttention", rng, seed)
        bound = math.sqrt(6.0 / (4 * embed_dim))  # Xavier-uniform on (3E, E), as PyTorch
        self.in_proj_weight = Parameter(rng.uniform(-bound, bound, (3 * embed_dim, embed_dim)),
                                        dtype=dtype, device=device)
        self.in_proj_bias = Parameter(np.zeros(3 * embed_dim), dtype=dtype, device=device) if (
            bias) else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, dtype=dtype, device=device,
                               rng=rng)
        if bias:
            self.out_proj.bias = Parameter(np.zeros(embed_dim), dtype=dtype, device=device)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any = None,
                need_weights: bool = True, attn_mask: Any = None,
                average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:
            raise ShapeError("MultiheadAttention: is_causal=True is a hint that attn_mask is the "
                             "causal mask (as in PyTorch): pass attn_mask too")
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ShapeError(
                f"MultiheadAttention: query {list(query.shape)}, key {list(key.shape)} and value "
                f"{list(value.shape)} must all be (L, N, E) (batch_first: (N, L, E)) or (L, E)"
            )
        self_attention = query is key and key is value
        if not batched:
            query, key, value = (ops.unsqueeze(t, 0) for t in (query, key, value))
        elif not self.batch_first:
            query, key, value = (ops.swapaxes(t, 0, 1) for t in (query, key, value))
        q, k, v = self._project(query, key, value, self_attention)
        mask = _merged_mask(attn_mask, key_padding_mask, q)
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = ops.matmul(q, ops.matrix_transpose(k)) * (1.0 / math.sqrt(self.head_dim))
            weights = ops.softmax(scores if mask is None else scores + mask, -1)
            weights = F.dropout(weights, p) if p > 0.0 else weights
            heads = ops.matmul(weights, v)
        else:
            heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            weights = None
        n, _, length, _ = heads.shape
        out = self.out_proj(ops.reshape(ops.swapaxes(heads, 1, 2), (n, length, self.embed_dim)))
        if not batched:
            out = out[0]
            weights = None if weights is None else weights[0]
        elif not self.batch_first:
            out = ops.swapaxes(out, 0, 1)
        if weights is not None and average_attn_weights:
            weights = ops.mean(weights, axis=-3)
        return out, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor,
                 self_attention: bool) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as (N, heads, length, head_dim); self-attention takes one product."""
        w, b, e = self.in_proj_weight, self.in_proj_bias, self.embed_dim
        if self_attention:
            parts = ops.split(F.linear(query, w, b), 3, axis=-1)
        else:
            parts = [F.linear(x, w[i * e:(i + 1) * e], None if b is None else b[i * e:(i + 1) * e])
                     for i, x in enumerate((query, key, value))]
        return tuple(  # type: ignore[return-value]
            ops.swapaxes(ops.reshape(t, (t.shape[0], t.shape[1], self.num_heads, self.head_dim)),
                         1, 2)
            for t in parts
        )

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"


def _additive(mask: Any, like: Tensor) -> Any:
    """A mask as scores to add: booleans (True: may not attend) become -inf and 0."""
    if mask is None:
        return None
    data = mask._data if isinstance(mask, Tensor) else mask
    if "bool" not in str(data.dtype):
        return mask if isinstance(mask, Tensor) else Tensor._wrap(
            to_device(np.asarray(data, dtype=like.dtype), like.device))
    host = np.asarray(to_device(data, "cpu"))
    return Tensor._wrap(to_device(np.where(host, -np.inf, 0.0).astype(like.dtype), like.device))


def _merged_mask(attn_mask: Any, key_padding_mask: Any, q: Tensor) -> Any:
    """attn_mask ((L, S) or (N*heads, L, S)) and key_padding_mask ((N, S)) as one float mask
    that broadcasts to the scores (N, heads, L, S), or None."""
    n, heads, length, _ = q.shape
    total = _additive(attn_mask, q)
    if total is not None and total.ndim == 3:
        total = ops.reshape(total, (n, heads, length, total.shape[-1]))
    padding = _additive(key_padding_mask, q)
    if padding is not None:
        padding = ops.reshape(padding, (padding.shape[0], 1, 1, padding.shape[-1]))
        total = padding if total is None else total + padding
    return total


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class TransformerEncoderLayer(Module):
    """Self-attention and a feed-forward block, each with a residual connection and LayerNorm:
    PyTorch's ``nn.TransformerEncoderLayer`` (post-norm by default, pre-norm with
    ``norm_first=True``), with its sub-module names.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import TransformerEncoderLayer
    >>> layer = TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, seed=0)
    >>> layer(cad.randn(5, 3, 8, generator=0)).shape
    (5, 3, 8)
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable[[Tensor], Tensor] = "relu",
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, dtype: Any = "float32",
                 device: str | None = None, rng: np.random.Generator | None = None,
                 seed: int | None = None) -> None:
        rng = make_rng("TransformerEncoderLayer", rng, seed)
        kinds = dict(dtype=dtype, device=device)
        self.self_attn = MultiheadAttention(d_model, nhead, dropout, bias, batch_first,
                                            rng=rng, **kinds)
        self.linear1 = Linear(d_model, dim_feedforward, bias, rng=rng, **kinds)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias, rng=rng, **kinds)
        self.norm_first = bool(norm_first)
        self.norm1 = LayerNorm(d_model, layer_norm_eps, **kinds)
        self.norm2 = LayerNorm(d_model, layer_norm_eps, **kinds)
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ModuleConfigError(
                    f"TransformerEncoderLayer: activation must be 'relu', 'gelu' or a callable, "
                    f"got {activation!r}"
                )
            activation = _ACTIVATIONS[activation]
        self.activation = activation

    def forward(self, src: Tensor, src_mask: Any = None, src_key_padding_mask: Any = None,
                is_causal: bool = False) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._attention(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._feed_forward(self.norm2(x))
        x = self.norm1(x + self._attention(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._feed_forward(x))

    def _attention(self, x: Tensor, mask: Any, padding: Any, is_causal: bool) -> Tensor:
        out, _ = self.self_attn(x, x, x, key_padding_mask=padding, need_weights=False,
                                attn_mask=mask, is_causal=is_causal)
        return self.dropout1(out)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoder(Module):
    """`num_layers` copies of `encoder_layer` (each its own parameters), then `norm` if given:
    PyTorch's ``nn.TransformerEncoder``, state dict keys ``layers.N....``.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import TransformerEncoder, TransformerEncoderLayer
    >>> encoder = TransformerEncoder(TransformerEncoderLayer(8, 2, 16, seed=0), num_layers=2)
    >>> encoder.eval()(cad.randn(5, 3, 8, generator=0)).shape
    (5, 3, 8)
    """

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int,
                 norm: Module | None = None) -> None:
        check_size("TransformerEncoder", "num_layers", num_layers)
        self.layers = ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src: Tensor, mask: Any = None, src_key_padding_mask: Any = None,
                is_causal: bool | None = None) -> Tensor:
        x = src
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                      is_causal=bool(is_causal))
        return x if self.norm is None else self.norm(x)
