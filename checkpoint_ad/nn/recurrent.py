"""Recurrent cells and multi-layer RNN/GRU/LSTM whose time loop runs through `scan`.

Why through `scan`: the loop is where a recurrent network spends its memory (every step's
saved values), and `scan` is where checkpointing strategies apply to loops. Passing
``strategy=Binomial(s)`` (or any loop or storage strategy, or setting one with
`checkpoint_ad.use`) trades recomputation for memory without touching the model.

Parameter names, shapes, gate order and formulas are PyTorch's documented ones, so state dicts
load across: ``weight_ih_l{k}`` (G*hidden, in), ``weight_hh_l{k}`` (G*hidden, hidden),
``bias_ih_l{k}``, ``bias_hh_l{k}`` (G*hidden), with G = 1 (RNN), 3 (GRU: r, z, n) or
4 (LSTM: i, f, g, o), all drawn from U(-1/sqrt(hidden), 1/sqrt(hidden)).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import ops
from ..errors import ModuleConfigError, ShapeError
from ..strategies.loops.scan import scan
from ..tensor import Tensor
from . import functional as F
from .layers import make_rng
from .module import Module, Parameter, check_size

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _gates(x: Tensor, count: int) -> list[Tensor]:
    size = x.shape[-1] // count
    return [x[..., i * size:(i + 1) * size] for i in range(count)]


def _hidden_part(h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    return F.linear(h, w_hh, b_hh)


def rnn_update(x_part: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None,
               nonlinearity: str = "tanh") -> Tensor:
    """h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh), given the input part ``x W_ih^T + b_ih``."""
    pre = x_part + _hidden_part(h, w_hh, b_hh)
    return ops.tanh(pre) if nonlinearity == "tanh" else ops.relu(pre)


def gru_update(x_part: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    """PyTorch's GRU: r, z = sigmoid(...), n = tanh(x_n + r * (W_hn h + b_hn)),
    h' = (1 - z) * n + z * h."""
    x_r, x_z, x_n = _gates(x_part, 3)
    h_r, h_z, h_n = _gates(_hidden_part(h, w_hh, b_hh), 3)
    r = ops.sigmoid(x_r + h_r)
    z = ops.sigmoid(x_z + h_z)
    n = ops.tanh(x_n + r * h_n)
    return (1.0 - z) * n + z * h


def lstm_update(x_part: Tensor, h: Tensor, c: Tensor, w_hh: Tensor,
                b_hh: Tensor | None) -> tuple[Tensor, Tensor]:
    """PyTorch's LSTM: gates i, f, g, o; c' = f * c + i * g, h' = o * tanh(c')."""
    gates = x_part + _hidden_part(h, w_hh, b_hh)
    i, f, g, o = _gates(gates, 4)
    c_next = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(g)
    return ops.sigmoid(o) * ops.tanh(c_next), c_next


class _CellBase(Module):
    kind = "RNN"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 dtype: Any = "float32", device: str | None = None,
                 rng: np.random.Generator | None = None, seed: int | None = None) -> None:
        name = f"{self.kind}Cell"
        self.input_size = check_size(name, "input_size", input_size)
        self.hidden_size = check_size(name, "hidden_size", hidden_size)
        rng = make_rng(name, rng, seed)
        rows = _GATES[self.kind] * hidden_size
        bound = 1.0 / math.sqrt(hidden_size)

        def draw(*shape: int) -> Parameter:
            return Parameter(rng.uniform(-bound, bound, shape), dtype=dtype, device=device)

        self.weight_ih = draw(rows, input_size)
        self.weight_hh = draw(rows, hidden_size)
        self.bias_ih = draw(rows) if bias else None
        self.bias_hh = draw(rows) if bias else None

    def _start(self, x: Tensor, h: Tensor | None) -> Tensor:
        if x.shape[-1:] != (self.input_size,) or x.ndim not in (1, 2):
            raise ShapeError(
                f"{type(self).__name__}: input must be (batch, {self.input_size}) or "
                f"({self.input_size},), got {list(x.shape)}"
            )
        if h is None:
            return ops.broadcast_to(ops.zeros_like(x[..., :1]), (*x.shape[:-1], self.hidden_size))
        return h

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"


