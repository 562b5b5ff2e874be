"""A neural ODE, dy/dt = tanh(y @ W1 + b1) @ W2, integrated with fixed-step classical RK4.

Each RK4 step evaluates the network four times, so the unrolled graph is deep and wide in
saved values: storing every stage is the memory problem that checkpointing ODE adjoints
(Chen et al. 2018; ANODE, Gholami et al. 2019) address. The scanned input is the step size,
which lets a schedule of uneven steps be passed without changing the step function.
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
class NeuralODEConfig:
    """State size `dim`, network width `hidden`, RK4 `steps` over [0, t_final], and the weight
    `reg` of the penalty sum_t dt |y_t|^2 added to the misfit."""

    dim: int = 4
    hidden: int = 16
    batch: int = 8
    steps: int = 20
    t_final: float = 1.0
    reg: float = 1e-3
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("dim", "hidden", "batch", "steps", "t_final"), ("reg", "seed"))


def _rotation(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random orthogonal matrix with determinant +1 (a flow can reach it)."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


class NeuralODE(UnrolledModel):
    """carry: y (batch, dim); x: the step size dt; y_t: dt * |y_{t+1}|^2.

    loss = (0.5 |y_T - target|^2 + reg * sum_t y_t) / batch, with target = y_0 @ R for a
    random rotation R.

    >>> from checkpoint_ad.models.neural_ode import NeuralODEConfig, make_neural_ode
    >>> model = make_neural_ode(NeuralODEConfig(steps=4, dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: NeuralODEConfig) -> None:
        self.config = config
        self.n_steps = config.steps
        rng = np.random.default_rng(config.seed)
        d, w = config.dim, config.hidden
        self.W1 = self._parameter(rng.standard_normal((d, w)) / np.sqrt(d))
        self.b1 = self._parameter(0.1 * rng.standard_normal(w))
        self.W2 = self._parameter(0.5 * rng.standard_normal((w, d)) / np.sqrt(w))
        y0 = rng.standard_normal((config.batch, d))
        self.y0 = self._constant(y0)
        self.target = self._constant(y0 @ _rotation(rng, d))
        self.dts = self._constant(np.full(config.steps, config.t_final / config.steps))

    def field(self, y: Tensor) -> Tensor:
        """The learned vector field f(y)."""
        return tanh(y @ self.W1 + self.b1) @ self.W2

    def init_carry(self) -> Tensor:
        return self.y0

    def inputs(self) -> Tensor:
        return self.dts

    def step(self, y: Tensor, dt: Tensor) -> tuple[Tensor, Tensor]:
        half = dt * 0.5
        k1 = self.field(y)
        k2 = self.field(y + k1 * half)
        k3 = self.field(y + k2 * half)
        k4 = self.field(y + k3 * dt)
        y = y + (k1 + k2 * 2.0 + k3 * 2.0 + k4) * (dt / 6.0)
        return y, reduce_sum(y * y) * dt

    def loss(self, final_carry: Tensor, ys: Any) -> Tensor:
        miss = final_carry - self.target
        return (0.5 * reduce_sum(miss * miss) + self.config.reg * total(ys)) / self.config.batch

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """Discrete adjoint of RK4 by hand, storing y per step and recomputing the stages:
        grads for [W1, b1, W2]."""
        W1, b1, W2 = self._host()
        reg, B = self.config.reg, self.config.batch
        dts = self.dts.numpy()

        def f(z: np.ndarray) -> np.ndarray:
            return np.tanh(z @ W1 + b1) @ W2

        def stages(y: np.ndarray, dt: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
            zs, ks = [y], [f(y)]
            for scale in (0.5 * dt, 0.5 * dt, dt):
                zs.append(y + scale * ks[-1])
                ks.append(f(zs[-1]))
            return zs, ks

        ys = [self.y0.numpy()]
        for dt in dts:
            _, (k1, k2, k3, k4) = stages(ys[-1], dt)
            ys.append(ys[-1] + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4))
        miss = ys[-1] - self.target.numpy()
        energy = sum(dt * (y * y).sum() for dt, y in zip(dts, ys[1:]))
        loss = float((0.5 * (miss * miss).sum() + reg * energy) / B)

        gW1, gb1, gW2 = np.zeros_like(W1), np.zeros_like(b1), np.zeros_like(W2)

        def f_vjp(z: np.ndarray, g: np.ndarray) -> np.ndarray:
            nonlocal gW1, gb1, gW2
            s = np.tanh(z @ W1 + b1)
            gW2 += s.T @ g
            ga = (g @ W2.T) * (1.0 - s * s)
            gW1 += z.T @ ga
            gb1 += ga.sum(axis=0)
            return ga @ W1.T

        gy = miss / B
        for t in range(self.n_steps - 1, -1, -1):
            dt = dts[t]
            gy = gy + 2.0 * reg * dt * ys[t + 1] / B
            zs, _ = stages(ys[t], dt)
            gk = [dt / 6.0 * gy, dt / 3.0 * gy, dt / 3.0 * gy, dt / 6.0 * gy]
            for i, scale in ((3, dt), (2, 0.5 * dt), (1, 0.5 * dt)):
                gz = f_vjp(zs[i], gk[i])
                gy = gy + gz
                gk[i - 1] = gk[i - 1] + scale * gz
            gy = gy + f_vjp(zs[0], gk[0])
        return loss, [gW1, gb1, gW2]


def make_neural_ode(config: NeuralODEConfig | None = None) -> NeuralODE:
    """A neural ODE with weights, initial states and target rotation drawn from `config.seed`."""
    return NeuralODE(config if config is not None else NeuralODEConfig())
