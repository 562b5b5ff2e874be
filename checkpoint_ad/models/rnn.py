"""A vanilla RNN, h_t = tanh(h_{t-1} @ W + x_t @ U + b): the textbook deep unrolled model.

The loss sums every hidden state, so each step's gradient is O(1) and a long sequence keeps
its gradients far from denormals (a loss on the last state alone would let them vanish).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops import sum as reduce_sum
from ..ops import tanh
from ..tensor import Tensor
from .base import UnrolledModel, check_config, total


@dataclass(frozen=True)
class RNNConfig:
    """Sizes of the RNN; `steps` is the sequence length T (the depth of the unrolled graph)."""

    steps: int = 20
    batch: int = 4
    input_size: int = 3
    hidden: int = 8
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("steps", "batch", "input_size", "hidden"), ("seed",))


class RNN(UnrolledModel):
    """carry: h (batch, hidden); x: x_t (batch, input_size); y: sum(h_t).

    >>> from checkpoint_ad.models.rnn import RNNConfig, make_rnn
    >>> model = make_rnn(RNNConfig(steps=5, dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: RNNConfig) -> None:
        self.config = config
        self.n_steps = config.steps
        rng = np.random.default_rng(config.seed)
        h, i = config.hidden, config.input_size
        self.W = self._parameter(rng.standard_normal((h, h)) / np.sqrt(h))
        self.U = self._parameter(rng.standard_normal((i, h)) / np.sqrt(i))
        self.b = self._parameter(0.1 * rng.standard_normal(h))
        self.xs = self._constant(rng.standard_normal((config.steps, config.batch, i)))

    def init_carry(self) -> Tensor:
        return self._constant(np.zeros((self.config.batch, self.config.hidden)))

    def inputs(self) -> Tensor:
        return self.xs

    def step(self, h: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        h = tanh(h @ self.W + x @ self.U + self.b)
        return h, reduce_sum(h)

    def loss(self, final_carry: Tensor, ys: object) -> Tensor:
        return total(ys)

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """Backpropagation through time by hand: grads for [W, U, b]."""
        W, U, b = self._host()
        xs = self.xs.numpy()
        hs = [np.zeros((self.config.batch, self.config.hidden), dtype=W.dtype)]
        for x in xs:
            hs.append(np.tanh(hs[-1] @ W + x @ U + b))
        loss = float(sum(h.sum() for h in hs[1:]))
        gW, gU, gb = np.zeros_like(W), np.zeros_like(U), np.zeros_like(b)
        gh = np.zeros_like(hs[0])
        for t in range(self.n_steps, 0, -1):
            ga = (gh + 1.0) * (1.0 - hs[t] ** 2)
            gW += hs[t - 1].T @ ga
            gU += xs[t - 1].T @ ga
            gb += ga.sum(axis=0)
            gh = ga @ W.T
        return loss, [gW, gU, gb]


def make_rnn(config: RNNConfig | None = None) -> RNN:
    """An RNN with parameters and inputs drawn from `config.seed`."""
    return RNN(config if config is not None else RNNConfig())
