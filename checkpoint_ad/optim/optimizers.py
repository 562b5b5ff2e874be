"""Optimizers with PyTorch's names, hyperparameters, update formulas and state dicts.

Updates run under `no_grad()` with the in-place tensor methods (`sub_`, `mul_`, `add_`), so
they are not recorded, bump each parameter's version counter (a tape that saved the old value
then refuses to use it), and use only tensor arithmetic: the same code runs on numpy and cupy.

Parameters come as one iterable or as *param groups* (dicts with ``"params"`` and their own
hyperparameters); each update reads its hyperparameters from its group, so a scheduler or the
user can change ``group["lr"]`` between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..errors import OptimizerConfigError
from ..grad_mode import enable_grad, no_grad
from ..ops import copy, maximum, sqrt, zeros_like
from ..tensor import Tensor, tensor


def _check_range(name: str, value: float, low: float, high: float | None = None,
                 low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        bracket = "(" if low_open else "["
        upper = f"{high})" if high is not None else "inf)"
        raise OptimizerConfigError(f"{name} must be a number in {bracket}{low}, {upper}, "
                                   f"got {value!r}")


class Optimizer:
    """Base class: param groups, per-parameter state, `zero_grad`, `step`, state dicts.

    A subclass gives its defaults to ``__init__`` and defines
    ``_update(p, grad, group, state)``, called for every parameter that has a gradient.
    """

    def __init__(self, params: Iterable[Any], lr: float, **defaults: Any) -> None:
        items = list(params)
        if not items:
            raise OptimizerConfigError(
                f"{type(self).__name__} got an empty parameter list; pass model.parameters()"
            )
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        self.defaults = {"lr": lr, **defaults}
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[int, dict[str, Any]] = {}  # by id(parameter)
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add parameters with their own hyperparameters (the rest from the defaults)."""
        if not isinstance(group, dict) or "params" not in group:
            raise OptimizerConfigError("a param group is a dict with a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        offset = len(self.params)
        for i, p in enumerate(params):
            if not isinstance(p, Tensor) or not p.is_leaf or not p.requires_grad:
                what = type(p).__name__ if not isinstance(p, Tensor) else (
                    f"a {'non-leaf' if not p.is_leaf else 'constant'} tensor "
                    f"{p.dtype}{list(p.shape)}"
                )
                raise OptimizerConfigError(
                    f"{type(self).__name__}: params[{offset + i}] is {what}; optimizers update "
                    "leaf tensors that require grad (e.g. nn.Parameter)"
                )
        known = {id(p) for p in self.params}
        if any(id(p) in known for p in params):
            raise OptimizerConfigError("a parameter appears in more than one param group")
        full = {**self.defaults, **group, "params": params}
        self._check(full)
        self.param_groups.append(full)

    def _check(self, group: dict[str, Any]) -> None:
        _check_range("lr", group["lr"], low=0.0, low_open=True)

    @property
    def params(self) -> list[Tensor]:
        """Every parameter, group after group."""
        return [p for g in getattr(self, "param_groups", []) for p in g["params"]]

    @property
    def lr(self) -> float:
        """The first group's learning rate (the only one when there are no groups)."""
        return self.param_groups[0]["lr"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients before the next backward: set `.grad` to None (the
        default), or fill it with zeros in place."""
        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; those without one are left alone.

        `closure`, if given, recomputes the loss (with gradients) first and its value is
        returned, as in PyTorch.
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        with no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, p.grad, group, self.state.setdefault(id(p), {}))
        return loss

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]
                ) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define _update()")

    # ----------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters per group and per-parameter state (numpy copies), with parameters
        numbered in order: PyTorch's layout."""
        index = {id(p): i for i, p in enumerate(self.params)}
        state = {
            index[key]: {k: (v.numpy().copy() if isinstance(v, Tensor) else v)
                         for k, v in entries.items()}
            for key, entries in self.state.items() if key in index
        }
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (from this or an identically built optimizer)."""
        groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise OptimizerConfigError(
                "load_state_dict: the saved param groups have sizes "
                f"{[len(g['params']) for g in groups]}, this optimizer's are "
                f"{[len(g['params']) for g in self.param_groups]}; build it with the same "
                "parameters"
            )
        params = self.params
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.state = {}
        for i, entries in state_dict.get("state", {}).items():
            p = params[int(i)]
            self.state[id(p)] = {
                k: (tensor(np.array(v.numpy() if isinstance(v, Tensor) else v), dtype=p.dtype,
                           device=p.device) if isinstance(v, (np.ndarray, Tensor)) else v)
                for k, v in entries.items()
            }


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's momentum, dampening, Nesterov and L2 weight
    decay: g += wd p; b = momentum b + (1 - dampening) g (b = g at the first step);
    g = g + momentum b (Nesterov) or b; p -= lr g.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.optim import SGD
    >>> w = cad.tensor([1.0, 2.0], requires_grad=True, dtype="float64")
    >>> opt = SGD([w], lr=0.5)
    >>> (w * w).sum().backward()
    >>> opt.step()
    >>> w.tolist()
    [0.0, 0.0]
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__(params, lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)

    def _check(self, group: dict[str, Any]) -> None:
        super()._check(group)
        _check_range("momentum", group["momentum"], low=0.0, high=1.0)
        _check_range("dampening", group["dampening"], low=0.0, high=1.0 + 1e-12)
        _check_range("weight_decay", group["weight_decay"], low=0.0)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise OptimizerConfigError("nesterov needs momentum > 0 and dampening = 0")

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]
                ) -> None:
        if group["weight_decay"]:
            g = g + p * group["weight_decay"]
        momentum = group["momentum"]
        if momentum:
            b = state.get("momentum_buffer")
            if b is None:
                b = state["momentum_buffer"] = copy(g)
            else:
                b.mul_(momentum).add_(g * (1.0 - group["dampening"]))
            g = g + b * momentum if group["nesterov"] else b
        p.sub_(g * group["lr"])


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015, Algorithm 1) with PyTorch's options: L2 `weight_decay` added
    to the gradient, and `amsgrad` (the running maximum of the second moment).

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

    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)

    def _check(self, group: dict[str, Any]) -> None:
        super()._check(group)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise OptimizerConfigError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        _check_range("betas[0]", betas[0], low=0.0, high=1.0)
        _check_range("betas[1]", betas[1], low=0.0, high=1.0)
        _check_range("eps", group["eps"], low=0.0, low_open=True)
        _check_range("weight_decay", group["weight_decay"], low=0.0)

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]
                ) -> None:
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        if wd and self.decoupled:
            p.mul_(1.0 - lr * wd)
        elif wd:
            g = g + p * wd
        if not state:
            state.update(step=0, exp_avg=zeros_like(p), exp_avg_sq=zeros_like(p))
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = zeros_like(p)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(g * (1.0 - b1))
        v.mul_(b2).add_(g * g * (1.0 - b2))
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = maximum(state["max_exp_avg_sq"], v)
            v = state["max_exp_avg_sq"]
        m_hat = m / (1.0 - b1**t)
        v_hat = v / (1.0 - b2**t)
        p.sub_(m_hat * lr / (sqrt(v_hat) + group["eps"]))


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019): p *= 1 - lr wd before the
    Adam step, instead of adding wd p to the gradient. Default weight_decay 0.01, as PyTorch.

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.optim import AdamW
    >>> w = cad.tensor([1.0], requires_grad=True, dtype="float64")
    >>> w.grad = cad.tensor([0.0], dtype="float64")
    >>> AdamW([w], lr=0.1, weight_decay=0.5).step()  # zero gradient: only the decay acts
    >>> w.tolist()
    [0.95]
    """

    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


class RMSprop(Optimizer):
    """RMSprop (Hinton's lecture 6e) with PyTorch's options: v = alpha v + (1 - alpha) g^2;
    centered subtracts the squared running mean of g; with momentum b = momentum b +
    g / (sqrt(v) + eps) and p -= lr b, else p -= lr g / (sqrt(v) + eps).

    >>> import checkpoint_ad as cad
    >>> from checkpoint_ad.optim import RMSprop
    >>> w = cad.tensor([1.0], requires_grad=True, dtype="float64")
    >>> (w * w).sum().backward()
    >>> RMSprop([w], lr=0.01, alpha=0.0).step()  # v = g^2: a step of lr
    >>> round(w.item(), 6)
    0.99
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False) -> None:
        super().__init__(params, lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                         momentum=momentum, centered=centered)

    def _check(self, group: dict[str, Any]) -> None:
        super()._check(group)
        _check_range("alpha", group["alpha"], low=0.0, high=1.0)
        _check_range("eps", group["eps"], low=0.0, low_open=True)
        _check_range("weight_decay", group["weight_decay"], low=0.0)
        _check_range("momentum", group["momentum"], low=0.0, high=1.0)

    def _update(self, p: Tensor, g: Tensor, group: dict[str, Any], state: dict[str, Any]
                ) -> None:
        alpha = group["alpha"]
        if group["weight_decay"]:
            g = g + p * group["weight_decay"]
        if not state:
            state.update(step=0, square_avg=zeros_like(p))
            if group["centered"]:
                state["grad_avg"] = zeros_like(p)
            if group["momentum"]:
                state["momentum_buffer"] = zeros_like(p)
        state["step"] += 1
        v = state["square_avg"]
        v.mul_(alpha).add_(g * g * (1.0 - alpha))
        if group["centered"]:
            mean = state["grad_avg"]
            mean.mul_(alpha).add_(g * (1.0 - alpha))
            denom = sqrt(v - mean * mean) + group["eps"]
        else:
            denom = sqrt(v) + group["eps"]
        if group["momentum"]:
            b = state["momentum_buffer"]
            b.mul_(group["momentum"]).add_(g / denom)
            p.sub_(b * group["lr"])
        else:
            p.sub_(g / denom * group["lr"])
