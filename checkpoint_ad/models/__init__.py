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
from .footprint import Footprint, check_fits
from .gpt import GPTConfig, make_gpt
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
    "gpt": ModelEntry(GPTConfig, make_gpt),
}


# Sizes of the main job (`checkpoint-ad sweep`), per model: large enough that saved values
# dominate the measured memory and that every saved activation is worth quantizing (the configs'
# own defaults are tiny, for doctests: there an LSTM's (4, 8) float32 states are 128 bytes, below
# `quantize.MIN_WORTH_BYTES`, so int8 and int4 stored them exactly and changed nothing), small
# enough that a default sweep of each takes well under a minute on a laptop-class CPU. The RNN's
# (the default model's) is larger: one keep-all run takes at least 0.2 s on one core (0.5 s of
# CPU on the reference machine; at 256 steps, hidden 128, it took 0.02-0.08 s, which timer
# noise swamps), so that presets' times can be told apart; its default sweep takes ~60 s of CPU.
SWEEP_SIZES: dict[str, dict[str, int]] = {
    "rnn": {"steps": 512, "batch": 64, "input_size": 32, "hidden": 320},
    "lstm": {"steps": 128, "batch": 32, "input_size": 32, "hidden": 64},
    "residual_mlp": {"layers": 64, "width": 64, "batch": 64},
    "heat": {"grid": 32, "steps": 128},
    "neural_ode": {"dim": 16, "hidden": 64, "batch": 64, "steps": 64},
    "gpt": {"layers": 8, "seq": 64, "batch": 8, "hidden": 64, "heads": 4, "vocab": 128},
}


def sizes_of(model: UnrolledModel) -> dict[str, Any]:
    """The integer sizes of a built model's config (its seed left out), for table headers and
    plot titles: what a reader needs to know which problem was measured."""
    config = model.config
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.name != "seed" and isinstance(getattr(config, f.name), int)}


def config_of(name: str, **overrides: Any) -> Any:
    """The config `build(name, **overrides)` would use, checked, with nothing allocated.

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
    return entry.config(**overrides)


def build(name: str, **overrides: Any) -> UnrolledModel:
    """The model registered as `name`, with its config's defaults replaced by `overrides`
    (checked as `config_of` checks them)."""
    config = config_of(name, **overrides)
    return MODELS[name].make(config)


def check_memory(name: str, **overrides: Any) -> Footprint:
    """The estimated peak of a keep-all run of the model (`models.footprint`); raises
    ModelTooLargeError (a ModelConfigError and a MemoryError) when it is more than the host's
    available memory. Nothing is allocated.

    >>> check_memory("rnn", steps=8).bytes < 2**20
    True
    """
    return check_fits(name, config_of(name, **overrides))


__all__ = [
    "MODELS",
    "Footprint",
    "SWEEP_SIZES",
    "GPTConfig",
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
    "make_gpt",
    "check_memory",
    "config_of",
    "make_heat",
    "make_lstm",
    "make_neural_ode",
    "make_residual_mlp",
    "make_rnn",
    "python_loop",
    "sizes_of",
]
