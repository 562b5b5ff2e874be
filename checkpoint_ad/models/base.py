"""What every built-in model shares: a step function over a carry, and the loop that runs it.

Each model is a deep unrolled computation written as `step(carry, x) -> (carry, y)`, the
signature of JAX's `lax.scan`. Written that way, the same model runs under a plain Python loop
(`python_loop`, the default) or under any scan-like driver passed as `run(loop=...)`, such as
a checkpointing scan: the driver decides what to store, the model only says what one step does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from ..errors import ModelConfigError
from ..nn import Module, Parameter
from ..ops import stack
from ..ops import sum as reduce_sum
from ..pytree import index_tree, tree_length
from ..tensor import Tensor, tensor

Step = Callable[[Any, Any], tuple[Any, Any]]
Loop = Callable[[Step, Any, Any], tuple[Any, Any]]


def check_config(config: Any, positive: Sequence[str], non_negative: Sequence[str] = ()) -> None:
    """Raise ModelConfigError unless the named fields are positive (or non-negative) numbers
    (ints where the field's default is an int) and `config.dtype` is a floating dtype."""
    name = type(config).__name__
    defaults = {f.name: f.default for f in fields(config)}
    for field_name in (*positive, *non_negative):
        value = getattr(config, field_name)
        want_int = isinstance(defaults[field_name], int)
        kinds = (int,) if want_int else (int, float)
        ok = isinstance(value, kinds) and not isinstance(value, bool)
        strict = field_name in positive
        if not ok or not (value > 0 if strict else value >= 0):
            kind = "int" if want_int else "number"
            bound = "positive" if strict else "non-negative"
            raise ModelConfigError(f"{name}.{field_name} must be a {bound} {kind}, got {value!r}")
    try:
        floating = config.dtype is not None and np.dtype(config.dtype).kind == "f"
    except TypeError:
        floating = False
    if not floating:
        raise ModelConfigError(
            f"{name}.dtype must be a floating dtype such as 'float32' or 'float64', "
            f"got {config.dtype!r}"
        )


def python_loop(step: Step, carry: Any, xs: Any) -> tuple[Any, list[Any]]:
    """Run `step` once per row of `xs` with a plain Python loop; the tape records every step.

    This is the reference a scan implementation must agree with: same `(carry, ys)` except
    that here `ys` is a list rather than a stacked tensor.

    >>> import checkpoint_ad as cad
    >>> carry, ys = python_loop(lambda c, x: (c + x, c * x), cad.tensor(0.0),
    ...                         cad.tensor([1.0, 2.0, 3.0]))
    >>> carry.item(), [y.item() for y in ys]
    (6.0, [0.0, 2.0, 9.0])
    """
    ys = []
    for i in range(tree_length(xs)):
        carry, y = step(carry, index_tree(xs, i))
        ys.append(y)
    return carry, ys


def total(ys: Any) -> Tensor:
    """The sum of all per-step outputs, whether a loop returned them as a list or stacked."""
    if isinstance(ys, (list, tuple)):
        ys = stack(list(ys))
    return reduce_sum(ys)


class UnrolledModel(Module):
    """Base class of the built-in models: the scan contract plus `run`.

    Subclasses set `config` and `n_steps`, hold their parameters as `nn.Parameter` attributes,
    and define `init_carry`, `inputs` (the scanned xs, leading axis n_steps), `step`, `loss` and
    `numpy_reference_loss_and_grads` (a hand-derived backward pass, no tape: the floor for
    benchmarks and an independent check of the engine's gradients).
    """

    config: Any
    n_steps: int

    @property
    def params(self) -> list[Parameter]:
        """The trainable leaves, in the order the numpy reference returns gradients."""
        return self.parameters()

    def init_carry(self) -> Any:
        raise NotImplementedError

    def inputs(self) -> Any:
        raise NotImplementedError

    def step(self, carry: Any, x: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def loss(self, final_carry: Any, ys: Any) -> Tensor:
        raise NotImplementedError

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        raise NotImplementedError

    def forward(self, loop: Loop | None = None) -> Tensor:
        return self.run(loop)

    def run(self, loop: Loop | None = None) -> Tensor:
        """The scalar loss after all steps, run by `loop(step, init_carry, xs) -> (carry, ys)`
        (a plain Python loop when None; e.g. a checkpointing scan otherwise)."""
        driver = python_loop if loop is None else loop
        carry, ys = driver(self.step, self.init_carry(), self.inputs())
        return self.loss(carry, ys)

    def _constant(self, array: np.ndarray) -> Tensor:
        """A non-trainable tensor in the model's dtype and device."""
        return tensor(array, dtype=self.config.dtype, device=self.config.device)

    def _parameter(self, array: np.ndarray) -> Parameter:
        return Parameter(array, dtype=self.config.dtype, device=self.config.device)

    def _host(self) -> list[np.ndarray]:
        """The parameters' current values on the host (copies: the reference must not alias)."""
        return [np.array(p.numpy(), copy=True) for p in self.params]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