class RNNCell(_CellBase):
    """One Elman RNN step, h' = tanh(x W_ih^T + b_ih + h W_hh^T + b_hh) (or relu).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import RNNCell
    >>> RNNCell(3, 5, seed=0)(cad.ones(2, 3)).shape
    (2, 5)
    """

    kind = "RNN"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True,
                 nonlinearity: str = "tanh", **options: Any) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ModuleConfigError(f"RNNCell: nonlinearity must be 'tanh' or 'relu', got "
                                    f"{nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, bias, **options)

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        h = self._start(x, h)
        return rnn_update(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                          self.bias_hh, self.nonlinearity)


class GRUCell(_CellBase):
    """One GRU step with PyTorch's gates (r, z, n) and formulas.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import GRUCell
    >>> GRUCell(3, 5, seed=0)(cad.ones(2, 3)).shape
    (2, 5)
    """

    kind = "GRU"

    def forward(self, x: Tensor, h: Tensor | None = None) -> Tensor:
        h = self._start(x, h)
        return gru_update(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh,
                          self.bias_hh)


class LSTMCell(_CellBase):
    """One LSTM step with PyTorch's gates (i, f, g, o); takes and returns (h, c).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.nn import LSTMCell
    >>> h, c = LSTMCell(3, 5, seed=0)(cad.ones(2, 3))
    >>> h.shape, c.shape
    ((2, 5), (2, 5))
    """

    kind = "LSTM"

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor]:
        h0 = self._start(x, None)
        h, c = state if state is not None else (h0, h0)
        return lstm_update(F.linear(x, self.weight_ih, self.bias_ih), h, c, self.weight_hh,
                           self.bias_hh)


class _Recurrent(Module):
    kind = "RNN"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0,
                 strategy: Any = None, dtype: Any = "float32", device: str | None = None,
                 rng: np.random.Generator | None = None, seed: int | None = None,
                 generator: Any = None, nonlinearity: str = "tanh") -> None:
        name = self.kind
        self.input_size = check_size(name, "input_size", input_size)
        self.hidden_size = check_size(name, "hidden_size", hidden_size)
        self.num_layers = check_size(name, "num_layers", num_layers)
        if not 0.0 <= dropout <= 1.0:
            raise ModuleConfigError(f"{name}: dropout must lie in [0, 1], got {dropout!r}")
        if nonlinearity not in ("tanh", "relu"):
            raise ModuleConfigError(f"{name}: nonlinearity must be 'tanh' or 'relu', got "
                                    f"{nonlinearity!r}")
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.strategy = strategy
        self.nonlinearity = nonlinearity
        if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool):
            generator = np.random.default_rng(int(generator))
        self.generator = generator
        rng = make_rng(name, rng, seed)
        rows = _GATES[self.kind] * hidden_size
        bound = 1.0 / math.sqrt(hidden_size)
        for layer in range(num_layers):
            width = input_size if layer == 0 else hidden_size
            names = [("weight_ih", (rows, width)), ("weight_hh", (rows, hidden_size))]
            if bias:
                names += [("bias_ih", (rows,)), ("bias_hh", (rows,))]
            for label, shape in names:
                setattr(self, f"{label}_l{layer}", Parameter(
                    rng.uniform(-bound, bound, shape), dtype=dtype, device=device))

    def _weights(self, layer: int) -> tuple[Any, Any, Any, Any]:
        get = vars(self).get
        return (get(f"weight_ih_l{layer}"), get(f"weight_hh_l{layer}"),
                get(f"bias_ih_l{layer}"), get(f"bias_hh_l{layer}"))

    def _layer(self, layer: int, xs: Tensor, carry: Any) -> tuple[Any, Tensor]:
        w_ih, w_hh, b_ih, b_hh = self._weights(layer)
        projected = F.linear(xs, w_ih, b_ih)  # every step's input part in one product
        kind, nonlinearity = self.kind, self.nonlinearity

        def step(state: Any, x_part: Tensor) -> tuple[Any, Tensor]:
            if kind == "LSTM":
                h, c = lstm_update(x_part, state[0], state[1], w_hh, b_hh)
                return (h, c), h
            if kind == "GRU":
                h = gru_update(x_part, state, w_hh, b_hh)
            else:
                h = rnn_update(x_part, state, w_hh, b_hh, nonlinearity)
            return h, h

        return scan(step, carry, xs=projected, strategy=self.strategy)

    def forward(self, x: Tensor, hx: Any = None) -> tuple[Tensor, Any]:
        """(output, h_n) for RNN/GRU, (output, (h_n, c_n)) for LSTM, as in PyTorch."""
        name = self.kind
        if x.ndim not in (2, 3) or x.shape[-1] != self.input_size:
            raise ShapeError(
                f"{name}: input must be (seq, batch, {self.input_size}) (batch first with "
                f"batch_first=True) or (seq, {self.input_size}), got {list(x.shape)}"
            )
        unbatched = x.ndim == 2
        if unbatched:
            x = ops.expand_dims(x, 1)
        elif self.batch_first:
            x = ops.swapaxes(x, 0, 1)
        batch = x.shape[1]
        zeros = ops.zeros_like(x[0, :, :1])  # (batch, 1): the input's dtype and device
        start = _initial_state(hx, self.kind, self.num_layers, batch, self.hidden_size,
                               unbatched, zeros)
        finals: list[Any] = []
        out = x
        for layer in range(self.num_layers):
            if layer and self.dropout and self.training:
                out = F.dropout(out, self.dropout, True, self.generator)
            carry, out = self._layer(layer, out, start[layer])
            finals.append(carry)
        if unbatched:
            out = ops.squeeze(out, 1)
        elif self.batch_first:
            out = ops.swapaxes(out, 0, 1)
        if self.kind == "LSTM":
            h_n, c_n = (_stack_layers([f[i] for f in finals], unbatched) for i in (0, 1))
            return out, (h_n, c_n)
        return out, _stack_layers(finals, unbatched)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"batch_first={self.batch_first}, strategy={self.strategy!r}")


