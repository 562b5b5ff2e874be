"""A deep residual MLP, h_{l+1} = h_l + tanh(h_l @ W[l] + b[l]), written as a scan over layers.

The per-layer weights live in stacked parameters W (layers, width, width) and b (layers,
width), and the scanned input of layer l is the slice (W[l], b[l]): depth plays the role of
time, which is how checkpointing schemes for sequences apply to very deep networks.

Note: under the plain Python loop each `W[l]` is a getitem whose gradient is scattered into a
full (layers, width, width) array, so the backward pass costs O(layers^2 * width^2) memory
traffic; a scan that splits xs once avoids that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops import sum as reduce_sum
from ..ops import tanh
from ..tensor import Tensor
from .base import UnrolledModel, check_config, total


@dataclass(frozen=True)
class ResidualMLPConfig:
    """Sizes of the network; `reg` weights the penalty sum over layers of |h_l|^2."""

    layers: int = 16
    width: int = 16
    batch: int = 8
    reg: float = 1e-3
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("layers", "width", "batch"), ("reg", "seed"))


class ResidualMLP(UnrolledModel):
    """carry: h (batch, width); x: (W[l], b[l]); y: sum(h_{l+1}^2).

    loss = (0.5 |h_L - target|^2 + reg * sum_l |h_{l+1}|^2) / batch.

    >>> from checkpoint_ad.models.residual_mlp import ResidualMLPConfig, make_residual_mlp
    >>> model = make_residual_mlp(ResidualMLPConfig(layers=4, dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: ResidualMLPConfig) -> None:
        self.config = config
        self.n_steps = config.layers
        rng = np.random.default_rng(config.seed)
        L, w, B = config.layers, config.width, config.batch
        self.W = self._parameter(0.5 * rng.standard_normal((L, w, w)) / np.sqrt(w))
        self.b = self._parameter(0.1 * rng.standard_normal((L, w)))
        data = rng.standard_normal((B, w))
        self.data = self._constant(data)
        self.target = self._constant(np.tanh(data @ rng.standard_normal((w, w)) / np.sqrt(w)))

    def init_carry(self) -> Tensor:
        return self.data

    def inputs(self) -> tuple[Tensor, Tensor]:
        return self.W, self.b

    def step(self, h: Tensor, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        W, b = x
        h = h + tanh(h @ W + b)
        return h, reduce_sum(h * h)

    def loss(self, final_carry: Tensor, ys: Any) -> Tensor:
        miss = final_carry - self.target
        return (0.5 * reduce_sum(miss * miss) + self.config.reg * total(ys)) / self.config.batch

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """Backward through the residual stack by hand: grads for [W, b]."""
        W, b = self._host()
        reg, B = self.config.reg, self.config.batch
        hs, ss = [self.data.numpy()], []
        for k in range(self.n_steps):
            ss.append(np.tanh(hs[-1] @ W[k] + b[k]))
            hs.append(hs[-1] + ss[-1])
        miss = hs[-1] - self.target.numpy()
        penalty = sum((h * h).sum() for h in hs[1:])
        loss = float((0.5 * (miss * miss).sum() + reg * penalty) / B)
        gW, gb = np.zeros_like(W), np.zeros_like(b)
        gh = miss / B
        for k in range(self.n_steps - 1, -1, -1):
            gh = gh + 2.0 * reg * hs[k + 1] / B
            ga = gh * (1.0 - ss[k] ** 2)
            gW[k] = hs[k].T @ ga
            gb[k] = ga.sum(axis=0)
            gh = gh + ga @ W[k].T
        return loss, [gW, gb]


def make_residual_mlp(config: ResidualMLPConfig | None = None) -> ResidualMLP:
    """A residual MLP with weights, data and target drawn from `config.seed`."""
    return ResidualMLP(config if config is not None else ResidualMLPConfig())
