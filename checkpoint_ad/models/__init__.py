"""Built-in deep unrolled models, each a step function over a carry (see `models.base`).

`build(name, **overrides)` makes one by name with config fields overridden; `MODELS` lists
them. Every model has `params`, `init_carry()`, `inputs()`, `step(carry, x)`,
`loss(final_carry, ys)`, `n_steps`, `run(loop=None)` and `numpy_reference_loss_and_grads()`.

>>> from checkpoint_ad import models
>>> model = models.build("rnn", steps=3, dtype="float64")
>>> model.n_steps, [tuple(p.shape) for p in model.params]
(3, [(8, 8), (3, 8), (8,)])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ModelConfigError, UnknownModelError
from .base import UnrolledModel, python_loop
from .heat import HeatConfig, make_heat
from .lstm import LSTMConfig, make_lstm
from .neural_ode import NeuralODEConfig, make_neural_ode
from .residual_mlp import ResidualMLPConfig, make_residual_mlp
from .rnn import RNNConfig, make_rnn


@dataclass(frozen=True)
class ModelEntry:
    """How to build one registered model: its config class and its factory."""

    config: type
    make: Callable[[Any], UnrolledModel]


MODELS: dict[str, ModelEntry] = {
    "rnn": ModelEntry(RNNConfig, make_rnn),
    "lstm": ModelEntry(LSTMConfig, make_lstm),
    "residual_mlp": ModelEntry(ResidualMLPConfig, make_residual_mlp),
    "heat": ModelEntry(HeatConfig, make_heat),
    "neural_ode": ModelEntry(NeuralODEConfig, make_neural_ode),
}


def build(name: str, **overrides: Any) -> UnrolledModel:
    """The model registered as `name`, with its config's defaults replaced by `overrides`.

    Raises UnknownModelError (a ValueError) naming the known models for an unknown name, and
    ModelConfigError naming the valid fields for an unknown option or a bad size.
    """
    if name not in MODELS:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}"
        )
    entry = MODELS[name]
    known = [f.name for f in fields(entry.config)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ModelConfigError(
            f"model {name!r} has no option(s) {', '.join(unknown)}; its options are "
            f"{', '.join(known)}"
        )
    return entry.make(entry.config(**overrides))


__all__ = [
    "MODELS",
    "HeatConfig",
    "LSTMConfig",
    "ModelConfigError",
    "ModelEntry",
    "NeuralODEConfig",
    "RNNConfig",
    "ResidualMLPConfig",
    "UnknownModelError",
    "UnrolledModel",
    "build",
    "make_heat",
    "make_lstm",
    "make_neural_ode",
    "make_residual_mlp",
    "make_rnn",
    "python_loop",
]
