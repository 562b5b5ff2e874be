"""Time-stepped 2-D heat equation with a learnable diffusivity field and source: the classic
adjoint use-case, where the gradient of a final-time misfit needs every intermediate state.

u_{t+1} = u_t + dt * kappa * (D u_t + u_t D) + dt * a_t * q on an N x N grid with zero
(Dirichlet) boundary values, where D is the 1-D second-difference matrix / h^2 (so D u + u D is
the 5-point Laplacian), kappa = kappa_max * sigmoid(theta) keeps the diffusivity in
(0, kappa_max), and dt = cfl * h^2 / (4 kappa_max) keeps the explicit scheme stable (every
update weight non-negative) whatever theta becomes during training. a_t is a fixed forcing
schedule (the scanned input); theta and the source field q are the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelConfigError
from ..ops import sigmoid
from ..ops import sum as reduce_sum
from ..tensor import Tensor
from .base import UnrolledModel, check_config, total


@dataclass(frozen=True)
class HeatConfig:
    """Grid size N, number of time steps, stability fraction `cfl` in (0, 1], and the weight
    `reg` of the time-integrated energy sum_t dt |u_t|^2 added to the misfit."""

    grid: int = 16
    steps: int = 50
    kappa_max: float = 1.0
    cfl: float = 0.8
    reg: float = 1e-3
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("grid", "steps", "kappa_max", "cfl"), ("reg", "seed"))
        if self.cfl > 1:
            raise ModelConfigError(
                f"HeatConfig.cfl must be at most 1 (the explicit scheme's stability limit), "
                f"got {self.cfl!r}"
            )

    @property
    def dt(self) -> float:
        h = 1.0 / (self.grid + 1)
        return self.cfl * h * h / (4.0 * self.kappa_max)


def _laplacian_1d(n: int) -> np.ndarray:
    h = 1.0 / (n + 1)
    return (np.diag(-2.0 * np.ones(n)) + np.diag(np.ones(n - 1), 1)
            + np.diag(np.ones(n - 1), -1)) / (h * h)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


class Heat(UnrolledModel):
    """carry: u (N, N); x: a_t (scalar); y: dt * |u_{t+1}|^2.

    loss = 0.5 |u_T - target|^2 + reg * sum_t y_t, where the target comes from the same solver
    run with hidden "true" theta and q, so training has a reachable optimum.

    >>> from checkpoint_ad.models.heat import HeatConfig, make_heat
    >>> model = make_heat(HeatConfig(grid=6, steps=5, dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: HeatConfig) -> None:
        self.config = config
        self.n_steps = config.steps
        rng = np.random.default_rng(config.seed)
        n = config.grid
        self.theta = self._parameter(np.zeros((n, n)))
        self.q = self._parameter(np.zeros((n, n)))
        grid = np.linspace(0.0, 1.0, n + 2)[1:-1]
        self._u0 = np.exp(-40.0 * ((grid[:, None] - 0.4) ** 2 + (grid[None, :] - 0.5) ** 2))
        self._laplacian = _laplacian_1d(n)
        self._schedule = np.sin(np.pi * (np.arange(config.steps) + 0.5) / config.steps)
        true_theta = rng.standard_normal((n, n))
        true_q = 20.0 * rng.standard_normal((n, n))
        us = self._forward_numpy(true_theta, true_q, np.float64)
        self.laplacian = self._constant(self._laplacian)
        self.schedule = self._constant(self._schedule)
        self.target = self._constant(us[-1])

    def _forward_numpy(self, theta: np.ndarray, q: np.ndarray, dtype: Any) -> list[np.ndarray]:
        D = self._laplacian.astype(dtype)
        kappa = self.config.kappa_max * _sigmoid(theta)
        dt = self.config.dt
        us = [self._u0.astype(dtype)]
        for a in self._schedule.astype(dtype):
            u = us[-1]
            us.append(u + dt * (kappa * (D @ u + u @ D)) + (dt * a) * q)
        return us

    def init_carry(self) -> Tensor:
        return self._constant(self._u0)

    def inputs(self) -> Tensor:
        return self.schedule

    def run(self, loop: Any = None) -> Tensor:
        # the diffusivity field is the same at every step: compute it once per run, so the
        # tape saves it once (the steps capture it; its gradient flows back to theta). It stays
        # set after the run: checkpointing strategies re-run steps during the backward sweep.
        self._kappa = sigmoid(self.theta) * self.config.kappa_max
        return super().run(loop)

    def step(self, u: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        dt = self.config.dt
        kappa = getattr(self, "_kappa", None)
        if kappa is None:  # a step called on its own, outside run()
            kappa = sigmoid(self.theta) * self.config.kappa_max
        D = self.laplacian
        u = u + (kappa * (D @ u + u @ D)) * dt + self.q * (a * dt)
        return u, reduce_sum(u * u) * dt

    def loss(self, final_carry: Tensor, ys: Any) -> Tensor:
        miss = final_carry - self.target
        return 0.5 * reduce_sum(miss * miss) + self.config.reg * total(ys)

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """The discrete adjoint by hand: grads for [theta, q]."""
        theta, q = self._host()
        dtype = theta.dtype
        dt, reg = self.config.dt, self.config.reg
        D = self._laplacian.astype(dtype)
        sig = _sigmoid(theta)
        kappa = self.config.kappa_max * sig
        us = self._forward_numpy(theta, q, dtype)
        miss = us[-1] - self.target.numpy()
        energy = sum((u * u).sum() for u in us[1:])
        loss = float(0.5 * (miss * miss).sum() + reg * dt * energy)
        g_kappa, g_q = np.zeros_like(theta), np.zeros_like(q)
        gu = miss
        for t in range(self.n_steps - 1, -1, -1):
            gu = gu + 2.0 * reg * dt * us[t + 1]
            u = us[t]
            g_kappa += dt * gu * (D @ u + u @ D)
            g_q += dt * self._schedule[t].astype(dtype) * gu
            g_lap = dt * kappa * gu
            gu = gu + D.T @ g_lap + g_lap @ D.T
        g_theta = g_kappa * self.config.kappa_max * sig * (1.0 - sig)
        return loss, [g_theta, g_q]


def make_heat(config: HeatConfig | None = None) -> Heat:
    """A heat-equation inverse problem whose hidden truth is drawn from `config.seed`."""
    return Heat(config if config is not None else HeatConfig())
