"""Learning-rate schedules with PyTorch's names: call ``scheduler.step()`` once per epoch.

Each schedule is a closed form of the epoch count, written into every param group's ``"lr"``;
the optimizer reads it at its next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import OptimizerConfigError
from .optimizers import Optimizer


class LRScheduler:
    """Base class: remembers each group's starting lr and sets ``lr_at(epoch)`` on `step`.

    As in PyTorch, making a scheduler applies epoch 0 at once.
    """

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise OptimizerConfigError(
                f"{type(self).__name__} takes an optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def lr_at(self, base_lr: float, epoch: int, group: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} does not define lr_at()")

    def step(self) -> None:
        """Advance one epoch and set every group's lr."""
        self.last_epoch += 1
        for i, (group, base) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            group["lr"] = self.lr_at(base, self.last_epoch, i)

    def get_last_lr(self) -> list[float]:
        """The lr of every group as last set."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("optimizer", "lr_lambdas")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class StepLR(LRScheduler):
    """lr = base * gamma ** (epoch // step_size).

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor([1.0], requires_grad=True)
    >>> opt = cad.optim.SGD([w], lr=1.0)
    >>> sched = cad.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    >>> lrs = []
    >>> for _ in range(5):
    ...     lrs.append(sched.get_last_lr()[0]); sched.step()
    >>> lrs
    [1.0, 1.0, 0.5, 0.5, 0.25]
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1) -> None:
        if isinstance(step_size, bool) or not isinstance(step_size, int) or step_size <= 0:
            raise OptimizerConfigError(f"StepLR: step_size must be a positive int, got "
                                       f"{step_size!r}")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int, group: int) -> float:
        return base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base - eta_min) (1 + cos(pi epoch / T_max)) / 2 (SGDR without restarts,
    Loshchilov & Hutter 2017, eq. 5).

    >>> import checkpoint_ad as cad
    >>> opt = cad.optim.SGD([cad.tensor([1.0], requires_grad=True)], lr=1.0)
    >>> sched = cad.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2)
    >>> sched.step(); sched.get_last_lr()
    [0.5]
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1) -> None:
        if isinstance(T_max, bool) or not isinstance(T_max, int) or T_max <= 0:
            raise OptimizerConfigError(f"CosineAnnealingLR: T_max must be a positive int, got "
                                       f"{T_max!r}")
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int, group: int) -> float:
        cosine = (1 + math.cos(math.pi * epoch / self.T_max)) / 2
        return self.eta_min + (base_lr - self.eta_min) * cosine


class LambdaLR(LRScheduler):
    """lr = base * lr_lambda(epoch), one function for all groups or one per group.

    >>> import checkpoint_ad as cad
    >>> opt = cad.optim.SGD([cad.tensor([1.0], requires_grad=True)], lr=2.0)
    >>> sched = cad.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (epoch + 1))
    >>> sched.step(); sched.get_last_lr()
    [1.0]
    """

    def __init__(self, optimizer: Optimizer,
                 lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1) -> None:
        groups = len(optimizer.param_groups) if isinstance(optimizer, Optimizer) else 0
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * (
            groups)
        if len(lambdas) != groups:
            raise OptimizerConfigError(
                f"LambdaLR: {len(lambdas)} functions for {groups} param groups"
            )
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, epoch: int, group: int) -> float:
        return base_lr * self.lr_lambdas[group](epoch)
