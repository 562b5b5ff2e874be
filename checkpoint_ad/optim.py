"""Optimizers: SGD (with momentum) and Adam, updating parameters in place.

Updates run under `no_grad()` with the in-place tensor methods (`sub_`, `mul_`, `add_`), so
they are not recorded, bump each parameter's version counter (a tape that saved the old value
then refuses to use it), and use only tensor arithmetic: the same code runs on numpy and cupy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import CheckpointADError
from .grad_mode import no_grad
from .ops import copy, sqrt, zeros_like
from .tensor import Tensor


class OptimizerConfigError(CheckpointADError, ValueError):
    """An optimizer was given no parameters, a non-leaf tensor, or an invalid hyperparameter."""


class Optimizer:
    """Base class: holds the parameter list, clears gradients, and applies `_update` to each
    parameter that received a gradient."""

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params = list(params)
        if not self.params:
            raise OptimizerConfigError(
                f"{type(self).__name__} got an empty parameter list; pass model.parameters()"
            )
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor) or not p.is_leaf or not p.requires_grad:
                what = type(p).__name__ if not isinstance(p, Tensor) else (
                    f"a {'non-leaf' if not p.is_leaf else 'constant'} tensor "
                    f"{p.dtype}{list(p.shape)}"
                )
                raise OptimizerConfigError(
                    f"{type(self).__name__}: params[{i}] is {what}; optimizers update leaf "
                    "tensors that require grad (e.g. nn.Parameter)"
                )
        _check_range("lr", lr, low=0.0, low_open=True)
        self.lr = float(lr)

    def zero_grad(self) -> None:
        """Forget accumulated gradients (set `.grad` to None) before the next backward."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient; those without one are left alone."""
        with no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._update(i, p, p.grad)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:
        raise NotImplementedError


def _check_range(
    name: str, value: float, low: float, high: float | None = None, low_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bracket = "(" if low_open else "["
        upper = f"{high})" if high is not None else "inf)"
        raise OptimizerConfigError(f"{name} must be a number in {bracket}{low}, {upper}, "
                                   f"got {value!r}")


class SGD(Optimizer):
    """Stochastic gradient descent: p -= lr * v, where v = momentum * v + g (PyTorch's form;
    v = g when momentum is 0).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.optim import SGD
    >>> w = cad.tensor([1.0, 2.0], requires_grad=True, dtype="float64")
    >>> opt = SGD([w], lr=0.5)
    >>> (w * w).sum().backward()
    >>> opt.step()
    >>> w.tolist()
    [0.0, 0.0]
    """

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0) -> None:
        super().__init__(params, lr)
        _check_range("momentum", momentum, low=0.0, high=1.0)
        self.momentum = float(momentum)
        self.velocity: list[Tensor | None] = [None] * len(self.params)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:
        if self.momentum:
            v = self.velocity[i]
            if v is None:
                v = self.velocity[i] = copy(g)
            else:
                v.mul_(self.momentum).add_(g)
            g = v
        p.sub_(g * self.lr)


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015, Algorithm 1): bias-corrected first and second moment estimates.

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.optim import Adam
    >>> w = cad.tensor([1.0, -1.0], requires_grad=True, dtype="float64")
    >>> opt = Adam([w], lr=0.1)
    >>> (w * w).sum().backward()
    >>> opt.step()  # the first step moves each entry by about lr against its gradient's sign
    >>> [round(x, 6) for x in w.tolist()]
    [0.9, -0.9]
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise OptimizerConfigError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _check_range("betas[0]", betas[0], low=0.0, high=1.0)
        _check_range("betas[1]", betas[1], low=0.0, high=1.0)
        _check_range("eps", eps, low=0.0, low_open=True)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.steps = [0] * len(self.params)
        self.moments: list[tuple[Any, Any] | None] = [None] * len(self.params)

    def _update(self, i: int, p: Tensor, g: Tensor) -> None:
        b1, b2 = self.betas
        if self.moments[i] is None:
            self.moments[i] = (zeros_like(p), zeros_like(p))
        m, v = self.moments[i]
        self.steps[i] += 1
        t = self.steps[i]
        m.mul_(b1).add_(g * (1.0 - b1))
        v.mul_(b2).add_(g * g * (1.0 - b2))
        m_hat = m / (1.0 - b1**t)
        v_hat = v / (1.0 - b2**t)
        p.sub_(m_hat * self.lr / (sqrt(v_hat) + self.eps))