def _stack_layers(states: list[Tensor], unbatched: bool) -> Tensor:
    stacked = ops.stack(states, axis=0)
    return ops.squeeze(stacked, 1) if unbatched else stacked


def _initial_state(hx: Any, kind: str, layers: int, batch: int, hidden: int,
                   unbatched: bool, zeros: Tensor) -> list[Any]:
    """Per-layer start states from PyTorch's (num_layers, batch, hidden) tensors, or zeros."""
    shape = (layers, hidden) if unbatched else (layers, batch, hidden)
    if hx is None:
        blank = ops.broadcast_to(zeros, (batch, hidden))
        # an LSTM's h and c as two tensors: one tensor given as both carry leaves makes step
        # 0 a program other than step 1's, and `scan` would record every step
        return [(blank, ops.broadcast_to(zeros, (batch, hidden))) if kind == "LSTM" else blank
                for _ in range(layers)]
    parts = hx if kind == "LSTM" else (hx,)
    if kind == "LSTM" and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
        raise ShapeError("LSTM: hx must be a pair (h_0, c_0)")
    for p in parts:
        if tuple(p.shape) != shape:
            raise ShapeError(f"{kind}: initial state must have shape {list(shape)}, got "
                             f"{list(p.shape)}")
    if unbatched:
        parts = tuple(ops.expand_dims(p, 1) for p in parts)
    per_layer = [[p[k] for p in parts] for k in range(layers)]
    return [tuple(s) if kind == "LSTM" else s[0] for s in per_layer]


class RNN(_Recurrent):
    """Multi-layer Elman RNN (tanh or relu) over a sequence, its loop run by `scan`.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad import nn
    >>> rnn = nn.RNN(3, 4, num_layers=2, seed=0, strategy=cad.strategies.Binomial(2))
    >>> out, h_n = rnn(cad.ones(5, 2, 3))
    >>> out.shape, h_n.shape
    ((5, 2, 4), (2, 2, 4))
    """

    kind = "RNN"


class GRU(_Recurrent):
    """Multi-layer GRU (PyTorch's gates r, z, n) over a sequence, its loop run by `scan`.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad import nn
    >>> out, h_n = nn.GRU(3, 4, batch_first=True, seed=0)(cad.ones(2, 5, 3))
    >>> out.shape, h_n.shape
    ((2, 5, 4), (1, 2, 4))
    """

    kind = "GRU"


class LSTM(_Recurrent):
    """Multi-layer LSTM (PyTorch's gates i, f, g, o) over a sequence, its loop run by `scan`.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad import nn
    >>> out, (h_n, c_n) = nn.LSTM(3, 4, seed=0)(cad.ones(5, 2, 3))
    >>> out.shape, h_n.shape, c_n.shape
    ((5, 2, 4), (1, 2, 4), (1, 2, 4))
    """

    kind = "LSTM"
