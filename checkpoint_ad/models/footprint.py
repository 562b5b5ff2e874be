"""What a built-in model's run needs in memory, estimated before anything is allocated.

A model of 10**8 steps would otherwise be found too large only when the kernel kills the
process (the heat equation and the neural ODE allocate as they step) or when numpy refuses one
huge input array. The estimate is for a run that keeps every step (keep-all, which every sweep
runs as its reference): the model's arrays, and per step (per layer) the tape's saved values,
the inputs and the outputs, in elements of the model's dtype. The factors are measured peaks
of keep-all runs at the sweep's sizes rounded up (tests/test_models.py checks that they stay
above the measured peak and within twice it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from ..errors import ModelTooLargeError


@dataclass(frozen=True)
class Footprint:
    """Elements a model holds once (`fixed`) and per step or layer (`per_step`), and how many
    steps; `bytes` is the estimate of a keep-all run's peak."""

    fixed: int
    per_step: int
    steps: int
    itemsize: int

    @property
    def bytes(self) -> int:
        return (self.fixed + self.per_step * self.steps) * self.itemsize


def _rnn(c: Any) -> tuple[int, int, int]:
    b, h, i = c.batch, c.hidden, c.input_size
    return h * h + i * h + h + b * h, 2 * b * h + b * i, c.steps


def _lstm(c: Any) -> tuple[int, int, int]:
    b, h, i = c.batch, c.hidden, c.input_size
    return 4 * h * (h + i + 1) + 2 * b * h, 12 * b * h + b * i, c.steps


def _residual_mlp(c: Any) -> tuple[int, int, int]:
    b, w = c.batch, c.width
    return 2 * b * w, 2 * w * w + 4 * b * w, c.layers


def _heat(c: Any) -> tuple[int, int, int]:
    g = c.grid * c.grid
    return 6 * g, 5 * g, c.steps


def _neural_ode(c: Any) -> tuple[int, int, int]:
    b, h, d = c.batch, c.hidden, c.dim
    return 2 * (d * h + h * h + h * d) + 2 * b * d, 7 * b * h + 4 * b * d, c.steps


def _gpt(c: Any) -> tuple[int, int, int]:
    s, b, h, a, v = c.seq, c.batch, c.hidden, c.heads, c.vocab
    # per layer: its weights and their gradients, 16 s·b·h activations kept plus the a·s·s·b
    # softmax, and the layer's s·b·h input and output (bench/README.md derives the 16)
    per_layer = 2 * (12 * h * h + 13 * h) + s * b * (20 * h + 2 * a * s)
    return 2 * v * h + 4 * s * b * v + 4 * s * b * h, per_layer, c.layers


TERMS: dict[str, Callable[[Any], tuple[int, int, int]]] = {
    "rnn": _rnn,
    "lstm": _lstm,
    "residual_mlp": _residual_mlp,
    "heat": _heat,
    "neural_ode": _neural_ode,
    "gpt": _gpt,
}


def footprint(name: str, config: Any) -> Footprint:
    """The estimate for the model registered as `name` with `config` (nothing is built)."""
    fixed, per_step, steps = TERMS[name](config)
    return Footprint(fixed, per_step, steps, np.dtype(config.dtype).itemsize)


def available_bytes() -> int:
    """Host memory the operating system can give this process now (psutil)."""
    return int(psutil.virtual_memory().available)


def check_fits(name: str, config: Any, available: int | None = None) -> Footprint:
    """Raise ModelTooLargeError unless a keep-all run of `name` fits in `available` bytes
    (default: the host's available memory now)."""
    estimate = footprint(name, config)
    room = available_bytes() if available is None else available
    if estimate.bytes > room:
        raise _too_large(name, config, estimate.bytes, room)
    return estimate


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def _too_large(name: str, config: Any, needed: int, available: int) -> ModelTooLargeError:
    sizes = ", ".join(f"{k}={v}" for k, v in vars(config).items()
                      if isinstance(v, int) and k != "seed")
    return ModelTooLargeError(
        f"out of memory ahead: {name} with {sizes} needs about {_gib(needed)} keeping every "
        f"step (estimated), and {_gib(available)} is available; try smaller sizes (e.g. halve "
        "the largest --size value)", needed, available)
