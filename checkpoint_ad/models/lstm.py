"""An LSTM (Hochreiter & Schmidhuber 1997, with a forget gate): a recurrent model whose carry
is a tuple (h, c), the case a scan must handle beyond a single tensor.

z = h @ Wh + x_t @ Wx + b is split into the input, forget, cell and output gates;
c' = f * c + i * g and h' = o * tanh(c'). The forget-gate bias starts at 1 so that the cell
remembers by default. As for the RNN, the loss sums every hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops import sigmoid, tanh
from ..ops import sum as reduce_sum
from ..tensor import Tensor
from .base import UnrolledModel, check_config, total


@dataclass(frozen=True)
class LSTMConfig:
    """Sizes of the LSTM; `steps` is the sequence length."""

    steps: int = 20
    batch: int = 4
    input_size: int = 3
    hidden: int = 8
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("steps", "batch", "input_size", "hidden"), ("seed",))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class LSTM(UnrolledModel):
    """carry: (h, c), each (batch, hidden); x: x_t (batch, input_size); y: sum(h_t).

    >>> from checkpoint_ad.models.lstm import LSTMConfig, make_lstm
    >>> model = make_lstm(LSTMConfig(steps=5, dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: LSTMConfig) -> None:
        self.config = config
        self.n_steps = config.steps
        rng = np.random.default_rng(config.seed)
        h, i = config.hidden, config.input_size
        bias = 0.1 * rng.standard_normal(4 * h)
        bias[h:2 * h] += 1.0
        self.Wh = self._parameter(rng.standard_normal((h, 4 * h)) / np.sqrt(h))
        self.Wx = self._parameter(rng.standard_normal((i, 4 * h)) / np.sqrt(i))
        self.b = self._parameter(bias)
        self.xs = self._constant(rng.standard_normal((config.steps, config.batch, i)))

    def init_carry(self) -> tuple[Tensor, Tensor]:
        zeros = np.zeros((self.config.batch, self.config.hidden))
        return self._constant(zeros), self._constant(zeros)

    def inputs(self) -> Tensor:
        return self.xs

    def step(self, carry: tuple[Tensor, Tensor], x: Tensor) -> tuple[Any, Tensor]:
        h, c = carry
        n = self.config.hidden
        z = h @ self.Wh + x @ self.Wx + self.b
        i = sigmoid(z[:, :n])
        f = sigmoid(z[:, n:2 * n])
        g = tanh(z[:, 2 * n:3 * n])
        o = sigmoid(z[:, 3 * n:])
        c = f * c + i * g
        h = o * tanh(c)
        return (h, c), reduce_sum(h)

    def loss(self, final_carry: Any, ys: Any) -> Tensor:
        return total(ys)

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """Backpropagation through time by hand: grads for [Wh, Wx, b]."""
        Wh, Wx, b = self._host()
        xs = self.xs.numpy()
        n = self.config.hidden
        zeros = np.zeros((self.config.batch, n), dtype=Wh.dtype)
        hs, cs, gates = [zeros], [zeros], []
        for x in xs:
            z = hs[-1] @ Wh + x @ Wx + b
            i, f, o = _sigmoid(z[:, :n]), _sigmoid(z[:, n:2 * n]), _sigmoid(z[:, 3 * n:])
            g = np.tanh(z[:, 2 * n:3 * n])
            cs.append(f * cs[-1] + i * g)
            hs.append(o * np.tanh(cs[-1]))
            gates.append((i, f, g, o))
        loss = float(sum(h.sum() for h in hs[1:]))
        gWh, gWx, gb = np.zeros_like(Wh), np.zeros_like(Wx), np.zeros_like(b)
        gh, gc = np.zeros_like(zeros), np.zeros_like(zeros)
        for t in range(self.n_steps, 0, -1):
            i, f, g, o = gates[t - 1]
            gh = gh + 1.0
            tc = np.tanh(cs[t])
            gc = gc + gh * o * (1.0 - tc * tc)
            gz = np.concatenate([
                gc * g * i * (1.0 - i),
                gc * cs[t - 1] * f * (1.0 - f),
                gc * i * (1.0 - g * g),
                gh * tc * o * (1.0 - o),
            ], axis=1)
            gWh += hs[t - 1].T @ gz
            gWx += xs[t - 1].T @ gz
            gb += gz.sum(axis=0)
            gh = gz @ Wh.T
            gc = gc * f
        return loss, [gWh, gWx, gb]


def make_lstm(config: LSTMConfig | None = None) -> LSTM:
    """An LSTM with parameters and inputs drawn from `config.seed`."""
    return LSTM(config if config is not None else LSTMConfig())
