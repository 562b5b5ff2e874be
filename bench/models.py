"""Workload 3, the built-in deep models: a deep residual MLP (depth as time) and the heat
equation time-stepped on a grid, each under keep-everything, binomial, per-step recompute and
int8 storage, against the model's own hand-written numpy forward and backward (the floor).

The models come from `checkpoint_ad.models`, driven by the engine's `scan` (a plain Python loop
would index the stacked MLP weights once per layer, whose backward scatters into the whole
stack: see the model's note). Their losses add a penalty over every intermediate state, which
keeps the backward out of denormals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .measure import measure, time_median
from .rnn import preset_strategies, untaped_steps


def _model(params: dict) -> Any:
    from checkpoint_ad.models import build

    return build(params["model"], **params["sizes"])


def _grad_error(grads: list[np.ndarray], reference: list[np.ndarray]) -> float:
    return max(
        float(np.max(np.abs(g.astype(np.float64) - r)) / max(np.max(np.abs(r)), 1e-30))
        for g, r in zip(grads, reference)
    )


class _Floor:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.grads: list[np.ndarray] | None = None

    def run(self) -> None:
        self.grads = self.model.numpy_reference_loss_and_grads()[1]

    def clear(self) -> None:
        self.grads = None


class _Engine:
    def __init__(self, model: Any, strategy: Any, storage: Any) -> None:
        import checkpoint_ad as cad

        self.cad = cad
        self.model = model
        self.strategy = strategy
        self.storage = storage

    def loop(self, step: Any, init: Any, xs: Any) -> tuple[Any, Any]:
        return self.cad.scan(step, init, xs, strategy=self.strategy)

    def run(self) -> None:
        self.clear()
        with self.cad.use(self.storage):
            loss = self.model.run(loop=self.loop)
        loss.backward()

    def forward_untaped(self) -> None:
        with self.cad.no_grad():
            self.model.run(loop=self.loop)

    def clear(self) -> None:
        for p in self.model.params:
            p.grad = None


def numpy_floor(params: dict, threads: int) -> dict[str, Any]:
    result = measure(_Floor(_model(params)), params["repeats"], traced=True)
    result["extras"] = dict(params["sizes"])
    return result


def engine(params: dict, threads: int) -> dict[str, Any]:
    model = _model(params)
    strategy, storage = preset_strategies(params["strategy"], model.n_steps)
    work = _Engine(model, strategy, storage)
    reference = [r.astype(np.float64) for r in model.numpy_reference_loss_and_grads()[1]]
    result = measure(work, params["repeats"], traced=True, check=lambda: {
        "grad_error": _grad_error([p.grad.numpy() for p in model.params], reference)})
    extras: dict[str, Any] = dict(params["sizes"]) | {
        "strategy": f"{params['strategy']}: loop {strategy!r}, storage {storage!r}"}
    if isinstance(strategy, work.cad.strategies.LoopStrategy):
        extras["untaped_steps"] = untaped_steps(strategy, model.n_steps)
        forward = time_median(work.forward_untaped, params["repeats"])
        extras["untaped_step_seconds"] = forward.median / model.n_steps
    result["extras"] = extras
    return result
